"""Latency in the published card's format, FLOP accounting, and the map's efficiency.

Per context length (batch 1 unless asked otherwise), measured side by side in one run:

* native target prefill (decoder + the last token's logits, as a serving prefill),
* source prefill (decoder only: transfer needs its cache, not its logits; unless the map reads the source's
  final hidden states, not even its last layer's attention and MLP),
* warm map: source cache exists → target ``DynamicCache`` ready (RoPE removal, map, target RoPE,
  cache construction),
* cold source+map: both of the above in one timed call (the card's "cold" column),
* time to first token (TTFT), the full path to the first output token's logits: native = the
  target's prefill above (all T tokens, last token's logits); mapped = source prefill of the first
  T − m tokens + map + the target's forward over the m held-back tokens to the last one's logits
  (:meth:`Bridge.first_token_logits`). The card's cold column stops before that last step, so only
  ``ttft_speedup`` compares like with like,

with warm-ups, then timed trials; medians are quoted, min/max kept. On CUDA the device is
synchronized around every trial. ``graphs``: every timed call (native included, so the ratio stays
honest) replays a CUDA graph recorded for it (:mod:`kvbridge.core.graphs`) instead of launching each kernel
from Python; elsewhere the same calls run eagerly. ``map_efficiency`` is the map's achieved FLOP/s divided by the FLOP/s
of plain ``torch.matmul`` calls of the same shapes timed in the same run. ``cold_speedup_limit`` is
FLOPs(target prefill) ÷ (FLOPs(source prefill) + FLOPs(map)): the best a cold transfer could do;
``ttft_speedup_limit`` adds the target's forward over the held-back tokens to the denominator.

Peak memory: the device allocator's peak on CUDA; on CPU the process's peak RSS (VmHWM), which is
reset between phases through ``/proc/self/clear_refs`` where Linux allows it.
"""

from __future__ import annotations

import math
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from ..core.mapper import Mapper
from ..core.mapper_config import KINDS, MapperConfig
from ..core.models import prefill
from ..core.outputs import save_figure
from ..core.recompute import reads_source_state, recompute_counts
from ..core.transfer import Bridge


@dataclass
class BenchRow:
    context_tokens: int
    native_prefill_ms: float
    source_prefill_ms: float
    warm_map_ms: float
    cold_ms: float
    native_ttft_ms: float
    mapped_ttft_ms: float
    warm_speedup: float
    cold_speedup: float
    ttft_speedup: float
    map_gflop: float
    map_efficiency: float
    cold_speedup_limit: float
    ttft_speedup_limit: float
    native_prefill_gflop: float
    source_prefill_gflop: float
    timings_min_max_ms: dict
    peak_memory_native_bytes: int
    peak_memory_cold_bytes: int

    def to_dict(self) -> dict:
        return asdict(self)


def device_name(device: torch.device) -> str:
    """What a latency table was measured on, e.g. 'NVIDIA H200 (CUDA)' or 'CPU (2 threads)'."""
    if device.type == "cuda":
        return f"{torch.cuda.get_device_name(device)} (CUDA)"
    return f"CPU ({torch.get_num_threads()} threads)"


