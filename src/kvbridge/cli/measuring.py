"""The commands that measure a mapper or run it: ``kvbridge generate``, ``demo``, ``frontier``, ``bench``, ``eval``,
``gap``, ``diagnose`` and ``lm-eval``."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from ..core.outputs import check_output_dir, write_text
from ..errors import KVBridgeError
from ..family import describe
from .args import FAMILY_NAMES, add_mapper, add_pair, int_list, windows
from .console import EPILOG, check_results, clip, counts, require


def add_generate(p: argparse.ArgumentParser) -> None:
    """`kvbridge generate`'s options."""
    p.description = ("The source prefills the prompt except its last token(s), the mapper builds the target's cache, "
                     "the target generates.")
    p.epilog = EPILOG
    add_pair(p)
    add_mapper(p)
    p.add_argument("--prompt", required=True, action="append",
                   help="prompt text; repeat for a batch of prompts (different lengths are fine)")
    p.add_argument("--max-new-tokens", type=int, default=32, help="tokens to generate (default: 32)")
    p.add_argument("--hold-back", type=int, default=None,
                   help="last prompt tokens the target reads itself (default: the artifact's runtime option)")
    p.add_argument("--sample", action="store_true", help="sample instead of greedy decoding")
    p.add_argument("--temperature", type=float, help="sampling temperature (with --sample; default: 0.7)")
    p.add_argument("--top-p", type=float, help="nucleus sampling (with --sample; default: 0.95)")
    p.add_argument("--seed", type=int, default=0, help="random seed for --sample (default: 0)")
    p.add_argument("--compare", action="store_true", help="also run native target prefill and show both with timings")


def run_generate(args) -> int:
    import torch


    if args.max_new_tokens < 1:
        raise KVBridgeError("--max-new-tokens must be at least 1.")
    if not 0 <= args.seed < 2**63:
        raise KVBridgeError(f"--seed must be an integer from 0 to 2**63 - 1, not {args.seed}.")
    if not args.sample and (args.temperature is not None or args.top_p is not None):
        raise KVBridgeError("--temperature and --top-p apply to sampling only: add --sample, or drop them for greedy "
                            "decoding.")
    bridge = _bridge(args)
    kwargs = {}
    if args.sample:
        kwargs = {"do_sample": True, "temperature": 0.7 if args.temperature is None else args.temperature,
                  "top_p": 0.95 if args.top_p is None else args.top_p}
    runs = ["native", "mapped"] if args.compare else ["mapped"]
    results = {}
    for mode in runs:
        torch.manual_seed(args.seed)
        results[mode] = bridge.generate(args.prompt, mode=mode, max_new_tokens=args.max_new_tokens, **kwargs)
    for i, prompt in enumerate(args.prompt):
        print(f"=== prompt {i}: {clip(prompt, 70)!r}")
        for mode in runs:
            g = results[mode]
            held, total = g.held_back, g.prefilled[i] + g.held_back
            label = ("target prefills itself" if mode == "native" else
                     f"the source prefilled {g.prefilled[i]} of {total} prompt tokens → mapper → target, which read "
                     f"the last {held} itself")
            print(f"--- {mode} ({label}), {g.seconds * 1000:.1f} ms for the batch")
            if mode == "mapped" and held < bridge.hold_back:
                print(f"    note: hold-back {bridge.hold_back} was asked for, but the batch's shortest prompt has "
                      f"{held + 1} tokens: the target read {held} itself")
            if mode == "mapped" and g.prefilled[i] * 2 < total:
                print(f"    note: less than half of this prompt was mapped ({g.prefilled[i]} of {total} tokens): "
                      "the answer is mostly the target's own")
            print(g.texts[i].strip() or "(empty)")
        if args.compare:
            a, b = results["native"].token_ids[i], results["mapped"].token_ids[i]
            same = sum(x == y for x, y in zip(a, b))
            first = next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), None)
            where = "identical" if first is None and len(a) == len(b) else f"first difference at token {first}"
            print(f"--- agreement: {same}/{max(len(a), len(b))} tokens, {where}")
    return 0


