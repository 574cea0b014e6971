"""Serving under load: one seeded open-loop trace of Poisson arrivals, replayed against plain vLLM and kvbridge.

``kvbridge load-bench`` starts two servers side by side — ``kvbridge serve --plain`` (the target in vLLM alone, with
the engine settings kvbridge gives it: no connector, no middleware) and ``kvbridge serve`` — and replays the same
trace against each *way*:

* ``plain``: the plain server (no kv_transfer_params);
* ``native``: the kvbridge server, ``{"kvbridge": "native"}`` (what the connector and middleware cost traffic that
  does not use them);
* ``mapped-sync``: the kvbridge server, ``{"kvbridge": "mapped", "kvbridge_load": "sync"}``: the source prefills
  and the mapper maps inside the engine's step (the server's default), the target computes the hold-back;
* ``mapped-async``: the same with ``"kvbridge_load": "async"``: the map runs in the connector's thread beside the
  engine's steps;
* ``warm``: escalated requests. A third server, ``kvbridge serve-source --store`` (mapping ahead), has served each
  prompt earlier — before the way's run, one at a time, with the target request's own cache salt — and stored its
  blocks and their mapped K/V; once the source's maps ahead are done (its store's journal quiet) the way's run
  starts, and the kvbridge server (``--store``, the same folder) reads those blocks from its memory tier, or its
  folder, and computes the rest of the prompt. The cold ways above ask ``"kvbridge_store": false``;
* ``prewarm``: escalated requests whose source turn runs *under the load*: at each arrival the source's server
  serves the prompt (one token, ``"kvbridge_prewarm": true``), stores it and maps it ahead, and the kvbridge
  server's prewarm thread loads it into the target's prefix cache (a one-token mapped request); the escalated
  request follows ``--prewarm-lead`` seconds after the arrival, mapped;
* ``native-prewarm``: what a router without kvbridge can do instead, on the plain server: at each arrival the same
  source turn (not stored: ``"kvbridge_store": false``), then the prompt sent to the target (one token) as soon as
  the source answered, so the escalated request, ``--prewarm-lead`` seconds after the arrival, finds it in the
  target's prefix cache. The target computes every prompt token, ahead;
* ``ab``: plain and native at once: every arrival sent both to the plain server (``ab:plain``) and to the kvbridge
  server's native route (``ab:native``), so the two meet the same prompts on the same machine at the same moments,
  and the machine's drift between ways can neither hide nor fake what the kvbridge server costs traffic that does
  not use it (the machine carries twice the rate: halve ``--rates`` to compare with the other ways' load);
* ``ab-warm``: the same for escalated requests: the warm way's source pass first, then every arrival sent to plain
  vLLM (``ab-warm:plain``) and, mapped from the store, to the kvbridge server (``ab-warm:warm``) at once.

A trace is open-loop: request ``i`` is sent at its arrival time whatever the server is doing (exponential gaps at
the given rate, a fixed seed), its prompt a window of the family's held-out token stream of a length drawn
uniformly between the bounds, with a cache salt of its own (no request is a prefix-cache hit of another). Per rate,
the ways run one after the other, their order alternating from rate to rate (the first way of one rate is the last
of the next); before the rates, each way's *unloaded* figures: the trace's first requests sent one at a time.

Per rate and way: TTFT (send to first streamed token) p50, p90 and p99 with 95 % bootstrap intervals, end-to-end
latency (send to last token) the same, output throughput (generated tokens per second from the first send to the
last token), and the target's prefill work from vLLM's own ``/metrics`` counters, read before and after the way's
run (the prewarm ways' prewarm requests included): prompt tokens, of them computed by the engine
(``vllm:prompt_tokens_by_source{source="local_compute"}``), found in its prefix cache (``local_cache_hit``) and
loaded by the connector (``external_kv_transfer``); and the connector's outcomes and map time. The source's prefill
inside the connector is not the target's work: the map time says what it cost. The share computed is of the trace's
own prompt tokens (a prewarm way's target computes some of them in its prewarm requests).
"""

