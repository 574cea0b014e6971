"""Time to first token through the engine: native vs mapped requests, side by side, on one running server.

``kvbridge serve-bench`` starts ``kvbridge serve`` (or measures one at ``--url``) and sends completions requests
through its OpenAI-compatible API with streaming: TTFT is the time from sending a request to its first streamed
token, as a client sees it. Every request has a prompt of its own (a window of the family's held-out token stream,
sent as token ids of exactly the stated length), so no request is a prefix-cache hit of another. Per context length
and concurrency, rounds alternate native and mapped waves of ``concurrency`` simultaneous requests (warm-ups
first, then timed rounds); each mode's median TTFT over its requests, its p90, and its decode throughput (generated
tokens per second of wave wall time) are reported, and the speed-up is the ratio of the medians of one run.

Two more figures per row say where a mapped request's time goes. The **connector**: its time per mapped request
(source prefill, map, recompute, cache writes) from the server's ``vllm:kvbridge_map_seconds_total`` around each
mapped wave, the median over the waves. The **ceiling**: right after each native wave its prompts are sent again,
natively, one token longer; the engine's prefix cache then holds every full block of the first send (the share it
found is reported from ``vllm:prefix_cache_hits_total``), so the engine computes what follows the last full block: one
token when the length is a multiple of the block size (256 and 1,024 with blocks of 128), as a mapped request with a
hold-back of 1 does, more otherwise (81 tokens at 2,000). That is a transfer whose connector costs nothing: ``native
÷ ceiling`` is what the engine leaves any transfer at that length (at lengths that are multiples of the block size).
"""

from __future__ import annotations

import asyncio
import json
import re
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from ...errors import KVBridgeError

MODES = ("native", "mapped")
MAP_SECONDS = "vllm:kvbridge_map_seconds_total"
CACHE_HITS = "vllm:prefix_cache_hits_total"  # prompt tokens the engine found in its prefix cache


def metric(url: str, name: str) -> float:
    """The sum of a Prometheus counter over its label sets at ``url``/metrics (0 when absent)."""
    import urllib.request

    try:
        with urllib.request.urlopen(url + "/metrics", timeout=30) as response:
            text = response.read().decode()
        total = 0.0
        for line in text.splitlines():
            if line.startswith(name + "{") or line.startswith(name + " "):
                total += float(line.rsplit(" ", 1)[1])
    except (OSError, ValueError) as exc:  # (urllib's errors are OSErrors)
        raise KVBridgeError(f"{url}/metrics: the server's counters could not be read ({exc}); is the server still "
                            "running? Its log says why it stopped.") from None
    return total


_LINE = re.compile(r'^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})?\s+(\S+)')
_LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"')


def parse_metrics(text: str) -> list[tuple[str, dict[str, str], float]]:
    """The samples of a Prometheus text exposition: ``(name, labels, value)`` (comments and malformed lines
    skipped)."""
    out = []
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        m = _LINE.match(line)
        if not m:
            continue
        try:
            value = float(m.group(3))
        except ValueError:
            continue
        out.append((m.group(1), dict(_LABEL.findall(m.group(2) or "")), value))
    return out


@dataclass
class EngineRow:
    context_tokens: int
    concurrency: int
    native_ttft_ms: float
    mapped_ttft_ms: float
    ttft_speedup: float
    native_p90_ms: float
    mapped_p90_ms: float
    native_tokens_per_s: float
    mapped_tokens_per_s: float
    requests_per_mode: int
    ceiling_ttft_ms: float  # the native prompts again, one token longer: a prefix-cache hit on their full blocks
    ceiling_speedup: float  # native ÷ ceiling
    connector_ms: float  # median over the mapped waves of their connector time per request
    ceiling_cached_fraction: float  # of the ceiling's prompt tokens, those the engine found in its prefix cache


def heldout_stream(tokenizer) -> list[int]:
    """The family's held-out texts as one token stream (no special tokens)."""
    from ... import family

    return [t for text in family.heldout_texts() for t in tokenizer(text, add_special_tokens=False,
                                                                    verbose=False)["input_ids"]]


