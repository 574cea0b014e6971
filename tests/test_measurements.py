"""Measurements that can be trusted: TTFT, lm-eval paths that really map, the card's mean, positions that count."""

import json
import math
import re

import pytest
import torch
from conftest import build_tokenizer, ministral3_config, save_model

from kvbridge import Mapper, family
from kvbridge.core.mapper_config import MapperConfig
from kvbridge.core.models import load_model
from kvbridge.core.transfer import Bridge
from kvbridge.errors import InputError, NumericalError
from kvbridge.measure.evaluate import TaskResult, chose_truth, retention_table

# (task, native %, mapped %, floor %) of the published card, its mean 78.73 % raw / 73.07 % floor-normalized
CARD = [("arc_challenge", 60.15, 57.34, 25), ("hellaswag", 76.86, 74.13, 25), ("winogrande", 71.43, 67.01, 50),
        ("mmlu", 70.15, 58.96, 25), ("gsm8k_cot", 82.94, 19.94, 0)]


def _mean_row(table: str) -> tuple[float, float]:
    """The two percentages of a table's Mean row, as printed."""
    line = next(l for l in table.splitlines() if "**Mean**" in l)
    raw, norm = re.findall(r"([0-9.]+)%", line)[-2:]
    return float(raw), float(norm)


def test_family_mean_row_prints_the_cards_mean():
    results = [TaskResult(t, "acc", n / 100, m / 100, 0.0, f / 100, 1) for t, n, m, f in CARD]
    raw, norm = _mean_row(retention_table(results))
    assert raw == pytest.approx(78.73, abs=0.02) and norm == pytest.approx(73.07, abs=0.02)


def test_lm_eval_mean_counts_one_primary_metric_per_task():
    """ARC and HellaSwag report acc and acc_norm, GSM8K two filters: only the primary one enters the mean."""
    from kvbridge.measure.lm_eval_tasks import eval_table, metric_rows

    results = {"native": {"results": {}, "n-shot": {}}, "mapped": {"results": {}}}
    for task, native, mapped, _ in CARD:
        primary = {"arc_challenge": "acc_norm,none", "hellaswag": "acc_norm,none",
                   "gsm8k_cot": "exact_match,strict-match"}.get(task, "acc,none")
        results["native"]["results"][task] = {primary: native / 100, "alias": task}
        results["mapped"]["results"][task] = {primary: mapped / 100}
    for task, other in (("arc_challenge", "acc,none"), ("hellaswag", "acc,none"),
                        ("gsm8k_cot", "exact_match,flexible-extract")):
        results["native"]["results"][task][other] = 0.9
        results["mapped"]["results"][task][other] = 0.9 if task != "gsm8k_cot" else 0.7301
    rows = metric_rows(results, [t for t, *_ in CARD])
    assert sum(r["primary"] for r in rows) == 5 and len(rows) == 8
    table = eval_table(rows, "card")
    raw, norm = _mean_row(table)
    assert raw == pytest.approx(78.73, abs=0.02) and norm == pytest.approx(73.07, abs=0.02)
    mean_at = next(i for i, l in enumerate(table.splitlines()) if "**Mean**" in l)
    assert "flexible-extract" in "\n".join(table.splitlines()[mean_at:])  # listed after the mean, not in it
    assert table.startswith("Protocol: card")


def test_card_protocol_sets_shots_per_task():
    from kvbridge.measure.lm_eval_tasks import fewshot_plan

    plan = fewshot_plan(["arc_challenge", "mmlu", "gsm8k_cot", "kvbridge_family_cloze"], "card")
    assert plan == {"arc_challenge": 0, "mmlu": 5, "gsm8k_cot": 8, "kvbridge_family_cloze": None}
    assert fewshot_plan(["mmlu"], "default", 3) == {"mmlu": 3}
    with pytest.raises(InputError, match="only one"):
        fewshot_plan(["mmlu"], "card", 3)


