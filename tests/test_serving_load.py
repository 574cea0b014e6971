"""The load benchmark's pure parts (no engine): the seeded Poisson trace, percentiles and their intervals, the
/metrics parser on a vLLM-style exposition, the table; and the connector's load option."""

from __future__ import annotations

import math
import statistics
import time
from pathlib import Path

import pytest

from kvbridge.errors import InputError, KVBridgeError
from kvbridge.serving.bench.load import (
    Arrival,
    counter,
    engine_counters,
    load_table,
    loaded_ratios,
    parse_metrics,
    percentile,
    poisson_trace,
    prompt_ids,
    summary,
    way_result,
)


def test_the_trace_is_seeded_poisson_with_lengths_in_bounds():
    a = poisson_trace(3.0, 4000, (256, 2000), seed=7, stream_tokens=50_000)
    assert a == poisson_trace(3.0, 4000, (256, 2000), seed=7, stream_tokens=50_000)  # same seed, same trace
    assert a != poisson_trace(3.0, 4000, (256, 2000), seed=8, stream_tokens=50_000)
    gaps = [a[0].at_s] + [y.at_s - x.at_s for x, y in zip(a, a[1:])]
    assert all(g > 0 for g in gaps) and [x.index for x in a] == list(range(4000))
    assert statistics.mean(gaps) == pytest.approx(1 / 3, rel=0.06)  # exponential gaps of mean 1/rate
    assert statistics.stdev(gaps) == pytest.approx(1 / 3, rel=0.08)  # (an exponential's sd equals its mean)
    lengths = [x.length for x in a]
    assert min(lengths) >= 256 and max(lengths) <= 2000 and statistics.mean(lengths) == pytest.approx(1128, rel=0.03)
    assert all(0 <= x.start and x.start + x.length <= 50_000 for x in a)
    assert len({x.start for x in a}) > 3700  # (mostly windows of their own; each request is salted apart anyway)
    slow = poisson_trace(1.0, 4000, (256, 2000), seed=7, stream_tokens=50_000)
    assert slow[-1].at_s == pytest.approx(3 * a[-1].at_s, rel=1e-9)  # one seed: the same gaps, scaled by the rate


@pytest.mark.parametrize("rate, count, lengths, stream", [(0, 5, (2, 3), 100), (-1, 5, (2, 3), 100),
                                                          (math.inf, 5, (2, 3), 100), (1, 0, (2, 3), 100),
                                                          (1, 5, (1, 3), 100), (1, 5, (9, 3), 100),
                                                          (1, 5, (2, 300), 100)])
def test_bad_trace_arguments_are_refused(rate, count, lengths, stream):
    with pytest.raises(KVBridgeError):
        poisson_trace(rate, count, lengths, 0, stream)


def test_percentiles_interpolate_as_numpy_and_intervals_hold_them():
    np = pytest.importorskip("numpy")
    xs = [5.0, 1.0, 9.0, 3.0, 7.0, 2.0, 100.0]
    for q in (0, 10, 50, 90, 99, 100):
        assert percentile(xs, q) == pytest.approx(float(np.percentile(xs, q)))
    assert percentile([4.0], 90) == 4.0
    with pytest.raises(KVBridgeError):
        percentile([], 50)
    with pytest.raises(KVBridgeError):
        percentile(xs, 101)
    values = [float(v) for v in range(1, 101)]
    s = summary(values, replicates=500)
    assert s["n"] == 100 and s["p50"] == pytest.approx(50.5) and s["p90"] == pytest.approx(90.1)
    for q in (50, 90, 99):
        lo, hi = s[f"p{q}_interval"]
        assert lo <= s[f"p{q}"] <= hi and hi - lo < 25
    assert s == summary(values, replicates=500)  # seeded