def token_windows(tokenizer, stream: list[int], count: int, length: int, seed: int = 0) -> list[list[int]]:
    """``count`` distinct prompts of ``length`` tokens: BOS, then windows of the token ``stream``."""
    span = len(stream) - length
    if span <= 0:
        raise KVBridgeError(f"the held-out texts hold {len(stream)} tokens, too few for {length}-token prompts; "
                            "ask for shorter --contexts.")
    step = max(1, span // max(count, 1))
    bos = [tokenizer.bos_token_id] if tokenizer.bos_token_id is not None else []
    return [bos + stream[(seed * 7919 + i * step) % span:][:length - len(bos)] for i in range(count)]


async def _one(client, model: str, ids: list[int], mode: str, new_tokens: int) -> tuple[float, int]:
    """(ms to the first streamed token, tokens generated)."""
    start = time.perf_counter()
    first, tokens = None, 0
    stream = await client.completions.create(model=model, prompt=ids, max_tokens=new_tokens, temperature=0,
                                             stream=True, extra_body={"kv_transfer_params": {"kvbridge": mode},
                                                                      "ignore_eos": True})
    async for chunk in stream:
        if chunk.choices and chunk.choices[0].text is not None:
            if first is None:
                first = time.perf_counter()
            tokens += 1
    return 1000 * ((first or time.perf_counter()) - start), tokens


async def _measure(url: str, model: str, prompts: dict[int, list[list[int]]], concurrencies: list[int],
                   warmup: int, rounds: int, new_tokens: int, progress) -> list[EngineRow]:
    from openai import AsyncOpenAI

    client = AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=600)
    rows = []
    for length, pool in prompts.items():
        cursor = 0
        for conc in concurrencies:
            ttft = {m: [] for m in (*MODES, "ceiling")}
            rate = {m: [] for m in MODES}
            connector: list[float] = []  # per timed mapped wave: its connector time per request
            cached = sent = 0.0  # the ceiling waves' prompt tokens found in the prefix cache, and sent
            batch: list[list[int]] = []
            for r in range(warmup + rounds):
                # native and mapped alternate first in a round (drift hits both alike); the ceiling follows native
                for mode in (("native", "ceiling", "mapped") if r % 2 == 0 else ("mapped", "native", "ceiling")):
                    if mode == "ceiling":  # the native wave's prompts and one token more: all their full blocks hit
                        batch = [ids + ids[-1:] for ids in batch]
                    else:
                        batch = pool[cursor:cursor + conc]
                        cursor += conc
                    counter = {"mapped": MAP_SECONDS, "ceiling": CACHE_HITS}.get(mode)
                    before = await asyncio.to_thread(metric, url, counter) if counter else 0.0
                    t0 = time.perf_counter()
                    done = await asyncio.gather(*(_one(client, model, ids, "native" if mode == "ceiling" else mode,
                                                       new_tokens) for ids in batch))
                    wall = time.perf_counter() - t0
                    if r >= warmup:
                        ttft[mode] += [d[0] for d in done]
                        if mode in rate:
                            rate[mode].append(sum(d[1] for d in done) / wall)
                        delta = await asyncio.to_thread(metric, url, counter) - before if counter else 0.0
                        if mode == "mapped":
                            connector.append(delta / conc)
                        elif mode == "ceiling":
                            cached += delta
                            sent += sum(len(ids) for ids in batch)
                progress(f"{length} tokens, concurrency {conc}: round {r + 1}/{warmup + rounds}")
            med = {m: statistics.median(v) for m, v in ttft.items()}
            p90 = {m: sorted(ttft[m])[int(0.9 * (len(ttft[m]) - 1))] for m in MODES}
            rows.append(EngineRow(length, conc, med["native"], med["mapped"], med["native"] / med["mapped"],
                                  p90["native"], p90["mapped"], statistics.median(rate["native"]),
                                  statistics.median(rate["mapped"]), len(ttft["mapped"]), med["ceiling"],
                                  med["native"] / med["ceiling"], 1000 * statistics.median(connector),
                                  cached / sent))
    await client.close()
    return rows


def outcome(url: str, model: str, ids: list[int]) -> str:
    """What the server says it did with one mapped request (``mapped``, or the fallback's reason)."""
    from openai import OpenAI

    out = OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=600).completions.create(
        model=model, prompt=ids, max_tokens=1, extra_body={"kv_transfer_params": {"kvbridge": "mapped"}})
    return (out.kv_transfer_params or {}).get("kvbridge", "not reported")


