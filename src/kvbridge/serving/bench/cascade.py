"""Model switching without a prefill: a source server and a target server sharing the source's KV store.

``kvbridge cascade`` starts both: ``kvbridge serve-source`` (vLLM serving the source, storing its KV as it serves:
:mod:`kvbridge.serving.engine.producer`) and ``kvbridge serve --store`` (vLLM serving the target, mapping stored source
KV into its paged cache: :mod:`kvbridge.serving.engine.connector`). A conversation's first turns run on the source; when
one
escalates to the target (same messages, the servers apply the chat template), the target's connector finds the
conversation's blocks in the store and maps them — the source does not prefill them again — then the target
computes the new turn and the held-back tokens itself, over them, and answers.

``kvbridge cascade-bench`` measures that scenario: conversations built from held-out text whose first two turns the
source answers, then an escalated third turn sent to the target seven ways, one after another in a random order of
each conversation's own — native (the target re-prefills the whole history), warm (the stored history read as mapped
ahead unless ``--no-map-ahead``, from the target connector's memory where it loaded them, the new turn computed by
the target: ``kvbridge_native_rest``), warm from the folder (as warm, the blocks mapped ahead read from the store's
folder: ``kvbridge_store: "folder"``), warm with every token mapped (the source prefills the new turn for the
mapper: ``kvbridge_native_rest: 0``, the cold path's cache), mapped at the switch (as warm, the stored source K/V
mapped when the turn arrives, blocks mapped ahead ignored: ``kvbridge_store: "source"``), cold (mapped from a
fresh source prefill inside the connector, ``kvbridge_store: false``) and prewarmed (as warm, on a copy whose source
request asked the target's server to load it ahead, ``kvbridge_prewarm``: :mod:`kvbridge.serving.store.prewarm`; the
turn waits for that load) — each on a stored copy of its own of the
conversation, with each request's time to its first streamed token, and the escalated answers compared token by
token. The native request sent again finds the whole history in the target's own prefix cache: the time to first
token of a switch whose K/V cost nothing to bring — the ceiling any transfer can reach in this engine.

``--lmcache`` adds an eighth way through a second pair (``kvbridge cascade --lmcache``): its source serves each
conversation's turns too, storing through vLLM's ``LMCacheMPConnector``, and its target escalates the turn reading
the stored chunks from LMCache (as warm: the same native rest) — its answer compared with the cold path's at the same
split (an untimed request holding back what the way left to the target), its TTFT paired with the folder way's, and
the connector's time by phase (``vllm:kvbridge_read_seconds_total{phase}``) for every way that read a stored prefix.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from ...errors import KVBridgeError
from ..engine.config import PREWARM
from .cascade_report import LMCACHE, WAYS, agreement, per_conversation
from .ttft import CACHE_HITS, MAP_SECONDS, metric, parse_metrics

# ways reading a stored copy of the conversation of their own (their salt); prewarmed's copy asks for prewarming
COPIES = ("folder", "whole", "remap", "prewarmed")
REQUESTS = "vllm:kvbridge_requests_total"  # the target's requests the connector saw (a prewarm is one)
PREWARM_WAIT_S = 10.0  # the longest the benchmark waits for the target to load a conversation ahead
STORED = "vllm:kvbridge_stored_tokens_total"
PREMAPPED = "vllm:kvbridge_premapped_tokens_total"
HOT = "vllm:kvbridge_hot_tokens_total"
WRITE_SECONDS = "vllm:kvbridge_write_seconds_total"  # of them, writing into the engine's paged cache
READ_SECONDS = "vllm:kvbridge_read_seconds_total"  # the loads that read a stored prefix, by phase
LOADED = "vllm:prompt_tokens_by_source_total|external_kv_transfer"  # prompt tokens the connector loaded
HITS = "vllm:prompt_tokens_by_source_total|local_cache_hit"  # prompt tokens found in the engine's prefix cache


@dataclass
class CascadeRow:
    history_tokens: int  # median prompt tokens of the escalated turn
    conversations: int
    native_ttft_ms: float
    warm_ttft_ms: float
    cold_ttft_ms: float
    cached_ttft_ms: float  # the target's own prefix-cache hit on the history: the ceiling of any transfer
    folder_ttft_ms: float  # warm, the blocks mapped ahead read from the store's folder (not the connector's memory)
    whole_ttft_ms: float  # warm with every prompt token but the hold-back mapped (the cold path's cache)
    remap_ttft_ms: float  # warm, with the stored source K/V mapped at the switch (blocks mapped ahead ignored)
    warm_speedup: float  # native ÷ warm
    folder_speedup: float
    whole_speedup: float
    remap_speedup: float
    ceiling_speedup: float  # native ÷ cached
    cold_speedup: float
    warm_connector_ms: float  # median time inside the connector (store, source, map, recompute, cache writes)
    folder_connector_ms: float
    whole_connector_ms: float
    remap_connector_ms: float
    cold_connector_ms: float
    native_rest: int  # the most tokens after the stored prefix that warm and remap left to the target
    stored_fraction: float  # median share of the escalated prompt's tokens mapped from the store
    premapped_fraction: float  # of them, median share read as the source engine mapped them ahead
    hot_fraction: float  # of them, median share read from the target connector's memory (loaded ahead)
    native_fraction: float  # median share the target computed itself on the warm way (new turn and hold-back)
    whole_equals_cold: float  # share of conversations whose escalated answers are identical
    remap_equals_warm: float
    warm_first_token_agreement: float  # with native
    whole_first_token_agreement: float
    cold_first_token_agreement: float
    warm_token_agreement: float  # mean share of positions where the answer's token equals native's
    whole_token_agreement: float
    cold_token_agreement: float
    # the source's own turns on the storing server and on the baseline (the source without a store), when measured:
    # median times to the first token and to the whole answer, the median of each turn's storing ÷ baseline, and
    # the share of turns whose answers are equal
    source_storing_ttft_ms: float | None = None
    source_baseline_ttft_ms: float | None = None
    source_ttft_ratio: float | None = None
    source_storing_answer_ms: float | None = None
    source_baseline_answer_ms: float | None = None
    source_answer_ratio: float | None = None
    source_answers_equal: float | None = None
    # prewarmed: the conversation loaded into the target's prefix cache before the switch (serve-source's prewarm)
    prewarmed_ttft_ms: float | None = None
    prewarmed_speedup: float | None = None
    prewarmed_connector_ms: float | None = None
    prewarmed_equals_warm: float | None = None  # share of conversations whose escalated answers are identical
    prewarmed_cached_fraction: float | None = None  # median share of the prompt found in the target's prefix cache
    prewarm_landed: float | None = None  # share of conversations the target had prewarmed before the switch
    prewarm_wait_ms: float | None = None  # median time from the source's answer until the target's /metrics counted
    # the prewarm: an upper bound (vLLM's counters lag; the server's log says when each prewarm ended)
    # lmcache (cascade-bench --lmcache): warm through a second pair, its source storing through LMCache, its target
    # reading it (the same conversations, the same --native-rest), in the same random order as the other ways
    lmcache_ttft_ms: float | None = None
    lmcache_speedup: float | None = None  # native ÷ lmcache
    lmcache_connector_ms: float | None = None
    lmcache_stored_fraction: float | None = None  # median share of the escalated prompt read from LMCache
    lmcache_equal_cold: int | None = None  # conversations whose answer is the cold path's at the way's split
    lmcache_equals_cold: float | None = None  # (the same, as a share)
    lmcache_equals_folder: float | None = None  # share of conversations whose answer is the folder way's
    lmcache_token_agreement: float | None = None  # with native


def default_store() -> str:
    """Where both servers share the store by default: shared memory when the machine has it (/dev/shm)."""
    import os
    import tempfile

    base = "/dev/shm" if Path("/dev/shm").is_dir() and os.access("/dev/shm", os.W_OK) else tempfile.gettempdir()
    return str(Path(base) / f"kvbridge-store-{os.getuid() if hasattr(os, 'getuid') else 'user'}")


@contextlib.contextmanager
def launched_pair(source_args: list[str], target_args: list[str], log_dir: str | Path, timeout_s: float = 300.0,
                  together: bool = False):
    """Both servers as subprocesses (the source first: it creates the store, and the target then takes its block
    size; ``together``: both at once, where both use the engine's default block size or share no store, LMCache's:
    the target's connector finds the store once it exists); yields (source URL, target URL)."""
    from ..launch import launched, launched_together

    log_dir = Path(log_dir)
    log_dir.mkdir(parents=True, exist_ok=True)
    if together:
        with launched_together([(source_args, log_dir / "source.log", "serve-source"),
                                (target_args, log_dir / "target.log", "serve")], timeout_s) as urls:
            yield tuple(urls)
        return
    with launched(source_args, log_dir / "source.log", timeout_s, command="serve-source") as source_url, \
            launched(target_args, log_dir / "target.log", timeout_s) as target_url:
        yield source_url, target_url


def conversation_texts(tokenizer, count: int, history_tokens: int, seed: int = 0,
                       question_tokens: int = 24) -> list[list[str]]:
    """``count`` conversations' three user messages from held-out documents: two long ones (together about
    ``history_tokens`` tokens with the source's answers) and an escalated question of ``question_tokens``."""
    from .ttft import heldout_stream

    stream = heldout_stream(tokenizer)
    long = max(16, (history_tokens - 2 * ANSWER_TOKENS - 40) // 2)
    need = 2 * long + question_tokens
    span = len(stream) - need
    if span <= 0:
        raise KVBridgeError(f"the held-out texts hold {len(stream)} tokens, too few for {history_tokens}-token "
                            "histories.")
    step = max(1, span // max(count, 1))
    out = []
    for i in range(count):
        at = (seed * 7919 + i * step) % span
        parts = [stream[at:at + long], stream[at + long:at + 2 * long], stream[at + 2 * long:at + need]]
        out.append([tokenizer.decode(p) for p in parts])
    return out


ANSWER_TOKENS = 48  # each source answer
SETTLE_S = 1.0  # between the source's last answer (and its replays under other salts) and the escalated turn


async def _turn(client, model: str, messages: list[dict], max_tokens: int, params: dict | None = None,
                salt: str | None = None) -> tuple[float, str, list[int], float]:
    """One streamed chat turn: (ms to the first token, text, token ids, ms to the last)."""
    start = time.perf_counter()
    first, text = None, []
    body = {"ignore_eos": True, "return_token_ids": True}
    if params is not None:
        body["kv_transfer_params"] = params
    if salt is not None:
        body["cache_salt"] = salt
    stream = await client.chat.completions.create(model=model, messages=messages, max_tokens=max_tokens,
                                                  temperature=0, stream=True, extra_body=body)
    tokens: list[int] = []
    async for chunk in stream:
        if chunk.choices:
            delta = chunk.choices[0].delta
            if first is None and (delta.content or getattr(chunk.choices[0], "token_ids", None)):
                first = time.perf_counter()
            text.append(delta.content or "")
            tokens += list(getattr(chunk.choices[0], "token_ids", None) or [])
    end = time.perf_counter()
    return 1000 * ((first or end) - start), "".join(text), tokens, 1000 * (end - start)


async def _source_turn(source, source_model, baseline, baseline_model, messages, salt, order: int, turns: list):
    """One of the source's turns: its answer, from the storing server. With a baseline (the source served without a
    store) the turn goes to both, in alternating order, a settle apart; their times and answers are kept in
    ``turns``."""
    no_prewarm = {PREWARM: False}  # (a source started with --prewarm would prewarm every way's copy)
    if baseline is None:
        return (await _turn(source, source_model, messages, ANSWER_TOKENS, no_prewarm, salt))[1]
    out = {}
    for k, name in enumerate(("storing", "baseline") if order % 2 == 0 else ("baseline", "storing")):
        if k:
            await asyncio.sleep(SETTLE_S)  # the storing engine's background writes and maps done, both idle
        client, model = (source, source_model) if name == "storing" else (baseline, baseline_model)
        out[name] = await _turn(client, model, messages, ANSWER_TOKENS, no_prewarm if name == "storing" else None, salt)
    turns.append({f"{name}_{what}": value for name, (ttft, _, tokens, total) in out.items()
                  for what, value in (("ttft_ms", ttft), ("answer_ms", total), ("tokens", tokens))})
    return out["storing"][1]


def counters(url: str) -> dict[str, float]:
    """Every counter at ``url``/metrics in one scrape: by name, summed over its label sets, and by name and the value
    of its ``phase`` or ``source`` label (``name|value``)."""
    import urllib.request

    try:
        with urllib.request.urlopen(url + "/metrics", timeout=30) as response:
            samples = parse_metrics(response.read().decode())
    except OSError as exc:  # (urllib's errors are OSErrors)
        raise KVBridgeError(f"{url}/metrics: the server's counters could not be read ({exc}); is the server still "
                            "running? Its log says why it stopped.") from None
    out: dict[str, float] = {}
    for name, labels, value in samples:
        out[name] = out.get(name, 0.0) + value
        for label in ("phase", "source"):
            if label in labels:
                key = f"{name}|{labels[label]}"
                out[key] = out.get(key, 0.0) + value
    return out


async def _settled(url: str, before: dict[str, float], timeout_s: float = 5.0) -> dict[str, float]:
    """The server's counters once its connector has counted one more finished request (what the connector did for a
    request is published with its outcome; the stream may end before), or after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while True:
        after = await asyncio.to_thread(counters, url)
        if after.get(REQUESTS, 0.0) > before.get(REQUESTS, 0.0) or time.monotonic() > deadline:
            return after
        await asyncio.sleep(0.01)


def _read_phases(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """ms by phase (:data:`kvbridge.serving.engine.target_messages.PHASES`) of the connector's store reads between two
    scrapes."""
    out = {}
    for key, value in after.items():
        if key.startswith(READ_SECONDS + "|") and value > before.get(key, 0.0):
            out[key.split("|", 1)[1]] = 1000 * (value - before.get(key, 0.0))
    return out


async def _escalations(source_url, source_model, target_url, target_model, texts, warmup, new_tokens, native_rest,
                       progress, baseline_url=None, baseline_model=None, lmcache=None):
    """Per conversation: the source's two turns (to the baseline too, if any; to the LMCache pair's source too, if
    any), then the escalated turn each way (a seeded random order per conversation). ``lmcache``: (source URL,
    source model, target URL, target model) of a second pair sharing an LMCache server: the lmcache way."""
    from openai import AsyncOpenAI

    def client(url):
        return AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=600)

    source, target = client(source_url), client(target_url)
    baseline = client(baseline_url) if baseline_url else None
    lm_source, lm_target = (client(lmcache[0]), client(lmcache[2])) if lmcache else (None, None)
    all_ways = WAYS + ((LMCACHE,) if lmcache else ())
    results = []
    try:
        for i, (first, second, question) in enumerate(texts):
            salt = f"cascade-{i}-{time.time_ns()}"  # each conversation its own, in both engines' caches and the store
            turns: list[dict] = []
            messages = [{"role": "user", "content": first}]
            answer = await _source_turn(source, source_model, baseline, baseline_model, messages, salt, i, turns)
            if lmcache:  # the LMCache pair's source serves the same turn (it stores through LMCache as it answers)
                await _turn(lm_source, lmcache[1], messages, ANSWER_TOKENS, None, f"{salt}-{LMCACHE}")
            messages += [{"role": "assistant", "content": answer}, {"role": "user", "content": second}]
            answer = await _source_turn(source, source_model, baseline, baseline_model, messages, salt, i + 1, turns)
            if lmcache:
                await _turn(lm_source, lmcache[1], messages, ANSWER_TOKENS, None, f"{salt}-{LMCACHE}")
            prewarm = await _store_copies(source, source_model, target_url, messages, salt)
            messages += [{"role": "assistant", "content": answer}, {"role": "user", "content": question}]
            # the escalated turn comes once the source's answer is out: its engine has stored the conversation's
            # blocks (a background thread) and gone idle (on a shared CPU its threads would slow the target)
            await asyncio.sleep(SETTLE_S)
            # an order of its own per conversation (seeded): drift, caches and the stalls of a shared machine hit every
            # way alike, and no way always follows the same one (a rotation keeps warm right after native)
            ways = random.Random(i).sample(all_ways, len(all_ways))
            row = {}
            for way in ways:
                # the lmcache way is the second pair's target, reading what its source stored through LMCache
                server = (lm_target, lmcache[3], lmcache[2]) if way == LMCACHE else (target, target_model, target_url)
                row |= await _escalate(way, server, messages, new_tokens, native_rest, salt)
            if lmcache:
                # the cold path at the lmcache way's split (untimed): a fresh source prefill of the prefix the way
                # loaded, mapped, the rest computed by the target — what the way must answer, if LMCache's K/V are
                # the source's (the cold way holds back only the server's hold-back)
                rest = row["prompt_tokens"] - int(row["lmcache_loaded_tokens"])
                cold = {"kvbridge": "mapped", "kvbridge_store": False}
                if row["lmcache_loaded_tokens"] and rest >= 1:
                    cold["kvbridge_hold_back"] = rest
                row["lmcache_cold"] = (await _turn(lm_target, lmcache[3], messages, new_tokens, cold,
                                                   f"{salt}-{LMCACHE}-cold"))[2]
            row["source_turns"] = turns
            row.update(prewarm)
            if i >= warmup:
                results.append(row)
            also = f", LMCache {row[LMCACHE][0]:.1f} ms" if lmcache else ""
            progress(f"conversation {i + 1}/{len(texts)}: native {row['native'][0]:.1f} ms, warm "
                     f"{row['warm'][0]:.1f} ms (from the folder {row['folder'][0]:.1f} ms{also}), all mapped "
                     f"{row['whole'][0]:.1f} ms, mapped at the switch "
                     f"{row['remap'][0]:.1f} ms, cold {row['cold'][0]:.1f} ms, prewarmed "
                     f"{row['prewarmed'][0]:.1f} ms")
    finally:
        for c in (source, target, baseline, lm_source, lm_target):
            if c is not None:
                await c.close()
    return results


async def _store_copies(source, source_model: str, target_url: str, messages: list[dict], salt: str) -> dict:
    """The source's last turn again under other salts (greedy: the same answer), so that the conversation is stored
    again for each way that reads a copy of its own (one salt would make it a prefix-cache hit); the prewarmed copy
    asks the target to load it ahead, and the escalation waits for that request (it would run beside a way's turn):
    whether it landed and how long that took."""
    for way in COPIES:
        if way == "prewarmed":
            before = await asyncio.to_thread(metric, target_url, REQUESTS)
        await _turn(source, source_model, messages, ANSWER_TOKENS, {PREWARM: way == "prewarmed"}, f"{salt}-{way}")
    wait_start, landed = time.perf_counter(), False
    while not landed and time.perf_counter() - wait_start < PREWARM_WAIT_S:
        landed = await asyncio.to_thread(metric, target_url, REQUESTS) > before
        if not landed:
            await asyncio.sleep(0.02)
    return {"prewarm_landed": landed, "prewarm_wait_ms": 1000 * (time.perf_counter() - wait_start)}


async def _escalate(way: str, server: tuple, messages: list[dict], new_tokens: int, native_rest: int,
                    salt: str) -> dict:
    """One way's escalated turn on ``server`` (client, model, URL): its TTFT and tokens, and what the server's
    counters say its connector did (streamed responses carry no kv_transfer_params)."""
    client, model, url = server
    params = {"kvbridge": "native" if way == "native" else "mapped",
              "kvbridge_store": {"warm": True, "folder": "folder", "whole": True, "remap": "source",
                                 "prewarmed": True, LMCACHE: True}.get(way, False),
              "kvbridge_native_rest": 0 if way == "whole" else native_rest}
    before = await asyncio.to_thread(counters, url)
    # warm shares the source's salt (its stored blocks are keyed by it), whole and remap their copies'; the others
    # keep their own so that no way reads another's blocks from the target's prefix cache
    ttft, _, tokens, _ = await _turn(client, model, messages, new_tokens, params,
                                     salt if way == "warm" else f"{salt}-{way}")
    after = await _settled(url, before)
    delta = {m: after.get(m, 0.0) - before.get(m, 0.0) for m in after}
    row = {way: (ttft, tokens), f"{way}_connector_ms": 1000 * delta.get(MAP_SECONDS, 0.0),
           f"{way}_write_ms": 1000 * delta.get(WRITE_SECONDS, 0.0)}
    phases = _read_phases(before, after)
    if phases:  # (the ways that read a stored prefix: kvbridge_read_ms, from /metrics)
        row[f"{way}_read_ms"] = phases
    if way == "native":  # the same request again: the history is in the target's prefix cache
        row["cached_ms"] = (await _turn(client, model, messages, new_tokens, params, f"{salt}-native"))[0]
    if way == "prewarmed":  # what the engine found in its prefix cache (the connector loaded the rest)
        row["prewarmed_cached_tokens"] = delta.get(CACHE_HITS, 0.0)
    if way == "warm":
        row |= {"stored_tokens": delta.get(STORED, 0.0), "premapped_tokens": delta.get(PREMAPPED, 0.0),
                "hot_tokens": delta.get(HOT, 0.0), "prompt_tokens": await _prompt_tokens(client, model, messages)}
    if way == LMCACHE:
        row["lmcache_stored_tokens"] = delta.get(STORED, 0.0)
        # the prefix the target did not compute (loaded by the connector, or a prefix-cache hit)
        row["lmcache_loaded_tokens"] = delta.get(LOADED, 0.0) + delta.get(HITS, 0.0)
    return row


async def _floor(url: str, model: str, count: int = 9) -> float:
    """Median time to the first streamed token of an 8-token native prompt: the engine's own per-request cost."""
    from openai import AsyncOpenAI

    async with AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=600) as client:
        times = []
        for i in range(count + 1):
            start = time.perf_counter()
            stream = await client.completions.create(
                model=model, prompt=[1, 100 + i, 200, 300, 400, 500, 600, 700], max_tokens=2, temperature=0,
                stream=True, extra_body={"kv_transfer_params": {"kvbridge": "native"}, "ignore_eos": True})
            first = None
            async for _ in stream:
                first = first or time.perf_counter()
            times.append(1000 * ((first or time.perf_counter()) - start))
    return statistics.median(times[1:])


async def _prompt_tokens(client, model: str, messages: list[dict]) -> int:
    """The escalated turn's prompt length as the target's server counts it (a 1-token native request)."""
    out = await client.chat.completions.create(model=model, messages=messages, max_tokens=1, temperature=0,
                                               extra_body={"kv_transfer_params": {"kvbridge": "native"},
                                                           "cache_salt": f"length-{time.time_ns()}"})
    return int(out.usage.prompt_tokens)


def _source_cost(results: list[dict]) -> dict:
    """The source turns' figures of a row (:class:`CascadeRow`'s ``source_*``; the ratios are medians of each turn's
    storing ÷ baseline); empty without a baseline."""
    turns = [t for r in results for t in r["source_turns"]]
    if not turns:
        return {}

    def med(key: str) -> float:
        return statistics.median(t[key] for t in turns)

    def ratio(what: str) -> float:
        return statistics.median(t[f"storing_{what}"] / t[f"baseline_{what}"] for t in turns)

    return dict(source_storing_ttft_ms=med("storing_ttft_ms"), source_baseline_ttft_ms=med("baseline_ttft_ms"),
                source_ttft_ratio=ratio("ttft_ms"), source_storing_answer_ms=med("storing_answer_ms"),
                source_baseline_answer_ms=med("baseline_answer_ms"), source_answer_ratio=ratio("answer_ms"),
                source_answers_equal=sum(bool(t["storing_tokens"]) and t["storing_tokens"] == t["baseline_tokens"]
                                         for t in turns) / len(turns))


def run_cascade_bench(source_url: str, source_model: str, target_url: str, target_model: str, tokenizer,
                      histories: list[int], conversations: int, warmup: int = 2, new_tokens: int = 16,
                      native_rest: int = 256, question_tokens: int = 24, progress=print,
                      baseline_url: str | None = None, baseline_model: str | None = None,
                      lmcache: tuple[str, str, str, str] | None = None) -> dict:
    """Every row of the escalation benchmark against two running servers; ``native_rest``: the warm ways' (the most
    tokens after the stored prefix the target computes itself); ``question_tokens``: the escalated turn's new user
    message; ``baseline_url``: the source served without a store, which answers each source turn too (what storing
    costs the source's own requests); ``lmcache``: (source URL, source model, target URL, target model) of a second
    pair sharing an LMCache server (`kvbridge cascade --lmcache`): the lmcache way."""
    rows, raw = [], {}
    started = time.perf_counter()
    floor = asyncio.run(_floor(target_url, target_model))
    for h in histories:
        texts = conversation_texts(tokenizer, conversations + warmup, h, seed=h, question_tokens=question_tokens)
        results = asyncio.run(_escalations(source_url, source_model, target_url, target_model, texts, warmup,
                                           new_tokens, native_rest, progress, baseline_url, baseline_model, lmcache))
        rows.append(_cascade_row(results, native_rest, bool(lmcache)))
        ways = WAYS + ((LMCACHE,) if lmcache else ())
        raw[str(h)] = [_raw_conversation(r, ways, bool(lmcache)) for r in results]
    report = {"source_url": source_url, "target_url": target_url, "baseline_url": baseline_url,
              "warmup_conversations": warmup,
              "engine_floor_ms": floor, "native_rest": native_rest, "question_tokens": question_tokens,
              "new_tokens": new_tokens, "answer_tokens": ANSWER_TOKENS, "seconds": time.perf_counter() - started,
              "rows": [asdict(r) for r in rows], "conversations": raw}
    if lmcache:
        report |= {"lmcache_source_url": lmcache[0], "lmcache_target_url": lmcache[2]}
    return report | {"per_conversation": per_conversation(report)}


def _cascade_row(results: list[dict], native_rest: int, lmcache: bool) -> CascadeRow:
    """One history length's row: medians per way, speed-ups over native, the stored shares and token agreement."""
    native = [r["native"][1] for r in results]
    med = {w: statistics.median(r[w][0] for r in results) for w in WAYS}
    med["cached"] = statistics.median(r["cached_ms"] for r in results)
    lengths = [r["prompt_tokens"] for r in results]
    n = len(results)

    def same(a: str, b: str) -> float:
        return sum(r[a][1] == r[b][1] for r in results) / n

    def first(way: str) -> float:
        return sum(r[way][1][:1] == ref[:1] for r, ref in zip(results, native)) / n

    def tokens(way: str) -> float:
        return statistics.mean(agreement(r[way][1], ref) for r, ref in zip(results, native))

    def connector(way: str) -> float:
        return statistics.median(r[f"{way}_connector_ms"] for r in results)

    return CascadeRow(
        history_tokens=int(statistics.median(lengths)), conversations=n,
        native_ttft_ms=med["native"], warm_ttft_ms=med["warm"], cold_ttft_ms=med["cold"],
        cached_ttft_ms=med["cached"], folder_ttft_ms=med["folder"], whole_ttft_ms=med["whole"],
        remap_ttft_ms=med["remap"], warm_speedup=med["native"] / med["warm"],
        folder_speedup=med["native"] / med["folder"], whole_speedup=med["native"] / med["whole"],
        remap_speedup=med["native"] / med["remap"], ceiling_speedup=med["native"] / med["cached"],
        cold_speedup=med["native"] / med["cold"],
        warm_connector_ms=connector("warm"), folder_connector_ms=connector("folder"),
        whole_connector_ms=connector("whole"),
        remap_connector_ms=connector("remap"), cold_connector_ms=connector("cold"), native_rest=native_rest,
        stored_fraction=statistics.median(r["stored_tokens"] / t for r, t in zip(results, lengths)),
        premapped_fraction=statistics.median(r["premapped_tokens"] / t for r, t in zip(results, lengths)),
        hot_fraction=statistics.median(r["hot_tokens"] / t for r, t in zip(results, lengths)),
        native_fraction=statistics.median(1 - r["stored_tokens"] / t for r, t in zip(results, lengths)),
        whole_equals_cold=same("whole", "cold"), remap_equals_warm=same("remap", "warm"),
        warm_first_token_agreement=first("warm"), whole_first_token_agreement=first("whole"),
        cold_first_token_agreement=first("cold"), warm_token_agreement=tokens("warm"),
        whole_token_agreement=tokens("whole"), cold_token_agreement=tokens("cold"),
        prewarmed_ttft_ms=med["prewarmed"], prewarmed_speedup=med["native"] / med["prewarmed"],
        prewarmed_connector_ms=connector("prewarmed"), prewarmed_equals_warm=same("prewarmed", "warm"),
        prewarmed_cached_fraction=statistics.median(r["prewarmed_cached_tokens"] / t
                                                    for r, t in zip(results, lengths)),
        prewarm_landed=sum(r["prewarm_landed"] for r in results) / n,
        prewarm_wait_ms=statistics.median(r["prewarm_wait_ms"] for r in results), **_source_cost(results),
        **(_lmcache_figures(results, lengths, med["native"]) if lmcache else {}))


def _raw_conversation(r: dict, ways: tuple[str, ...], lmcache: bool) -> dict:
    """One conversation's figures as the report keeps them: every way's TTFT and tokens, the stored shares, the
    connector's times, the LMCache pair's and the source's turns when there are any."""
    return ({w: {"ttft_ms": r[w][0], "tokens": r[w][1]} for w in ways} | {"cached_ttft_ms": r["cached_ms"]} |
            {k: r[k] for k in ("prompt_tokens", "stored_tokens", "premapped_tokens", "hot_tokens",
                               "prewarmed_cached_tokens", "prewarm_landed", "prewarm_wait_ms")} |
            {f"{w}_{name}_ms": r[f"{w}_{name}_ms"] for w in ways if w != "native" for name in ("connector", "write")} |
            {f"{w}_read_ms": r[f"{w}_read_ms"] for w in ways if f"{w}_read_ms" in r} |
            ({"lmcache_cold": {"tokens": r["lmcache_cold"]}, "lmcache_stored_tokens": r["lmcache_stored_tokens"],
              "lmcache_loaded_tokens": r["lmcache_loaded_tokens"]} if lmcache else {}) |
            ({"source_turns": r["source_turns"]} if r["source_turns"] else {}))


def _lmcache_figures(results: list[dict], lengths: list[int], native_ms: float) -> dict:
    """The lmcache way's fields of a row (:class:`CascadeRow`'s ``lmcache_*``)."""
    n = len(results)
    ttft = statistics.median(r[LMCACHE][0] for r in results)
    equal = sum(bool(r[LMCACHE][1]) and r[LMCACHE][1] == r["lmcache_cold"] for r in results)
    return dict(lmcache_ttft_ms=ttft, lmcache_speedup=native_ms / ttft,
                lmcache_connector_ms=statistics.median(r["lmcache_connector_ms"] for r in results),
                lmcache_stored_fraction=statistics.median(r["lmcache_stored_tokens"] / t
                                                          for r, t in zip(results, lengths)),
                lmcache_equal_cold=equal, lmcache_equals_cold=equal / n,
                lmcache_equals_folder=sum(r[LMCACHE][1] == r["folder"][1] for r in results) / n,
                lmcache_token_agreement=statistics.mean(agreement(r[LMCACHE][1], r["native"][1]) for r in results))