# -- FLOP accounting ---------------------------------------------------------------------------
def attention_widths(config) -> tuple[int, int, int]:
    """(query heads, kv heads, head dim) of a decoder config (kv heads default to the query heads, the head
    dim to hidden size ÷ heads)."""
    heads = config.num_attention_heads
    return (heads, getattr(config, "num_key_value_heads", None) or heads,
            getattr(config, "head_dim", None) or config.hidden_size // heads)


def prefill_flops(config, tokens: int, logits_tokens: int = 1, past: int = 0) -> float:
    """Multiply-add FLOPs (×2) of a decoder forward over ``tokens`` new tokens after ``past`` cached ones.

    Per layer: q/k/v/o projections, the gated MLP (3 matrices), and attention scores plus
    weighted values over the causal pairs (T(T+1)/2 for a prefill, plus T·past against a cache).
    ``logits_tokens`` positions get the vocabulary projection (1 for a serving prefill, 0 for a
    decoder-only source prefill).
    """
    d, layers = config.hidden_size, config.num_hidden_layers
    heads, kv, hd = attention_widths(config)
    proj = d * heads * hd * 2 + d * kv * hd * 2  # q and o, k and v
    mlp = 3 * d * config.intermediate_size
    linear = 2.0 * tokens * layers * (proj + mlp)
    pairs = tokens * (tokens + 1) / 2 + tokens * past  # causal query-key pairs
    attention = 4.0 * layers * heads * hd * pairs  # QKᵀ and AV: 2 FLOPs × 2 products per pair, head and dim
    return linear + attention + 2.0 * logits_tokens * d * config.vocab_size


def cache_prefill_flops(config, tokens: int, past: int = 0, depth: int | None = None) -> float:
    """FLOPs of a forward that only fills the cache (:func:`kvbridge.core.models.cache_only`): every layer but the last
    whole, and the last one's query, key and value projections (the model's own code forms all three before it
    stores K/V; the forward stops there). ``depth``: the cache of the first ``depth`` layers only."""
    layers, d = config.num_hidden_layers, config.hidden_size
    heads, kv, hd = attention_widths(config)
    whole = (layers if depth is None else depth) - 1
    return prefill_flops(config, tokens, 0, past) * whole / layers + 2.0 * tokens * d * (heads + 2 * kv) * hd


def native_layers_flops(target_config, tokens: int, native_layers: int) -> float:
    """FLOPs of the target computing its own first ``native_layers`` layers' cache over ``tokens`` (0: none)."""
    return cache_prefill_flops(target_config, tokens, depth=native_layers) if native_layers else 0.0


def source_flops(source_config, mapper: Mapper | MapperConfig, tokens: int, hidden: bool = False) -> float:
    """FLOPs of the source prefill a transfer runs: the whole decoder when the map (or, with ``hidden``, the
    recompute criterion) reads its final hidden states, else only what fills the cache."""
    config = mapper.config if isinstance(mapper, Mapper) else mapper
    if hidden or config.reads_state:
        return prefill_flops(source_config, tokens, 0)
    return cache_prefill_flops(source_config, tokens, depth=config.source_depth)


def map_flops(mapper: Mapper | MapperConfig, tokens: int) -> float:
    """FLOPs of the map's GEMMs, keys and values: 2·T·Σ d_in·d_out over every weight (each layer's ``x @ W``
    and a residual MLP's two; a head-blocked layer's n blocks, n·(d_in/n)·(d_out/n) each).

    Takes a mapper or only its config (the shapes decide): a plan needs no weights.
    """
    config = mapper.config if isinstance(mapper, Mapper) else mapper
    return 2.0 * tokens * sum(math.prod(s) for n, s in config.weight_shapes().items() if n.endswith(".weight"))


def recompute_flops(config, n: int, prefix: int) -> float:
    """FLOPs of the target's recompute of ``n`` of ``prefix`` tokens (:mod:`kvbridge.core.recompute`): a forward
    of ``n`` queries over the whole prefix (at most) through every layer but the last, and the last layer's
    key and value projections only."""
    layers, d = config.num_hidden_layers, config.hidden_size
    _, kv, hd = attention_widths(config)
    return prefill_flops(config, n, 0, past=prefix - n) * (layers - 1) / layers + 2.0 * n * d * kv * hd * 2


def mapped_ttft_flops(bridge: Bridge, tokens: int, batch: int = 1) -> float:
    """FLOPs of a bridge's mapped path to the first token (:func:`path_flops` with its models and options)."""
    return batch * path_flops(bridge.source.model.config, bridge.target.model.config, bridge.mapper, tokens,
                              bridge.hold_back, bridge.recompute, bridge.sink, bridge.recompute_by,
                              bridge.native_layers)


def path_flops(source_config, target_config, mapper: Mapper | MapperConfig, tokens: int, hold_back: int = 1,
               recompute: float = 0.0, sink: bool = False, recompute_by: str = "logit", native_layers: int = 0
               ) -> float:
    """FLOPs of the mapped path to the first token: source prefill of T − m tokens (with its logits when the
    recompute criterion is the source's surprisal; its cache only when nothing reads its final hidden states,
    and only to the deepest layer the maps read, :func:`source_flops`), the map (every target layer's, as the
    runtime computes it), the target's own first ``native_layers`` layers over the prefix, the target's recompute
    of the chosen tokens and its forward over the m held-back tokens with the last token's logits. Configs only:
    a plan needs no weights."""
    m = min(hold_back, tokens - 1)
    prefix = tokens - m
    selects = recompute > 0 or sink
    if selects and recompute_by == "surprisal":  # the source's logits of every prefix token
        flops = prefill_flops(source_config, prefix, prefix)
    else:
        flops = source_flops(source_config, mapper, prefix, hidden=selects and reads_source_state(recompute_by))
    flops += map_flops(mapper, prefix)
    flops += native_layers_flops(target_config, prefix, native_layers)
    if selects:
        n = int(recompute_counts(recompute, torch.tensor([prefix]), sink)[0])  # as the runtime counts them
        flops += recompute_flops(target_config, n, prefix)
    return flops + prefill_flops(target_config, m, 1, past=prefix)


# -- timing ------------------------------------------------------------------------------------
def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_ms(fn, device: torch.device, warmup: int, trials: int) -> tuple[float, float, float]:
    """(median, min, max) wall time of ``fn()`` in ms, device-synchronized."""
    for _ in range(warmup):
        fn()
    _sync(device)
    times = []
    for _ in range(trials):
        _sync(device)
        start = time.perf_counter()
        fn()
        _sync(device)
        times.append((time.perf_counter() - start) * 1000)
    return statistics.median(times), min(times), max(times)


def _reset_peak(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        return
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        pass


def _peak(device: torch.device) -> int:
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    import resource

    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024


def matmul_ms(mapper: Mapper, tokens: int, device: torch.device, warmup: int, trials: int,
              graphs: bool = False) -> float:
    """Median time of plain ``torch.matmul`` calls with exactly the map's GEMM shapes (the reference): each
    group's ``x @ W`` and, for a residual MLP, its two GEMMs — every FLOP :func:`map_flops` counts."""
    pairs = []
    for kind in KINDS:
        for group in mapper.groups[kind]:
            # a head-blocked layer's weight is (n, F_in / n, Ft / n): one batched GEMM of n blocks
            x = torch.randn(*group.weight.shape[:-2], tokens, group.weight.shape[-2], device=mapper.device,
                            dtype=mapper.dtype)
            pairs.append((x, group.weight))
            for up in group.ups or ():  # a factored group's second GEMMs
                pairs.append((torch.randn(tokens, up.shape[0], device=mapper.device, dtype=up.dtype), up))
            if group.mlp is not None:
                w1, _, w2, _ = group.mlp
                pairs.append((x.to(w1.dtype), w1))
                pairs.append((torch.randn(tokens, w2.shape[0], device=mapper.device, dtype=w2.dtype), w2))
    return time_ms(_maybe_graphed(lambda: [torch.matmul(x, w) for x, w in pairs], device, graphs), device, warmup,
                   trials)[0]


def _maybe_graphed(fn, device: torch.device, graphs: bool, reasons: set | None = None):
    """``fn`` itself, or with ``graphs`` a replay of its CUDA graph (eager where none can be recorded; why goes
    into ``reasons``)."""
    if not graphs:
        return fn
    from ..core.graphs import Graphed, unpadded

    def run():
        with unpadded():
            return fn()

    graphed = Graphed(run, device)
    if graphed.reason and reasons is not None:
        reasons.add(graphed.reason)
    return graphed


@torch.no_grad()
def run_bench(bridge: Bridge, contexts: list[int], warmup: int = 2, trials: int = 7, batch: int = 1,
              progress: bool = True, graphs: bool = False, native_rows: dict | None = None,
              reasons: set | None = None) -> list[BenchRow]:
    """The table's rows at each context length. ``graphs``: CUDA graphs for every timed call. ``native_rows``:
    native timings by length, filled here or read from an earlier call with the same target (one native per
    length serves several mappers). ``reasons``: why a call ran eagerly although ``graphs`` asked."""
    from tqdm.auto import tqdm

    device = bridge.target.device
    native_rows = {} if native_rows is None else native_rows
    vocab = len(bridge.tokenizer)
    low = max(bridge.tokenizer.all_special_ids) + 1
    g = torch.Generator().manual_seed(0)
    rows = []
    for tokens in tqdm(contexts, desc="bench", unit="context", disable=not progress):
        ids = torch.randint(low, vocab, (batch, tokens), generator=g)
        src_device = bridge.source.device
        # on the device already when graphs record the calls (a graph cannot copy from pageable host memory)
        ids = ids.to(device) if graphs else ids
        mask = torch.ones_like(ids)

        def native():
            return prefill(bridge.target.model, ids, mask, logits="last")

        def source():
            return bridge.source_prefill(ids.to(src_device), mask.to(src_device))

        src_cache, positions, state = source()

        def warm():  # the map (and the target's own first layers, which no stored source cache spares)
            return bridge.native_lower(bridge.map_cache(src_cache, positions, state), ids, mask, positions)

        def cold():
            return bridge.native_lower(bridge.map_cache(*bridge.source_prefill(ids.to(src_device),
                                                                                mask.to(src_device))),
                                       ids, mask, positions)

        def mapped_ttft():
            return bridge.first_token_logits(ids, mask, "mapped")

        def timed(fn, dev):  # one graph at a time: each is freed once timed
            return time_ms(_maybe_graphed(fn, dev, graphs, reasons), dev, warmup, trials)

        if tokens not in native_rows:
            _reset_peak(device)
            native_rows[tokens] = (timed(native, device), _peak(device))
        t_native, peak_native = native_rows[tokens]
        t_source = timed(source, src_device)
        t_warm = timed(warm, device)
        _reset_peak(device)
        t_cold = timed(cold, device)
        peak_cold = _peak(device)
        t_ttft = timed(mapped_ttft, device)
        t_matmul = matmul_ms(bridge.mapper, batch * tokens, bridge.mapper.device, warmup, trials, graphs)
        f_map = map_flops(bridge.mapper, batch * tokens)
        f_native = batch * prefill_flops(bridge.target.model.config, tokens, 1)
        f_source = batch * source_flops(bridge.source.model.config, bridge.mapper, tokens)  # as timed above
        f_native_layers = batch * native_layers_flops(bridge.target.model.config, tokens, bridge.native_layers)
        f_ttft = mapped_ttft_flops(bridge, tokens, batch)
        rows.append(BenchRow(
            context_tokens=tokens,
            native_prefill_ms=t_native[0], source_prefill_ms=t_source[0], warm_map_ms=t_warm[0], cold_ms=t_cold[0],
            native_ttft_ms=t_native[0], mapped_ttft_ms=t_ttft[0],
            warm_speedup=t_native[0] / t_warm[0], cold_speedup=t_native[0] / t_cold[0],
            ttft_speedup=t_native[0] / t_ttft[0],
            map_gflop=f_map / 1e9, map_efficiency=t_matmul / t_warm[0],
            cold_speedup_limit=f_native / (f_source + f_map + f_native_layers), ttft_speedup_limit=f_native / f_ttft,
            native_prefill_gflop=f_native / 1e9, source_prefill_gflop=f_source / 1e9,
            timings_min_max_ms={"native": t_native[1:], "source": t_source[1:], "warm_map": t_warm[1:],
                                "cold": t_cold[1:], "mapped_ttft": t_ttft[1:], "matmul_reference_median": t_matmul},
            peak_memory_native_bytes=peak_native, peak_memory_cold_bytes=peak_cold,
        ))
    return rows


def _ms(v: float) -> str:
    return f"{v:,.1f} ms" if v >= 1 else f"{v:.3f} ms"


def bench_table(rows: list[BenchRow]) -> str:
    """The published card's latency columns, then time to first token and the FLOP-based columns.

    The native prefill includes the last token's logits, so it is also the native TTFT.
    """
    lines = ["| Context tokens | Native prefill = TTFT | Source prefill | Warm map | Cold source+map | Mapped TTFT | "
             "Warm speedup | Cold speedup | **TTFT speedup** | TTFT speedup limit | Map GFLOP | Map efficiency |",
             "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r.context_tokens:,} | {_ms(r.native_ttft_ms)} | {_ms(r.source_prefill_ms)} | "
                     f"{_ms(r.warm_map_ms)} | {_ms(r.cold_ms)} | {_ms(r.mapped_ttft_ms)} | {r.warm_speedup:.2f}× | "
                     f"{r.cold_speedup:.2f}× | **{r.ttft_speedup:.2f}×** | {r.ttft_speedup_limit:.2f}× | "
                     f"{r.map_gflop:.4g} | {r.map_efficiency:.2f} |")
    return "\n".join(lines)


def plot_bench(rows: list[BenchRow], path: str) -> None:
    """Latency vs context (log–log) for the four timings, and both speedups."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    x = [r.context_tokens for r in rows]
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    for key, label in (("native_prefill_ms", "native prefill = TTFT"), ("source_prefill_ms", "source prefill"),
                       ("warm_map_ms", "warm map"), ("cold_ms", "cold source+map"), ("mapped_ttft_ms", "mapped TTFT")):
        a.plot(x, [getattr(r, key) for r in rows], marker="o", label=label)
    a.set(xscale="log", yscale="log", xlabel="context tokens", ylabel="ms", title="latency")
    a.legend()
    for key, label in (("warm_speedup", "warm speedup"), ("cold_speedup", "cold speedup"),
                       ("ttft_speedup", "TTFT speedup"), ("ttft_speedup_limit", "TTFT limit (FLOPs)")):
        b.plot(x, [getattr(r, key) for r in rows], marker="o", label=label)
    b.axhline(1.0, color="grey", lw=0.8)
    b.set(xscale="log", xlabel="context tokens", ylabel="× vs native prefill", title="speedup")
    b.legend()
    fig.tight_layout()
    save_figure(fig, path, dpi=120)
    plt.close(fig)