from __future__ import annotations

import asyncio
import math
import random
import time
from dataclasses import asdict, dataclass

from ...errors import KVBridgeError
from ..engine.config import PREWARM, USE_STORE
from .ttft import parse_metrics

WAYS = ("plain", "native", "mapped-sync", "mapped-async", "warm", "prewarm", "native-prewarm", "ab", "ab-warm")
PARAMS = {"plain": None, "native": {"kvbridge": "native"},
          "mapped-sync": {"kvbridge": "mapped", "kvbridge_load": "sync", "kvbridge_store": False},
          "mapped-async": {"kvbridge": "mapped", "kvbridge_load": "async", "kvbridge_store": False},
          "warm": {"kvbridge": "mapped", "kvbridge_load": "sync"},
          "prewarm": {"kvbridge": "mapped", "kvbridge_load": "sync"}, "native-prewarm": None}
WARM = "warm"  # the way whose prompts the source's server serves (and stores) first
# the ways whose source turn runs under the load, before each escalated request: the source's parameters
PREWARMED = {"prewarm": {PREWARM: True}, "native-prewarm": {PREWARM: False, USE_STORE: False}}
# the paired ways: every arrival sent to plain vLLM and to a way of the kvbridge server at once; their halves,
# reported as ways of their own
PAIRED = {"ab": ("ab:plain", "ab:native"), "ab-warm": ("ab-warm:plain", "ab-warm:warm")}
PARAMS.update({"ab:plain": None, "ab:native": PARAMS["native"], "ab-warm:plain": None, "ab-warm:warm": PARAMS[WARM]})
STORED_FIRST = (WARM, "ab-warm")  # the ways whose prompts the source serves and stores before the run
SOURCED = (*STORED_FIRST, *PREWARMED)  # the ways that need the source's server
PLAIN_SERVER = ("plain", "native-prewarm", *PAIRED)  # the ways served by plain vLLM (a paired way: by both)
DEFAULT_WAYS = ("plain", "native", "mapped-sync", "mapped-async", WARM)  # one server per way, at the trace's rate
LEAD_S = 2.0  # the prewarm ways: seconds from an arrival (the source's turn) to its escalated request
QUIET_S = 1.0  # the source's maps ahead are done once its store's journal has not grown for this long ...
QUIET_MAX_S = 300.0  # (waiting at most this long)
SETTLE_S = 10.0  # ... then the target's memory tier loads what they announced (default of --warm-settle)
SOURCES = ("local_compute", "local_cache_hit", "external_kv_transfer")
QUANTILES = (50, 90, 99)


@dataclass(frozen=True)
class Arrival:
    """One request of a trace: sent ``at_s`` seconds after the trace starts, a prompt of ``length`` tokens that
    starts at ``start`` in the token stream."""

    index: int
    at_s: float
    length: int
    start: int


def poisson_trace(rate: float, count: int, lengths: tuple[int, int], seed: int, stream_tokens: int) -> list[Arrival]:
    """``count`` arrivals of a Poisson process of ``rate`` requests per second (exponential gaps; the first one at
    its first gap), prompt lengths uniform in ``lengths`` (both ends included), each prompt's start uniform in a
    stream of ``stream_tokens`` tokens. The same arguments give the same trace."""
    if not (isinstance(rate, (int, float)) and math.isfinite(rate) and rate > 0):
        raise KVBridgeError(f"a request rate must be a positive number of requests per second, not {rate!r}.")
    if not isinstance(count, int) or count < 1:
        raise KVBridgeError(f"a trace needs at least one request, not {count!r}.")
    lo, hi = lengths
    if not (isinstance(lo, int) and isinstance(hi, int) and 2 <= lo <= hi):
        raise KVBridgeError(f"prompt lengths must be integers 2 <= min <= max, not {lo!r}..{hi!r}.")
    if stream_tokens <= hi:
        raise KVBridgeError(f"the token stream holds {stream_tokens} tokens, too few for {hi}-token prompts; ask for "
                            "shorter prompts.")
    rng = random.Random(seed)
    at, out = 0.0, []
    for i in range(count):
        at += rng.expovariate(rate)
        length = rng.randint(lo, hi)
        out.append(Arrival(i, at, length, rng.randrange(stream_tokens - length)))
    return out


