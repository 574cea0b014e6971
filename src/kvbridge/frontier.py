"""``kvbridge frontier``: what each lever buys in retention and costs in time to first token, measured.

Fits a few mappers (the plain map and maps with levers, see :mod:`kvbridge.levers`), crosses them
with runtime options (selective recompute, a native sink token), and measures every point on the
family tasks at two context lengths (native, source and floors once, then only the mapped mode per
point) and its time to first token against the native target at the longest length, side by side in
one run. Writes ``frontier.json``, ``frontier.md`` and ``frontier.png`` (retention against TTFT
speed-up, Pareto front marked). ``recommended`` is the point with the best mean retention among
those with a TTFT speed-up of at least ``MIN_SPEEDUP``.
"""

from __future__ import annotations

import json
import statistics
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

from .bench import map_flops, prefill_flops, time_ms
from .evaluate import family_tasks, mean_retention
from .fit import FitConfig, fit_mapper
from .transfer import Bridge

MIN_SPEEDUP = 1.5


@dataclass(frozen=True)
class Point:
    """One setting: how the mapper is fitted (``fit``: FitConfig overrides) and used (``runtime``)."""

    name: str
    fit: dict = field(default_factory=dict)
    runtime: dict = field(default_factory=dict)  # Bridge options: recompute, sink, hold_back


@dataclass(frozen=True)
class FrontierConfig:
    fit: FitConfig  # shared settings of every fit (calibration size, ridge, MLP budget)
    points: tuple[Point, ...]
    lengths: tuple[int, ...] = (256, 1024)
    items: int = 48
    ttft_trials: int = 7
    ttft_warmup: int = 2


LAGS = dict(lags=(0, 1, 2), lever_inputs="kv")
FULL = FrontierConfig(
    fit=FitConfig(num_texts=200, seq_len=1024, stride=2, heldout_texts=4, batch_size=4, mlp_steps=1500,
                  mlp_batch=1024),
    points=(
        Point("plain"),
        Point("recompute 10%", runtime=dict(recompute=0.1)),
        Point("lags", fit=LAGS),
        Point("lags + MLP", fit=dict(LAGS, mlp_hidden=256)),
        Point("lags + MLP + sink", fit=dict(LAGS, mlp_hidden=256), runtime=dict(sink=True)),
        Point("lags + MLP + recompute 5%", fit=dict(LAGS, mlp_hidden=256), runtime=dict(recompute=0.05)),
        Point("lags + MLP + recompute 10%", fit=dict(LAGS, mlp_hidden=256), runtime=dict(recompute=0.1)),
        Point("lags + MLP + recompute 20%", fit=dict(LAGS, mlp_hidden=256), runtime=dict(recompute=0.2)),
    ),
)
QUICK = FrontierConfig(
    fit=FitConfig(num_texts=8, seq_len=256, stride=2, heldout_texts=2, batch_size=8, mlp_steps=20, mlp_batch=256),
    points=(Point("plain"), Point("lags + MLP", fit=dict(LAGS, mlp_hidden=16)),
            Point("plain + recompute 10%", runtime=dict(recompute=0.1))),
    lengths=(128, 256), items=8, ttft_trials=3, ttft_warmup=1,
)


def ttft(bridge: Bridge, tokens: int, warmup: int, trials: int) -> dict:
    """Native and mapped time to first token at ``tokens`` (batch 1), measured side by side, medians."""
    g = torch.Generator().manual_seed(0)
    low = max(bridge.tokenizer.all_special_ids) + 1
    ids = torch.randint(low, len(bridge.tokenizer), (1, tokens), generator=g)
    mask = torch.ones_like(ids)
    device = bridge.target.device
    native, mapped = [], []
    for _ in range(3):  # interleaved rounds: drift on a shared machine hits both alike
        native.append(time_ms(lambda: bridge.first_token_logits(ids, mask, "native"), device, warmup, trials)[0])
        mapped.append(time_ms(lambda: bridge.first_token_logits(ids, mask, "mapped"), device, warmup, trials)[0])
    n, m = statistics.median(native), statistics.median(mapped)
    return {"native_ttft_ms": n, "mapped_ttft_ms": m, "ttft_speedup": n / m}


