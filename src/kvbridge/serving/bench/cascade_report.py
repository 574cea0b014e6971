"""The cascade benchmark's ways and report: figures per conversation (paired differences and ratios with bootstrap
intervals, stalls, the connector's time by phase) and the markdown tables ``kvbridge cascade-bench`` writes beside
its JSON. :mod:`kvbridge.serving.bench.cascade` runs the benchmark; this module only reads its report."""

from __future__ import annotations

import json
import random
import statistics
from pathlib import Path

# the escalated turn's ways (cascade-bench's help says what each is); the lmcache way runs through a second pair
WAYS = ("native", "warm", "folder", "whole", "remap", "cold", "prewarmed")
LMCACHE = "lmcache"  # the way through a second pair whose source stores through LMCache (cascade-bench --lmcache)
# the connector's phases (kvbridge.serving.engine.target_messages.PHASES; not imported: that module imports vLLM)
PHASES = ("connect", "lookup", "retrieve", "decode", "check", "read", "map", "write")


def agreement(answer: list[int], reference: list[int]) -> float:
    """The share of ``reference``'s tokens ``answer`` repeats, position by position."""
    n = max(len(reference), 1)
    return sum(a == b for a, b in zip(answer, reference)) / n


def resampled_interval(values: list[float], replicates: int = 2000, seed: int = 0,
                       statistic=statistics.median) -> tuple[float, float]:
    """A 95 % bootstrap interval of ``statistic`` (the median) of ``values`` (resampled with a fixed seed)."""
    from ...measure.evaluate import percentile_interval

    rng = random.Random(seed)
    return percentile_interval([statistic(rng.choices(values, k=len(values))) for _ in range(replicates)])


# the ways whose turns skip most of the prefill
SHORT = ("warm", "folder", "whole", "remap", "prewarmed", LMCACHE, "cached")


def _ttft(row: dict, way: str) -> float:
    """A conversation's time to first token on ``way`` (``cached``: the ceiling's re-sent native request)."""
    return row["cached_ttft_ms"] if way == "cached" else row[way]["ttft_ms"]


def per_conversation(report: dict) -> dict:
    """Figures over a report's conversations, per history length: the folder way's TTFT minus warm's, paired per
    conversation (median and its 95 % bootstrap interval; files from before the folder way have none), and the
    stalls — turns of the short ways and the ceiling that took more than twice their way's median: their share,
    pooled, and the most any took beyond its median; the connector's median time writing into the engine's cache per
    way (reports from before have none); with the lmcache way, its TTFT minus the folder way's, paired (median and
    mean, each with its interval), and per way that read a stored prefix the median time of each phase of its loads
    (``kvbridge_read_ms``, from /metrics)."""
    out = {}
    for h, rows in report["conversations"].items():
        entry = {}
        if rows and LMCACHE in rows[0]:  # LMCache against today's warm way through the folder store
            paired = [r[LMCACHE]["ttft_ms"] - r["folder"]["ttft_ms"] for r in rows]
            entry["lmcache_minus_folder_ms"] = statistics.median(paired)
            entry["lmcache_minus_folder_interval"] = resampled_interval(paired)
            entry["lmcache_minus_folder_mean_ms"] = statistics.mean(paired)
            entry["lmcache_minus_folder_mean_interval"] = resampled_interval(paired, statistic=statistics.mean)
        for way in ("folder", "prewarmed"):
            if rows and way in rows[0]:
                paired = [r[way]["ttft_ms"] - r["warm"]["ttft_ms"] for r in rows]
                entry[f"{way}_minus_warm_ms"] = statistics.median(paired)
                entry[f"{way}_minus_warm_interval"] = resampled_interval(paired)
        # native ÷ each short way, conversation by conversation (native and the way a few seconds apart: the drift
        # of a shared machine's speed over the run cancels; the medians' ratio in the table does not pair them)
        for way in ("warm", "prewarmed", LMCACHE, "cached"):
            if rows and (way == "cached" or way in rows[0]):
                ratios = [r["native"]["ttft_ms"] / _ttft(r, way) for r in rows]
                entry[f"{way}_paired_speedup"] = statistics.median(ratios)
                entry[f"{way}_paired_speedup_interval"] = resampled_interval(ratios)
        # the answers' agreement with native's, each way's minus the cold path's, conversation by conversation (the
        # issue's quality bar: the switch keeps what the cold path keeps; a mean, the agreements being discrete)
        for way in ("warm", "prewarmed"):
            if rows and way in rows[0] and "tokens" in rows[0]["native"]:
                diffs = [agreement(r[way]["tokens"], r["native"]["tokens"])
                         - agreement(r["cold"]["tokens"], r["native"]["tokens"]) for r in rows]
                entry[f"{way}_minus_cold_agreement"] = statistics.mean(diffs)
                entry[f"{way}_minus_cold_agreement_interval"] = resampled_interval(diffs, statistic=statistics.mean)
        stalled, excess, turns = 0, 0.0, 0
        for way in (w for w in SHORT if rows and (w == "cached" or w in rows[0])):
            times = [_ttft(r, way) for r in rows]
            median = statistics.median(times)
            over = [t - median for t in times if t > 2 * median]
            stalled, turns, excess = stalled + len(over), turns + len(times), max([excess] + over)
        entry["stalled_share"], entry["stall_max_ms"] = (stalled / turns if turns else 0.0), excess
        writes = {w: statistics.median(r[f"{w}_write_ms"] for r in rows) for w in WAYS
                  if rows and f"{w}_write_ms" in rows[0]}
        if writes:
            entry["write_ms"] = writes
        reads = {}
        for w in (w for w in WAYS + (LMCACHE,) if any(f"{w}_read_ms" in r for r in rows)):
            phases = {p for r in rows for p in r.get(f"{w}_read_ms", {})}
            reads[w] = {p: statistics.median(r.get(f"{w}_read_ms", {}).get(p, 0.0) for r in rows)
                        for p in PHASES if p in phases}
        if reads:
            entry["read_ms"] = reads
        out[h] = entry
    return out