def percentile(values: list[float], q: float) -> float:
    """The ``q``-th percentile (0–100) of ``values``, interpolated linearly between order statistics (numpy's
    default)."""
    if not values:
        raise KVBridgeError("no values to take a percentile of.")
    if not 0 <= q <= 100:
        raise KVBridgeError(f"a percentile must lie in 0..100, not {q}.")
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def summary(values: list[float], replicates: int = 2000, seed: int = 0) -> dict:
    """p50, p90, p99 of ``values`` and a 95 % bootstrap interval of each (``p90_interval``: [low, high]); the mean,
    min, max and count."""
    from .cascade_report import resampled_interval

    if not values:
        raise KVBridgeError("no values to summarize.")
    out: dict = {"n": len(values), "mean": sum(values) / len(values), "min": min(values), "max": max(values)}
    for q in QUANTILES:
        out[f"p{q}"] = percentile(values, q)
        out[f"p{q}_interval"] = list(resampled_interval(values, replicates, seed + q,
                                                        statistic=lambda v, q=q: percentile(v, q)))
    return out


def counter(samples: list[tuple[str, dict[str, str], float]], name: str, **labels: str) -> float:
    """A counter's value summed over its label sets that carry ``labels`` (``name`` or ``name_total``; 0 when
    absent)."""
    names = {name, name + "_total"} if not name.endswith("_total") else {name}
    return sum(v for n, lab, v in samples if n in names and all(lab.get(k) == x for k, x in labels.items()))


def engine_counters(text: str) -> dict[str, float]:
    """What a way's run is measured by, from one ``/metrics`` scrape: prompt tokens, and by source (computed by the
    engine, prefix-cache hits, loaded by a connector), requests, generated tokens, the kvbridge connector's outcomes
    and map seconds (0 on a server without it)."""
    samples = parse_metrics(text)
    out = {"prompt_tokens": counter(samples, "vllm:prompt_tokens"),
           "generation_tokens": counter(samples, "vllm:generation_tokens"),
           "requests": counter(samples, "vllm:request_success")}
    for source in SOURCES:
        out[source] = counter(samples, "vllm:prompt_tokens_by_source", source=source)
    for outcome in ("mapped", "native", "short", "fallback", "cached"):
        out[f"kvbridge_{outcome}"] = counter(samples, "vllm:kvbridge_requests", outcome=outcome)
    out["kvbridge_map_seconds"] = counter(samples, "vllm:kvbridge_map_seconds")
    for count in ("stored_tokens", "premapped_tokens", "hot_tokens"):  # prefix tokens read from the store
        out[f"kvbridge_{count}"] = counter(samples, f"vllm:kvbridge_{count}")
    return out


def scrape(url: str) -> dict[str, float]:
    import urllib.request

    try:
        with urllib.request.urlopen(url + "/metrics", timeout=30) as response:
            return engine_counters(response.read().decode())
    except OSError as exc:
        raise KVBridgeError(f"{url}/metrics: the server's counters could not be read ({exc}); is the server still "
                            "running? Its log says why it stopped.") from None


OUTCOMES = ("kvbridge_mapped", "kvbridge_native", "kvbridge_short", "kvbridge_fallback", "kvbridge_cached")