def _bridge(args):
    from ..core.transfer import Bridge

    return Bridge.from_pretrained(
        args.source, args.target, args.mapper, source_revision=args.source_revision,
        target_revision=args.target_revision, mapper_revision=args.mapper_revision, device=args.device,
        dtype=args.dtype, mapper_device=args.mapper_device, target_device=args.target_device,
        hold_back=getattr(args, "hold_back", None), recompute=getattr(args, "recompute", None),
        allow_revision_mismatch=args.allow_revision_mismatch)


def add_demo(p: argparse.ArgumentParser) -> None:
    """`kvbridge demo`'s options."""
    p.description = ("Runs offline on the two small models shipped with kvbridge: loads the recommended mapper and "
                     "the plain map shipped with them as verified artifacts (--refit fits both on the calibration "
                     "split), saves and verifies the recommended one, compares native and mapped continuations on "
                     "held-out prompts, then prints the retention table (perplexity, 4-way cloze, in-context recall) "
                     "and the latency table. All figures are CPU.")
    p.add_argument("--out", help="keep the artifact (OUT/mapper) and every figure (OUT/demo.json) here")
    p.add_argument("--quick", action="store_true", help="a reduced run for smoke tests (seconds, not minutes)")
    p.add_argument("--refit", action="store_true",
                   help="fit the recommended mapper and the plain map again instead of loading the shipped ones "
                        "(about four more minutes on 2 cores; the same bytes)")
    p.add_argument("--quiet", action="store_true", help="no progress bars")
    p.add_argument("--family", choices=FAMILY_NAMES, default="default",
                   help=f"the embedded family ({describe()}; only default ships a mapper, for the others the "
                        "demo fits one)")


def run_demo(args) -> int:
    from ..measure.demo import run_demo

    run_demo(out=args.out, quick=args.quick, progress=not args.quiet, refit=args.refit, name=args.family)
    return 0


def add_frontier(p: argparse.ArgumentParser) -> None:
    """`kvbridge frontier`'s options."""
    p.description = ("Fits mappers over a grid of lever settings (plain map, lagged features, residual MLP, tuning on "
                     "the target's output, selective recompute, hold-back, a blind recompute as a control), measures "
                     "each on the family tasks and its time to first token against native at each context length "
                     "(256, 1,024, 2,048), and writes OUT/frontier.json, frontier.md and frontier.png with the Pareto "
                     "front and the recommended point at one length (--at; the fastest whose speed-up clears 1.5x by "
                     "its own timing noise and whose validation retention ties the best, by a paired bootstrap). "
                     "Retention is capped at 100 percent per task. Without --source/--target it runs on the embedded "
                     "family.")
    p.epilog = EPILOG
    p.add_argument("--out", required=True, help="folder for frontier.json, frontier.md, frontier.png")
    p.add_argument("--source", help="source model (default: the embedded family's)")
    p.add_argument("--target", help="target model (default: the embedded family's)")
    p.add_argument("--family", choices=FAMILY_NAMES, default=None,
                   help=f"which embedded family without --source/--target (default: default; {describe()}); "
                        "it sets the default grid")
    p.add_argument("--texts", help="calibration .txt/.jsonl (default: the family's calibration split)")
    p.add_argument("--heldout", help="held-out .txt/.jsonl for the tasks (default: the family's held-out split)")
    p.add_argument("--device", default="cpu", help="device of both models (default: cpu)")
    p.add_argument("--grid", default=None,
                   choices=["full", "extended", "tuning", "values", "deep", "deep-levers", "deep-bottleneck",
                            "deep-native", "layers", "quick"],
                   help="full: the levers worth their cost and a blind-recompute control (about 36 minutes on 2 CPU "
                        "cores); extended: also those that did not make it, for the record (hours); tuning: what "
                        "tuning on the target's output and the repeated spans each buy; values: what a lever on the "
                        "same layer's values buys (each about as long as full); deep: fast maps (top-k, reduced "
                        "rank, head-matched) against full ones; deep-levers: the deep family's fits with residual "
                        "MLPs again (run it with another --seed) beside larger recompute shares, two source layers a "
                        "map and the source's hidden state (about an hour); deep-bottleneck: levers on the keys and "
                        "values of the deep family's worst layer, and with a wider MLP (about 35 minutes); "
                        "deep-native: the deep target's first four layers computed natively (--native-layers 4), the "
                        "map filling the rest from the source's first one, two or four layers, beside a control "
                        "that fills them with the maps' means; layers: "
                        "one source layer a map against every one, plain and with the levers; quick: a smoke test "
                        "(default: full; deep with --family deep, layers with --family deep-pruned)")
    p.add_argument("--quick", action="store_true", help="same as --grid quick")
    p.add_argument("--at", type=int, default=None, metavar="TOKENS",
                   help="the context length the recommendation is made and headlined at, one of the grid's lengths "
                        "(default: the longest, 2,048; quick: 256)")
    p.add_argument("--items", type=int, default=None, metavar="N",
                   help="held-out rows per length (default: the grid's, 48; quick: 8); when too few documents are "
                        "that long, documents packed end to end. More rows narrow every interval: a small "
                        "difference, such as the target's lead over the source on cloze, needs more than 48")
    p.add_argument("--seed", type=int, default=None,
                   help="seed of every fit (residual MLPs and their samples; default: the grid's, 0): rerun with "
                        "another seed to see how much of a difference between points is the fit's chance")
    p.add_argument("--quiet", action="store_true", help="no progress bars")


