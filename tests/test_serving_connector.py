"""The target connector's two sides without an engine: what they send each other survives pickling (vLLM ships it
between processes), two tensor-parallel workers' reports combine, and the scheduler's bookkeeping per request gives
the response's kv_transfer_params and the stats (the engine tests run them inside vLLM). The connector's modules are
imported by the tests, not at collection: they import vLLM, which takes seconds."""

import pickle
from types import SimpleNamespace

import pytest

from kvbridge.errors import InputError

pytestmark = pytest.mark.vllm  # (skipped where vLLM does not import, except in CI)


def outcomes():
    """Two mapped loads' reports and a failed one: (A, B, FAILED)."""
    from kvbridge.serving.engine.target_messages import LoadOutcome

    return (LoadOutcome("mapped", 10.0, 5, None, 3, 3, 2.0, {"read": 1.0, "map": 4.0}),
            LoadOutcome("mapped", 12.0, 5, "torn", 3, 1, 3.0, {"read": 2.0, "write": 1.0}),
            LoadOutcome("fallback: x"))


def test_a_request_says_once_what_of_the_store_it_reads():
    from kvbridge.serving.engine.config import StoreUse, request_use_store

    assert request_use_store(None) is StoreUse.ON and request_use_store({"kvbridge_store": False}) is StoreUse.OFF
    assert request_use_store({"kvbridge_store": "folder"}) is StoreUse.FOLDER
    for bad in (1, "yes", None, 0.0):
        with pytest.raises(InputError) as caught:
            request_use_store({"kvbridge_store": bad})
        assert str(caught.value) == \
            f'kv_transfer_params.kvbridge_store must be true, false, "folder" or "source", not {bad!r}.'


def test_the_workers_reports_combine_and_survive_pickling():
    """One worker's failure fails the request's load; both mapped: the least read from memory, the slowest writes
    and phases; a request one worker alone reported keeps its report."""
    from kvbridge.serving.engine.config import StoreUse
    from kvbridge.serving.engine.target_messages import KVBridgeMetadata, KVBridgeWorkerMetadata, Load, LoadOutcome

    A, B, FAILED = outcomes()
    merged = KVBridgeWorkerMetadata({"r": A, "s": FAILED, "t": A}).aggregate(
        KVBridgeWorkerMetadata({"r": B, "s": A, "t": FAILED, "u": B}))
    merged = pickle.loads(pickle.dumps(merged))
    assert merged.outcomes == {"r": LoadOutcome("mapped", 10.0, 5, None, 3, 1, 3.0,
                                                {"read": 2.0, "map": 4.0, "write": 1.0}),
                               "s": FAILED, "t": FAILED, "u": B}
    meta = pickle.loads(pickle.dumps(KVBridgeMetadata([Load("r", [1, 2], 0, 2, [0], None, StoreUse.FOLDER, True)],
                                                      idle=True)))
    assert meta.loads[0].use_store is StoreUse.FOLDER and meta.idle


def test_the_stats_add_up_the_reports_and_the_outcomes():
    from kvbridge.serving.engine.connector import KVBridgeConnector
    from kvbridge.serving.engine.target_metrics import KVBridgeStats

    A, B, FAILED = outcomes()
    stats = KVBridgeStats()
    stats.add_load(A)
    stats.add_load(B)
    stats.add_request("fallback: x")
    stats.add_request("cached: y")
    r = stats.reduce()
    assert (r["map_ms"], r["write_ms"], r["stored_tokens"], r["premapped_tokens"], r["hot_tokens"]) == (22, 5, 10, 6, 4)
    assert r["store_refused"] == 1 and r["fallback"] == 1 and r["cached"] == 1 and r["mapped"] == 0
    assert r["read_read_ms"] == 3.0 and r["read_write_ms"] == 1.0 and r["read_map_ms"] == 4.0
    assert KVBridgeConnector.build_kv_connector_stats(stats.data).reduce() == r


def scheduler():
    """A scheduler with settings of its own (hold-back 2, 100 source positions, prefix caching on, no store)."""
    from kvbridge.serving.engine.config import ServeConfig
    from kvbridge.serving.engine.target_scheduler import KVBridgeScheduler
    from kvbridge.serving.engine.target_setup import TargetSetup

    config = ServeConfig(mapper="m", source="s", target="t", min_tokens=4)
    return KVBridgeScheduler(TargetSetup(config, None, 2, 100, 4, True, "kvbridge-ns", 1), None)