async def settled(url: str, before: dict, requests: int, counted: bool, timeout_s: float = 60.0) -> dict:
    """The server's counters once they count ``requests`` more finished requests (and, ``counted``, as many more
    connector outcomes: vLLM publishes the connector's at its logging interval), or after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while True:
        after = await asyncio.to_thread(scrape, url)
        done = after["requests"] - before.get("requests", 0) >= requests
        if counted:
            done = done and sum(after[o] - before.get(o, 0) for o in OUTCOMES) >= requests
        if done or time.monotonic() > deadline:
            return after
        await asyncio.sleep(0.5)


def prompt_ids(arrival: Arrival, stream: list[int], bos: int | None) -> list[int]:
    head = [bos] if bos is not None else []
    return head + stream[arrival.start:arrival.start + arrival.length - len(head)]


async def _one(client, model: str, ids: list[int], params: dict | None, salt: str, new_tokens: int) -> dict:
    """One streamed completion: ms to its first token and to its last, tokens generated."""
    extra = {"ignore_eos": True, "cache_salt": salt}
    if params is not None:
        extra["kv_transfer_params"] = params
    start = time.perf_counter()
    first, tokens = None, 0
    stream = await client.completions.create(model=model, prompt=ids, max_tokens=new_tokens, temperature=0,
                                             stream=True, extra_body=extra)
    async for chunk in stream:
        if chunk.choices and chunk.choices[0].text is not None:
            if first is None:
                first = time.perf_counter()
            tokens += 1
    end = time.perf_counter()
    return {"ttft_ms": 1000 * ((first or end) - start), "e2e_ms": 1000 * (end - start), "tokens": tokens,
            "sent_s": start, "prompt_tokens": len(ids)}


def _late(row: dict, due: float | None) -> dict:
    """``row`` with how far behind ``due`` (perf_counter seconds; None: no schedule) it was sent, ``late_ms``."""
    if due is not None:
        row["late_ms"] = 1000 * (row["sent_s"] - due)
    return row


async def _paced(trace: list[Arrival], one, open_loop: bool) -> list:
    """``one(arrival, due)`` for each arrival of ``trace``, in the trace's order: open-loop, each started at its
    arrival time (``due``: that time, perf_counter seconds) whatever the others are doing; else one after the other
    (``due`` None)."""
    if not open_loop:
        return [await one(a, None) for a in trace]
    t0 = time.perf_counter()

    async def timed(a: Arrival):
        due = t0 + a.at_s
        await asyncio.sleep(max(0.0, due - time.perf_counter()))
        return await one(a, due)

    return await asyncio.gather(*(timed(a) for a in trace))


async def _prewarmed(clients: dict, way: str, a: Arrival, ids: list[int], salt: str, lead_s: float, due: float,
                     new_tokens: int) -> dict:
    """One arrival of a prewarm way: the source's turn (one token), for ``native-prewarm`` then the prompt sent to
    the target (one token) once the source answered, and at ``due + lead_s`` (perf_counter seconds) the escalated
    request, measured."""
    source, source_model = clients["source"]
    target, target_model = clients["target"]
    await _one(source, source_model, ids, PREWARMED[way], salt, 1)
    if way == "native-prewarm":
        await _one(target, target_model, ids, None, salt, 1)
    await asyncio.sleep(max(0.0, due + lead_s - time.perf_counter()))
    row = await _one(target, target_model, ids, PARAMS[way], salt, new_tokens)
    return _late(row, due + lead_s)  # sent after its time: the turn before it ran over


async def replay_prewarmed(clients: dict, way: str, trace: list[Arrival], stream: list[int], bos: int | None,
                           salt: str, new_tokens: int, lead_s: float, open_loop: bool = True) -> list[dict]:
    """A prewarm way's trace: each arrival's source turn sent at its arrival time (``open_loop``; else one arrival
    after the other), its escalated request ``lead_s`` seconds later (or later still, when the turn before it was
    slower than that: ``late_ms``)."""
    async def one(a: Arrival, due: float | None) -> dict:
        return await _prewarmed(clients, way, a, prompt_ids(a, stream, bos), f"{salt}-{a.index}", lead_s,
                                time.perf_counter() if due is None else due, new_tokens)

    return await _paced(trace, one, open_loop)


async def replay_ab(sides: list[tuple], trace: list[Arrival], stream: list[int], bos: int | None, salt: str,
                    new_tokens: int, open_loop: bool = True) -> list[list[dict]]:
    """The trace sent to every one of ``sides`` ((client, model, kv_transfer_params) each) at once: each arrival's
    prompt to all of them at its arrival time (``open_loop``; else one arrival after the other). Each side's rows,
    in the trace's order."""
    async def one(a: Arrival, due: float | None) -> list[dict]:
        ids = prompt_ids(a, stream, bos)
        rows = await asyncio.gather(*(_one(client, model, ids, params, f"{salt}-{a.index}", new_tokens)
                                      for client, model, params in sides))
        return [_late(row, due) for row in rows]

    per_arrival = await _paced(trace, one, open_loop)
    return [[rows[k] for rows in per_arrival] for k in range(len(sides))]