def test_ties_are_wrong_and_nan_is_refused():
    assert chose_truth([-1.0, -2.0, -3.0, -4.0])
    assert not chose_truth([-1.0, -1.0, -3.0, -4.0])  # a tie with a distractor is not a correct answer
    assert not chose_truth([-2.0, -1.0, -3.0, -4.0])
    with pytest.raises(NumericalError):
        chose_truth([float("nan")] * 4)


# -- the embedded family: rolling log-likelihood, fallbacks, NaN mappers -------------------------------------
@pytest.fixture(scope="module")
def pair():
    return family.load_family()


def _filled_mapper(source, target, value: float) -> Mapper:
    layers = tuple(range(source.info.num_layers))
    selection = {k: (layers,) * target.info.num_layers for k in ("key", "value")}
    config = MapperConfig(source=source.info, target=target.info, selection=selection, fit={"kind": "test"})
    return Mapper(config, {n: torch.full(s, value) for n, s in config.weight_shapes().items()})


def test_rolling_loglikelihood_maps_its_context_and_counts_fallbacks(pair, monkeypatch):
    pytest.importorskip("lm_eval")
    from lm_eval.api.instance import Instance

    from kvbridge.measure.lm_eval_model import KVBridgeLM

    source, target = pair
    zero = Bridge(source, target, _filled_mapper(source, target, 0.0))
    text = family.heldout_texts()[0][:3000]
    requests = [Instance("loglikelihood_rolling", {}, (text,), 0, ("wikitext", 0, 1))]
    calls = []
    original = Mapper.map_features  # the runtime's hot path (Mapper.map wraps it)
    monkeypatch.setattr(Mapper, "map_features", lambda self, *a, **k: calls.append(1) or original(self, *a, **k))
    totals = {}
    for mode in ("native", "mapped"):
        lm = KVBridgeLM.from_bridge(zero, mode=mode, rolling_chunk=128)
        totals[mode] = lm.loglikelihood_rolling(requests, disable_tqdm=True)[0]
        if mode == "mapped":
            chunks = len(lm.rolling_windows(lm.tok_encode(text, add_special_tokens=False)))
            assert chunks > 2 and lm.request_counts["wikitext"] == chunks
            assert lm.native_fallbacks["wikitext"] == 1  # only the first chunk: its context is BOS alone
    assert calls, "the mapper was never called in mapped mode"
    assert totals["mapped"] < totals["native"] - 50  # an all-zero mapper must hurt perplexity


def test_rolling_windows_score_every_token_once_after_the_text_before_it(pair):
    pytest.importorskip("lm_eval")
    from kvbridge.measure.lm_eval_model import KVBridgeLM

    source, target = pair
    lm = KVBridgeLM.from_bridge(Bridge(source, target, _filled_mapper(source, target, 0.0)), rolling_chunk=100)
    lm.max_length = 256
    tokens = list(range(10, 10 + 555))
    windows = lm.rolling_windows(tokens)
    assert [t for _, chunk in windows for t in chunk] == tokens
    for ctx, chunk in windows:
        start = tokens.index(chunk[0])
        assert ctx == ([lm.prefix_token_id] + tokens)[: start + 1][-len(ctx):]  # ends right before the chunk
        assert len(ctx) + len(chunk) <= 256 and (len(ctx) == start + 1 or len(ctx) + len(chunk) == 256)


def test_nan_mapper_is_refused_not_scored(pair):
    from kvbridge.errors import ArtifactError

    source, target = pair
    with pytest.raises(ArtifactError, match="NaN or Inf"):  # a NaN weight never makes a mapper
        _filled_mapper(source, target, float("nan"))
    bridge = Bridge(source, target, _filled_mapper(source, target, 1e37))  # finite weights, overflowing outputs
    with pytest.raises(NumericalError, match="NaN"):
        bridge.score(["def f(x):\n    return"], [" x"])
    with pytest.raises(NumericalError):
        bridge.generate(["def f(x):\n    return"], max_new_tokens=2)


