"""lm-evaluation-harness integration, offline, on the embedded family; and the diagnostics."""

import json

import pytest
import torch

from kvbridge import Mapper, family
from kvbridge.cli import main
from kvbridge.core.transfer import Bridge

lm_eval = pytest.importorskip("lm_eval")
TASKS = ["kvbridge_family_cloze", "kvbridge_family_recall"]


@pytest.fixture(autouse=True)
def offline(monkeypatch, tmp_path):
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "datasets"))


def test_registry_returns_our_class():
    from lm_eval.api.registry import get_model

    from kvbridge.measure.lm_eval_model import KVBridgeLM

    assert get_model("kvbridge") is KVBridgeLM


@pytest.fixture(scope="module")
def pair():
    return family.load_family()


@pytest.fixture(scope="module")
def fitted(pair, tmp_path_factory):
    from kvbridge.fit import FitConfig, fit_mapper

    source, target = pair
    out = tmp_path_factory.mktemp("harness") / "mapper"
    config = FitConfig(num_texts=8, seq_len=256, heldout_texts=0, tune_steps=20, mlp_steps=50)  # a few seconds
    fit_mapper(source, target, family.calibration_texts(), config,
               progress=False).save_pretrained(out)
    return str(out)


def test_local_tasks_run_in_every_mode(pair, fitted):
    from kvbridge.measure.lm_eval_tasks import metric_rows, run_lm_eval

    source, target = pair
    bridge = Bridge(source, target, Mapper.from_pretrained(fitted))
    results = run_lm_eval(bridge, TASKS, modes=("native", "mapped", "source"), limit=8)
    rows = {(r["task"], r["metric"]): r for r in metric_rows(results, TASKS)}
    cloze = rows[("kvbridge_family_cloze", "acc")]
    assert set(cloze) >= {"native", "mapped", "source", "floor", "raw_retention"} and cloze["floor"] == 0.25
    assert cloze["native"] > 0.25  # the family reads its context
    assert ("kvbridge_family_recall", "exact_match") in rows
    assert results["mapped"]["kvbridge"]["native_fallbacks"] == {}  # every context was long enough to map


def test_offline_tasks_at_1024_tokens_run(pair, fitted):
    from kvbridge.measure.lm_eval_tasks import metric_rows, run_lm_eval

    source, target = pair
    bridge = Bridge(source, target, Mapper.from_pretrained(fitted))
    tasks = ["kvbridge_family_cloze_1024"]
    rows = metric_rows(run_lm_eval(bridge, tasks, modes=("native", "mapped"), limit=4), tasks)
    assert rows[0]["task"] == "kvbridge_family_cloze_1024" and rows[0]["floor"] == 0.25 and rows[0]["primary"]


def test_identity_map_gives_identical_lm_eval_results(pair):
    from kvbridge.measure.lm_eval_tasks import run_lm_eval

    _, target = pair
    bridge = Bridge(target, target, Mapper.identity(target.info))
    results = run_lm_eval(bridge, TASKS, modes=("native", "mapped"), limit=8)
    native, mapped = results["native"]["results"], results["mapped"]["results"]
    for task in TASKS:
        assert ({k: v for k, v in native[task].items() if "," in k}
                == {k: v for k, v in mapped[task].items() if "," in k})


def test_eval_command_writes_table_and_json(pair, fitted, tmp_path, capsys):
    code = main(["eval", "--source", family.source_path(), "--target", family.target_path(), "--mapper", fitted,
                 "--tasks", ",".join(TASKS), "--limit", "4", "--out", str(tmp_path / "eval")])
    assert code == 0
    assert "| kvbridge_family_cloze | acc |" in capsys.readouterr().out
    payload = json.loads((tmp_path / "eval" / "results.json").read_text())
    assert {"native", "mapped"} <= set(payload["lm_eval"]) and (tmp_path / "eval" / "table.md").is_file()


def test_diagnose_writes_plots_and_identity_cosine_is_one(pair, tmp_path):
    from kvbridge.measure.diagnose import diagnose

    _, target = pair
    report = diagnose(Bridge(target, target, Mapper.identity(target.info)), family.heldout_texts(),
                      items=4, seq_len=128)
    assert all(c == pytest.approx(1.0, abs=1e-5) for c in report["attention_cosine"])
    assert report["top1_agreement"] == 1.0 and abs(report["next_token_kl"]) < 1e-5


def test_diagnose_command(pair, fitted, tmp_path, capsys):
    texts = tmp_path / "held.jsonl"
    texts.write_text("".join(json.dumps({"text": t}) + "\n" for t in family.heldout_texts()[:20]))
    out = tmp_path / "diag"
    assert main(["diagnose", "--source", family.source_path(), "--target", family.target_path(), "--mapper", fitted,
                 "--texts", str(texts), "--items", "4", "--seq-len", "128", "--out", str(out)]) == 0
    report = json.loads((out / "diagnostics.json").read_text())
    assert len(report["attention_cosine"]) == 4 and 0 <= report["top1_agreement"] <= 1
    for name in ("key_r2", "value_r2", "attention_cosine"):
        assert (out / f"{name}.png").read_bytes()[:4] == b"\x89PNG"
    assert "Attention-output cosine" in capsys.readouterr().out


def test_recomputed_attention_matches_the_models_own(tiny_pair):
    """The diagnostic's queries (RoPE, Ministral3 position scaling) reproduce the model's attention output."""
    from kvbridge.core.models import attention_queries, cache_kv, load_model, positions_from_mask, prefill
    from kvbridge.core.rope import rotary_factors
    from kvbridge.measure.diagnose import _attend

    target = load_model(tiny_pair[1])
    model = target.model
    ids = torch.randint(4, 300, (2, 200))  # beyond original_max_position_embeddings=128: query scaling active
    mask = torch.ones_like(ids)
    positions = positions_from_mask(mask)
    seen = {}
    layer = model.model.layers[1]
    h1 = layer.register_forward_pre_hook(lambda m, a, kw: seen.__setitem__("h", (a or (kw["hidden_states"],))[0]),
                                         with_kwargs=True)
    h2 = layer.self_attn.o_proj.register_forward_pre_hook(lambda m, a: seen.__setitem__("o", a[0]))
    try:
        cache, _ = prefill(model, ids, mask, positions)
    finally:
        h1.remove()
        h2.remove()
    keys, values = cache_kv(cache)
    cos, sin = rotary_factors(model, positions)
    q = attention_queries(model, seen["h"], 1, cos, sin, positions)
    ours = _attend(q, keys[1], values[1]).transpose(1, 2).reshape(2, 200, -1)
    assert torch.allclose(ours, seen["o"], atol=1e-5)
