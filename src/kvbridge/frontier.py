"""``kvbridge frontier``: what each lever buys in retention and costs in time to first token, measured.

Fits a few mappers (the plain map and maps with levers, see :mod:`kvbridge.levers`), crosses them
with runtime options (selective recompute, a native sink token), and measures every point on the
family tasks at two context lengths (native, source and floors once, then only the mapped mode per
point) and its time to first token against the native target at the longest length, side by side in
one run. Writes ``frontier.json``, ``frontier.md`` and ``frontier.png`` (retention against TTFT
speed-up, Pareto front marked).

Settings are chosen on validation data and reported on held-out data: the last calibration documents
long enough for the longest length are kept out of every fit and serve as the validation set, measured
at every length as the held-out set is (a point is chosen on what it is reported on);
``recommended`` is, among points with a TTFT speed-up of at least ``MIN_SPEEDUP``, the fastest whose
*validation* retention is within ``TIE`` of the best. Held-out retention comes with a 95 % bootstrap
interval over documents.
"""

from __future__ import annotations

import json
import statistics
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import torch

from .bench import device_name, map_flops, mapped_ttft_flops, prefill_flops, time_ms
from .evaluate import family_tasks, mean_retention
from .fit import FitConfig, fit_mapper
from .outputs import check_output_dir, save_figure, write_text
from .transfer import Bridge

MIN_SPEEDUP = 1.5
TIE = 0.01  # validation retentions closer than one point count as equal: the faster point is recommended


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
    validation_items: int = 24
    ttft_trials: int = 7
    ttft_warmup: int = 2
    ttft_rounds: int = 5


LAGS = dict(lags=(0, 1, 2), lever_inputs="kv")
MLP128 = dict(LAGS, mlp_hidden=128)
MLP256 = dict(LAGS, mlp_hidden=256)
STATE128 = dict(LAGS, lever_inputs="kvs", mlp_hidden=128)  # + the source's final hidden state at each lag
# lags + MLP 128, calibrated with repeated spans and tuned on the target's next-token distribution (kvbridge.tune)
TUNED = dict(MLP128, repeat_spans=0.5, lever_objective="output")
# every point starts from the plain map: its levers are spelled out, whatever kvbridge fit's defaults are
PLAIN = dict(lags=(0,), lever_inputs="same", lever_kinds=("key",), lever_layers=None, lever_count=1, lever_top_k=4,
             lever_weighting="none", mlp_hidden=0, repeat_spans=0.0, lever_objective="kv", tune_plain=False,
             recompute=0.0, recompute_by="logit", recompute_window=1, sink=False, hold_back=1)
# the embedded family's source has two layers: each plain map and the lever read the one that predicts them best
# (every source layer, kvbridge fit's default, costs twice the FLOPs here for no measured gain; see docs/levers.md)
FAMILY = dict(top_k=1, lever_top_k=1)
FIT = FitConfig(num_texts=160, seq_len=1024, stride=2, heldout_texts=4, batch_size=4, mlp_steps=4000, mlp_batch=1024,
                **PLAIN)
