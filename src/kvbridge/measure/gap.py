"""``kvbridge gap``: what the mapped target keeps of what the target adds over the source, on text nobody here wrote.

A user pays for the target because it is better than the source. For each context length this measures, on the
third-party texts shipped with the family (:mod:`kvbridge.family.external`: validation to choose settings on,
held-out to report; or any texts file):

* perplexity of the last quarter of each row and 4-way cloze (scored), with *gap recovered*
  ((mapped − source) ÷ (native − source); perplexity in log space) and its paired bootstrap interval over documents;
* free generation (:mod:`kvbridge.measure.freegen`): greedy continuations' agreement with native, first divergence and
  distinct 4-grams, for mapped and for the source alone, and a span stated far back, written (exact match);
* time to first token, native against mapped, at the same length (batch 1, measured side by side).

A cell where the target does not beat the source beyond noise prints ``n/s`` instead of a ratio.
"""

from __future__ import annotations

import json
import platform
import subprocess
from dataclasses import dataclass, field, replace
from pathlib import Path

from ..core.outputs import check_output_dir, write_text
from ..core.transfer import Bridge
from ..errors import InputError
from .evaluate import (
    CHOICE_TOKENS,
    TaskResult,
    document_rows,
    gap_interval,
    gap_recovered,
    has_source,
    mapped_minus_source,
    target_leads,
    task_cloze,
    task_perplexity,
)
from .freegen import continuation_results, written_recall_result


@dataclass(frozen=True)
class GapConfig:
    lengths: tuple[int, ...] = (1024, 2048)
    items: int = 48
    new_tokens: int = 48
    batch_size: int = 8
    ttft: bool = True
    warmup: int = 1
    trials: int = 3
    rounds: int = 3
    scored: int | None = None  # perplexity's scored tokens (default: a quarter of the length)
    tasks: tuple[str, ...] = field(default=("perplexity", "cloze", "recall", "continuation"))


TASKS = ("perplexity", "cloze", "recall", "continuation")


def cell(result: TaskResult) -> dict:
    """A task's figures with gap recovered, its interval and the target's own lead over the source."""
    lead = mapped_minus_source(result, mode="native") if has_source(result) else (float("nan"),) * 2
    gain = mapped_minus_source(result) if has_source(result) else (float("nan"),) * 2
    leads = target_leads(result)
    against_native = (float("nan"),) * 2
    if has_source(result):  # mapped − native, paired: "no worse than native" where it includes zero
        as_source = replace(result, per_item=result.per_item | {"source": result.per_item["native"]})
        against_native = mapped_minus_source(as_source)
    return result.to_dict() | {
        "target_minus_source": list(lead), "mapped_minus_source": list(gain), "target_leads": leads,
        "mapped_minus_native": list(against_native),
        "gap_recovered": gap_recovered(result) if leads else None,
        "gap_interval": list(gap_interval(result)) if leads else None}