def run_engine_bench(url: str, model: str, tokenizer, contexts: list[int], concurrencies: list[int], warmup: int = 2,
                     rounds: int = 5, new_tokens: int = 16, progress=print) -> dict:
    """Every row of the benchmark against the server at ``url`` (started with ``kvbridge serve``)."""
    need = {c: sum(2 * k * (warmup + rounds) for k in concurrencies) for c in contexts}
    stream = heldout_stream(tokenizer)  # tokenized once for every length
    prompts = {c: token_windows(tokenizer, stream, need[c] + 1, c, seed=i) for i, c in enumerate(contexts)}
    # streamed responses do not carry kv_transfer_params: one probe per length shows the server maps, not falls back
    for c in contexts:
        said = outcome(url, model, prompts[c].pop())
        if said != "mapped":
            raise KVBridgeError(f"the server did not map a {c}-token prompt ({said}); nothing would be measured.")
    started = time.perf_counter()
    rows = asyncio.run(_measure(url, model, prompts, concurrencies, warmup, rounds, new_tokens, progress))
    return {"url": url, "model": model, "warmup_rounds": warmup, "rounds": rounds, "new_tokens": new_tokens,
            "seconds": time.perf_counter() - started, "rows": [asdict(r) for r in rows]}


def engine_table(report: dict) -> str:
    """The report's rows as a Markdown table (reports from before the ceiling and connector columns: "–" there)."""
    lines = ["| Context tokens | Concurrency | Native TTFT | Mapped TTFT | **TTFT speedup** | Connector | "
             "Ceiling (prefix-cache hit) | Native p90 | Mapped p90 | Native tok/s | Mapped tok/s |",
             "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in report["rows"]:
        connector = f"{r['connector_ms']:.1f} ms" if "connector_ms" in r else "–"
        cached = f", {r['ceiling_cached_fraction']:.0%} cached" if "ceiling_cached_fraction" in r else ""
        ceiling = (f"{r['ceiling_ttft_ms']:.1f} ms ({r['ceiling_speedup']:.2f}×{cached})" if "ceiling_ttft_ms" in r
                   else "–")
        lines.append(f"| {r['context_tokens']:,} | {r['concurrency']} | {r['native_ttft_ms']:.1f} ms | "
                     f"{r['mapped_ttft_ms']:.1f} ms | **{r['ttft_speedup']:.2f}×** | {connector} | {ceiling} | "
                     f"{r['native_p90_ms']:.1f} ms | {r['mapped_p90_ms']:.1f} ms | {r['native_tokens_per_s']:.0f} | "
                     f"{r['mapped_tokens_per_s']:.0f} |")
    return "\n".join(lines)


def plot_engine(report: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(1, 2, figsize=(10, 4))
    for conc in sorted({r["concurrency"] for r in report["rows"]}):
        rows = [r for r in report["rows"] if r["concurrency"] == conc]
        x = [r["context_tokens"] for r in rows]
        ax[0].plot(x, [r["native_ttft_ms"] for r in rows], "o--", label=f"native, concurrency {conc}")
        ax[0].plot(x, [r["mapped_ttft_ms"] for r in rows], "o-", label=f"mapped, concurrency {conc}")
        (line,) = ax[1].plot(x, [r["ttft_speedup"] for r in rows], "o-", label=f"concurrency {conc}")
        if all("ceiling_speedup" in r for r in rows):
            ax[1].plot(x, [r["ceiling_speedup"] for r in rows], "x:", color=line.get_color(),
                       label=f"ceiling (prefix-cache hit), concurrency {conc}")
    ax[0].set(xlabel="context tokens", ylabel="median TTFT (ms)", title="time to first token through vLLM")
    ax[1].axhline(1.0, color="gray", lw=0.8)
    ax[1].set(xlabel="context tokens", ylabel="native ÷ mapped", title="TTFT speed-up")
    for a in ax:
        a.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def write_report(report: dict, json_path: str) -> None:
    """``json_path`` and, beside it, the table as ``.md``."""
    from ...core.outputs import write_text

    write_text(json_path, json.dumps(report, indent=2) + "\n")
    write_text(str(Path(json_path).with_suffix(".md")), engine_table(report) + "\n")
