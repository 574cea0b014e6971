"""What ``kvbridge frontier`` writes for people: the markdown table (``frontier.md``), the plot (``frontier.png``)
and the one-line headline, all read from a frontier report (``frontier.json``, :mod:`kvbridge.measure.frontier`).
"""

from __future__ import annotations

from ..core.outputs import save_figure


def headline(report: dict) -> str:
    """"X % at Y× at N tokens" for the recommended point (or says that no point was fast enough)."""
    n = report["headline_tokens"]
    if report["recommended"] is None:
        return f"no point cleared {report['min_ttft_speedup']}× at {n:,} tokens by its own timing noise"
    p = next(p for p in report["points"] if p["name"] == report["recommended"])
    lo, hi = p["interval_95"]
    return (f"{100 * p['retention']:.1f} % [{100 * lo:.1f}, {100 * hi:.1f}] at {p['ttft_speedup']:.2f}× at {n:,} "
            f"tokens ({p['name']})")


def frontier_table(report: dict) -> str:
    lengths, n = report["lengths"], report["headline_tokens"]
    head = (f"| Point | Validation @{n} | Held-out @{n} [95% interval] | "
            + " | ".join(f"@{m}: retention, TTFT speed-up" for m in lengths)
            + f" | Gap recovered, perplexity @{n} | Greedy agreement with native @{n} (source alone) | Map MFLOP/token "
              "| Ministral-3 FLOP limit @1024 | Mapped below source on |")
    lines = [head, "|---|---:|---:|" + "---:|" * (len(lengths) + 4) + "---|"]
    for p in report["points"]:
        star = " **(recommended)**" if p["name"] == report["recommended"] else ""
        front = " ◆" if p["name"] in report["pareto"] else ""
        lo, hi = p["interval_95"]
        cells = []
        for m in lengths:
            v = p["by_length"][str(m)]
            cells.append(f"{100 * v['retention']:.1f}%, {v['ttft_speedup']:.2f}× ±{v['speedup_noise']:.2f}")
        real = p.get("real_geometry_ttft_flop_limit")
        lines.append(f"| {p['name']}{star}{front} | {100 * p['validation_retention']:.1f}% | "
                     f"{100 * p['retention']:.1f}% [{100 * lo:.1f}, {100 * hi:.1f}] | " + " | ".join(cells)
                     + f" | {_gap(p, n)} | {_agreement(p)} | {p['map_mflop_per_token']:.2f} | "
                     + (f"{real:.2f}× | " if real else "— | ")
                     + f"{', '.join(p['source_beats_mapped']) or '—'} |")
    lines.append("")
    chosen = next((p for p in report["points"] if p["name"] == report["recommended"]), None)
    if chosen is not None and "mapped_beats_source" in chosen:
        cells = chosen["tasks"]
        short = [f"{cell_name(t)} [{_points(t, 'mapped_minus_source_95')}]" for t in cells
                 if cell_name(t) not in chosen["mapped_beats_source"]]
        lines += [f"The recommended point's mapped target beats the source alone beyond noise (paired interval of "
                  f"mapped − source above zero) on {len(cells) - len(short)} of {len(cells)} task cells"
                  + (f"; not on {', '.join(short)}." if short else ".")]
        if all("native_minus_source_95" in t for t in chosen["tasks"]):
            tied = [f"{cell_name(t)} [{_points(t, 'native_minus_source_95')}]"
                    for t in chosen["tasks"] if not t["native_minus_source_95"][0] > 0]  # NaN: not beyond noise
            lines[-1] += (f" The target itself (native) does not beat the source beyond noise on "
                          f"{', '.join(tied)}: a transfer that matches the target is not expected to show it there "
                          "with these items." if tied else
                          " The target itself (native) beats the source beyond noise on every cell.")
        lines.append("")
    for p in report["points"]:
        if "recommended_minus_control_95" in p:
            d = p["recommended_minus_control_95"]
            lines += [f"Recommended minus *{p['name']}*, paired 95 % intervals in points: held-out "
                      f"[{100 * d['heldout'][0]:+.1f}, {100 * d['heldout'][1]:+.1f}], validation "
                      f"[{100 * d['validation'][0]:+.1f}, {100 * d['validation'][1]:+.1f}].", ""]
    tasks = "five family tasks (recall of the document's own text included)" if report.get("predictable_recall") \
        else "four family tasks"
    rows = ", ".join(f"{v} at {m}" for m, v in report["validation_rows"].items())
    lines.append(f"**{headline(report)}.** Retention: mean floor-normalized retention over the {tasks}, each task's "
                 f"cell capped at 100 % (uncapped means in frontier.json), with a 95 % bootstrap interval that "
                 f"resamples documents. TTFT speed-up: native ÷ mapped time to first token at the same length, "
                 f"median of {report.get('ttft_rounds', 5)} interleaved rounds ± their median absolute deviation. "
                 f"Validation: {report['validation_documents']} calibration documents kept out of every fit (rows "
                 f"{rows}; packed end to end where longer than the documents); held-out: {report['items']} rows per "
                 f"length, never trained or calibrated on. Recommended at {n:,} tokens: among points whose speed-up "
                 f"less its noise is ≥ {report['min_ttft_speedup']}×, the fastest whose paired interval of validation "
                 f"retention minus the best one's reaches zero. Below source: the paired interval of mapped − source "
                 f"lies below zero. ◆ Pareto front at {n:,} tokens. {report['device']}, batch 1.")
    return "\n".join(lines)


