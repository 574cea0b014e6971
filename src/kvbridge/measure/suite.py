"""The GPU suite: every real-geometry figure in one command, ``python -m kvbridge.measure.suite OUT``.

On one GPU, from a source tree (``PYTHONPATH=src``; torch, transformers, safetensors, huggingface_hub, tqdm and
nothing else), with random bfloat16 weights at the Ministral-3 3B → 8B text geometry
(:mod:`kvbridge.measure.bench_real`):

1. the FLOP plan of the maps (no weights);
2. the card's latency table for four maps — ``kvbridge fit``'s defaults (top-k 1, levers, selective recompute),
   plain top-k 1, plain head-matched (8 blocks) and the published plain map (every source layer) — eager and with
   CUDA graphs (native graphed too), from 64 to 16,384 tokens; one native timing per length and mode serves all maps;
3. the published fit (500 × 1,024 tokens, stride 4, every source layer) with the statistics on the GPU: capture and
   solve time, measured peak beside ``kvbridge plan``'s;
4. the goals: TTFT ≥ 1.0× at 512 and 1,024 tokens (defaults, graphed), ≥ 0.9 of the FLOP limit at ≥ 4,096,
   top-k 1 map efficiency ≥ 0.6 at ≥ 4,096, fit ≤ 60 s with its peak within 15 % of the plan.

Each section prints as it ends and rewrites ``OUT/suite.json`` and ``OUT/suite.md``, so a run stopped by its time
limit leaves what it measured; ``--budget-s`` skips what would start after that many seconds. ``--tiny`` runs the
same on CPU-sized models (a test runs it): graphs are then replaced by eager calls, with the reason recorded.
"""

from __future__ import annotations

import json
import platform
import subprocess
import time
from pathlib import Path

import torch

MAPS = (  # (name, levers, published_config's fast-map arguments)
    ("defaults", True, {}),
    ("top-k 1", False, {"top_k": 1}),
    ("head-matched", False, {"head_blocks": "heads"}),  # as many blocks as KV heads (8 at Ministral-3's geometry)
    ("published (every source layer)", False, {}),
)
GOALS = {"ttft_short": 1.0, "flop_share": 0.9, "efficiency": 0.6, "fit_s": 60.0, "plan_error": 0.15}


def _commit() -> str:
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=10,
                             cwd=Path(__file__).parent)
        return out.stdout.strip() or "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


class Suite:
    """Results gathered section by section, written after each."""

    def __init__(self, out: Path, budget_s: float):
        self.out, self.budget_s, self.start = out, budget_s, time.perf_counter()
        self.data: dict = {"sections": {}, "skipped": [], "graphs_eager_because": []}

    def elapsed(self) -> float:
        return time.perf_counter() - self.start

    def over_budget(self, what: str) -> bool:
        if self.elapsed() > self.budget_s:
            self.data["skipped"].append(f"{what} (budget of {self.budget_s:.0f} s spent)")
            print(f"skipped {what}: the budget of {self.budget_s:.0f} s is spent", flush=True)
            self.save()
            return True
        return False

    def add(self, name: str, value, text: str) -> None:
        self.data["sections"][name] = {"value": value, "text": text}
        print(f"\n## {name} ({self.elapsed():.0f} s)\n\n{text}\n", flush=True)
        self.save()

    def save(self) -> None:
        from ..core.outputs import write_text

        self.data["elapsed_s"] = self.elapsed()
        write_text(self.out / "suite.json", json.dumps(self.data, indent=2, default=str) + "\n")
        lines = [f"# kvbridge GPU suite\n\n{self.data['header']}\n"]
        for name, section in self.data["sections"].items():
            lines.append(f"## {name}\n\n{section['text']}\n")
        if self.data["skipped"]:
            lines.append("Skipped: " + "; ".join(self.data["skipped"]) + "\n")
        write_text(self.out / "suite.md", "\n".join(lines))


def _ms(fn, device, warmup: int = 2, trials: int = 5) -> float:
    from .bench import time_ms

    return time_ms(fn, torch.device(device), warmup, trials)[0]