async def replay(client, model: str, trace: list[Arrival], stream: list[int], bos: int | None, params: dict | None,
                 salt: str, new_tokens: int, open_loop: bool = True) -> list[dict]:
    """The trace's requests, each sent at its arrival time (``open_loop``) or each after the last one finished."""
    async def one(a: Arrival, due: float | None) -> dict:
        row = await _one(client, model, prompt_ids(a, stream, bos), params, f"{salt}-{a.index}", new_tokens)
        return _late(row, due)  # how far behind its arrival it was sent

    return await _paced(trace, one, open_loop)


@dataclass
class WayResult:
    way: str
    rate: float | None  # None: unloaded (one request at a time)
    requests: int
    ttft_ms: dict
    e2e_ms: dict
    output_tokens_per_s: float
    wall_s: float
    counters: dict  # the engine's counters' deltas over the run
    computed_share: float  # of the trace's prompt tokens, the share the target's engine computed itself
    late_ms_max: float  # the latest any request was sent after its arrival (the client keeping up)
    ttft_by_request: list | None = None  # ms, in the trace's order (where the stalls fall)
    prompt_tokens: int = 0  # the trace's (the measured requests')


def way_result(way: str, rate: float | None, rows: list[dict], wall_s: float, before: dict, after: dict,
               replicates: int = 2000) -> WayResult:
    delta = {k: after[k] - before.get(k, 0.0) for k in after}
    tokens = sum(r["tokens"] for r in rows)
    prompt = sum(r.get("prompt_tokens", 0) for r in rows) or delta.get("prompt_tokens", 0.0)
    return WayResult(way, rate, len(rows), summary([r["ttft_ms"] for r in rows], replicates),
                     summary([r["e2e_ms"] for r in rows], replicates), tokens / wall_s if wall_s > 0 else 0.0,
                     wall_s, delta, delta.get("local_compute", 0.0) / prompt if prompt else float("nan"),
                     max((r.get("late_ms", 0.0) for r in rows), default=0.0),
                     [round(r["ttft_ms"], 1) for r in rows], int(prompt))


async def quiet(store: str | None, quiet_s: float | None = None, max_s: float | None = None) -> None:
    """Returns once the store's journal of mapped entries has not grown for ``quiet_s`` (the source's maps ahead
    done), or after ``max_s``; at once without a store."""
    if store is None:
        return
    from pathlib import Path

    from ..store.folder import JOURNAL_FILE

    quiet_s = QUIET_S if quiet_s is None else quiet_s
    deadline = time.monotonic() + (QUIET_MAX_S if max_s is None else max_s)
    journal = Path(store) / JOURNAL_FILE

    def size() -> int:
        return journal.stat().st_size if journal.exists() else -1

    last, since = size(), time.monotonic()
    while time.monotonic() < deadline:
        await asyncio.sleep(min(0.1, quiet_s))
        now = size()
        if now != last:
            last, since = now, time.monotonic()
        elif time.monotonic() - since >= quiet_s:
            return


@dataclass
class _Run:
    """What every way of one benchmark run shares."""

    clients: dict
    urls: dict[str, str]
    models: dict[str, str]
    stream: list[int]
    bos: int | None
    new_tokens: int
    run_id: str
    replicates: int
    source: tuple[str, str] | None
    store: str | None
    settle_s: float
    lead_s: float