SCRAPE = """# HELP vllm:prompt_tokens_total Number of prefill tokens processed.
# TYPE vllm:prompt_tokens_total counter
vllm:prompt_tokens_total{engine="0",model_name="m"} 1200.0
vllm:prompt_tokens_by_source_total{engine="0",model_name="m",source="local_compute"} 202.0
vllm:prompt_tokens_by_source_total{engine="0",model_name="m",source="local_cache_hit"} 128.0
vllm:prompt_tokens_by_source_total{engine="0",model_name="m",source="external_kv_transfer"} 870.0
vllm:generation_tokens_total{engine="0",model_name="m"} 64.0
vllm:request_success_total{engine="0",finished_reason="length",model_name="m"} 3.0
vllm:request_success_total{engine="0",finished_reason="stop",model_name="m"} 1.0
vllm:kvbridge_requests_total{engine="0",model_name="m",outcome="mapped"} 2.0
vllm:kvbridge_requests_total{engine="0",model_name="m",outcome="fallback"} 1.0
vllm:kvbridge_map_seconds_total{engine="0",model_name="m"} 0.75
vllm:kvbridge_map_seconds_created{engine="0",model_name="m"} 1.7e+09
vllm:time_to_first_token_seconds_bucket{engine="0",le="0.5",model_name="m"} 3.0
"""


def test_the_metrics_parser_reads_vllms_counters():
    samples = parse_metrics(SCRAPE + "garbage line\nvllm:x{a=\"1\"} notanumber\n")
    assert counter(samples, "vllm:prompt_tokens") == 1200 == counter(samples, "vllm:prompt_tokens_total")
    assert counter(samples, "vllm:request_success") == 4
    assert counter(samples, "vllm:request_success", finished_reason="stop") == 1
    assert counter(samples, "vllm:absent") == 0
    c = engine_counters(SCRAPE)
    assert c["prompt_tokens"] == c["local_compute"] + c["local_cache_hit"] + c["external_kv_transfer"]
    assert (c["local_compute"], c["kvbridge_mapped"], c["kvbridge_fallback"]) == (202, 2, 1)
    assert c["kvbridge_map_seconds"] == 0.75 and c["requests"] == 4 and c["generation_tokens"] == 64


def test_a_ways_result_and_the_table():
    rows = [{"ttft_ms": 100.0 + i, "e2e_ms": 300.0 + i, "tokens": 8, "late_ms": 0.5} for i in range(10)]
    before = engine_counters(SCRAPE)
    after = dict(before, prompt_tokens=before["prompt_tokens"] + 5000, local_compute=before["local_compute"] + 50,
                 external_kv_transfer=before["external_kv_transfer"] + 4950, kvbridge_mapped=12.0)
    r = way_result("mapped-sync", 2.0, rows, 4.0, before, after, replicates=200)
    assert r.output_tokens_per_s == 20.0 and r.computed_share == pytest.approx(0.01) and r.requests == 10
    assert r.counters["kvbridge_mapped"] == 10 and r.late_ms_max == 0.5
    base = way_result("plain", None, [dict(x, ttft_ms=50.0) for x in rows], 4.0, before, before, replicates=200)
    assert math.isnan(base.computed_share)  # (no counter moved)
    from dataclasses import asdict

    report = {"rates": [2.0], "results": [asdict(base), asdict(dict_way("plain", r))]}
    table = load_table({"results": [asdict(r)]})
    assert "| 2 | mapped-sync | 10 |" in table and "10 / 0" in table and "1.0 %" in table
    assert loaded_ratios(report)[0].startswith("at 2 req/s plain vLLM's p90 TTFT is 2.")


def dict_way(way, r):
    from dataclasses import replace

    return replace(r, way=way)


def test_prompts_start_with_bos_and_have_the_arrivals_length():
    stream = list(range(1000, 3000))
    a = Arrival(0, 0.1, 300, 17)
    ids = prompt_ids(a, stream, 1)
    assert len(ids) == 300 and ids[0] == 1 and ids[1] == 1017
    assert prompt_ids(a, stream, None) == stream[17:317]