def cascade_table(report: dict) -> str:
    lines = ["| History tokens | Native TTFT | **Warm** (new turn native) | Prewarmed | Warm, from the folder | "
             "Warm, all mapped | "
             "Mapped at the switch | Cold | Ceiling (prefix-cache hit) | Connector: warm / from the folder / all "
             "mapped / at the switch / cold | Prefix from the store (mapped ahead; from memory) | Tokens = native: "
             "warm / all mapped / cold | All mapped = cold; at the switch = warm |", "|" + "---:|" * 13]
    for r in report["rows"]:
        def way(name: str) -> str:
            if r.get(name + "_ttft_ms") is None:  # (a file from before that way)
                return "—"
            return f"{r[name + '_ttft_ms']:.1f} ms ({r[name + '_speedup']:.2f}×)"

        lines.append(f"| {r['history_tokens']:,} | {r['native_ttft_ms']:.1f} ms | **{way('warm')}** | "
                     f"{way('prewarmed')} | {way('folder')} "
                     f"| {way('whole')} | {way('remap')} | {way('cold')} | {r['cached_ttft_ms']:.1f} ms "
                     f"({r['ceiling_speedup']:.2f}×) | {r['warm_connector_ms']:.1f} / "
                     f"{r.get('folder_connector_ms', float('nan')):.1f} / "
                     f"{r['whole_connector_ms']:.1f} / "
                     f"{r['remap_connector_ms']:.1f} / {r['cold_connector_ms']:.1f} ms | {r['stored_fraction']:.0%} "
                     f"({r['premapped_fraction']:.0%}; {r.get('hot_fraction', 0):.0%}) | "
                     f"{r['warm_token_agreement']:.0%} / "
                     f"{r['whole_token_agreement']:.0%} / {r['cold_token_agreement']:.0%} | "
                     f"{r['whole_equals_cold']:.0%}; {r['remap_equals_warm']:.0%} |")
    prewarmed = [r for r in report["rows"] if r.get("prewarmed_ttft_ms") is not None]
    if prewarmed:
        lines += ["", "Prewarmed (the source asked the target's server to load the conversation ahead; the turn "
                  "waited for it): " + "; ".join(
                      f"history {r['history_tokens']:,}: loaded before the switch in {r['prewarm_landed']:.0%} of "
                      f"conversations, counted by the target's /metrics {r['prewarm_wait_ms']:.0f} ms after the "
                      f"source's answer (median; the counters lag, the log has each prewarm's delay); at the "
                      f"switch {r['prewarmed_cached_fraction']:.0%} of the prompt was in the target's prefix cache, "
                      f"the connector took {r['prewarmed_connector_ms']:.1f} ms; answers = "
                      f"warm's in {r['prewarmed_equals_warm']:.0%}" for r in prewarmed)]
    extra = report.get("per_conversation") or per_conversation(report)  # (files from before it: computed)
    for way, name in (("folder", "the folder way's"), ("prewarmed", "prewarmed's")):
        paired = {h: e for h, e in extra.items() if f"{way}_minus_warm_ms" in e}
        if paired:
            lines += ["", f"Paired per conversation, {name} TTFT minus warm's (median, 95 % bootstrap interval): "
                      + "; ".join(f"history {h} {e[f'{way}_minus_warm_ms']:+.1f} ms "
                                  f"[{e[f'{way}_minus_warm_interval'][0]:+.1f}, "
                                  f"{e[f'{way}_minus_warm_interval'][1]:+.1f}]" for h, e in paired.items())]
    speedups = {h: e for h, e in extra.items() if "warm_paired_speedup" in e}
    if speedups:
        names = (("warm", "warm"), ("prewarmed", "prewarmed"), ("cached", "ceiling"))
        lines += ["", "Native ÷ the way, paired per conversation (median, 95 % bootstrap interval): " + "; ".join(
            f"history {h} " + ", ".join(f"{name} {e[f'{way}_paired_speedup']:.2f}× "
                                        f"[{e[f'{way}_paired_speedup_interval'][0]:.2f}, "
                                        f"{e[f'{way}_paired_speedup_interval'][1]:.2f}]"
                                        for way, name in names if f"{way}_paired_speedup" in e)
            for h, e in speedups.items())]
    agree = {h: e for h, e in extra.items() if "warm_minus_cold_agreement" in e}
    if agree:
        lines += ["", "Answers' token agreement with native's, the way's minus the cold path's, paired per "
                  "conversation (mean, 95 % bootstrap interval): " + "; ".join(
                      f"history {h} " + ", ".join(f"{way} {100 * e[f'{way}_minus_cold_agreement']:+.1f} points "
                                                  f"[{100 * e[f'{way}_minus_cold_agreement_interval'][0]:+.1f}, "
                                                  f"{100 * e[f'{way}_minus_cold_agreement_interval'][1]:+.1f}]"
                                                  for way in ("warm", "prewarmed")
                                                  if f"{way}_minus_cold_agreement" in e)
                      for h, e in agree.items())]
    lines += ["", "Stalls (turns of the short ways and the ceiling over twice their way's median): "
              + "; ".join(f"history {h} {e['stalled_share']:.0%} of them, up to {e['stall_max_ms']:.0f} ms "
                          "over the median" for h, e in extra.items())]
    writes = {h: e["write_ms"] for h, e in extra.items() if "write_ms" in e}
    if writes:
        lines += ["", "Of the connector's time, writing into the engine's paged cache (its own cache-update op; "
                  "median): " + "; ".join(f"history {h} " + ", ".join(f"{w} {ms:.1f} ms" for w, ms in e.items())
                              for h, e in writes.items())]
    lines += _lmcache_lines(report, extra)
    measured = [r for r in report["rows"] if r.get("source_ttft_ratio") is not None]
    if measured:
        lines += ["", "The source's own turns, served storing its K/V (and mapping them ahead, if on) vs. without a "
                  "store (median):", "", "| History tokens | TTFT: storing / without a store | Whole answer: storing "
                  "/ without a store | Same answers |", "|" + "---:|" * 4]
        for r in measured:
            lines.append(f"| {r['history_tokens']:,} | {r['source_storing_ttft_ms']:.1f} / "
                         f"{r['source_baseline_ttft_ms']:.1f} ms ({r['source_ttft_ratio']:.2f}×) | "
                         f"{r['source_storing_answer_ms']:.0f} / {r['source_baseline_answer_ms']:.0f} ms "
                         f"({r['source_answer_ratio']:.2f}×) | {r['source_answers_equal']:.0%} |")
    return "\n".join(lines)