def test_generation_kwargs_are_honoured_or_refused(pair):
    pytest.importorskip("lm_eval")
    from kvbridge.measure.lm_eval_model import KVBridgeLM

    source, target = pair
    lm = KVBridgeLM.from_bridge(Bridge(source, target, _filled_mapper(source, target, 0.0)))
    until, max_new, kw = lm.generation_kwargs({"until": ["\n"], "do_sample": True, "max_gen_toks": 7})
    assert until == ["\n"] and max_new == 7 and kw == {"do_sample": True, "temperature": 1.0}
    _, _, kw = lm.generation_kwargs({"do_sample": True, "temperature": 0.5, "top_p": 0.9, "top_k": 5})
    assert kw == {"do_sample": True, "temperature": 0.5, "top_p": 0.9, "top_k": 5}
    _, _, kw = lm.generation_kwargs({"temperature": 0.0})
    assert kw == {"do_sample": False}
    with pytest.raises(InputError, match="bogus"):
        lm.generation_kwargs({"bogus": 1})
    with pytest.raises(InputError, match="temperature"):
        lm.generation_kwargs({"do_sample": True, "temperature": 0})


def test_lm_eval_launcher_runs_lm_evals_own_cli(pair, tmp_path, monkeypatch, capsys):
    pytest.importorskip("lm_eval")
    from kvbridge.cli import main

    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "datasets"))
    source, target = pair
    mapper = tmp_path / "mapper"
    _filled_mapper(source, target, 0.0).save_pretrained(mapper)
    args = f"source={family.source_path()},target={family.target_path()},mapper={mapper},mode=mapped"
    code = main(["lm-eval", "--model", "kvbridge", "--model_args", args, "--tasks", "kvbridge_family_cloze",
                 "--limit", "4", "--output_path", str(tmp_path / "out")])
    assert code == 0
    assert "kvbridge_family_cloze" in capsys.readouterr().out
    assert list((tmp_path / "out").rglob("results*.json"))


# -- positions: a pair that differs only in RoPE ---------------------------------------------------------------
@pytest.fixture(scope="module")
def rope_only_pair(tmp_path_factory):
    """One-layer Ministral3 twins with the same weights and different RoPE (θ, YaRN factor, original length).

    With one layer, content K and V depend on the token alone, so the identity map is exact *only if*
    the source's RoPE is removed and the target's applied at the right position of every token.
    """
    from transformers import Ministral3ForCausalLM

    root = tmp_path_factory.mktemp("rope-only")
    tokenizer = build_tokenizer(root / "tok")
    torch.manual_seed(3)
    target_cfg = ministral3_config(len(tokenizer), 1, 64, 4, 16, theta=500000.0)
    source_cfg = ministral3_config(len(tokenizer), 1, 64, 4, 16, theta=10000.0)
    source_cfg.rope_parameters = dict(source_cfg.rope_parameters, factor=2.0, original_max_position_embeddings=64)
    target = Ministral3ForCausalLM(target_cfg).eval()
    source = Ministral3ForCausalLM(source_cfg).eval()
    source.load_state_dict(target.state_dict())
    s = load_model(save_model(source, tokenizer, root / "source"), dtype="float32")
    t = load_model(save_model(target, tokenizer, root / "target"), dtype="float32")
    assert s.info.rope.to_dict() != t.info.rope.to_dict()
    eye = Mapper.identity(t.info)
    return Bridge(s, t, Mapper(MapperConfig(source=s.info, target=t.info, selection=eye.config.selection,
                                            fit=eye.config.fit), eye.weights))


PROMPTS = ["Return a new dictionary", "The logging module defines functions and classes which implement a flexible "
           "event logging system for applications and libraries", "Create a new instance of the class"]