def test_the_load_option_per_server_and_per_request():
    from kvbridge.serving.engine.config import ServeConfig, request_load
    from kvbridge.serving.engine.middleware import check_body

    assert ServeConfig(mapper="m", source="s", target="t").sync_load is True  # synchronous by default (measured)
    with pytest.raises(InputError, match="sync_load must be true or false"):
        ServeConfig(mapper="m", source="s", target="t", sync_load="yes")
    assert not ServeConfig.from_extra({"mapper": "m", "source": "s", "target": "t", "sync_load": False}).sync_load
    assert request_load(None, False) and not request_load(None, True)
    assert request_load({"kvbridge_load": "async"}, True) and not request_load({"kvbridge_load": "sync"}, False)
    with pytest.raises(InputError, match='must be "sync" or "async"'):
        request_load({"kvbridge_load": 1}, False)
    check_body({"kv_transfer_params": {"kvbridge": "mapped", "kvbridge_load": "sync"}})
    with pytest.raises(InputError, match="kvbridge_load"):
        check_body({"kv_transfer_params": {"kvbridge": "mapped", "kvbridge_load": "later"}})


def test_the_warm_way_has_the_source_serve_each_prompt_first_under_the_targets_salt(monkeypatch):
    """The warm way's prompts go to the storing source first, one at a time, 1 token each, under the very salts the
    target's requests then carry (its store keys by them); the cold ways ask for no store; no source: refused."""
    import asyncio

    from kvbridge.serving.bench import load

    calls = []

    async def replay(client, model, trace, stream, bos, params, salt, new_tokens, open_loop=True):
        calls.append((model, salt, new_tokens, open_loop, params))
        return [{"ttft_ms": 1.0, "e2e_ms": 2.0, "tokens": new_tokens} for _ in trace]

    async def settled(url, before, requests, counted, timeout_s=60.0):
        return before

    monkeypatch.setattr(load, "replay", replay)
    monkeypatch.setattr(load, "settled", settled)
    monkeypatch.setattr(load, "scrape", lambda url: {"prompt_tokens": 0.0})
    trace = poisson_trace(2.0, 4, (256, 512), 0, 10_000)
    args = ({w: "http://127.0.0.1:9" for w in ("native", "warm")}, {"native": "t", "warm": "t"}, ["native", "warm"],
            [2.0], {2.0: trace}, trace[:2], list(range(10_000)), 1, 8, "run")
    with pytest.raises(KVBridgeError, match="warm way needs the storing source"):
        asyncio.run(load.run_ways(*args))
    results = asyncio.run(load.run_ways(*args, progress=lambda m: None, source=("http://127.0.0.1:8", "src"),
                                        settle_s=0.0))
    assert [(r.way, r.rate) for r in results] == [("native", None), ("warm", None), ("warm", 2.0), ("native", 2.0)]
    for i, call in enumerate(calls):
        if call[0] == "src":  # the source's pass: closed loop, one token, no kvbridge parameters ...
            assert call[2:] == (1, False, None)
            nxt = calls[i + 1]  # ... right before the target's run under the same salts
            assert nxt[0] == "t" and nxt[1] == call[1] and nxt[4] == load.PARAMS["warm"]
    assert sum(c[0] == "src" for c in calls) == 2
    assert load.PARAMS["mapped-sync"]["kvbridge_store"] is False and load.PARAMS["mapped-async"]["kvbridge_store"] \
        is False


