"""Quality tooling: the oracle diagnostic and the frontier, on the embedded family."""

import json

import pytest
import torch

from kvbridge import Mapper, family
from kvbridge.cli import main
from kvbridge.core.transfer import Bridge
from kvbridge.errors import UnsupportedModelError
from kvbridge.fit import FitConfig, fit_mapper
from kvbridge.measure.diagnose import OracleBridge
from kvbridge.measure.evaluate import family_tasks, mean_retention


@pytest.fixture(scope="module")
def pair():
    return family.load_family()


@pytest.fixture(scope="module")
def bridge(pair):
    source, target = pair
    # a runtime the short test rows leave work for
    mapper = fit_mapper(source, target, family.calibration_texts(),
                        FitConfig(num_texts=8, seq_len=128, heldout_texts=0, tune_steps=20, mlp_steps=50,
                                  hold_back=1, recompute=0.04), progress=False)
    return Bridge(source, target, mapper)


def test_an_oracle_of_every_layer_is_native(bridge):
    texts = family.heldout_texts()
    baseline = family_tasks(bridge, texts, items=8, seq_len=128)
    every = OracleBridge(bridge, {layer: "both" for layer in range(bridge.target.info.num_layers)})
    results = family_tasks(every, texts, items=8, seq_len=128, reference=baseline)
    for r in results:
        assert r.mapped == pytest.approx(r.native, rel=1e-6, abs=1e-6), r.task
    assert mean_retention(results) == pytest.approx(1.0, abs=1e-6)


def test_diagnose_oracle_writes_rows_and_plot(bridge, tmp_path, capsys):
    mapper = tmp_path / "m"
    bridge.mapper.save_pretrained(mapper)
    texts = tmp_path / "held.jsonl"
    texts.write_text("".join(json.dumps({"text": t}) + "\n" for t in family.heldout_texts()[:30]))
    out = tmp_path / "diag"
    assert main(["diagnose", "--source", family.source_path(), "--target", family.target_path(), "--mapper",
                 str(mapper), "--texts", str(texts), "--items", "4", "--seq-len", "128", "--out", str(out),
                 "--oracle", "--oracle-window", "4"]) == 0
    rows = json.loads((out / "diagnostics.json").read_text())["oracle"]["rows"]
    assert len(rows) == 1 + 4 * 3 + 4
    assert ({tuple(sorted(r)) for r in rows[1:-4]}
            == {("kind", "mean_floor_normalized_retention", "target_layer", "tasks")})
    assert [(r["target_layer"], r["kind"], r["window"]) for r in rows[-4:]] == [(i, "both", 4) for i in range(4)]
    assert (out / "oracle.png").read_bytes()[:4] == b"\x89PNG"
    printed = capsys.readouterr().out
    assert "Target layer made native" in printed and "both, window 4" in printed