@pytest.mark.parametrize("hold_back", [1, 3])
def test_rope_only_pair_maps_exactly_through_left_padded_batches(rope_only_pair, hold_back):
    bridge = Bridge(rope_only_pair.source, rope_only_pair.target, rope_only_pair.mapper, hold_back=hold_back)
    continuations = [" and keyword arguments.", " is useful", " returns it"]
    mapped = bridge.score(PROMPTS, continuations, mode="mapped")
    native = bridge.score(PROMPTS, continuations, mode="native")
    for m, n in zip(mapped, native):
        assert m.logprob == pytest.approx(n.logprob, abs=1e-4)
    assert bridge.generate(PROMPTS, max_new_tokens=8).token_ids == \
        bridge.generate(PROMPTS, mode="native", max_new_tokens=8).token_ids
    ids, mask = bridge.encode(PROMPTS)
    _, first_mapped = bridge.first_token_logits(ids, mask, "mapped")
    _, first_native = bridge.first_token_logits(ids, mask, "native")
    assert torch.allclose(first_mapped, first_native, atol=1e-4)  # the TTFT path is the same computation


def test_fitted_mapper_scores_the_same_batched_and_alone(tiny_pair):
    from kvbridge.fit import FitConfig, fit_mapper
    from kvbridge.fit.texts import read_texts

    source, target = load_model(tiny_pair[0]), load_model(tiny_pair[1])
    config = FitConfig(num_texts=8, seq_len=48, heldout_texts=0, mlp_steps=30, tune_steps=20)
    mapper = fit_mapper(source, target, read_texts(tiny_pair[2]), config, progress=False)
    continuations = [" and keyword arguments.", " is useful", " returns it"]
    # hold-back 4 is below every prompt's length here; a longer one would shrink to the batch's shortest prompt
    for bridge in (Bridge(source, target, mapper, hold_back=1), Bridge(source, target, mapper, hold_back=4)):
        batched = bridge.score(PROMPTS, continuations)
        for i in range(len(PROMPTS)):
            alone = bridge.score([PROMPTS[i]], [continuations[i]])[0]
            assert alone.logprob == pytest.approx(batched[i].logprob, abs=1e-4) and alone.correct == batched[i].correct


def test_heldout_r2_reads_whole_documents_of_its_own(tiny_pair):
    from kvbridge.fit.texts import read_texts, split_heldout_documents

    tokenizer = load_model(tiny_pair[1]).tokenizer
    texts = read_texts(tiny_pair[2])
    fit, held = split_heldout_documents(tokenizer, texts, 2, 48)
    assert fit + held == texts and held and fit  # a split at a document boundary, held-out last
    n_held = sum(len(tokenizer(t, add_special_tokens=False)["input_ids"]) + 1 for t in held)
    assert n_held >= 2 * 47 and n_held - (len(tokenizer(held[0], add_special_tokens=False)["input_ids"]) + 1) < 2 * 47
    with pytest.raises(InputError, match="documents of their own"):
        split_heldout_documents(tokenizer, texts[:1], 2, 48)


def test_calibration_hash_has_one_definition(tiny_pair, tmp_path):
    from kvbridge.cli import main
    from kvbridge.core.hashing import sha256_texts
    from kvbridge.fit.texts import read_texts

    source, target, texts = tiny_pair
    out = tmp_path / "m"
    assert main(["fit", "--source", source, "--target", target, "--texts", texts, "--out", str(out), "--num-texts", "4",
                 "--seq-len", "32", "--heldout-texts", "0", "--mlp-steps", "30", "--tune-steps", "10", "--quiet"]) == 0
    fit = json.loads((out / "mapper.json").read_text())["fit"]
    assert fit["calibration_sha256"] == sha256_texts(read_texts(texts))
    assert not math.isnan(fit["key_r2_fit_mean"])


def test_fallback_counts_are_per_task_and_groups_sum_their_subtasks():
    from kvbridge.measure.lm_eval_tasks import _task_count

    counts = {"kvbridge_family_cloze": 3, "kvbridge_family_cloze_1024": 5, "mmlu_anatomy": 2, "mmlu_virology": 4}
    assert _task_count(counts, "kvbridge_family_cloze") == 3
    assert _task_count(counts, "mmlu") == 6 and _task_count(counts, "arc_challenge") == 0