def run_frontier(args) -> int:
    from dataclasses import replace

    from .. import family
    from ..core.models import load_model
    from ..fit.texts import read_texts
    from ..measure.frontier import FAMILY_GRIDS, GRIDS, frontier_table, run_frontier

    if bool(args.source) != bool(args.target):
        raise KVBridgeError("give both --source and --target, or neither (the embedded family).")
    if args.source and args.family:
        raise KVBridgeError("give --family or --source/--target, not both.")
    if args.source and not (args.heldout and args.texts):
        raise KVBridgeError("with your own pair give --texts (calibration) and --heldout (texts the models were "
                            "not calibrated on); the embedded family's texts would not fit another tokenizer.")
    check_output_dir(args.out)
    require("matplotlib", "plot", "kvbridge frontier (frontier.png)")  # fail now, not after minutes
    if args.source:
        source, target = load_model(args.source, device=args.device), load_model(args.target, device=args.device)
    else:
        source, target = family.load_family(device=args.device, name=args.family or "default")
    calibration = read_texts(args.texts) if args.texts else family.calibration_texts()
    heldout = read_texts(args.heldout) if args.heldout else family.heldout_texts()
    grid = GRIDS["quick" if args.quick else args.grid or FAMILY_GRIDS.get(args.family, "full")]
    if args.seed is not None:
        grid = replace(grid, fit=replace(grid.fit, seed=args.seed))  # FitConfig checks the seed's range
    if args.at is not None:
        if args.at not in grid.lengths:
            raise KVBridgeError(f"--at {args.at}: the grid measures {', '.join(map(str, grid.lengths))} tokens; "
                                "give one of them.")
        grid = replace(grid, choose_at=args.at)
    if args.items is not None:
        grid = replace(grid, items=args.items)
    report = run_frontier(source, target, calibration, heldout, grid, args.out, progress=not args.quiet)
    print()
    print(frontier_table(report))
    print(f"\nwritten: {Path(args.out) / 'frontier.json'}, frontier.md, frontier.png ({report['seconds']:.0f} s)")
    return 0