def test_a_windowed_forward_sees_the_window_only(pair):
    from kvbridge.core.models import cache_kv, prefill
    from kvbridge.measure.diagnose import windowed_kv

    target = pair[1].model
    ids = torch.randint(10, 4000, (2, 96), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[1, :20] = 0  # a left-padded row
    nk, nv = cache_kv(prefill(target, ids, mask, logits="none")[0])
    wide_k, wide_v = windowed_kv(target, ids, mask, 96)
    for a, b in zip(wide_k + wide_v, nk + nv):  # a window over the whole row is the plain causal forward
        torch.testing.assert_close(a[0], b[0], rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(a[1, :, 20:], b[1, :, 20:], rtol=1e-4, atol=1e-4)
    one_k, one_v = windowed_kv(target, ids, mask, 1)
    torch.testing.assert_close(one_k[0], nk[0], rtol=1e-4, atol=1e-4)  # layer 0's K/V read the token alone
    torch.testing.assert_close(one_v[0], nv[0], rtol=1e-4, atol=1e-4)
    assert (one_k[1] - nk[1]).abs().amax() > 1e-2  # layer 1's read what layer 0 attended to


def test_diagnose_refuses_a_window_without_the_oracle(tmp_path, capsys):
    texts = tmp_path / "held.jsonl"
    texts.write_text(json.dumps({"text": "x = 1\n" * 200}) + "\n")
    assert main(["diagnose", "--family", "default", "--mapper", family.mapper_path(), "--texts", str(texts),
                 "--out", str(tmp_path / "d"), "--oracle-window", "8"]) != 0
    assert "pass --oracle too" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["diagnose", "--family", "default", "--mapper", family.mapper_path(), "--texts", str(texts), "--oracle",
              "--oracle-window", "0"])


def _zero_mapper(bridge):
    from kvbridge.core.mapper import Mapper as M

    return M(bridge.mapper.config, {n: torch.zeros_like(t) for n, t in bridge.mapper.weights.items()})


@pytest.mark.parametrize("prompts", [["def read(path):\n    with open(path) as handle:\n        return"],
                                     ["import os\n\ndef main():\n    print(os.getcwd())\n", "x = 1\ny ="]])
def test_recomputing_every_token_gives_the_native_cache(bridge, prompts):
    """Even from an all-zero mapper, a recompute of all prefix tokens is exactly the target's own prefill."""
    from kvbridge.core.models import cache_kv, prefill

    zero = Bridge(bridge.source, bridge.target, _zero_mapper(bridge), recompute=1.0)
    ids, mask = zero.encode(prompts)
    mapped = cache_kv(zero.mapped_cache(ids, mask))
    native = cache_kv(prefill(bridge.target.model, ids, mask, logits="none")[0])
    real = mask.bool()[:, None, :, None]  # pad columns hold whatever: nothing attends to them
    for a, b in zip(mapped[0] + mapped[1], native[0] + native[1]):
        assert torch.allclose(a * real, b * real, atol=1e-4)
    scores = zero.score(prompts, [" x"] * len(prompts))
    native_scores = zero.score(prompts, [" x"] * len(prompts), mode="native")
    assert [s.logprob for s in scores] == pytest.approx([s.logprob for s in native_scores], abs=1e-4)


def test_recompute_stops_after_the_last_layers_keys_and_values(bridge):
    """The recomputed tokens' last-layer attention and MLP feed nothing: they do not run; the layers before do."""
    layers = bridge.target.model.get_decoder().layers
    calls = {0: 0, len(layers) - 1: 0}
    hooks = [layers[j].mlp.register_forward_hook(lambda *a, j=j: calls.__setitem__(j, calls[j] + 1)) for j in calls]
    try:
        ids, mask = bridge.encode(["def read(path):\n    with open(path) as handle:\n        return"])
        Bridge(bridge.source, bridge.target, bridge.mapper, recompute=0.5).mapped_cache(ids, mask)
    finally:
        for h in hooks:
            h.remove()
    assert calls == {0: 1, len(layers) - 1: 0}


class _RecomputeFirst(Bridge):
    """The reference: the recompute runs on its own (a complete prefix cache), then the continuing model reads."""

    def prefix_cache(self, mode, ids, mask, owing=False):
        return super().prefix_cache(mode, ids, mask, owing=False)


@pytest.mark.parametrize("window", [None, 16])  # 16: the 14-token prefix fits, the tokens read after it reach past
def test_recompute_rides_along_with_the_next_forward_exactly(bridge, window):
    """first_token_logits, score and generate carry the recompute in the continuing model's first pass: the same
    logits, cache, scores and tokens as recomputing first and reading after — batched with mixed lengths, three
    held-back tokens, right-padded continuations, and a sliding-window target."""
    from kvbridge.core.models import cache_kv

    config = bridge.target.model.get_decoder().config
    saved = config.sliding_window
    config.sliding_window = window
    try:
        fused, first = (cls(bridge.source, bridge.target, bridge.mapper, recompute=0.3, hold_back=3)
                        for cls in (Bridge, _RecomputeFirst))
        prompts = ["def read(path):\n    with open(path) as handle:\n        return", "x = 1\ny ="]
        ids, mask = fused.encode(prompts)
        (cache, logits), (ref_cache, ref_logits) = (b.first_token_logits(ids, mask) for b in (fused, first))
        assert torch.allclose(logits, ref_logits, atol=1e-4)
        real = mask.bool()[:, None, :, None]
        for x, y in zip(*(cache_kv(c)[0] + cache_kv(c)[1] for c in (cache, ref_cache))):
            kept = y.shape[2]  # a sliding-window layer keeps the last columns only (the fused cache keeps all)
            assert torch.allclose((x * real)[:, :, -kept:], (y * real[:, :, -kept:]), atol=1e-4)
        continuations = [" handle.read()\n", " 2"]
        scores = fused.score(prompts, continuations)
        assert [s.logprob for s in scores] == pytest.approx([s.logprob for s in first.score(prompts, continuations)],
                                                            abs=1e-4)
        assert [s.logprob for s in scores] != pytest.approx([s.logprob for s in fused.score(prompts, continuations,
                                                                                            "native")], abs=1e-3)
        assert fused.generate_ids(ids, mask, max_new_tokens=4).tolist() == \
            first.generate_ids(ids, mask, max_new_tokens=4).tolist()
        if window:  # a prefix longer than the window's cache: a clear refusal, not an index error
            with pytest.raises(UnsupportedModelError, match="sliding-window"):
                fused.first_token_logits(*fused.encode(["x = 1\n" * 6]))
    finally:
        config.sliding_window = saved


def test_a_failed_carrying_pass_leaves_a_cache_that_refuses_reads(bridge):
    from kvbridge.core.models import positions_from_mask, with_cache
    from kvbridge.core.recompute import reading

    b = Bridge(bridge.source, bridge.target, bridge.mapper, recompute=0.3)
    ids, mask = b.encode(["x = 1\ny = 2\nz ="])
    model, owing = b.prefix_cache("mapped", ids, mask, owing=True)
    read = dict(input_ids=ids[:, -1:], attention_mask=mask, position_ids=positions_from_mask(mask)[:, -1:],
                **with_cache(owing), use_cache=True)

    def boom(*args):
        raise KeyboardInterrupt

    hook = model.get_decoder().layers[1].mlp.register_forward_hook(boom)
    try:
        with pytest.raises(KeyboardInterrupt), reading(model):
            model(**read)
    finally:
        hook.remove()
    with pytest.raises(RuntimeError, match="failed part-way"), reading(model):
        model(**read)


def test_a_cache_that_owes_a_recompute_refuses_a_plain_read(bridge):
    from kvbridge.core.models import positions_from_mask, with_cache

    b = Bridge(bridge.source, bridge.target, bridge.mapper, recompute=0.3)
    ids, mask = b.encode(["x = 1\ny = 2\nz ="])
    model, owing = b.prefix_cache("mapped", ids, mask, owing=True)
    with pytest.raises(RuntimeError, match="owes a selective recompute"):
        model(input_ids=ids[:, -1:], attention_mask=mask, position_ids=positions_from_mask(mask)[:, -1:],
              **with_cache(owing), use_cache=True)


def test_the_fused_pass_runs_the_last_layer_for_the_new_tokens_only(bridge):
    layers = bridge.target.model.get_decoder().layers
    rows = []
    hook = layers[-1].mlp.register_forward_hook(lambda module, args, out: rows.append(args[0].shape[1]))
    try:
        b = Bridge(bridge.source, bridge.target, bridge.mapper, recompute=0.5)
        ids, mask = b.encode(["def read(path):\n    with open(path) as handle:\n        return"])
        b.first_token_logits(ids, mask)
    finally:
        hook.remove()
    assert rows == [b.held_back(mask)]


def test_recompute_picks_the_sources_most_surprising_tokens():
    from kvbridge.core.recompute import choose_columns

    scores = torch.tensor([[0.0, 0.0, 5.0, 1.0, 9.0, 2.0], [0.0, 3.0, 1.0, 8.0, 2.0, 7.0]])
    mask = torch.tensor([[0, 0, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1]])
    assert choose_columns(scores, mask, 0.3, sink=False).tolist() == [[2, 4], [3, 5]]
    assert choose_columns(scores, mask, 0.0, sink=True).tolist() == [[2], [0]]  # the first real token
    # each row gets its own share, as alone: 1 of 2 real tokens, 3 of 6; the short row's surplus is pads
    short = torch.tensor([[0, 0, 0, 0, 1, 1], [1, 1, 1, 1, 1, 1]])
    picks = choose_columns(scores, short, 0.5, sink=False).tolist()
    assert picks[1] == [1, 3, 5] and [c for c in picks[0] if short[0, c]] == [4] and len(set(picks[0])) == 3


def test_the_window_ranks_unpredictable_spans_whole_and_ignores_pads():
    from kvbridge.core.recompute import choose_columns, window_mean

    # one surprising token (column 3) in ordinary text, and a run of fairly surprising ones (columns 7-9)
    scores = torch.tensor([[0.0, 2.0, 1.0, 9.0, 1.0, 1.0, 1.0, 6.0, 6.0, 6.0, 1.0, 1.0]])
    valid = torch.ones_like(scores, dtype=torch.bool)
    valid[0, 0] = False  # a row's first token has no score
    mask = torch.ones_like(scores, dtype=torch.long)
    assert choose_columns(window_mean(scores, valid, 1), mask, 0.25, sink=False).tolist() == [[3, 7, 8]]
    assert choose_columns(window_mean(scores, valid, 3), mask, 0.25, sink=False).tolist() == [[7, 8, 9]]
    # the mean over the valid columns of the window: the unscored first column and pads count for nothing
    assert window_mean(scores, valid, 3)[0, :3].tolist() == [2.0, 1.5, 4.0]
    padded = torch.cat([torch.tensor([[100.0, float("nan"), float("inf")]]), scores], 1)  # a pad scores anything
    padded_valid = torch.cat([torch.zeros((1, 3), dtype=torch.bool), valid], 1)
    assert torch.equal(window_mean(padded, padded_valid, 5)[:, 3:], window_mean(scores, valid, 5))
    assert torch.equal(window_mean(scores, valid, 1), scores.masked_fill(~valid, 0.0))


def test_the_recompute_window_is_a_runtime_option_older_artifacts_lack(pair, tmp_path):
    import json as js

    from kvbridge.errors import InputError

    source, target = pair
    mapper = fit_mapper(source, target, family.calibration_texts(),
                        FitConfig(num_texts=4, seq_len=64, heldout_texts=0, lever_objective="kv", mlp_steps=5,
                                  recompute_window=5), progress=False)
    mapper.save_pretrained(tmp_path / "m")
    assert Bridge(source, target, Mapper.from_pretrained(str(tmp_path / "m"))).recompute_window == 5
    assert Bridge(source, target, mapper, recompute_window=1).recompute_window == 1
    with pytest.raises(InputError, match="odd integer"):
        Bridge(source, target, mapper, recompute_window=4)
    with pytest.raises(InputError, match="--recompute-window"):
        FitConfig(recompute_window=0)
    config = js.loads((tmp_path / "m" / "mapper.json").read_text())
    assert config["runtime"]["recompute_window"] == 5
    plain = mapper.config.runtime.override(recompute_window=1).to_dict()
    assert "recompute_window" not in plain  # window 1 writes what releases before the window wrote
    from kvbridge.core.mapper_config import RuntimeOptions

    assert RuntimeOptions.from_dict(plain).recompute_window == 1  # an artifact without the field: as before


def test_frontier_quick_writes_its_three_files(tmp_path, capsys, monkeypatch):
    import kvbridge.measure.frontier

    # some point is recommended at any speed
    monkeypatch.setattr(kvbridge.measure.frontier, "MIN_SPEEDUP", float("-inf"))
    assert main(["frontier", "--quick", "--quiet", "--seed", "3", "--items", "4", "--out", str(tmp_path)]) == 0
    report = json.loads((tmp_path / "frontier.json").read_text())
    assert report["fit"]["seed"] == 3  # every fit of the grid used it
    assert report["items"] == 4  # the held-out rows asked for (the quick grid's own: 8)
    names = [p["name"] for p in report["points"]]
    assert report["recommended"] in names and set(report["pareto"]) <= set(names)
    assert not report["recommended"].endswith("(control)")
    assert report["headline_tokens"] == 256 and report["lengths"] == [128, 256]
    for p in report["points"]:
        assert {"name", "levers", "tasks", "mean_floor_normalized_retention", "ttft_speedup", "context_tokens",
                "validation_retention", "interval_95", "retention", "speedup_noise", "by_length"} <= set(p)
        assert {t["context_tokens"] for t in p["tasks"]} == set(report["lengths"])
        assert {t["task"] for t in p["tasks"]} >= {"recall (document)"}  # the predictable span
        assert {"task", "native", "mapped", "source", "floor", "floor_normalized_retention",
                "mapped_minus_source_95"} <= set(p["tasks"][0])
        for n in report["lengths"]:  # retention and speed at the same length
            at = p["by_length"][str(n)]
            assert at["retention"] <= 1.0 and at["ttft_speedup"] > 0 and len(at["round_speedups"]) == 3
            lo, hi = at["interval_95"]
            assert lo <= hi
        assert p["retention"] == p["by_length"]["256"]["retention"]  # the headline is one length's
        # free generation for mapped and the source alone (native agrees with itself), gap recovered where it leads
        assert set(p["generation"]) == {"agreement", "first divergence", "distinct 4-grams"}
        assert p["generation"]["agreement"]["native"] == 1.0
        assert all(("gap_interval_95" in t) == (t["gap_recovered"] is not None) for t in p["tasks"])
        lo, hi = p["interval_95"]
        assert lo <= hi
        for t in p["tasks"]:
            assert (f"{t['task']}@{t['context_tokens']}" in p["source_beats_mapped"]) == (
                t["mapped_minus_source_95"][1] < 0)
            assert (f"{t['task']}@{t['context_tokens']}" in p["mapped_beats_source"]) == (
                t["mapped_minus_source_95"][0] > 0)
            lead = next(q for q in report["points"][0]["tasks"] if q["task"] == t["task"]
                        and q["context_tokens"] == t["context_tokens"])["native_minus_source_95"]
            assert t["native_minus_source_95"] == lead and lead[0] <= lead[1]  # the target's own, one per cell
    levered = next(p for p in report["points"] if p["levers"]["mapper"])
    assert levered["levers"]["mapper"][0]["lags"] == [0, 1, 2]
    blind = next(p for p in report["points"] if p["levers"]["runtime"].get("recompute_by") == "random")
    assert blind["levers"]["runtime"]["recompute"] == 0.1  # the control spends the same budget
    lo, hi = blind["recommended_minus_control_95"]["heldout"]  # the recommended point against the control, paired
    assert lo <= hi and "recommended_minus_control_95" not in levered
    assert (tmp_path / "frontier.png").read_bytes()[:4] == b"\x89PNG"
    table = (tmp_path / "frontier.md").read_text()
    assert "Held-out @256" in table and "at 256 tokens" in table
    assert "Gap recovered, perplexity @256" in table and "Greedy agreement with native @256" in table
    assert "Recommended minus *plain + recompute 10% at random (control)*" in table
    assert "beats the source alone beyond noise" in table and "The target itself (native)" in table


def test_frontier_rule_clears_the_bar_by_its_noise_and_ties_inside_the_paired_interval():
    from kvbridge.measure.evaluate import TaskResult
    from kvbridge.measure.frontier import recommend

    def point(name, speedup, noise, validation):
        return {"name": name, "ttft_speedup": speedup, "speedup_noise": noise, "validation_retention": validation}

    def run(mapped):  # one task, 40 documents, native 1, floor 0: retention = mean of the items
        return [[TaskResult("recall", "acc", 1.0, sum(mapped) / len(mapped), 0.5, 0.0, len(mapped),
                            per_item={"native": [1.0] * len(mapped), "mapped": mapped, "source": [0.5] * len(mapped)},
                            keys=list(range(len(mapped))))]]

    best = [0.9] * 40
    close = [0.9] * 39 + [0.5]  # one document worse: inside the noise of 40
    far = [0.5] * 40
    points = [point("best", 1.6, 0.05, 0.9), point("close", 2.0, 0.1, 0.89), point("far", 2.5, 0.1, 0.5),
              point("noisy", 3.0, 1.6, 0.9)]
    validation = {"best": run(best), "close": run(close), "far": run(far), "noisy": run(best)}
    assert recommend(points, validation) == "close"  # noisy clears 1.5x only inside its own noise
    assert recommend(points[:1] + points[2:], validation) == "best"  # far is faster, but worse beyond noise
    assert recommend([point("slow", 1.52, 0.05, 0.9)], validation | {"slow": run(best)}) is None
    # a control measures what a choice adds: never recommended, however it measures
    control = point("blind (control)", 4.0, 0.0, 0.95)
    assert recommend(points + [control], validation | {"blind (control)": run([0.95] * 40)}) == "close"


def test_paired_bootstrap_draws_a_document_at_every_length_at_once():
    from kvbridge.measure.evaluate import TaskResult, paired_replicates

    def run(values, keys):
        return [TaskResult("t", "acc", 1.0, sum(values) / len(values), 0.0, 0.0, len(values),
                           per_item={"native": [1.0] * len(values), "mapped": values, "source": [0.0] * len(values)},
                           keys=keys)]

    short, long = run([1.0, 0.0, 1.0], [0, 1, 2]), run([1.0, 0.0], [0, 1])  # documents 0 and 1 at both lengths
    diff = paired_replicates([short, long], lambda d: d[0].mapped - d[1].mapped if len(d) == 2 else 0.0,
                             replicates=300)
    # paired: document 1 is 0.0 at both lengths, so a replicate never sees short and long disagree beyond doc 2
    assert min(diff) >= -1e-9


def test_packed_rows_at_a_length_longer_than_the_documents(pair):
    from kvbridge.errors import InputError
    from kvbridge.measure.evaluate import document_rows

    tok = pair[1].tokenizer
    texts = ["def f(x):\n    return x\n" * 3, "import os\n" * 5, "class A:\n    pass\n" * 12]
    with pytest.raises(InputError, match="held-out documents"):
        document_rows(tok, texts, 2, 64)
    sizes = [len(tok(t, add_special_tokens=False)["input_ids"]) + 1 for t in texts]  # + EOS
    length = sizes[0] + sizes[1] // 2 + 1  # a row longer than any of the documents but the last
    assert max(sizes[:2]) < length - 1 < sizes[2]
    rows, keys = document_rows(tok, texts, 2, length, pack=True)  # one document is long enough: packing
    assert rows.shape == (2, length) and rows[0, 0] == tok.bos_token_id
    assert keys == [0, 1]  # row 1 starts inside document 1
    assert rows[0, sizes[0]].item() == tok.eos_token_id  # document 0 ends, document 1 begins
    with pytest.raises(InputError, match="even packed"):
        document_rows(tok, texts, 50, 64, pack=True)


def test_bigram_surprisal_ranks_unseen_pairs_high():
    from kvbridge.core.recompute import bigram_surprisal, bigram_tables

    tables = bigram_tables(torch.tensor([[1, 2, 3, 1, 2, 3, 1, 2, 4]]), vocab=6)
    assert tables["recompute.bigram.keys"].dtype == torch.int64
    s = bigram_surprisal(torch.tensor([[1, 2, 3, 5, 1]]), tables)
    assert s[0, 0] == 0 and s[0, 1] < s[0, 2] < s[0, 3]  # 1→2 seen 3×, 2→3 seen 2×, 3→5 never


def test_bigram_recompute_round_trips_and_needs_no_source_logits(pair, tmp_path, monkeypatch):
    import kvbridge.core.models as models

    source, target = pair
    mapper = fit_mapper(source, target, family.calibration_texts(),
                        FitConfig(num_texts=8, seq_len=128, heldout_texts=0, recompute=0.1, recompute_by="bigram",
                                  tune_steps=20, mlp_steps=50),
                        progress=False)
    mapper.save_pretrained(tmp_path / "m")
    loaded = Mapper.from_pretrained(str(tmp_path / "m"), dtype=torch.bfloat16)
    keys = loaded.weights["recompute.bigram.keys"]
    assert keys.dtype == torch.int64 and torch.equal(keys, mapper.weights["recompute.bigram.keys"])
    bridge = Bridge(source, target, Mapper.from_pretrained(str(tmp_path / "m")))
    assert bridge.recompute == 0.1 and bridge.recompute_by != "surprisal"
    import kvbridge.core.transfer as transfer

    seen = []
    original = models.prefill  # what selective_recompute and Bridge.source_prefill call
    spy = lambda *a, **k: seen.append(k.get("logits", a[4] if len(a) > 4 else "all")) or original(*a, **k)  # noqa: E731
    monkeypatch.setattr(models, "prefill", spy)
    monkeypatch.setattr(transfer, "prefill", spy)
    assert bridge.generate(["def f(x):\n    return x +"], max_new_tokens=3).token_ids
    assert seen and "all" not in seen


def test_fit_defaults_are_the_frontiers_recommended_point():
    from dataclasses import replace

    from kvbridge.measure.demo import FULL as DEMO
    from kvbridge.measure.frontier import FAMILY, FULL, RECOMMENDED

    point = next(p for p in FULL.points if p.name == RECOMMENDED)
    # the frontier fits on fewer windows: 64 of the calibration documents are its validation set
    assert FitConfig(**FAMILY) == replace(FULL.fit, **point.fit, **point.runtime, num_texts=160) == DEMO.fit
    # one source layer a map by default, chosen on the embedded families (the deep ones' 4-layer sources too)
    assert FitConfig() == FitConfig(**FAMILY) and FitConfig().top_k == 1


def test_every_grid_point_is_a_valid_fit_and_a_plain_point_reads_every_source_layer():
    """Grid points spell their settings out: a changed kvbridge fit default (one source layer a map) does not
    silently change what a grid's plain map is."""
    from dataclasses import replace

    from kvbridge.measure.frontier import GRIDS

    for name, grid in GRIDS.items():
        assert grid.fit.top_k is None and not grid.fit.has_levers and grid.fit.recompute == 0, name
        seen = {}
        for point in grid.points:
            config = replace(grid.fit, **point.fit, **point.runtime)  # FitConfig checks every setting on construction
            # no point repeats another's fit and runtime (a lever_top_k above top_k is capped to it, for one)
            effective = replace(config, lever_top_k=min(config.lever_top_k or config.top_k or 10**6,
                                                        config.top_k or 10**6))
            assert effective not in seen, (name, point.name, seen.get(effective))
            seen[effective] = point.name


def test_a_cell_counts_only_where_native_beats_the_floor_beyond_noise_and_is_held_to_0_100():
    from dataclasses import replace

    from kvbridge.measure.evaluate import TaskResult, capped_mean_retention, has_benefit, mean_retention

    def cell(native, mapped, floor):
        n = len(native)
        return TaskResult("recall", "acc", sum(native) / n, sum(mapped) / n, 0.0, sum(floor) / n, n,
                          per_item={"native": native, "mapped": mapped, "source": [0.0] * n, "floor": floor})

    clear = cell([0.8] * 30, [0.9] * 30, [0.1] * 30)  # retention 114 %: held to 100 %
    worse = cell([0.8] * 30, [0.0] * 30, [0.1] * 30)  # worse than no context: held to 0 %
    noise = cell([0.3, 0.2] * 15, [0.0] * 30, [0.2, 0.3] * 15)  # native equals its floor on average
    assert has_benefit(clear) and has_benefit(worse) and not has_benefit(noise)
    cells = [replace(c, benefit=has_benefit(c)) for c in (clear, worse, noise)]
    assert capped_mean_retention(cells) == pytest.approx(0.5)
    assert mean_retention(cells) == pytest.approx((0.8 / 0.7 - 1.0 / 7) / 2)


def test_a_replicate_where_native_drops_to_its_floor_keeps_nothing_and_benefit_resamples_documents():
    from dataclasses import replace

    from kvbridge.measure.evaluate import TaskResult, capped_mean_retention, has_benefit, mean_retention

    # counted on the whole sample, but this resample's native equals its floor minus a bit: 0, not (−)/(−) > 0
    drawn = TaskResult("recall", "acc", 0.30, 0.10, 0.0, 0.35, 4, benefit=True)
    assert mean_retention([drawn]) == 0.0 and capped_mean_retention([drawn]) == 0.0
    # the items of one document gain 0.2 each, the other's lose 0.1: by items (400) the mean gain of 0.05 looks
    # certain, by documents it is one document of two
    native = [0.3] * 200 + [0.0] * 200
    floor = [0.1] * 400
    per = {"native": native, "mapped": native, "source": native, "floor": floor}
    cell = TaskResult("recall", "acc", 0.15, 0.15, 0.15, 0.1, 400, per_item=per)
    assert has_benefit(cell)
    assert not has_benefit(replace(cell, keys=[0] * 200 + [1] * 200))