def attention_probe(device: str, tokens: int = 8192) -> str:
    """Causal attention at the 8B's shape (32 heads × 128, ``tokens`` tokens, bfloat16): eager and graphed, per
    kernel order. Says which kernel a graph should record."""
    from ..core.graphs import Graphed, attention_priority

    q, k, v = (torch.randn(1, 32, tokens, 128, device=device, dtype=torch.bfloat16) for _ in range(3))
    lines = [f"| SDPA kernels first ({tokens:,} tokens, causal) | Eager | CUDA graph |", "|---|---:|---:|"]
    for first in (None, "FLASH_ATTENTION", "CUDNN_ATTENTION", "EFFICIENT_ATTENTION"):
        order = None if first is None else (first, "MATH")

        def attend():
            return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)

        cells = []
        try:
            with attention_priority(order):
                cells.append(f"{_ms(attend, device):.2f} ms")
                graphed = Graphed(attend, device, strict=True, priorities=(None,))
            cells.append(f"{_ms(graphed, device):.2f} ms")
        except Exception as exc:  # a kernel this GPU or this torch cannot run, or cannot record
            cells += [f"fails: {type(exc).__name__}"] * (2 - len(cells))
        lines.append(f"| {first or 'default order'} | {cells[0]} | {cells[1]} |")
    return "\n".join(lines)


def map_breakdown(bridge, tokens: int = 16384) -> str:
    """Where a warm map's time goes at ``tokens`` (eager, each part timed alone on the same inputs)."""
    from ..core.mapper_config import KINDS
    from ..core.models import positions_from_mask
    from ..core.rope import rope_factors, rotate_cast_
    from ..core.transfer import content_features, token_major

    device = bridge.target.device
    ids = torch.randint(12, len(bridge.tokenizer), (1, tokens), device=device)
    mask = torch.ones_like(ids)
    cache, positions, state = bridge.source_prefill(ids, mask)
    positions = positions_from_mask(mask)
    mapper = bridge.mapper
    src_k, src_v = (list(x) for x in zip(*((layer.keys, layer.values) for layer in cache.layers if layer.keys
                                            is not None)))
    read = mapper.config.read_layers
    src_k, src_v = [src_k[s] for s in read], [src_v[s] for s in read]
    unrotate = token_major(rope_factors(bridge.source.model, positions, inverse=True))
    rotate = token_major(rope_factors(bridge.target.model, positions))
    kv = content_features(src_k, src_v, slice(None), unrotate, mapper.dtype, device)
    out = mapper.map_features(kv)
    keys = out["key"].clone()  # the GEMM's keys, rotated on their way into the cache as map_source_cache does
    parts = {
        "RoPE factors (both models)": lambda: (rope_factors(bridge.source.model, positions, inverse=True),
                                               rope_factors(bridge.target.model, positions)),
        "source features (RoPE out, layout)": lambda: content_features(src_k, src_v, slice(None), unrotate,
                                                                       mapper.dtype, device),
        "the GEMMs (map_features, into one buffer)": lambda: mapper.map_features(kv, out=out),
        "target RoPE on the keys (fused)": lambda: rotate_cast_(out["key"], keys, *rotate),
        "finiteness sum": lambda: out["key"].sum(dtype=torch.float32) + out["value"].sum(dtype=torch.float32),
        "whole warm map (map_cache)": lambda: bridge.map_cache(cache, positions, state),
    }
    lines = [f"| Warm map at {tokens:,} tokens, {len(read)} source layer(s) read | ms |", "|---|---:|"]
    for name, fn in parts.items():
        lines.append(f"| {name} | {_ms(fn, device):.2f} |")
    x = torch.randn(tokens, mapper.groups[KINDS[0]][0].weight.shape[0], device=device, dtype=mapper.dtype)
    lines.append(f"| reference: one plain matmul per kind of the same shapes | "
                 f"{_ms(lambda: [x @ g.weight for kind in KINDS for g in mapper.groups[kind]], device):.2f} |")
    return "\n".join(lines)