def add_bench(p: argparse.ArgumentParser) -> None:
    """`kvbridge bench`'s options."""
    p.description = ("Times native target prefill, source prefill, warm map and cold source+map per context length "
                     "(warm-ups, then trials; medians), with the map's FLOPs, its efficiency against plain matmul and "
                     "the FLOP-bound cold speedup.")
    p.epilog = EPILOG
    add_pair(p)
    add_mapper(p)
    p.add_argument("--contexts", default="64,512,1024",
                   help="comma-separated context lengths (default: 64,512,1024)")
    p.add_argument("--warmup", type=int, default=2, help="untimed runs first (default: 2)")
    p.add_argument("--trials", type=int, default=7, help="timed runs; the median is reported (default: 7)")
    p.add_argument("--batch", type=int, default=1, help="prompts per batch (default: 1)")
    p.add_argument("--json", help="write every row (timings, FLOPs, efficiency, memory) to this file")
    p.add_argument("--plot", help="write a PNG: latency vs context (log-log) and speedups")


def run_bench(args) -> int:
    import json

    from ..measure.bench import bench_table, device_name, plot_bench, run_bench

    contexts = counts(args.contexts, minimum=2)  # one token is the held-back one: nothing to map
    if args.trials < 1 or args.warmup < 0 or args.batch < 1:
        raise KVBridgeError("--trials must be >= 1, --warmup >= 0, --batch >= 1.")
    check_results(args, "kvbridge bench")
    bridge = _bridge(args)
    limit = bridge.target.info.max_positions
    if limit and max(contexts) > limit:
        raise KVBridgeError(f"context {max(contexts)} exceeds the target's {limit} positions; drop it from --contexts.")
    rows = run_bench(bridge, contexts, args.warmup, args.trials, args.batch)
    device = bridge.target.device
    where = device_name(device)
    print(f"{where}, {str(next(bridge.target.model.parameters()).dtype).replace('torch.', '')}, batch {args.batch}, "
          f"{args.warmup} warm-ups, median of {args.trials} trials\n")
    print(bench_table(rows))
    if args.json:
        write_text(args.json, json.dumps({"device": where, "rows": [r.to_dict() for r in rows]}, indent=2) + "\n")
    if args.plot:
        plot_bench(rows, args.plot)
    return 0


def add_eval(p: argparse.ArgumentParser) -> None:
    """`kvbridge eval`'s options."""
    p.description = ("Runs lm-evaluation-harness once per mode through the registered `kvbridge` model and prints "
                     "task, native, mapped, raw and floor-normalized retention (floors: 25% for 4-way tasks, 50% "
                     "WinoGrande, 0 GSM8K), with a mean row. Needs `pip install \"kvbridge[eval]\"`. Offline tasks "
                     "shipped with kvbridge: kvbridge_family_cloze, kvbridge_family_recall.")
    p.epilog = EPILOG
    add_pair(p)
    add_mapper(p)
    p.add_argument("--tasks", default="arc_challenge,hellaswag,winogrande,mmlu,gsm8k_cot",
                   help="comma-separated lm-eval tasks (default: the published card's five)")
    p.add_argument("--num-fewshot", type=int, help="few-shot examples for every task (default: each task's own)")
    p.add_argument("--protocol", choices=["default", "card"], default="default",
                   help="card: the published card's protocol (MMLU 5-shot, GSM8K 8-shot chain of thought, "
                        "ARC/HellaSwag/WinoGrande 0-shot); default: each task's own few-shot setting")
    p.add_argument("--rolling-chunk", type=int, default=256,
                   help="perplexity tasks: tokens scored per chunk, each after the text before it (default: 256)")
    p.add_argument("--limit", type=float, help="at most N documents per task (or a fraction < 1)")
    p.add_argument("--batch-size", type=int, default=8, help="requests per forward pass (default: 8)")
    p.add_argument("--with-source", action="store_true", help="also run the source alone")
    p.add_argument("--out", help="folder for results.json (full lm-eval output) and table.md")