def test_the_prewarm_ways_run_the_source_turn_under_load_then_the_escalated_request(monkeypatch):
    """prewarm: at each arrival the source's turn asks for prewarming, and the escalated (mapped) request follows
    the lead later under the same salt; native-prewarm: the source's turn is not stored and the prompt goes to the
    plain target (one token) before the escalated request. Only the escalated requests are measured; the target's
    counters wait for its prewarm requests too; no source: refused."""
    import asyncio

    from kvbridge.serving.bench import load

    calls = []

    async def one(client, model, ids, params, salt, new_tokens):
        calls.append((model, salt, new_tokens, params, time.perf_counter()))
        return {"ttft_ms": 1.0, "e2e_ms": 2.0, "tokens": new_tokens, "sent_s": time.perf_counter(),
                "prompt_tokens": len(ids)}

    waited = []

    async def settled(url, before, requests, counted, timeout_s=60.0):
        waited.append((requests, counted))
        return before

    monkeypatch.setattr(load, "_one", one)
    monkeypatch.setattr(load, "settled", settled)
    monkeypatch.setattr(load, "scrape", lambda url: {"prompt_tokens": 0.0})
    trace = poisson_trace(50.0, 3, (256, 512), 0, 10_000)
    ways = ["prewarm", "native-prewarm"]
    args = ({"prewarm": "http://127.0.0.1:9", "native-prewarm": "http://127.0.0.1:7"},
            {"prewarm": "kv", "native-prewarm": "plain"}, ways, [50.0], {50.0: trace}, trace[:2],
            list(range(10_000)), 1, 8, "run")
    with pytest.raises(KVBridgeError, match="prewarm way needs the storing source"):
        asyncio.run(load.run_ways(*args))
    results = asyncio.run(load.run_ways(*args, progress=lambda m: None, source=("http://127.0.0.1:8", "src"),
                                        lead_s=0.05))
    assert [(r.way, r.rate, r.requests) for r in results] == [
        ("prewarm", None, 2), ("native-prewarm", None, 2), ("native-prewarm", 50.0, 3), ("prewarm", 50.0, 3)]
    assert [w[0] for w in waited] == [4, 4, 6, 6] and [w[1] for w in waited] == [True, False, False, True]
    models = {"prewarm": "kv", "native-prewarm": "plain"}
    salts = sorted({c[1] for c in calls})
    assert len(salts) == 2 * (2 + 3)  # one per arrival and way
    for salt in salts:
        way = salt.removeprefix("load-run-").rsplit("-", 2)[0]
        mine = [c for c in calls if c[1] == salt]
        assert mine[0][:4] == ("src", salt, 1, load.PREWARMED[way])  # the source's turn first
        if way == "native-prewarm":  # the router's re-send: one token to plain vLLM, no kvbridge parameters
            assert mine[1][:4] == ("plain", salt, 1, None)
        assert mine[-1][:4] == (models[way], salt, 8, load.PARAMS[way]) and len(mine) == 2 + (way == "native-prewarm")
        assert mine[-1][4] - mine[0][4] >= 0.05 - 1e-3  # the escalated request waits out the lead
    assert load.PREWARMED["native-prewarm"] == {"kvbridge_prewarm": False, "kvbridge_store": False}
    assert all(r.prompt_tokens == sum(a.length for a in (trace if r.rate else trace[:2])) for r in results)


def test_the_ab_way_sends_every_arrival_to_plain_and_native_at_once(monkeypatch):
    """ab: each arrival goes to plain vLLM (no kvbridge parameters) and to kvbridge native on one clock, the same
    prompt and time for both; each server's rows are a result of their own, its counters waited for with its own
    request count (only the kvbridge server counts connector outcomes)."""
    import asyncio

    from kvbridge.serving.bench import load

    calls = []

    async def one(client, model, ids, params, salt, new_tokens):
        calls.append((model, salt, params, len(ids), time.perf_counter()))
        return {"ttft_ms": float(len(calls)), "e2e_ms": 2.0, "tokens": new_tokens, "sent_s": time.perf_counter(),
                "prompt_tokens": len(ids)}

    waited = []

    async def settled(url, before, requests, counted, timeout_s=60.0):
        waited.append((url, requests, counted))
        return before

    monkeypatch.setattr(load, "_one", one)
    monkeypatch.setattr(load, "settled", settled)
    monkeypatch.setattr(load, "scrape", lambda url: {"prompt_tokens": 0.0})
    trace = poisson_trace(50.0, 5, (256, 512), 0, 10_000)
    urls = {"ab:plain": "http://127.0.0.1:7", "ab:native": "http://127.0.0.1:9"}
    results = asyncio.run(load.run_ways(urls, {"ab:plain": "plain", "ab:native": "kv"}, ["ab"], [50.0],
                                        {50.0: trace}, trace[:2], list(range(10_000)), 1, 8, "run",
                                        progress=lambda m: None))
    assert [(r.way, r.rate, r.requests) for r in results] == [("ab:plain", None, 2), ("ab:native", None, 2),
                                                              ("ab:plain", 50.0, 5), ("ab:native", 50.0, 5)]
    by_salt = {}
    for model, salt, params, length, at in calls:
        by_salt.setdefault(salt, []).append((model, params, length, at))
    for salt, sent in by_salt.items():  # both servers, the same prompt, within a moment of each other
        assert sorted((m, str(p)) for m, p, _, _ in sent) == [("kv", str({"kvbridge": "native"})), ("plain", "None")]
        assert sent[0][2] == sent[1][2] and abs(sent[0][3] - sent[1][3]) < 0.05
    assert waited[2:] == [(urls["ab:plain"], 5, False), (urls["ab:native"], 5, True)]
    assert results[2].prompt_tokens == results[3].prompt_tokens == sum(a.length for a in trace)
    assert all(r.wall_s > 0 for r in results)  # each half's throughput over its own span


