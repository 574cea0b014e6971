"""``kvbridge fit`` and ``kvbridge plan``: fitting a mapper, and pricing a fit before it runs."""

from __future__ import annotations

import argparse

from ..core.outputs import check_output_dir, check_output_file, write_text
from ..errors import KVBridgeError
from .args import add_fit_options, add_levers, add_pair, fit_config
from .console import EPILOG, counts, log


def add_fit(p: argparse.ArgumentParser) -> None:
    """`kvbridge fit`'s options."""
    p.description = ("Capture both models' KV caches on the same texts, accumulate statistics in one pass, select "
                     "source layers and solve a closed-form affine ridge map per target layer for keys and values. "
                     "Writes an artifact folder and verifies it.")
    p.epilog = EPILOG
    add_pair(p)
    p.add_argument("--texts", required=True, help=".txt (one text per line) or .jsonl (a 'text' field per line)")
    p.add_argument("--out", required=True, help="artifact folder to write (replaced atomically if it exists)")
    add_fit_options(p)
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    add_levers(p)


def run_fit(args) -> int:
    from ..core.artifact import check_writable_artifact_dir
    from ..core.models import check_device
    from ..fit import distributed
    from ..fit.texts import read_texts

    config = fit_config(args)
    texts = read_texts(args.texts)
    out = check_output_dir(args.out)
    check_writable_artifact_dir(out)  # before minutes of fitting, not after
    device = args.device
    if distributed.launched():
        if args.target_device:
            raise KVBridgeError("under torchrun each process holds both models on its own device: drop "
                                "--target-device.")
        check_device(device)
        device = distributed.start(device)
    try:
        return _fit_and_write(args, config, texts, out, device)
    finally:
        distributed.stop()


def _fit_and_write(args, config, texts, out, device) -> int:
    from ..core.mapper import check_mapper
    from ..core.models import check_device, load_model, resolve_dtype
    from ..fit import distributed
    from ..fit.closed_form import fit_mapper

    dtype = resolve_dtype(args.dtype, device)
    if args.target_device:
        check_device(args.target_device, "--target-device")
    main_process = distributed.is_main()
    if main_process:
        log(f"loading source {args.source} and target {args.target} ({str(dtype).replace('torch.', '')}, {device})")
    source = load_model(args.source, args.source_revision, device, dtype)
    target = load_model(args.target, args.target_revision, args.target_device or device, dtype)
    mapper = fit_mapper(source, target, texts, config, progress=not args.quiet, distributed=distributed.launched(),
                        totals=args.statistics_on)
    if not main_process:
        return 0
    mapper.save_pretrained(out)
    problems = check_mapper(out)
    if problems:
        raise KVBridgeError(f"the artifact written to {out} does not verify: {'; '.join(problems)}")
    f, run = mapper.config.fit, mapper.run_report
    gib = run["peak_memory_bytes"] / 2**30
    print(f"fitted {mapper.config.num_parameters():,} parameters in {run['fit_seconds']:.1f} s "
          f"({f['observations']:,} observations, {run['observations_per_second']:,.0f} obs/s, "
          f"statistics {run['statistics_gflop_per_second']:.2f} GFLOP/s, peak memory {gib:.2f} GiB "
          f"[{run['peak_memory_kind']}])")
    for kind in ("key", "value"):
        line = f"  {kind:5s} R²: fit {f[f'{kind}_r2_fit_mean']:.4f}"
        if f"{kind}_r2_heldout_mean" in f:
            line += f", held-out {f[f'{kind}_r2_heldout_mean']:.4f}"
        print(line)
        if f[f"{kind}_r2_fit_mean"] < 0.1:
            log(f"warning: the {kind} map explains less than 10% of the target's variance (R² "
                 f"{f[f'{kind}_r2_fit_mean']:.3f}); a smaller --ridge, more --num-texts, or another pair may help.")
    print(f"saved and verified: {out}")
    return 0


def add_plan(p: argparse.ArgumentParser) -> None:
    """`kvbridge plan`'s options."""
    p.description = ("Peak memory and FLOPs of `kvbridge fit` with these options (per phase, on the host and on the "
                     "fit's device) and of a mapped prefill per context length, from the models' configs: no weights "
                     "are loaded. --source/--target take a folder, a config.json, a hub id (its config only), or a "
                     "shipped config (ministral3-3b-text, ministral3-8b-text; also their Reasoning-2512 hub ids) that "
                     "works offline.")
    p.epilog = EPILOG
    add_pair(p, "configs")
    p.add_argument("--contexts", help="runtime context lengths (default: 1024,8192,32768, those the models support)")
    p.add_argument("--batch", type=int, default=1, help="runtime batch size (default: 1)")
    p.add_argument("--processes", type=int, default=1,
                   help="fit processes on one machine (torchrun --nproc-per-node): each holds its own statistics "
                        "in host memory (default: 1)")
    p.add_argument("--json", help="also write the plan (bytes; fit_peak_bytes = the fit's peak beyond the model "
                   "weights) to this file")
    add_fit_options(p)
    add_levers(p)


def run_plan(args) -> int:
    import json

    import torch

    from ..core.models import default_dtype, resolve_dtype
    from ..measure.plan import model_shape, plan, plan_table, read_config

    config = fit_config(args)
    if config.rank is not None or config.rank_flops is not None or config.head_blocks is not None:
        raise KVBridgeError("plan does not model reduced-rank or head-blocked maps yet; plan without "
                            "--rank/--rank-flops/--head-blocks (the full maps: an upper bound on memory; `python -m "
                            "kvbridge.measure.bench_real --plan` prices their FLOPs at the Ministral-3 geometry).")
    contexts = tuple(counts(args.contexts, minimum=1)) if args.contexts is not None else None
    if args.batch < 1:
        raise KVBridgeError("--batch must be at least 1.")
    if args.json:
        check_output_file(args.json, "--json")
    try:
        kind = torch.device(args.device).type
    except RuntimeError:
        raise KVBridgeError(f"--device {args.device!r} is not a device name; use e.g. cuda, cuda:1 or cpu.") from None
    # the device is planned for, not used: it need not exist here
    dtype = str(default_dtype(kind) if args.dtype == "auto" else resolve_dtype(args.dtype, "cpu")).replace("torch.", "")
    source = model_shape(read_config(args.source, args.source_revision), args.source)
    target = model_shape(read_config(args.target, args.target_revision), args.target)
    totals = None if args.statistics_on == "auto" else args.statistics_on
    result = plan(source, target, config, args.device, dtype, contexts, args.batch, args.processes, totals)
    print(plan_table(result))
    if args.json:
        write_text(args.json, json.dumps(result, indent=2) + "\n")
    return 0