def run_eval(args) -> int:
    import json
    import os

    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    require("lm_eval", "eval", "kvbridge eval")
    from ..measure.lm_eval_tasks import eval_table, fewshot_plan, metric_rows, run_lm_eval

    tasks = [t.strip() for t in args.tasks.split(",") if t.strip()]
    if not tasks:
        raise KVBridgeError("--tasks is empty.")
    if args.limit is not None and not 0 < args.limit < float("inf"):
        raise KVBridgeError(f"--limit must be a number of documents >= 1 or a fraction in (0, 1), not {args.limit}.")
    if args.batch_size < 1 or (args.num_fewshot is not None and args.num_fewshot < 0) or args.rolling_chunk < 2:
        raise KVBridgeError("--batch-size must be >= 1, --num-fewshot >= 0 and --rolling-chunk >= 2.")
    limit = None if args.limit is None else (int(args.limit) if args.limit >= 1 else args.limit)
    fewshot = fewshot_plan(tasks, args.protocol, args.num_fewshot)
    if args.out:
        check_output_dir(args.out)
    bridge = _bridge(args)
    modes = ("native", "mapped") + (("source",) if args.with_source else ())
    try:
        results = run_lm_eval(bridge, tasks, modes, fewshot, limit, args.batch_size, rolling_chunk=args.rolling_chunk)
    except KeyError as exc:
        raise KVBridgeError(f"lm-eval does not know task {exc}; check --tasks (lm-eval ls tasks).") from None
    rows = metric_rows(results, tasks)
    table = eval_table(rows, args.protocol)
    print(table)
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        from ..measure.bench import device_name

        payload = {"protocol": {"name": args.protocol, "num_fewshot": fewshot}, "rows": rows,
                   "device": device_name(bridge.target.device),
                   "dtype": str(next(bridge.target.model.parameters()).dtype).replace("torch.", ""),
                   "native_fallbacks": results["mapped"]["kvbridge"],
                   "lm_eval": {m: {k: r[k] for k in ("results", "versions", "n-shot", "config", "kvbridge")
                                   if k in r} for m, r in results.items()}}
        write_text(out / "results.json", json.dumps(payload, indent=2, default=str) + "\n")
        write_text(out / "table.md", table + "\n")
        print(f"\nwritten: {out / 'results.json'}, {out / 'table.md'}")
    return 0


def add_gap(p: argparse.ArgumentParser) -> None:
    """`kvbridge gap`'s options."""
    p.description = ("Measures, per context length, perplexity and cloze (native, mapped, source alone) with gap "
                     "recovered = (mapped - source) / (native - source) and its paired bootstrap interval over "
                     "documents; free generation (greedy continuations' agreement with native, first divergence, "
                     "distinct 4-grams) and a span stated far back, written (exact match), for mapped and for the "
                     "source alone; and time to first token, native vs mapped, at the same length. Texts: the "
                     "third-party Python shipped with the family (validation packages to choose settings, held-out "
                     "packages to report), or --texts FILE. CPU figures on CPU.")
    p.epilog = EPILOG
    add_pair(p)
    add_mapper(p, required=False, default_help=" (default: the family's shipped mapper, with --family default)")
    p.add_argument("--split", choices=("validation", "heldout"), default="heldout",
                   help="which third-party packages: validation to choose settings on, heldout to report "
                        "(default: heldout)")
    p.add_argument("--kind", choices=("code", "prose"), default="code",
                   help="their Python (code) or their READMEs (prose) (default: code)")
    p.add_argument("--texts", help="a .txt or .jsonl file of your own texts instead")
    p.add_argument("--lengths", type=int_list, default=(1024, 2048),
                   help="context lengths in tokens, comma-separated (default: 1024,2048)")
    p.add_argument("--items", type=int, default=48, help="rows per length, one per document (default: 48)")
    p.add_argument("--new-tokens", type=int, default=48, help="greedy tokens per continuation (default: 48)")
    p.add_argument("--tasks", default="perplexity,cloze,recall,continuation",
                   help="comma-separated subset of perplexity, cloze, recall, continuation (default: all)")
    p.add_argument("--hold-back", type=int, help="override the mapper's hold-back (last prompt tokens the target "
                   "reads itself)")
    p.add_argument("--recompute", type=float, help="override the mapper's selective recompute share (0-1)")
    p.add_argument("--no-ttft", action="store_true", help="skip the time-to-first-token measurement")
    p.add_argument("--batch-size", type=int, default=8, help="rows per forward pass (default: 8)")
    p.add_argument("--out", help="folder for gap.json and gap.md")
    p.add_argument("--table", metavar="GAP_JSON",
                   help="print (and with --out, rewrite) the tables of a saved gap.json instead of measuring")
    p.add_argument("--quiet", action="store_true", help="no progress lines")


