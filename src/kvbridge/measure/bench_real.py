"""Latency at the real Ministral-3 geometry, no downloads: ``python -m kvbridge.measure.bench_real``.

Builds randomly initialised Ministral-3-3B and -8B text decoders from the text configs shipped in
``kvbridge/configs`` (26 vs 34 layers, hidden 3072 vs 4096, 8 KV heads × 128, YaRN θ=1e6 ×16,
original 16,384), a random mapper at the published artifact's geometry (top_k = 26: every target
layer reads all source layers; 1.85 B parameters), and prints the card's latency table. Random
weights are valid for timing: the work does not depend on the values. Meant for one H100/H200-class
GPU in bf16 (about 8 minutes for 64 … 16,384 tokens); ``--tiny`` shrinks the models for a CPU smoke run.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

CONFIGS = Path(__file__).parents[1] / "configs"  # kvbridge/configs


class _VocabOnly:
    """What the benchmark needs of a tokenizer (random ids, no text)."""

    def __init__(self, vocab: int):
        self.vocab, self.bos_token_id, self.eos_token_id, self.pad_token_id = vocab, 1, 2, 11
        self.all_special_ids = [0, 1, 2, 11]

    def __len__(self) -> int:
        return self.vocab


def build(name: str, device, dtype, tiny: bool):
    from transformers import Ministral3Config, Ministral3ForCausalLM

    from ..core.models import LoadedModel, ModelInfo
    from ..core.rope import rope_spec

    data = json.loads((CONFIGS / f"{name}.json").read_text())
    if tiny:  # same structure, CPU-sized
        data.update(hidden_size=data["hidden_size"] // 32, intermediate_size=data["intermediate_size"] // 32,
                    num_hidden_layers=max(2, data["num_hidden_layers"] // 8), num_attention_heads=4,
                    num_key_value_heads=2, head_dim=16, vocab_size=512)
    config = Ministral3Config(**{k: v for k, v in data.items() if k not in ("architectures", "model_type")})
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = Ministral3ForCausalLM(config).eval()
    finally:
        torch.set_default_dtype(previous)
    info = ModelInfo(f"random:{name}", None, "Ministral3ForCausalLM", config.num_hidden_layers,
                     config.num_key_value_heads, config.head_dim, config.max_position_embeddings, rope_spec(model),
                     "random-weights")
    return LoadedModel(model=model, tokenizer=_VocabOnly(config.vocab_size), info=info)


def published_config(source_info, target_info, levers: bool, source_hidden: int = 0, lever_inputs: str | None = None,
                     top_k: int | None = None, rank_fraction: float | None = None, head_blocks: int | None = None,
                     source_depth: int | None = None):
    """The published artifact's geometry (top_k = 26: every target layer reads all source layers), with or
    without ``kvbridge fit``'s default levers on the last target layer (which layer a real fit picks depends
    on the data; the cost does not). ``lever_inputs`` replaces the default's (e.g. "kvs"). Fast maps: ``top_k``
    source layers a plain map (the last ones: the cost depends on the count only); ``rank_fraction``: every layer
    without levers factored through the rank that costs this share of its full map's FLOPs; ``head_blocks``: every
    layer without levers split into that many blocks of KV heads (the head count: head-matched); ``source_depth``:
    every map reads the first that many source layers only (the source's prefill stops there)."""
    from dataclasses import replace

    from ..core.mapper_config import MapperConfig
    from ..fit.config import FitConfig

    all_layers = tuple(range(source_info.num_layers if source_depth is None else source_depth))
    chosen_layers = all_layers if top_k is None else all_layers[-min(top_k, len(all_layers)):]
    selection = {kind: [chosen_layers] * target_info.num_layers for kind in ("key", "value")}
    chosen = ()
    d = FitConfig() if lever_inputs is None else replace(FitConfig(), lever_inputs=lever_inputs)
    if levers and d.has_levers:
        last = target_info.num_layers - 1
        chosen = tuple(d.lever(kind, last, source_hidden) for kind in d.lever_kinds)
        if d.lever_top_k is not None:  # the lever layer reads its best lever_top_k source layers (here: the last)
            for kind in d.lever_kinds:
                selection[kind][last] = all_layers[-min(d.lever_top_k, len(all_layers)):]
    selection = {kind: tuple(layers) for kind, layers in selection.items()}
    ranks = {}
    if rank_fraction is not None:
        lever_layers = {v.layer for v in chosen}
        ft, fs = target_info.kv_features, source_info.kv_features
        ranks = {kind: tuple(0 if l in lever_layers else max(1, int(rank_fraction * (len(layers) * fs) * ft
                                                                    // (len(layers) * fs + ft)))
                             for l, layers in enumerate(selection[kind])) for kind in selection}
    heads = {}
    if head_blocks is not None:
        lever_layers = {v.layer for v in chosen}
        heads = {kind: tuple(1 if l in lever_layers else head_blocks for l in range(target_info.num_layers))
                 for kind in selection}
    from ..core.mapper_config import RuntimeOptions

    runtime = RuntimeOptions()
    if levers:  # kvbridge fit's runtime defaults too: hold-back, selective recompute (a source-logit criterion)
        runtime = RuntimeOptions(hold_back=d.hold_back, recompute=d.recompute, recompute_by=d.recompute_by,
                                 sink=d.sink, recompute_window=d.recompute_window)
    return MapperConfig(source=source_info, target=target_info, selection=selection, fit={"kind": "random"},
                        levers=chosen, ranks=ranks, heads=heads, runtime=runtime)


def random_mapper(source, target, device, dtype, levers: bool = False, **fast):
    """Random weights at the published geometry (``levers``: at kvbridge fit's defaults, source layers included
    and its runtime options; ``fast``: :func:`published_config`'s top_k, rank_fraction, head_blocks, source_depth)."""
    from ..core.mapper import Mapper
    from ..core.mapper_config import keeps_dtype
    from ..core.models import source_hidden_size
    from ..fit.config import FitConfig

    if levers and "top_k" not in fast:
        fast["top_k"] = FitConfig().top_k
    config = published_config(source.info, target.info, levers, source_hidden_size(source.model), **fast)
    weights = {}
    for name, shape in config.weight_shapes().items():  # matrices scaled to keep activations O(1); never zeros
        scale = shape[-2] ** -0.5 if len(shape) >= 2 else 0.01
        weights[name] = torch.randn(shape, device=device, dtype=torch.float32 if keeps_dtype(name) else dtype) * scale
    return Mapper(config, weights)


def _published_infos():
    """ModelInfo and config of Ministral-3 3B and 8B (text) from the shipped configs."""
    from transformers import Ministral3Config

    from ..core.models import ModelInfo
    from ..core.rope import RopeSpec

    infos, configs = {}, {}
    for name in ("ministral3-3b-text", "ministral3-8b-text"):
        data = json.loads((CONFIGS / f"{name}.json").read_text())
        config = Ministral3Config(**{k: v for k, v in data.items() if k not in ("architectures", "model_type")})
        rope = RopeSpec("ministral3", config.rope_parameters["rope_type"], config.head_dim,
                        dict(config.rope_parameters))
        infos[name] = ModelInfo(name, None, "Ministral3ForCausalLM", config.num_hidden_layers,
                                config.num_key_value_heads, config.head_dim, config.max_position_embeddings, rope,
                                "plan")
        configs[name] = config
    return infos, configs


def resident_line(device: str = "cpu") -> str:
    """Build the plain published mapper as ``from_pretrained`` does — tensors arrive one at a time (zeros here,
    float32 as on disk) and are written into their group buffers in bfloat16 — and report what it holds and,
    on CPU, the process's peak resident memory (torch and Python included)."""
    import resource

    from ..core.mapper import Mapper, assemble

    infos, _ = _published_infos()
    config = published_config(infos["ministral3-3b-text"], infos["ministral3-8b-text"], levers=False)
    shapes = config.weight_shapes()
    mapper = Mapper(config, assemble(config, lambda name: torch.zeros(shapes[name]), device, torch.bfloat16))
    n = config.num_parameters()
    peak = (f"; process peak RSS {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20:.2f} GiB"
            if torch.device(device).type == "cpu" else "")
    return (f"plain mapper at the Ministral-3 3B→8B geometry in bfloat16 on {device}: {n / 1e9:.3f} B parameters, "
            f"resident {mapper.resident_bytes / 1e9:.2f} GB (parameters × 2 bytes = {2 * n / 1e9:.2f} GB){peak}")


def plan_table() -> str:
    """Parameters, size and FLOPs per token of the plain published geometry, of it with kvbridge fit's default
    levers, and of kvbridge fit's defaults (source layers included).

    From the shipped configs alone: no weights are built.
    """
    from ..fit.config import FitConfig
    from .bench import map_flops, prefill_flops

    infos, configs = _published_infos()
    source, target = infos["ministral3-3b-text"], infos["ministral3-8b-text"]
    per_token_8b = prefill_flops(configs["ministral3-8b-text"], 1, 0)
    lines = ["| Mapper at the Ministral-3 3B→8B geometry | Parameters | float32 | bfloat16 | Map GFLOP/token | "
             "÷ 8B's own GFLOP/token |", "|---|---:|---:|---:|---:|---:|"]
    top_k = FitConfig().top_k
    rows = (("plain (the published artifact's: every source layer)", False, None, None),
            ("the same + kvbridge fit's default levers", True, None, None),
            ("the same with the source's state (--lever-inputs kvs)", True, "kvs", None),
            (f"kvbridge fit's defaults (top-k {top_k or 'all'}, levers)", True, None, top_k))
    for label, levers, inputs, top in rows:
        config = published_config(source, target, levers, configs["ministral3-3b-text"].hidden_size, inputs,
                                  top_k=top)
        n, f = config.num_parameters(), map_flops(config, 1)
        lines.append(f"| {label} | {n / 1e9:.3f} B | {4 * n / 1e9:.2f} GB | {2 * n / 1e9:.2f} GB | {f / 1e9:.3f} | "
                     f"{f / per_token_8b:.3f} |")
        if levers:
            lines.append(f"| levers: {', '.join(str(v.to_dict()) for v in config.levers)} | | | | | |")
    lines += ["", ttft_limit_table(source, target, configs)]
    return "\n".join(lines)


def ttft_limit_table(source, target, configs, lengths=(1024, 8192)) -> str:
    """The TTFT speed-up limit (a native prefill's FLOPs ÷ the mapped path's) at the published geometry, for
    the plain map and for kvbridge fit's defaults (levers, selective recompute, hold-back)."""
    from ..fit.config import FitConfig
    from .bench import path_flops, prefill_flops

    d = FitConfig()
    src, tgt = configs["ministral3-3b-text"], configs["ministral3-8b-text"]
    defaults = dict(hold_back=d.hold_back, recompute=d.recompute, sink=d.sink, recompute_by=d.recompute_by)
    top = "every source layer" if d.top_k is None else f"top-k {d.top_k}"
    name = (f"kvbridge fit's defaults ({top}, levers, recompute {d.recompute:g} by {d.recompute_by}, hold-back "
            f"{d.hold_back})")
    plain = dict(hold_back=1)
    rows = (("plain (the published artifact's: every source layer)", False, plain, {}),
            ("plain, top-k 4", False, plain, dict(top_k=4)),
            ("plain, top-k 1", False, plain, dict(top_k=1)),
            ("plain, rank at 25 % of the FLOPs", False, plain, dict(rank_fraction=0.25)),
            ("plain, head-matched (8 KV heads: head h → head h)", False, plain, dict(head_blocks=8)),
            ("plain, top-k 1 + the target's first 4 layers native (`--native-layers 4`)", False,
             dict(plain, native_layers=4), dict(top_k=1)),
            ("plain, top-k 1 of the first 6 source layers + the target's first 17 native (the deep family's "
             "shares)", False, dict(plain, native_layers=17), dict(top_k=1, source_depth=6)),
            (name, True, defaults, dict(top_k=d.top_k)),
            ("the same, top-k 4", True, defaults, dict(top_k=4)),
            ("the same, every source layer", True, defaults, {}),
            ("the same, every source layer at rank 25 % of the FLOPs", True, defaults, dict(rank_fraction=0.25)),
            ("the same, every source layer head-matched", True, defaults, dict(head_blocks=8)))
    lines = ["| Mapped path at the Ministral-3 3B→8B geometry | Map GFLOP/token | " + " | ".join(
        f"TTFT FLOP limit @{n:,}" for n in lengths) + " |", "|---|---:|" + "---:|" * len(lengths)]
    from .bench import map_flops

    for label, levers, options, fast in rows:
        config = published_config(source, target, levers, src.hidden_size, **fast)
        limits = [prefill_flops(tgt, n, 1) / path_flops(src, tgt, config, n, **options) for n in lengths]
        lines.append(f"| {label} | {map_flops(config, 1) / 1e9:.3f} | " + " | ".join(f"{x:.2f}×" for x in limits)
                     + " |")
    return "\n".join(lines)


def published_fit(texts: int, seq_len: int, stride: int, batch_size: int = 4):
    """The published fit's settings: every source layer for every target layer, ridge 0.01, no levers."""
    from ..fit.config import FitConfig

    return FitConfig(num_texts=texts, seq_len=seq_len, stride=stride, batch_size=batch_size, heldout_texts=0,
                     top_k=None, lags=(0,), lever_inputs="same", mlp_hidden=0, recompute=0.0)


def fit_report(device: str, dtype: torch.dtype, tiny: bool, texts: int, seq_len: int, stride: int,
               batch_size: int = 4, totals: str = "auto", models=None) -> dict:
    """The plain published fit (:func:`published_fit`) on random models and random token ids: capture and solve
    times, where the statistics lived, and the measured peak beside the plan's for that choice. The models are
    counted in neither (``models``: the (source, target) already built, else built here)."""
    from ..fit.closed_form import solve
    from ..fit.stats import collect_statistics, statistics_bytes, totals_device
    from .plan import Phase, device_peak, measured_peak, model_shape, plan

    source, target = models or (build("ministral3-3b-text", device, dtype, tiny),
                                build("ministral3-8b-text", device, dtype, tiny))
    config = published_fit(texts, seq_len, stride, batch_size)
    ids = torch.randint(12, source.tokenizer.vocab, (texts, seq_len), generator=torch.Generator().manual_seed(0))
    name = str(dtype).replace("torch.", "")
    shapes = model_shape(source.model.config), model_shape(target.model.config)
    fx, fy = (m.layers * m.kv_features for m in shapes)
    device_plan = plan(*shapes, config, device, name, totals="device")
    transient = max(Phase(**p).device for p in device_plan["fit_phases"][:2]) - statistics_bytes(fx, fy)
    where = totals_device(totals, torch.device(device), fx, fy, transient)
    side = "device" if where.type != "cpu" and torch.device(device).type != "cpu" else "host"

    def fit():
        start = time.perf_counter()
        stats = collect_statistics(source, target, ids, stride, batch_size, progress=False,
                                   totals="device" if side == "device" else "cpu")
        _sync(device)
        captured = time.perf_counter()
        _, _, report = solve(stats, source.info, target.info, None, config.ridge, device)
        _sync(device)
        return captured - start, time.perf_counter() - captured, report

    (capture_s, solve_s, report), measured = measured_peak(fit, device)
    planned = plan(*shapes, config, device, name, totals=side)
    predicted = device_peak([Phase(**p) for p in planned["fit_phases"]], device, ("capture", "solve"))
    return {"device": device, "dtype": name, "tiny": tiny, "texts": texts, "seq_len": seq_len, "stride": stride,
            "statistics_on": side, "capture_s": capture_s, "solve_s": solve_s, "key_r2": report["key"]["r2_fit_mean"],
            "measured_peak_bytes": measured, "planned_peak_bytes": predicted,
            "measured_over_planned": measured / predicted}


def fit_lines(report: dict) -> list[str]:
    """:func:`fit_report` as text."""
    r = report
    cpu = torch.device(r["device"]).type == "cpu"
    return [
        f"fit at the {'tiny' if r['tiny'] else 'Ministral-3 3B→8B'} geometry on {r['device']} ({r['dtype']}, random "
        f"weights and ids): {r['texts']} × {r['seq_len']} tokens, stride {r['stride']}, every source layer for every "
        f"target layer; statistics on the {r['statistics_on']}",
        f"  capture {r['capture_s']:.1f} s, solve {r['solve_s']:.1f} s, "
        f"together {r['capture_s'] + r['solve_s']:.1f} s; "
        f"key R² {r['key_r2']:.3f}",
        f"  peak beyond the models: measured {r['measured_peak_bytes'] / 2**30:.3f} GiB "
        f"({'tensor-bytes account, host and device' if cpu else 'CUDA allocator'}), planned "
        f"{r['planned_peak_bytes'] / 2**30:.3f} GiB (kvbridge plan: capture and solve), measured/planned "
        f"{r['measured_over_planned']:.2f}",
    ]


def _sync(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def main(argv=None) -> None:
    from ..core.outputs import check_output_file, write_text
    from ..core.transfer import Bridge
    from .bench import bench_table, device_name, run_bench

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    parser.add_argument("--contexts", default="64,512,1024,2048,4096,8192,16384")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--trials", type=int, default=7)
    parser.add_argument("--chunk-tokens", type=int, default=4096,
                        help="tokens mapped per GEMM (bounds transient memory)")
    parser.add_argument("--json", help="write the rows here")
    parser.add_argument("--tiny", action="store_true", help="CPU-sized models of the same structure (smoke test)")
    parser.add_argument("--levers", action="store_true",
                        help="time a mapper at kvbridge fit's defaults (its source layers a map and levers) instead "
                             "of the plain published one")
    parser.add_argument("--plan", action="store_true",
                        help="only print parameters, size and FLOPs per token of the plain and levered mappers")
    parser.add_argument("--fit", action="store_true",
                        help="only fit the plain published map on random models and ids (--fit-texts × --fit-seq-len "
                             "tokens) and print its time and peak memory beside kvbridge plan's")
    parser.add_argument("--fit-texts", type=int, default=500, help="calibration sequences for --fit (default: 500)")
    parser.add_argument("--fit-seq-len", type=int, default=1024, help="tokens per sequence for --fit (default: 1024)")
    parser.add_argument("--fit-stride", type=int, default=4, help="observe every S-th token for --fit (default: 4)")
    parser.add_argument("--statistics-on", choices=("auto", "device", "host"), default="auto",
                        help="where --fit keeps its float64 statistics (default: auto, the GPU when they fit)")
    parser.add_argument("--resident", action="store_true",
                        help="only build the plain published mapper (zero weights, bfloat16, on --device) and print "
                             "the memory it holds (about 7.4 GB at peak while it is built)")
    args = parser.parse_args(argv)
    if args.plan:
        print(plan_table())
        return
    if args.resident:
        print(resident_line(args.device))
        return
    if args.fit:
        print("\n".join(fit_lines(fit_report(args.device, getattr(torch, args.dtype), args.tiny, args.fit_texts,
                                             args.fit_seq_len, args.fit_stride, totals=args.statistics_on))))
        return
    if args.json:
        check_output_file(args.json, "--json")
    dtype = getattr(torch, args.dtype)
    start = time.perf_counter()
    source = build("ministral3-3b-text", args.device, dtype, args.tiny)
    target = build("ministral3-8b-text", args.device, dtype, args.tiny)
    mapper = random_mapper(source, target, args.device, dtype, levers=args.levers)
    bridge = Bridge(source, target, mapper, chunk_tokens=args.chunk_tokens)
    params = mapper.config.num_parameters()
    where = device_name(torch.device(args.device))
    print(f"{where}; {args.dtype}; random weights at the published geometry"
          f"{' (tiny)' if args.tiny else ''}; mapper {params / 1e9:.3f} B parameters, resident "
          f"{mapper.resident_bytes / 1e9:.2f} GB; built in {time.perf_counter() - start:.0f} s\n", flush=True)
    contexts = [int(c) for c in args.contexts.split(",")]
    rows = run_bench(bridge, contexts, args.warmup, args.trials)
    print(bench_table(rows))
    for r in rows:
        print(f"peak memory at {r.context_tokens:,} tokens: native {r.peak_memory_native_bytes / 2**30:.2f} GiB, "
              f"source+map {r.peak_memory_cold_bytes / 2**30:.2f} GiB")
    if args.json:
        write_text(args.json, json.dumps({"device": where, "dtype": args.dtype, "tiny": args.tiny,
                                               "rows": [r.to_dict() for r in rows]}, indent=2) + "\n")
    print(f"\ntotal {time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
    main()