def flop_limit(bridge: Bridge, tokens: int) -> float:
    """FLOPs of a native prefill ÷ FLOPs of the mapped path (source prefill, map, recompute, held-back tokens)."""
    m = bridge.hold_back
    prefix = tokens - m
    src = bridge.source.model.config
    mapped = prefill_flops(src, prefix, prefix if bridge.selects_tokens else 0) + map_flops(bridge.mapper, prefix)
    if bridge.selects_tokens:
        n = max(int(bridge.recompute * prefix + 0.999), int(bridge.sink))
        mapped += prefill_flops(bridge.target.model.config, n, 0, past=prefix - n)
    mapped += prefill_flops(bridge.target.model.config, m, 1, past=prefix)
    return prefill_flops(bridge.target.model.config, tokens, 1) / mapped


def pareto(points: list[dict]) -> list[str]:
    """Names of the points no other point beats on both retention and TTFT speed-up."""
    front = []
    for p in points:
        if not any(q is not p and q["mean_floor_normalized_retention"] >= p["mean_floor_normalized_retention"]
                   and q["ttft_speedup"] >= p["ttft_speedup"]
                   and (q["mean_floor_normalized_retention"], q["ttft_speedup"])
                   != (p["mean_floor_normalized_retention"], p["ttft_speedup"]) for q in points):
            front.append(p["name"])
    return front