# the tuned map with a lever on layer 3's values as well as its keys
TUNED_KV = dict(TUNED, lever_kinds=("key", "value"))
# tuning also trains layer 3's plain value map (no runtime cost), every map reads one source layer
LEAN = dict(TUNED, tune_plain=True, **FAMILY)
# selective recompute by each token's own score (the previous releases' rule) ...
RECOMPUTE = {r: dict(recompute=r, recompute_by="logit", recompute_window=1) for r in (0.03, 0.05, 0.07, 0.1, 0.15, 0.2)}
# ... and by its score averaged over the 9 tokens centred on it (kvbridge fit's default): unpredictable spans whole
SPANS = {r: dict(recompute=r, recompute_by="logit", recompute_window=9) for r in (0.03, 0.04, 0.05, 0.07)}
FULL = FrontierConfig(  # about 7 minutes on 2 CPU cores
    fit=FIT,
    points=(
        Point("plain"),
        Point("lean", fit=LEAN),
        Point("lean + recompute 5% by token", fit=LEAN, runtime=RECOMPUTE[0.05]),
        Point("lean + recompute 3% by span", fit=LEAN, runtime=SPANS[0.03]),
        Point("lean + recompute 4% by span", fit=LEAN, runtime=SPANS[0.04]),
        Point("lean + recompute 5% by span", fit=LEAN, runtime=SPANS[0.05]),
        Point("lean + recompute 7% by span", fit=LEAN, runtime=SPANS[0.07]),
    ),
)
ABLATION = (
    Point("lags + MLP 128, repeated spans only", fit=dict(MLP128, repeat_spans=0.5)),
    Point("lags + MLP 128, tuned without repeated spans", fit=dict(MLP128, lever_objective="output")),
)
VALUES = (
    Point("tuned, keys and values", fit=TUNED_KV),
    Point("tuned, keys and values + recompute 5%", fit=TUNED_KV, runtime=RECOMPUTE[0.05]),
)
EXTENDED = FrontierConfig(  # FULL plus the levers that did not make it, for the record (about 40 minutes)
    fit=FIT,
    points=FULL.points + (
        Point("tuned", fit=TUNED),
        Point("tuned + recompute 7%", fit=TUNED, runtime=RECOMPUTE[0.07]),
        Point("lean + recompute 7% by token", fit=LEAN, runtime=RECOMPUTE[0.07]),
        Point("lean + recompute 10% by token", fit=LEAN, runtime=RECOMPUTE[0.1]),
        Point("lean + recompute 5%, window 5", fit=LEAN, runtime=dict(SPANS[0.05], recompute_window=5)),
        Point("lean + recompute 5%, window 13", fit=LEAN, runtime=dict(SPANS[0.05], recompute_window=13)),
        Point("lags + MLP 128", fit=MLP128),
        Point("tuned + recompute 3%", fit=TUNED, runtime=RECOMPUTE[0.03]),
        Point("tuned + recompute 5%", fit=TUNED, runtime=RECOMPUTE[0.05]),
        Point("tuned + recompute 10%", fit=TUNED, runtime=RECOMPUTE[0.1]),
        Point("tuned, plain value map tuned too", fit=dict(TUNED, tune_plain=True)),
        Point("tuned, one source layer a map", fit=dict(TUNED, **FAMILY)),
        Point("lags", fit=LAGS),
        Point("plain + recompute 10%", runtime=RECOMPUTE[0.1]),
        Point("lags + MLP 128 + recompute 10%", fit=MLP128, runtime=RECOMPUTE[0.1]),
        Point("lags + MLP 128 + recompute 5%", fit=MLP128, runtime=RECOMPUTE[0.05]),
        Point("lags + MLP 128 + recompute 20%", fit=MLP128, runtime=RECOMPUTE[0.2]),
        Point("tuned + recompute 15%", fit=TUNED, runtime=RECOMPUTE[0.15]),
        Point("lags + MLP 256", fit=MLP256),
        Point("lags + MLP 128 + hold-back 32", fit=MLP128, runtime=dict(hold_back=32)),
        Point("lags + MLP 128 + hold-back 64", fit=MLP128, runtime=dict(hold_back=64)),
        Point("tuned + hold-back 64", fit=TUNED, runtime=dict(hold_back=64)),
        Point("lags, attention-weighted ridge", fit=dict(LAGS, lever_weighting="attention")),
        Point("lags + MLP 128 + native sink", fit=MLP128, runtime=dict(sink=True, recompute_by="logit")),
        Point("lags + MLP 128 + recompute 10% by bigram", fit=MLP128,
              runtime=dict(recompute=0.1, recompute_by="bigram")),
        Point("lags + MLP 128 + recompute 10% by surprisal", fit=MLP128,
              runtime=dict(recompute=0.1, recompute_by="surprisal")),
        Point("lags + state + MLP 128", fit=STATE128),
        Point("lags + state + MLP 128 + hold-back 64", fit=STATE128, runtime=dict(hold_back=64)),
    ) + ABLATION + VALUES,
)
TUNING = FrontierConfig(  # what tuning and the repeated spans each buy (about 12 minutes)
    fit=FIT,
    points=(Point("lags + MLP 128", fit=MLP128),) + ABLATION + (Point("tuned", fit=TUNED),),
)
VALUE_LEVER = FrontierConfig(  # what a lever on the values of the same layer buys, alone and beside recompute
    fit=FIT,  # (about 11 minutes)
    points=(Point("tuned", fit=TUNED), Point("tuned + recompute 5%", fit=TUNED, runtime=RECOMPUTE[0.05])) + VALUES,
)
QUICK = FrontierConfig(
    fit=FitConfig(num_texts=8, seq_len=256, stride=2, heldout_texts=2, batch_size=8, mlp_steps=20, mlp_batch=256,
                  **PLAIN),
    points=(Point("plain"), Point("lags + MLP", fit=dict(LAGS, mlp_hidden=16)),
            Point("lags + MLP, tuned", fit=dict(LAGS, mlp_hidden=16, repeat_spans=0.5, lever_objective="output",
                                                tune_steps=10)),
            Point("plain + recompute 10%", runtime=RECOMPUTE[0.1])),
    lengths=(128, 256), items=8, validation_items=4, ttft_trials=3, ttft_warmup=1, ttft_rounds=3,
)