def test_the_ab_warm_way_stores_first_then_pairs_plain_with_warm(monkeypatch):
    """ab-warm: the source serves every prompt first (one token, closed loop, the target's salts), then each arrival
    goes to plain vLLM and, mapped from the store, to the kvbridge server at once; without a source: refused."""
    import asyncio

    from kvbridge.serving.bench import load

    calls = []

    async def one(client, model, ids, params, salt, new_tokens):
        calls.append((model, salt, params, new_tokens))
        return {"ttft_ms": 1.0, "e2e_ms": 2.0, "tokens": new_tokens, "sent_s": time.perf_counter(),
                "prompt_tokens": len(ids)}

    async def settled(url, before, requests, counted, timeout_s=60.0):
        return before

    monkeypatch.setattr(load, "_one", one)
    monkeypatch.setattr(load, "settled", settled)
    monkeypatch.setattr(load, "scrape", lambda url: {"prompt_tokens": 0.0})
    trace = poisson_trace(50.0, 3, (256, 512), 0, 10_000)
    urls = {"ab-warm:plain": "http://127.0.0.1:7", "ab-warm:warm": "http://127.0.0.1:9"}
    args = (urls, {"ab-warm:plain": "plain", "ab-warm:warm": "kv"}, ["ab-warm"], [50.0], {50.0: trace}, trace[:2],
            list(range(10_000)), 1, 8, "run")
    with pytest.raises(KVBridgeError, match="ab-warm way needs the storing source"):
        asyncio.run(load.run_ways(*args))
    results = asyncio.run(load.run_ways(*args, progress=lambda m: None, source=("http://127.0.0.1:8", "src"),
                                        settle_s=0.0))
    assert [(r.way, r.rate, r.requests) for r in results] == [
        ("ab-warm:plain", None, 2), ("ab-warm:warm", None, 2), ("ab-warm:plain", 50.0, 3), ("ab-warm:warm", 50.0, 3)]
    for salt in {c[1] for c in calls}:
        mine = [c for c in calls if c[1] == salt]
        assert mine[0] == ("src", salt, None, 1)  # stored first ...
        assert sorted(mine[1:], key=lambda c: c[0]) == [("kv", salt, load.PARAMS["warm"], 8), ("plain", salt, None, 8)]


def test_the_warm_ways_source_server_serves_the_kvbridge_servers_pair_and_mapper():
    from kvbridge.cli.load_bench import _load_source_argv

    argv = _load_source_argv(["--mapper", "m", "--target=t", "--max-model-len", "2048", "--recompute", "0",
                              "--hold-back", "4", "--block-size", "64", "--connector-dtype", "bfloat16"], "/tmp/s")
    assert argv == ["--store", "/tmp/s", "--map-ahead", "--served-model-name", "load-source", "--mapper", "m",
                    "--target", "t", "--max-model-len", "2048", "--block-size", "64", "--map-dtype", "bfloat16"]


def test_the_warm_way_waits_for_the_sources_maps_ahead(tmp_path):
    """quiet(): returns once the store's journal stops growing, not before; at once without a store."""
    import asyncio
    import time

    from kvbridge.serving.bench.load import quiet
    from kvbridge.serving.store.folder import JOURNAL_FILE

    journal = tmp_path / JOURNAL_FILE

    async def writer():
        for i in range(5):
            with open(journal, "a") as f:
                f.write(f"entries/{i}\n")
            await asyncio.sleep(0.1)

    async def both():
        task = asyncio.create_task(writer())
        start = time.monotonic()
        await quiet(str(tmp_path), quiet_s=0.3, max_s=10)
        await task
        return time.monotonic() - start

    took = asyncio.run(both())
    assert 0.6 <= took < 5 and journal.read_text().count("\n") == 5
    start = time.monotonic()
    asyncio.run(quiet(None))
    asyncio.run(quiet(str(tmp_path / "none"), quiet_s=0.2, max_s=0.5))  # no journal yet: quiet too
    assert time.monotonic() - start < 2