READ_NAMES = {"warm": "warm (from memory)", "folder": "warm, from the folder", "whole": "warm, all mapped",
              "remap": "mapped at the switch", "prewarmed": "prewarmed", LMCACHE: "LMCache"}


def _lmcache_lines(report: dict, extra: dict) -> list[str]:
    """The lmcache way's table (reports without it: none) and, per way that read a stored prefix, where its loads'
    time went."""
    lines = []
    rows = [(r, h) for r, h in zip(report["rows"], report["conversations"]) if r.get("lmcache_ttft_ms") is not None]
    if rows:
        lines += ["", "Through LMCache: a second pair, its source storing through vLLM's LMCacheMPConnector into an "
                  "LMCache server, its target reading from there (the same conversations, the lmcache way in the "
                  "same random order as the others, the same native rest), beside today's warm ways through the "
                  "folder store. Its answers are compared with the cold path's at the same split (a fresh source "
                  "prefill of the prefix the way loaded, the rest computed by the target):", "",
                  "| History tokens | Native TTFT | Warm (from memory) | Warm, from the folder | **LMCache** | Cold | "
                  "LMCache − folder, paired: median [95 %]; mean [95 %] | Prefix read: folder / LMCache | "
                  "Connector: folder / LMCache | LMCache answers = cold's at its split | = the folder way's |",
                  "|" + "---:|" * 11]
        for r, h in rows:
            e = extra.get(h, {})

            def way(name: str) -> str:
                return f"{r[name + '_ttft_ms']:.1f} ms ({r[name + '_speedup']:.2f}×)"

            diff = "—"
            if "lmcache_minus_folder_ms" in e:
                lo, hi = e["lmcache_minus_folder_interval"]
                mlo, mhi = e["lmcache_minus_folder_mean_interval"]
                diff = (f"{e['lmcache_minus_folder_ms']:+.1f} ms [{lo:+.1f}, {hi:+.1f}]; "
                        f"{e['lmcache_minus_folder_mean_ms']:+.1f} ms [{mlo:+.1f}, {mhi:+.1f}]")
            lines.append(f"| {r['history_tokens']:,} | {r['native_ttft_ms']:.1f} ms | {way('warm')} | {way('folder')} "
                         f"| **{way('lmcache')}** | {way('cold')} | {diff} | {r['stored_fraction']:.0%} / "
                         f"{r['lmcache_stored_fraction']:.0%} | {r['folder_connector_ms']:.1f} / "
                         f"{r['lmcache_connector_ms']:.1f} ms | {r['lmcache_equal_cold']}/{r['conversations']} | "
                         f"{r['lmcache_equals_folder']:.0%} |")
    reads = {h: e["read_ms"] for h, e in extra.items() if e.get("read_ms")}
    if reads:
        phases = [p for p in PHASES if any(p in ph for ways in reads.values() for ph in ways.values())]
        lines += ["", "Where the loads that read a stored prefix spent their time (median ms per phase over the "
                  "conversations, from the target's vllm:kvbridge_read_seconds_total{phase}: what a non-streamed "
                  "response carries as kvbridge_read_ms):", "",
                  "| History tokens | Way | " + " | ".join(phases) + " | Sum |",
                  "|---:|---|" + "---:|" * (len(phases) + 1)]
        for h, ways in reads.items():
            for w, ph in ways.items():
                lines.append(f"| {h} | {READ_NAMES.get(w, w)} | " + " | ".join(
                    f"{ph[p]:.1f}" if p in ph else "–" for p in phases) + f" | {sum(ph.values()):.1f} |")
    return lines


def write_cascade(report: dict, json_path: str) -> None:
    from ...core.outputs import write_text

    write_text(json_path, json.dumps(report, indent=2) + "\n")
    write_text(str(Path(json_path).with_suffix(".md")), cascade_table(report) + "\n")