def run_frontier(source, target, calibration: list[str], heldout: list[str], config: FrontierConfig,
                 out: str | Path, progress: bool = True) -> dict:
    """Measure every point; write DIR/frontier.json, frontier.md, frontier.png; return the JSON."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    mappers: dict[tuple, object] = {}
    references: dict[int, list] = {}
    points = []
    longest = max(config.lengths)
    for point in config.points:
        key = tuple(sorted(point.fit.items()))
        if key not in mappers:
            t0 = time.perf_counter()
            mappers[key] = fit_mapper(source, target, calibration, replace(config.fit, **point.fit), progress=progress)
            _say(f"[{time.perf_counter() - start:5.0f} s] fitted {point.name!r} in {time.perf_counter() - t0:.0f} s",
                 progress)
        bridge = Bridge(source, target, mappers[key], **point.runtime)
        tasks = []
        for length in config.lengths:
            if length not in references:  # the first point runs every mode; the others only the mapped one
                results = references[length] = family_tasks(bridge, heldout, config.items, length)
            else:
                results = family_tasks(bridge, heldout, config.items, length, reference=references[length])
            for r in results:
                tasks.append({"task": r.task, "context_tokens": length, "native": r.native, "mapped": r.mapped,
                              "source": r.source, "floor": r.floor, "higher_is_better": r.higher_is_better,
                              "floor_normalized_retention": r.floor_normalized_retention})
        timing = ttft(bridge, longest, config.ttft_warmup, config.ttft_trials)
        by_length = {str(n): mean_retention([_as_result(t) for t in tasks if t["context_tokens"] == n])
                     for n in config.lengths}
        fit = mappers[key].config.fit
        points.append({
            "name": point.name, "levers": {"fit": point.fit, "runtime": point.runtime,
                                           "mapper": [v.to_dict() for v in mappers[key].config.levers]},
            "tasks": tasks, "mean_floor_normalized_retention": sum(by_length.values()) / len(by_length),
            "mean_by_length": by_length, "context_tokens": longest, **timing,
            "ttft_flop_limit": flop_limit(bridge, longest),
            "map_mflop_per_token": map_flops(mappers[key], 1) / 1e6,
            "mapper_parameters": mappers[key].config.num_parameters(),
            "key_r2_heldout": fit.get("key_r2_heldout"),
            "source_beats_mapped": [f"{t['task']}@{t['context_tokens']}" for t in tasks if _worse_than_source(t)],
        })
        _say(f"[{time.perf_counter() - start:5.0f} s] {point.name}: retention "
             + ", ".join(f"{100 * v:.1f}% @{n}" for n, v in by_length.items())
             + f", TTFT speed-up {timing['ttft_speedup']:.2f}× at {longest}", progress)
    eligible = [p for p in points if p["ttft_speedup"] >= MIN_SPEEDUP]
    recommended = max(eligible, key=lambda p: p["mean_floor_normalized_retention"])["name"] if eligible else None
    report = {"points": points, "recommended": recommended, "pareto": pareto(points), "min_ttft_speedup": MIN_SPEEDUP,
              "lengths": list(config.lengths), "items": config.items, "fit": _fit_dict(config.fit),
              "device": "cpu", "threads": torch.get_num_threads(), "seconds": round(time.perf_counter() - start, 1)}
    (out / "frontier.json").write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
    (out / "frontier.md").write_text(frontier_table(report) + "\n", encoding="utf-8")
    plot_frontier(report, out / "frontier.png")
    return report


def _fit_dict(config: FitConfig) -> dict:
    from dataclasses import asdict

    return asdict(config)


def _as_result(t: dict):
    from .evaluate import TaskResult

    return TaskResult(t["task"], "", t["native"], t["mapped"], t["source"], t["floor"], 0, t["higher_is_better"])


def _worse_than_source(t: dict) -> bool:
    return t["mapped"] < t["source"] if t["higher_is_better"] else t["mapped"] > t["source"]


def _say(message: str, progress: bool) -> None:
    if progress:
        print(message, flush=True)


def frontier_table(report: dict) -> str:
    lengths = report["lengths"]
    head = ("| Point | " + " | ".join(f"Retention @{n}" for n in lengths)
            + " | Mean | TTFT speed-up @" + str(max(lengths)) + " | FLOP limit | Map MFLOP/token | Below source on |")
    lines = [head, "|---|" + "---:|" * (len(lengths) + 4) + "---|"]
    for p in report["points"]:
        star = " **(recommended)**" if p["name"] == report["recommended"] else ""
        front = " ◆" if p["name"] in report["pareto"] else ""
        lines.append(f"| {p['name']}{star}{front} | " + " | ".join(f"{100 * p['mean_by_length'][str(n)]:.1f}%"
                                                                  for n in lengths)
                     + f" | {100 * p['mean_floor_normalized_retention']:.1f}% | {p['ttft_speedup']:.2f}× | "
                     f"{p['ttft_flop_limit']:.2f}× | {p['map_mflop_per_token']:.2f} | "
                     f"{', '.join(p['source_beats_mapped']) or '—'} |")
    lines.append("")
    lines.append(f"◆ Pareto front (no point has both more retention and more speed-up). Recommended: the best mean "
                 f"retention with a TTFT speed-up ≥ {report['min_ttft_speedup']}×. Retention: mean floor-normalized "
                 f"retention over the four family tasks ({report['items']} held-out documents per length). "
                 f"CPU, {report['threads']} threads, batch 1.")
    return "\n".join(lines)


def plot_frontier(report: dict, path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for p in report["points"]:
        on = p["name"] in report["pareto"]
        ax.scatter(p["ttft_speedup"], 100 * p["mean_floor_normalized_retention"], s=60 if on else 30,
                   marker="D" if on else "o", color="tab:red" if p["name"] == report["recommended"] else "tab:blue")
        ax.annotate(p["name"], (p["ttft_speedup"], 100 * p["mean_floor_normalized_retention"]), fontsize=7,
                    xytext=(4, 3), textcoords="offset points")
    front = sorted((p for p in report["points"] if p["name"] in report["pareto"]), key=lambda p: p["ttft_speedup"])
    ax.plot([p["ttft_speedup"] for p in front], [100 * p["mean_floor_normalized_retention"] for p in front],
            color="tab:blue", lw=0.8, ls="--")
    ax.axvline(report["min_ttft_speedup"], color="grey", lw=0.8)
    ax.set(xlabel=f"TTFT speed-up at {max(report['lengths'])} tokens (× native)",
           ylabel="mean floor-normalized retention (%)", title="retention vs time to first token")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