def goals_text(results: dict, fit: dict | None) -> tuple[str, dict]:
    """The issue's goals, each with the measured value (None: not measured) and whether it is met."""
    checks: dict[str, tuple[float | None, float, bool]] = {}  # goal → (value, bar, higher is better)
    graphed = results.get(("defaults", True), [])
    for n in (512, 1024):
        row = next((r for r in graphed if r["context_tokens"] == n), None)
        checks[f"defaults, graphed: TTFT speed-up at {n:,} ≥ {GOALS['ttft_short']}"] = (
            None if row is None else row["ttft_speedup"], GOALS["ttft_short"], True)
    for name, share in (("defaults", True), ("top-k 1", False)):
        for graphs in (True, False):
            rows = [r for r in results.get((name, graphs), []) if r["context_tokens"] >= 4096]
            values = [r["ttft_speedup"] / r["ttft_speedup_limit"] if share else r["map_efficiency"] for r in rows]
            what, bar = (("TTFT share of its FLOP limit", GOALS["flop_share"]) if share else
                         ("map efficiency", GOALS["efficiency"]))
            checks[f"{name}, {'graphed' if graphs else 'eager'}: {what} at ≥ 4,096 (lowest) ≥ {bar}"] = (
                min(values) if values else None, bar, True)
    if fit is not None:
        checks[f"published fit: capture + solve ≤ {GOALS['fit_s']:.0f} s"] = (
            fit["capture_s"] + fit["solve_s"], GOALS["fit_s"], False)
        checks[f"published fit: |measured ÷ planned − 1| ≤ {GOALS['plan_error']}"] = (
            abs(fit["measured_over_planned"] - 1), GOALS["plan_error"], False)
    lines = ["| Goal | Measured | Met |", "|---|---:|---|"]
    for goal, (value, bar, higher) in checks.items():
        met = "not measured" if value is None else ("yes" if (value >= bar if higher else value <= bar) else "no")
        lines.append(f"| {goal} | {'—' if value is None else f'{value:.2f}'} | {met} |")
    return "\n".join(lines), {k: v[0] for k, v in checks.items()}