def run_gap(bridge: Bridge, texts: list[str], config: GapConfig, progress=print, label: str = "") -> dict:
    """Every length's cells (and TTFT), as a JSON-able report."""
    unknown = set(config.tasks) - set(TASKS)
    if unknown:
        raise InputError(f"unknown task(s) {', '.join(sorted(unknown))}; choose from {', '.join(TASKS)}.")
    limit = bridge.max_positions
    report = {"texts": label, "config": {k: list(v) if isinstance(v, tuple) else v
                                         for k, v in config.__dict__.items()},
              "hold_back": bridge.hold_back, "lengths": []}
    for length in config.lengths:
        if length > limit:
            raise InputError(f"length {length} is more than the {limit} positions these models support.")
        rows, keys = document_rows(bridge.tokenizer, texts, config.items, length, pack=True)
        cells = []
        if "perplexity" in config.tasks:
            progress(f"  {length} tokens: perplexity")
            scored = config.scored or length // 4
            cells.append(task_perplexity(bridge, rows, scored=scored, batch_size=config.batch_size))
        if "cloze" in config.tasks:
            progress(f"  {length} tokens: cloze")
            cells.append(task_cloze(bridge, rows, context=length - CHOICE_TOKENS, batch_size=config.batch_size))
        cells = [TaskResult(**{**r.__dict__, "keys": keys}) for r in cells]
        context = min(length, limit - config.new_tokens)
        if "recall" in config.tasks:
            progress(f"  {length} tokens: recall, written")
            cells.append(written_recall_result(bridge, rows, keys, config.batch_size))
        if "continuation" in config.tasks:
            progress(f"  {length} tokens: free generation")
            cells += continuation_results(bridge, [r[:context].tolist() for r in rows], keys, config.new_tokens,
                                          config.batch_size)
        entry = {"length": length, "generation_context": context, "cells": [cell(r) for r in cells]}
        if config.ttft:
            from .frontier import ttft

            progress(f"  {length} tokens: time to first token")
            entry["ttft"] = ttft(bridge, length, config.warmup, config.trials, config.rounds)
        report["lengths"].append(entry)
    return report


def _pct(value: float, scale: bool) -> str:
    return f"{100 * value:.1f}%" if scale else f"{value:.2f}"


def _interval(pair: list, scale: float) -> str:
    return f"[{scale * pair[0]:+.2f}, {scale * pair[1]:+.2f}]"


def gap_table(report: dict) -> str:
    """Markdown: per length and task, native / mapped / source, the paired differences (points for a share, NLL per
    token for perplexity, signed so that above zero is better), gap recovered."""
    lines = ["| Length | Task | Native | Mapped | Source alone | Target − source [95 %] | Mapped − source [95 %] | "
             "Mapped − native [95 %] | Gap recovered [95 %] |", "|---:|---|---:|---:|---:|---:|---:|---:|---:|"]
    for entry in report["lengths"]:
        for c in entry["cells"]:
            pct = c["higher_is_better"] and c["task"] != "first divergence"
            scale = 100 if pct else 1
            lead, gain, own = c["target_minus_source"], c["mapped_minus_source"], c["mapped_minus_native"]
            gap = (f"**{100 * c['gap_recovered']:.0f}%** [{100 * c['gap_interval'][0]:.0f}, "
                   f"{100 * c['gap_interval'][1]:.0f}]" if c["target_leads"] else "n/s (target ≈ source)")
            lines.append(f"| {entry['length']:,} | {c['task']} | {_pct(c['native'], pct)} | {_pct(c['mapped'], pct)} | "
                         f"{_pct(c['source'], pct)} | {_interval(lead, scale)} | {_interval(gain, scale)} | "
                         f"{_interval(own, scale)} | {gap} |")
    ttfts = [(e["length"], e["ttft"]) for e in report["lengths"] if "ttft" in e]
    if ttfts:
        lines += ["", "| Length | Native TTFT | Mapped TTFT | Speed-up (median of rounds) |", "|---:|---:|---:|---:|"]
        lines += [f"| {n:,} | {t['native_ttft_ms']:.1f} ms | {t['mapped_ttft_ms']:.1f} ms | "
                  f"{t['ttft_speedup']:.2f}× ± {t['speedup_noise']:.2f} |" for n, t in ttfts]
    return "\n".join(lines)


def provenance(command: str) -> dict:
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                cwd=Path(__file__).parent, timeout=10).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        commit = None
    return {"command": command, "commit": commit, "machine": f"{platform.machine()} CPU, {platform.processor()}"
            .rstrip(", ")}


def write_report(report: dict, out: str) -> Path:
    folder = check_output_dir(out)
    folder.mkdir(parents=True, exist_ok=True)
    write_text(folder / "gap.json", json.dumps(report, indent=2) + "\n")
    write_text(folder / "gap.md", f"`{report.get('provenance', {}).get('command', '')}`\n\n{gap_table(report)}\n")
    return folder