def run_gap(args) -> int:
    import shlex

    from ..fit.texts import read_texts
    from ..measure.gap import TASKS, GapConfig, gap_table, provenance, run_gap, write_report

    if args.table:
        import json

        try:
            report = json.loads(Path(args.table).read_text(encoding="utf-8"))
            print(gap_table(report))
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise KVBridgeError(f"{args.table} is not a readable gap.json ({exc.__class__.__name__}: {exc}); pass "
                                "the file `kvbridge gap --out DIR` wrote.") from None
        if args.out:
            write_report(report, args.out)
        return 0
    tasks = tuple(t.strip() for t in args.tasks.split(",") if t.strip())
    if not tasks or set(tasks) - set(TASKS):
        raise KVBridgeError(f"--tasks must name some of {', '.join(TASKS)}, not {args.tasks!r}.")
    if args.items < 4 or args.new_tokens < 1 or args.batch_size < 1 or min(args.lengths) < 64:
        raise KVBridgeError("--items must be >= 4, --new-tokens and --batch-size >= 1, and every length >= 64.")
    if args.out:
        check_output_dir(args.out)
    if not args.mapper:
        if args.family != "default":
            raise KVBridgeError("only the default family ships a mapper: pass --mapper (fit one with kvbridge fit).")
        from .. import family

        args.mapper = family.mapper_path()
    if args.texts:
        texts, label = read_texts(args.texts), args.texts
    else:
        from ..family.external import external_texts

        texts, label = external_texts(args.split, args.kind), f"third-party {args.kind}, {args.split} packages"
    bridge = _bridge(args)
    say = (lambda message: None) if args.quiet else (lambda message: print(message, file=sys.stderr, flush=True))
    config = GapConfig(lengths=args.lengths, items=args.items, new_tokens=args.new_tokens, tasks=tasks,
                       batch_size=args.batch_size, ttft=not args.no_ttft)
    report = run_gap(bridge, texts, config, progress=say, label=label)
    report["provenance"] = provenance("kvbridge gap " + shlex.join(sys.argv[2:] if sys.argv[1:2] == ["gap"] else []))
    print(f"Texts: {label}; mapper {args.mapper}; hold-back {bridge.hold_back}; CPU figures where the device is cpu.")
    print(gap_table(report))
    if args.out:
        folder = write_report(report, args.out)
        print(f"\nwritten: {folder / 'gap.json'}, {folder / 'gap.md'}")
    return 0


def add_diagnose(p: argparse.ArgumentParser) -> None:
    """`kvbridge diagnose`'s options."""
    p.description = ("On held-out text: R² of mapped K and V per target layer, cosine of the target's attention "
                     "outputs with native vs mapped K/V (its own queries, query scaling applied), next-token KL and "
                     "top-1 agreement. Writes a JSON and a PNG per metric.")
    p.epilog = EPILOG
    add_pair(p)
    add_mapper(p)
    p.add_argument("--texts", required=True, help="held-out .txt or .jsonl (never used for fitting)")
    p.add_argument("--items", type=int, default=16, help="texts to use (default: 16)")
    p.add_argument("--seq-len", type=int, default=256, help="tokens per text (default: 256)")
    p.add_argument("--out", default="diagnostics", help="folder for diagnostics.json and the plots")
    p.add_argument("--oracle", action="store_true",
                   help="also measure, per target layer and kind (key, value, both), the mean floor-normalized "
                        "retention on the family tasks when that layer's native K/V replace the mapped ones")
    p.add_argument("--oracle-window", type=windows, default=(), metavar="W[,W...]",
                   help="with --oracle, also each layer's K/V from the target's own forward with attention limited "
                        "to the last W tokens, e.g. 8,32: does the layer need nearby tokens or the whole prefix?")