# the deep family (8-layer target, 4-layer source trained on its own): fast maps — fewer source layers a map, or
# reduced-rank maps at a quarter of the FLOPs — against every source layer, plain and with the recommended levers
LEAN_DEEP = dict(TUNED, tune_plain=True)
DEEP = FrontierConfig(
    fit=FIT,
    points=(
        Point("plain"),
        Point("plain, top-k 1", fit=dict(top_k=1, lever_top_k=1)),
        Point("plain, rank at 25% FLOPs", fit=dict(rank_flops=0.25)),
        Point("lean", fit=LEAN_DEEP),
        Point("lean + recompute 4% by span", fit=LEAN_DEEP, runtime=SPANS[0.04]),
        Point("lean, top-k 1 + recompute 4% by span", fit=dict(LEAN_DEEP, top_k=1, lever_top_k=1),
              runtime=SPANS[0.04]),
        Point("lean, rank at 25% FLOPs + recompute 4% by span", fit=dict(LEAN_DEEP, rank_flops=0.25),
              runtime=SPANS[0.04]),
    ),
)
GRIDS = {"full": FULL, "extended": EXTENDED, "tuning": TUNING, "values": VALUE_LEVER, "deep": DEEP, "quick": QUICK}
# the point kvbridge fit's defaults reproduce, with FAMILY's source-layer counts (the demo adds them; a deeper
# source keeps every source layer by default): the best one that cleared MIN_SPEEDUP in every frontier run on the
# family (the rule's own pick in a single run can be a point whose speed-up sits on the bar: see docs/levers.md)
RECOMMENDED = "lean + recompute 4% by span"


def split_validation(tokenizer, texts: list[str], items: int, length: int) -> tuple[list[str], list[str]]:
    """(fit texts, validation texts): the last ``items`` documents with at least ``length`` tokens are validation."""
    from .errors import InputError

    chosen = []
    for i in range(len(texts) - 1, -1, -1):
        if len(tokenizer(texts[i], add_special_tokens=False, verbose=False)["input_ids"]) >= length:
            chosen.append(i)
            if len(chosen) == items:
                break
    if len(chosen) < items:
        raise InputError(f"the calibration texts hold only {len(chosen)} documents of {length}+ tokens; the frontier "
                         f"keeps {items} of them out of the fit for validation. Pass more texts.")
    keep = set(chosen)
    return [t for i, t in enumerate(texts) if i not in keep], [texts[i] for i in sorted(keep)]


def ttft(bridge: Bridge, tokens: int, warmup: int, trials: int, rounds: int = 5) -> dict:
    """Native and mapped time to first token at ``tokens`` (batch 1), measured side by side.

    ``rounds`` interleaved rounds, each timing native then mapped (medians of ``trials``): the speed-up is
    the median of the rounds' ratios, so drift on a shared machine between rounds cancels out of it."""
    g = torch.Generator().manual_seed(0)
    low = max(bridge.tokenizer.all_special_ids) + 1
    ids = torch.randint(low, len(bridge.tokenizer), (1, tokens), generator=g)
    mask = torch.ones_like(ids)
    device = bridge.target.device
    native, mapped = [], []
    for _ in range(rounds):
        native.append(time_ms(lambda: bridge.first_token_logits(ids, mask, "native"), device, warmup, trials)[0])
        mapped.append(time_ms(lambda: bridge.first_token_logits(ids, mask, "mapped"), device, warmup, trials)[0])
    return {"native_ttft_ms": statistics.median(native), "mapped_ttft_ms": statistics.median(mapped),
            "ttft_speedup": statistics.median(n / m for n, m in zip(native, mapped))}


def flop_limit(bridge: Bridge, tokens: int) -> float:
    """FLOPs of a native prefill ÷ FLOPs of the mapped path (source prefill, map, recompute, held-back tokens)."""
    return prefill_flops(bridge.target.model.config, tokens, 1) / mapped_ttft_flops(bridge, tokens)