def run_suite(out: str | Path, tiny: bool = False, device: str | None = None, budget_s: float = 420.0,
              contexts: tuple[int, ...] | None = None, warmup: int = 2, trials: int = 5,
              fit_texts: int | None = None, maps: tuple[str, ...] | None = None, fit: bool = True,
              probes: bool = True) -> dict:
    """Run the suite into folder ``out`` (see the module docstring); returns its data. ``maps``: the names of
    :data:`MAPS` to time (default: all); ``fit``: time the published fit; ``probes``: the attention kernels' and the
    warm map's breakdowns (GPU only)."""
    import transformers

    from ..core.outputs import check_output_dir
    from ..core.rope import fuse_failure
    from ..core.transfer import Bridge
    from .bench import bench_table, device_name, run_bench
    from .bench_real import build, fit_lines, fit_report, plan_table, random_mapper

    out = check_output_dir(out)
    out.mkdir(parents=True, exist_ok=True)
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.float32 if tiny else torch.bfloat16  # (bfloat16 matmuls on a CPU time the CPU's emulation)
    contexts = contexts or ((64, 256, 512) if tiny else (64, 512, 1024, 2048, 4096, 8192, 16384))
    suite = Suite(out, budget_s)
    where = device_name(torch.device(device))
    suite.data.update(device=where, tiny=tiny, commit=_commit(), torch=torch.__version__,
                      transformers=transformers.__version__, python=platform.python_version(), contexts=contexts,
                      warmup=warmup, trials=trials)
    suite.data["header"] = (f"{where}; {str(dtype).replace('torch.', '')}; random weights at the Ministral-3 3B → 8B "
                            "text geometry"
                            f"{' (tiny: CPU-sized)' if tiny else ''}; torch {torch.__version__}, transformers "
                            f"{transformers.__version__}; commit {suite.data['commit']}; batch 1, {warmup} warm-ups, "
                            f"median of {trials}")
    print(suite.data["header"], flush=True)
    suite.add("FLOP plan (configs only)", None, plan_table())
    source = build("ministral3-3b-text", device, dtype, tiny)
    target = build("ministral3-8b-text", device, dtype, tiny)
    results: dict = {}
    native: dict = {True: {}, False: {}}
    fit_done = None
    chosen = [m for m in MAPS if maps is None or m[0] in maps]
    order = chosen[:1] + (["fit"] if fit else []) + chosen[1:]
    if probes and device.startswith("cuda"):
        suite.add("attention kernels, eager and recorded", None, attention_probe(device))
        probe = Bridge(source, target, random_mapper(source, target, device, dtype, top_k=1), chunk_tokens=16384)
        suite.add("where a warm map's time goes (plain top-k 1)", None, map_breakdown(probe))
        del probe
    for item in order:
        if item == "fit":
            if suite.over_budget("the published fit"):
                continue
            texts = fit_texts or (16 if tiny else 500)
            fit_done = fit_report(device, dtype, tiny, texts, 256 if tiny else 1024, 4, totals="auto",
                                  models=(source, target))
            suite.add("published fit (statistics on the device when they fit)", fit_done,
                      "\n".join(fit_lines(fit_done)))
            continue
        name, levers, fast = item
        fast = {k: target.info.num_kv_heads if v == "heads" else v for k, v in fast.items()}
        mapper = random_mapper(source, target, device, dtype, levers=levers, **fast)
        bridge = Bridge(source, target, mapper, chunk_tokens=4096)
        for graphs in (True, False):
            label = f"{name}, {'CUDA graphs' if graphs else 'eager'}"
            if suite.over_budget(label):
                continue
            reasons: set = set()
            rows = run_bench(bridge, list(contexts), warmup, trials, progress=False, graphs=graphs,
                             native_rows=native[graphs], reasons=reasons)
            results[(name, graphs)] = [r.to_dict() for r in rows]
            suite.data["graphs_eager_because"] = sorted(set(suite.data["graphs_eager_because"]) | reasons)
            note = f"\n\n(eager where no graph could be recorded: {'; '.join(sorted(reasons))})" if reasons else ""
            suite.add(f"latency: {label}", results[(name, graphs)], bench_table(rows) + note)
        del bridge, mapper
        if device.startswith("cuda"):
            torch.cuda.empty_cache()
    failure = fuse_failure()
    text, values = goals_text(results, fit_done)
    if failure:
        text += f"\n\nThe fused RoPE kernel was given up for the eager path: {failure}"
    suite.add("goals", values, text)
    return suite.data


def main(argv=None) -> None:
    import argparse

    parser = argparse.ArgumentParser(prog="python -m kvbridge.measure.suite", description=__doc__.split("\n\n")[0])
    parser.add_argument("out", help="folder for suite.json and suite.md (made if missing)")
    parser.add_argument("--tiny", action="store_true", help="CPU-sized models of the same structure (about a minute)")
    parser.add_argument("--device", help="default: cuda when there is one, else cpu")
    parser.add_argument("--budget-s", type=float, default=420.0,
                        help="skip a section that would start after this many seconds (default: 420)")
    parser.add_argument("--contexts", help="context lengths (default: 64,512,…,16384; --tiny: 64,256,512)")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--trials", type=int, default=7)
    parser.add_argument("--maps", help="time only these maps, comma-separated: " + ", ".join(m[0] for m in MAPS))
    parser.add_argument("--no-fit", action="store_true", help="skip the published fit")
    parser.add_argument("--no-probes", action="store_true", help="skip the attention and warm-map breakdowns")
    args = parser.parse_args(argv)
    contexts = tuple(int(c) for c in args.contexts.split(",")) if args.contexts else None
    maps = tuple(m.strip() for m in args.maps.split(",")) if args.maps else None
    unknown = sorted(set(maps or ()) - {m[0] for m in MAPS})
    if unknown:
        parser.error(f"unknown map(s) {', '.join(unknown)}; the maps are {', '.join(m[0] for m in MAPS)}")
    run_suite(args.out, args.tiny, args.device, args.budget_s, contexts, args.warmup, args.trials, maps=maps,
              fit=not args.no_fit, probes=not args.no_probes)


if __name__ == "__main__":
    main()