def request(rid, n, params=None, salt="kvbridge-ns"):
    return SimpleNamespace(request_id=rid, prompt_token_ids=list(range(n)), kv_transfer_params=params, cache_salt=salt,
                           mm_features=None, prompt_embeds=None, skip_reading_prefix_cache=False)


BLOCKS = SimpleNamespace(get_block_ids=lambda: ([7, 8, 9],))


def test_a_mapped_request_is_planned_once_and_answered_with_its_load():
    from kvbridge.serving.engine.config import StoreUse
    from kvbridge.serving.engine.target_messages import KVBridgeWorkerMetadata

    A, B, FAILED = outcomes()
    s = scheduler()
    r = request("a", 10, {"kvbridge": "mapped", "kvbridge_store": "source"})
    assert s.get_num_new_matched_tokens(r, 4) == (4, False)  # every token but the hold-back, past the cache hit
    s.update_state_after_alloc(r, BLOCKS, 4)
    meta = s.build_connector_meta(SimpleNamespace(total_num_scheduled_tokens=3))
    assert [(x.request_id, x.start, x.end, x.block_ids, x.use_store, x.token_ids) for x in meta.loads] == \
        [("a", 4, 8, [7, 8, 9], StoreUse.SOURCE, list(range(8)))] and not meta.idle
    assert s.build_connector_meta(SimpleNamespace(total_num_scheduled_tokens=0)).loads == []  # planned once
    s.update_connector_output(SimpleNamespace(kv_connector_worker_meta=KVBridgeWorkerMetadata({"a": A, "gone": B})))
    assert s.request_finished(r, []) == (False, {
        "kvbridge": "mapped", "kvbridge_mapped_tokens": 4, "kvbridge_map_ms": 10.0, "kvbridge_write_ms": 2.0,
        "kvbridge_read_ms": {"read": 1.0, "map": 4.0}})
    assert s._requests == {} and s._planned == {}
    stats = s.get_kv_connector_stats().reduce()
    assert stats["mapped"] == 1 and stats["map_ms"] == 22.0  # (the report of a finished request counted too)
    assert s.get_kv_connector_stats() is None


def test_the_other_outcomes_and_a_fallback_that_sticks():
    s = scheduler()
    native = request("b", 10, {"kvbridge": "native"})
    assert s.get_num_new_matched_tokens(native, 0) == (0, False)
    s.update_state_after_alloc(native, BLOCKS, 0)
    assert s.request_finished(native, [])[1] == {"kvbridge": "native"}
    bad = request("c", 10, {"kvbridge": "bogus"})
    assert s.get_num_new_matched_tokens(bad, 0) == (0, False)
    s.update_state_after_alloc(bad, BLOCKS, 0)
    assert s.get_num_new_matched_tokens(bad, 0) == (0, False)
    assert s.request_finished(bad, [])[1]["kvbridge"].startswith("fallback: kv_transfer_params.kvbridge must be")
    unsalted = request("d", 10, {"kvbridge": "mapped"}, salt=None)
    assert s.get_num_new_matched_tokens(unsalted, 0) == (0, False)
    assert s._requests["d"].decision.status.startswith("fallback: prefix caching is on")
    assert s.request_finished(unsalted, []) == (False, None) and s._requests == {}  # never allocated: not counted
    later = request("e", 10, {"kvbridge": "mapped", "kvbridge_load": "async"})
    assert s.get_num_new_matched_tokens(later, 8) == (0, False)
    assert s._requests["e"].decision.status.startswith("cached")
    assert s.get_num_new_matched_tokens(later, 0) == (8, True)  # asked again: the answer was provisional
    s.update_state_after_alloc(later, BLOCKS, 4)  # the engine took less than was claimed
    assert s._requests["e"].status == "fallback: the engine did not load the mapped prefix"
    assert s.build_connector_meta(SimpleNamespace()).loads[0].asynchronous
    assert s.get_num_new_matched_tokens(later, 0) == (0, False)  # (preempted, asked again: stays native)


def test_a_second_load_keeps_what_the_first_one_named():
    from kvbridge.serving.engine.target_messages import LoadOutcome
    from kvbridge.serving.engine.target_scheduler import RequestState

    A, B, FAILED = outcomes()
    state = RequestState(status="mapped")
    state.report(B)
    state.report(A)
    assert state.outcome.refused == "torn" and state.outcome.phases == A.phases and state.outcome.ms == 10.0
    state.report(LoadOutcome("mapped", 1.0))
    assert state.outcome.phases == A.phases and state.outcome.refused == "torn"