def real_flop_limit(bridge: Bridge, tokens: int) -> float | None:
    """The TTFT FLOP limit this point's kind of map would have at the Ministral-3 3B→8B geometry (plan arithmetic,
    :func:`kvbridge.bench_real.published_config`): its plain maps reading the same share of the source's layers and
    spending the same share of their full-rank FLOPs, its levers if it has the fit's default ones, its runtime
    options. None for a point with other levers (their cost at that geometry is not planned here)."""
    from .bench import path_flops
    from .bench_real import _published_infos, published_config
    from .fit import FitConfig

    config = bridge.mapper.config
    default = FitConfig()
    expected = {(v.lags, v.inputs, v.hidden) for v in config.levers}
    if config.levers and (expected != {(default.lags, default.lever_input_kinds or (v.kind,), default.mlp_hidden)
                                       for v in config.levers} or {v.kind for v in config.levers}
                          != set(default.lever_kinds)):
        return None
    lever_layers = {v.layer for v in config.levers}
    plain = [(kind, l) for kind in config.selection for l in range(config.target.num_layers) if l not in lever_layers]
    ft, fs = config.target.kv_features, config.source.kv_features
    share = statistics.mean(len(config.selection[kind][l]) for kind, l in plain) / config.source.num_layers
    widths = {(kind, l): len(config.selection[kind][l]) * fs for kind, l in plain}
    spent = sum(config.rank(kind, l) * (widths[(kind, l)] + ft) if config.rank(kind, l) else widths[(kind, l)] * ft
                for kind, l in plain)
    fraction = spent / sum(w * ft for w in widths.values()) if config.ranks else None
    infos, configs = _published_infos()
    source, target = infos["ministral3-3b-text"], infos["ministral3-8b-text"]
    top_k = max(1, round(share * source.num_layers)) if share < 1 else None
    real = published_config(source, target, bool(config.levers), configs["ministral3-3b-text"].hidden_size,
                            top_k=top_k, rank_fraction=fraction)
    src, tgt = configs["ministral3-3b-text"], configs["ministral3-8b-text"]
    return prefill_flops(tgt, tokens, 1) / path_flops(src, tgt, real, tokens, bridge.hold_back, bridge.recompute,
                                                      bridge.sink, bridge.recompute_by)


def recommend(points: list[dict]) -> str | None:
    """Among points with a TTFT speed-up ≥ MIN_SPEEDUP, the fastest whose validation retention is within
    ``TIE`` of the best one (a smaller difference is noise on the family's documents); None if none is fast
    enough."""
    eligible = [p for p in points if p["ttft_speedup"] >= MIN_SPEEDUP]
    if not eligible:
        return None
    best = max(p["validation_retention"] for p in eligible)
    return max((p for p in eligible if p["validation_retention"] >= best - TIE),
               key=lambda p: p["ttft_speedup"])["name"]


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
    from .evaluate import bootstrap_interval

    out = check_output_dir(out)
    out.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    longest = max(config.lengths)
    fit_texts, validation = split_validation(target.tokenizer, calibration, config.validation_items, longest)
    mappers: dict[tuple, object] = {}
    references: dict[str, list] = {}
    points = []

    def tasks_of(bridge, texts, items, length, tag):
        if tag not in references:  # the first point runs every mode; the others only the mapped one
            references[tag] = family_tasks(bridge, texts, items, length)
            return references[tag]
        return family_tasks(bridge, texts, items, length, reference=references[tag])

    for point in config.points:
        key = tuple(sorted(point.fit.items()))
        if key not in mappers:
            t0 = time.perf_counter()
            mappers[key] = fit_mapper(source, target, fit_texts, replace(config.fit, **point.fit), progress=progress)
            _say(f"[{time.perf_counter() - start:5.0f} s] fitted {point.name!r} in {time.perf_counter() - t0:.0f} s",
                 progress)
        bridge = Bridge(source, target, mappers[key], **point.runtime)
        runs = {n: tasks_of(bridge, heldout, config.items, n, f"heldout@{n}") for n in config.lengths}
        val = {n: tasks_of(bridge, validation, config.validation_items, n, f"validation@{n}") for n in config.lengths}
        tasks = [{"task": r.task, "context_tokens": n, "native": r.native, "mapped": r.mapped, "source": r.source,
                  "floor": r.floor, "higher_is_better": r.higher_is_better,
                  "floor_normalized_retention": r.floor_normalized_retention} for n, run in runs.items() for r in run]
        timing = ttft(bridge, longest, config.ttft_warmup, config.ttft_trials, config.ttft_rounds)
        by_length = {str(n): mean_retention(run) for n, run in runs.items()}
        fit = mappers[key].config.fit
        points.append({
            "name": point.name, "levers": {"fit": point.fit, "runtime": point.runtime,
                                           "mapper": [v.to_dict() for v in mappers[key].config.levers]},
            "tasks": tasks,
            "mean_floor_normalized_retention": mean_retention([r for run in runs.values() for r in run]),
            "interval_95": bootstrap_interval(list(runs.values())), "mean_by_length": by_length,
            "validation_retention": mean_retention([r for run in val.values() for r in run]),
            "validation_by_length": {str(n): mean_retention(run) for n, run in val.items()},
            "context_tokens": longest, **timing,
            "ttft_flop_limit": flop_limit(bridge, longest),
            "real_geometry_ttft_flop_limit": real_flop_limit(bridge, 1024),
            "map_mflop_per_token": map_flops(mappers[key], 1) / 1e6,
            "mapper_parameters": mappers[key].config.num_parameters(),
            "key_r2_heldout": fit.get("key_r2_heldout"),
            "source_beats_mapped": [f"{t['task']}@{t['context_tokens']}" for t in tasks if _worse_than_source(t)],
        })
        _say(f"[{time.perf_counter() - start:5.0f} s] {point.name}: held-out retention "
             + ", ".join(f"{100 * v:.1f}% @{n}" for n, v in by_length.items())
             + f"; validation {100 * points[-1]['validation_retention']:.1f}%; TTFT speed-up "
             f"{timing['ttft_speedup']:.2f}× at {longest}", progress)
    recommended = recommend(points)
    report = {"points": points, "recommended": recommended, "pareto": pareto(points), "min_ttft_speedup": MIN_SPEEDUP,
              "lengths": list(config.lengths), "items": config.items, "validation_items": config.validation_items,
              "fit": asdict(config.fit), "device": device_name(target.device), "threads": torch.get_num_threads(),
              "seconds": round(time.perf_counter() - start, 1)}
    write_text(out / "frontier.json", json.dumps(report, indent=2) + "\n")
    write_text(out / "frontier.md", frontier_table(report) + "\n")
    plot_frontier(report, out / "frontier.png")
    return report