async def _run_way(run: _Run, way: str, rate: float | None, trace: list[Arrival]) -> list[WayResult]:
    """One way's run of ``trace`` (open-loop at ``rate``; one request at a time when None), measured from its
    server's counters before and after; a paired way gives one result per server."""
    salt = f"load-{run.run_id}-{way}-{rate or 0}"
    open_loop = rate is not None
    if way in STORED_FIRST:  # the conversations the source served earlier: stored (and mapped ahead) by now
        await replay(run.clients[run.source[0]], run.source[1], trace, run.stream, run.bos, None, salt, 1,
                     open_loop=False)
        await quiet(run.store)  # (the source's map-ahead thread would otherwise share the CPU with the run)
        await asyncio.sleep(run.settle_s)
    names = list(PAIRED.get(way, (way,)))
    urls = [run.urls[n] for n in names]
    before = [await asyncio.to_thread(scrape, u) for u in urls]
    t0 = time.perf_counter()
    if way in PAIRED:
        sides = [(run.clients[u], run.models[n], PARAMS[n]) for n, u in zip(names, urls)]
        per_side = await replay_ab(sides, trace, run.stream, run.bos, salt, run.new_tokens, open_loop)
    elif way in PREWARMED:
        pair = {"source": (run.clients[run.source[0]], run.source[1]),
                "target": (run.clients[urls[0]], run.models[way])}
        per_side = [await replay_prewarmed(pair, way, trace, run.stream, run.bos, salt, run.new_tokens, run.lead_s,
                                           open_loop)]
    else:
        per_side = [await replay(run.clients[urls[0]], run.models[way], trace, run.stream, run.bos, PARAMS[way],
                                 salt, run.new_tokens, open_loop)]
    wall = time.perf_counter() - t0
    out = []
    for name, url, rows, start in zip(names, urls, per_side, before):
        # a prewarm way's target also served one prewarm request per arrival (kvbridge's: when it landed)
        expected = 2 * len(rows) if way in PREWARMED else len(rows)
        after = await settled(url, start, expected, counted=not (name in PLAIN_SERVER or name.endswith(":plain")),
                              timeout_s=30.0 if way == "prewarm" else 60.0)
        # a paired way's halves share the run: each one's throughput runs to its own last token
        side_wall = max(r["sent_s"] + r["e2e_ms"] / 1000 for r in rows) - t0 if way in PAIRED and rows else wall
        out.append(way_result(name, rate, rows, side_wall, start, after, run.replicates))
    if way in SOURCED:
        await quiet(run.store)  # the source's maps ahead of this way done before the next way runs
    return out


async def run_ways(urls: dict[str, str], models: dict[str, str], ways: list[str], rates: list[float],
                   traces: dict[float, list[Arrival]], unloaded: list[Arrival], stream: list[int], bos: int | None,
                   new_tokens: int, run_id: str, progress=print, replicates: int = 2000,
                   source: tuple[str, str] | None = None, store: str | None = None,
                   settle_s: float = SETTLE_S, lead_s: float = LEAD_S) -> list[WayResult]:
    """Each way unloaded, then each rate's trace against each way, the ways' order alternating per rate.
    ``source``: (URL, model) of the storing source's server, which serves the warm way's prompts first and the
    prewarm ways' source turns; ``store``: its store's folder (the warm way's run waits until its maps ahead are
    done, then ``settle_s``; every way using the source waits for them after its run); ``lead_s``: the prewarm
    ways' seconds from a source turn to its escalated request."""
    from openai import AsyncOpenAI

    needs_source = [w for w in ways if w in SOURCED]
    if needs_source and source is None:
        raise KVBridgeError(f"the {needs_source[0]} way needs the storing source's server (kvbridge serve-source "
                            "--store).")
    clients = {u: AsyncOpenAI(base_url=u + "/v1", api_key="unused", max_retries=0, timeout=1800)
               for u in set(urls.values()) | ({source[0]} if source else set())}
    results = []
    try:
        plan = [(None, ways)] + [(rate, ways if i % 2 else ways[::-1]) for i, rate in enumerate(rates)]
        run = _Run(clients, urls, models, stream, bos, new_tokens, run_id, replicates, source, store, settle_s,
                   lead_s)
        for rate, order in plan:
            for way in order:
                for result in await _run_way(run, way, rate, unloaded if rate is None else traces[rate]):
                    results.append(result)
                    what = "unloaded" if rate is None else f"{rate:g} req/s"
                    progress(f"{what}, {result.way}: TTFT p50 {result.ttft_ms['p50']:.0f} ms, p90 "
                             f"{result.ttft_ms['p90']:.0f} ms; {result.output_tokens_per_s:.1f} tokens/s; the engine "
                             f"computed {100 * result.computed_share:.0f} % of the prompt tokens")
    finally:
        for client in clients.values():
            await client.close()
    return results