def _gap(point: dict, length: int) -> str:
    """The point's gap recovered on perplexity at ``length`` with its interval ("n/s" where the target's lead over
    the source is inside the noise; "—" for a report written before the figure existed)."""
    task = next((t for t in point["tasks"] if t["task"] == "perplexity" and t["context_tokens"] == length), None)
    if task is None or "gap_recovered" not in task:
        return "—"
    if task["gap_recovered"] is None:
        return "n/s"
    lo, hi = task["gap_interval_95"]
    return f"{100 * task['gap_recovered']:.0f}% [{100 * lo:.0f}, {100 * hi:.0f}]"


def _agreement(point: dict) -> str:
    """The point's greedy continuations' agreement with native's, the source alone's beside it."""
    g = (point.get("generation") or {}).get("agreement")
    return "—" if g is None else f"{100 * g['mapped']:.1f}% ({100 * g['source']:.1f}%)"


def cell_name(task: dict) -> str:
    """A task cell as frontier.json names it: ``task@length``."""
    return f"{task['task']}@{task['context_tokens']}"


def _points(task: dict, key: str) -> str:
    """A task's interval in its own unit, positive where the first mode does better: points for a score, NLL per
    token saved for perplexity."""
    lo, hi = task[key]
    return f"{lo:+.2f}, {hi:+.2f} NLL/token saved" if not task["higher_is_better"] else \
        f"{100 * lo:+.1f}, {100 * hi:+.1f} points"


def plot_frontier(report: dict, path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for p in report["points"]:
        on = p["name"] in report["pareto"]
        ax.scatter(p["ttft_speedup"], 100 * p["retention"], s=60 if on else 30,
                   marker="D" if on else "o", color="tab:red" if p["name"] == report["recommended"] else "tab:blue")
        ax.annotate(p["name"], (p["ttft_speedup"], 100 * p["retention"]), fontsize=7,
                    xytext=(4, 3), textcoords="offset points")
    front = sorted((p for p in report["points"] if p["name"] in report["pareto"]), key=lambda p: p["ttft_speedup"])
    ax.plot([p["ttft_speedup"] for p in front], [100 * p["retention"] for p in front],
            color="tab:blue", lw=0.8, ls="--")
    ax.axvline(report["min_ttft_speedup"], color="grey", lw=0.8)
    ax.set(xlabel=f"TTFT speed-up at {report['headline_tokens']} tokens (× native)",
           ylabel=f"retention at {report['headline_tokens']} tokens (%, capped)",
           title="retention vs time to first token")
    fig.tight_layout()
    save_figure(fig, path, dpi=120)
    plt.close(fig)