def _worse_than_source(t: dict) -> bool:
    return t["mapped"] < t["source"] if t["higher_is_better"] else t["mapped"] > t["source"]


def _say(message: str, progress: bool) -> None:
    if progress:
        print(message, flush=True)


def frontier_table(report: dict) -> str:
    lengths = report["lengths"]
    head = ("| Point | Validation | " + " | ".join(f"Held-out @{n}" for n in lengths)
            + " | Held-out mean [95% interval] | TTFT speed-up @" + str(max(lengths))
            + " | FLOP limit | Map MFLOP/token | Ministral-3 FLOP limit @1024 | Mapped below source on |")
    lines = [head, "|---|---:|" + "---:|" * (len(lengths) + 5) + "---|"]
    for p in report["points"]:
        star = " **(recommended)**" if p["name"] == report["recommended"] else ""
        front = " ◆" if p["name"] in report["pareto"] else ""
        lo, hi = p["interval_95"]
        lines.append(f"| {p['name']}{star}{front} | {100 * p['validation_retention']:.1f}% | "
                     + " | ".join(f"{100 * p['mean_by_length'][str(n)]:.1f}%" for n in lengths)
                     + f" | {100 * p['mean_floor_normalized_retention']:.1f}% [{100 * lo:.1f}, {100 * hi:.1f}] | "
                     f"{p['ttft_speedup']:.2f}× | {p['ttft_flop_limit']:.2f}× | {p['map_mflop_per_token']:.2f} | "
                     + (f"{p['real_geometry_ttft_flop_limit']:.2f}× | " if p.get("real_geometry_ttft_flop_limit")
                        else "— | ")
                     + f"{', '.join(p['source_beats_mapped']) or '—'} |")
    lines.append("")
    lines.append(f"Retention: mean floor-normalized retention over the four family tasks. Validation: "
                 f"{report['validation_items']} calibration documents kept out of every fit, at "
                 f"{' and '.join(map(str, lengths))} tokens; held-out: {report['items']} documents per length, "
                 f"never trained or calibrated on, 95 % bootstrap interval over documents. Recommended: among "
                 f"points with a TTFT speed-up ≥ {report['min_ttft_speedup']}×, the fastest within one point of the "
                 f"best validation retention. ◆ Pareto front on held-out retention and speed-up. "
                 f"{report['device']}, batch 1.")
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
    save_figure(fig, path, dpi=120)
    plt.close(fig)