def run_diagnose(args) -> int:
    import json

    from ..fit.texts import read_texts
    from ..measure.diagnose import diagnose, oracle, oracle_cell, plot_diagnostics

    texts = read_texts(args.texts)
    if args.items < 4 or args.seq_len < 128:
        raise KVBridgeError("--items must be >= 4 and --seq-len >= 128 "
                            "(the recall task places spans 64+ tokens apart).")
    if args.oracle_window and not args.oracle:
        raise KVBridgeError("--oracle-window adds rows to the oracle; pass --oracle too.")
    check_output_dir(args.out)
    require("matplotlib", "plot", "kvbridge diagnose (its plots)")
    bridge = _bridge(args)
    if args.seq_len > bridge.max_positions:
        raise KVBridgeError(f"--seq-len {args.seq_len} exceeds the {bridge.max_positions} positions these models "
                            f"support; pass at most {bridge.max_positions}.")
    report = diagnose(bridge, texts, args.items, args.seq_len)
    if args.oracle:
        report["oracle"] = oracle(bridge, texts, args.items, args.seq_len, windows=args.oracle_window)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    write_text(out / "diagnostics.json", json.dumps(report, indent=2) + "\n")
    plots = plot_diagnostics(report, out)
    if args.oracle:
        rows = report["oracle"]["rows"]
        print(f"plain map: mean floor-normalized retention {100 * rows[0]['mean_floor_normalized_retention']:.1f}%")
        windows = args.oracle_window
        print("| Target layer made native | keys | values | both |" + "".join(f" both, window {w} |" for w in windows)
              + "\n|---:|---:|---:|---:|" + "---:|" * len(windows))
        for layer in range(bridge.target.info.num_layers):
            cells = ([100 * oracle_cell(rows, layer, kind) for kind in ("key", "value", "both")]
                     + [100 * oracle_cell(rows, layer, "both", w) for w in windows])
            print(f"| {layer} | " + " | ".join(f"{c:.1f}%" for c in cells) + " |")
        print()
    print("| Target layer | R² keys | R² values | Attention-output cosine |")
    print("|---:|---:|---:|---:|")
    for layer, (rk, rv, c) in enumerate(zip(report["key_r2"], report["value_r2"], report["attention_cosine"])):
        print(f"| {layer} | {rk:.4f} | {rv:.4f} | {c:.4f} |")
    print(f"\nnext-token KL(native ‖ mapped) {report['next_token_kl']:.4f} nats, "
          f"top-1 agreement {100 * report['top1_agreement']:.1f}% over {report['items']} held-out texts")
    print(f"written: {out / 'diagnostics.json'}, " + ", ".join(plots))
    return 0


def run_lm_eval(args) -> int:
    """lm-eval's own CLI with the kvbridge model registered and kvbridge's offline tasks on the include path."""
    import os

    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    require("lm_eval", "eval", "kvbridge lm-eval")
    import shutil

    from lm_eval.__main__ import cli_evaluate

    from ..measure import lm_eval_model  # noqa: F401  (registers the `kvbridge` model)
    from ..measure.lm_eval_tasks import local_task_dir


    argv = list(args.lm_eval_args)
    wants_run = argv and argv[0] not in ("ls", "validate", "-h", "--help")
    folder = None
    if wants_run and not any(a.startswith("--include_path") for a in argv):
        folder = local_task_dir()
        argv += ["--include_path", str(folder)]
    saved = sys.argv
    sys.argv = ["lm-eval"] + argv
    try:
        cli_evaluate()
    except SystemExit as exc:
        return exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    except ValueError as exc:  # lm-eval's own refusals (unknown tasks, bad arguments) arrive as ValueError
        raise KVBridgeError(f"lm-eval refused the run: {str(exc).splitlines()[0] if str(exc) else exc!r} (`kvbridge "
                            "lm-eval ls tasks` lists the tasks it knows, kvbridge's offline ones included).") from None
    finally:
        sys.argv = saved
        if folder is not None:
            shutil.rmtree(folder, ignore_errors=True)
    return 0