def load_table(report: dict) -> str:
    """Markdown: per rate and way, TTFT p50/p90/p99 [95 % intervals], e2e p50/p90, output tokens/s, the target's
    computed prefill tokens."""
    def cell(s: dict, q: int) -> str:
        lo, hi = s[f"p{q}_interval"]
        return f"{s[f'p{q}']:.0f} [{lo:.0f}, {hi:.0f}]"

    lines = ["| Rate (req/s) | Way | n | TTFT p50 ms | TTFT p90 ms | TTFT p99 ms | E2E p50 ms | E2E p90 ms | "
             "Output tok/s | Prompt tokens | Computed by the target | Prefix-cache hits | Mapped / fallback | "
             "Read from the store |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|---:|"]
    for r in report["results"]:
        c = r["counters"]
        rate = "unloaded" if r["rate"] is None else f"{r['rate']:g}"
        mapped = (f"{c.get('kvbridge_mapped', 0):.0f} / {c.get('kvbridge_fallback', 0):.0f}"
                  if r["way"].startswith("mapped") or r["way"] in (WARM, "prewarm", "ab-warm:warm") else "")
        stored = (f"{c.get('kvbridge_stored_tokens', 0):,.0f} ({c.get('kvbridge_hot_tokens', 0):,.0f} from memory)"
                  if r["way"] in (WARM, "prewarm", "ab-warm:warm") else "")
        prompt = r.get("prompt_tokens") or c.get("prompt_tokens", 0)
        lines.append(f"| {rate} | {r['way']} | {r['requests']} | {cell(r['ttft_ms'], 50)} | {cell(r['ttft_ms'], 90)} "
                     f"| {cell(r['ttft_ms'], 99)} | {r['e2e_ms']['p50']:.0f} | {r['e2e_ms']['p90']:.0f} | "
                     f"{r['output_tokens_per_s']:.1f} | {prompt:,.0f} | "
                     f"{c.get('local_compute', 0):,.0f} ({100 * r['computed_share']:.1f} %) | "
                     f"{c.get('local_cache_hit', 0):,.0f} | {mapped} | {stored} |")
    return "\n".join(lines)


def loaded_ratios(report: dict) -> list[str]:
    """Per rate, plain vLLM's p90 TTFT over its unloaded p90 and p50 (the load the rate puts on the engine)."""
    by = {(r["way"], r["rate"]): r for r in report["results"]}
    plain = next((w for w in ("plain", "ab:plain", "ab-warm:plain") if (w, None) in by), None)  # a paired half too
    out = []
    if plain is None:
        return out
    base = by[(plain, None)]
    for rate in report["rates"]:
        r = by.get((plain, rate))
        if r is not None:
            p90 = r["ttft_ms"]["p90"]
            out.append(f"at {rate:g} req/s plain vLLM's p90 TTFT is {p90 / base['ttft_ms']['p90']:.2f}× its unloaded "
                       f"p90 and {p90 / base['ttft_ms']['p50']:.2f}× its unloaded p50")
    return out


def to_dict(results: list[WayResult]) -> list[dict]:
    return [asdict(r) for r in results]