def test_load_bench_starts_the_servers_its_ways_need_and_writes_its_report(monkeypatch, tmp_path, capsys):
    """`kvbridge load-bench` end to end, engines faked: the storing source, plain vLLM and the kvbridge server (it
    reads the source's store) started once each, with the options load-bench does not know; each way sent to its
    server; the store removed afterwards; the report, its table and the loaded ratios written."""
    pytest.importorskip("openai")
    import contextlib
    import json
    import sys
    import types

    from kvbridge.cli import main
    from kvbridge.serving import launch
    from kvbridge.serving.bench import load

    started, seen = [], {}

    @contextlib.contextmanager
    def together(servers, timeout_s=300.0):
        started.extend(servers)
        yield [f"http://127.0.0.1:{9000 + i}" for i in range(len(servers))]

    async def run_ways(urls, models, ways, rates, traces, unloaded, stream, bos, new_tokens, run_id, progress=print,
                       source=None, store=None, settle_s=0.0, lead_s=0.0):
        seen.update(urls=urls, models=models, source=source, store=store, unloaded=len(unloaded),
                    store_there=Path(store).is_dir(), lengths={a.length for t in traces.values() for a in t})
        rows = [{"ttft_ms": 10.0 + i, "e2e_ms": 30.0 + i, "tokens": new_tokens} for i in range(4)]
        return [way_result(w, r, rows, 1.0, {}, {}, replicates=50) for r in (None, *rates) for w in ways]

    monkeypatch.setattr(launch, "launched_together", together)
    monkeypatch.setattr(load, "run_ways", run_ways)
    monkeypatch.setitem(sys.modules, "vllm", types.SimpleNamespace(__version__="0.0-test"))
    out = tmp_path / "load.json"
    assert main(["load-bench", "--ways", "plain,warm", "--rates", "2", "--requests", "3", "--unloaded", "2",
                 "--lengths", "300,400", "--json", str(out), "--log", str(tmp_path / "log"),
                 "--max-model-len", "2048"]) == 0
    store = seen["store"]
    assert [(argv, command) for argv, _, command in started] == [
        (["--store", store, "--map-ahead", "--served-model-name", "load-source", "--max-model-len", "2048"],
         "serve-source"),
        (["--plain", "--max-model-len", "2048", "--served-model-name", "load-plain"], "serve"),
        (["--store", store, "--max-model-len", "2048", "--served-model-name", "load-kvbridge"], "serve")]
    assert seen["urls"] == {"plain": "http://127.0.0.1:9001", "warm": "http://127.0.0.1:9002"}
    assert seen["models"] == {"plain": "load-plain", "warm": "load-kvbridge"}
    assert seen["source"] == ("http://127.0.0.1:9000", "load-source") and seen["store_there"]
    assert not Path(store).exists() and seen["unloaded"] == 2 and seen["lengths"] <= set(range(300, 401))
    report = json.loads(out.read_text())
    assert report["command"].startswith("kvbridge load-bench --ways plain,warm") and report["ways"] == ["plain", "warm"]
    assert report["server_args"] == ["--max-model-len", "2048"] and report["machine"]["vllm"] == "0.0-test"
    assert report["warm_settle_s"] == load.SETTLE_S and report["prewarm_lead_s"] is None
    assert [(r["way"], r["rate"]) for r in report["results"]] == [("plain", None), ("warm", None), ("plain", 2.0),
                                                                   ("warm", 2.0)]
    assert report["load"][0].startswith("at 2 req/s plain vLLM's p90 TTFT is 1.00×")
    printed = capsys.readouterr().out
    assert "| 2 | warm | 4 |" in printed and report["load"][0] in printed
    assert out.with_suffix(".md").read_text().startswith(f"`{report['command']}`")
