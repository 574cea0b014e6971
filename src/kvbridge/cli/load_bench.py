"""``kvbridge load-bench``: serving under load, one seeded Poisson trace replayed against plain vLLM and kvbridge's
ways. Every option it does not know goes to the servers it starts."""

from __future__ import annotations

import argparse
import contextlib
import os
from pathlib import Path

from ..core.outputs import check_output_file
from ..errors import KVBridgeError
from .console import counts, log, require
from .serve_bench import serving_device


def add_load_bench(p: argparse.ArgumentParser) -> None:
    """`kvbridge load-bench`'s options."""
    from ..serving.bench.load import DEFAULT_WAYS, LEAD_S, SETTLE_S, WAYS

    p.description = ("Serving under load: starts `kvbridge serve --plain` (the target in vLLM alone) and `kvbridge "
                     "serve` side by side (every option this command does not know goes to both), then replays one "
                     "seeded open-loop trace — Poisson arrivals, prompts of mixed lengths, each with a cache salt of "
                     "its own — against each way (plain: vLLM alone; native: kvbridge serve, no transfer; mapped-sync "
                     "/ mapped-async: cold transfer, the map inside or beside the engine's step; warm: escalated "
                     "requests, each prompt served and stored earlier by a third server, `kvbridge serve-source "
                     "--store` mapping ahead, which this command starts when a way needs it; prewarm: the source's "
                     "turn at each arrival, under the load, and the target's server loading it into its prefix cache "
                     "ahead of the escalated request; native-prewarm: the same source turn unstored, then the prompt "
                     "re-sent to plain vLLM ahead, as a router without kvbridge would; ab: every arrival sent to "
                     "plain vLLM and to kvbridge native at once; ab-warm: the same with warm), each way unloaded "
                     "first (one request at a time), then at each rate, the ways' order alternating per rate. TTFT "
                     "and end-to-end p50/p90/p99 with 95 % bootstrap intervals, output throughput, and the prompt "
                     "tokens the target computed, from vLLM's /metrics.")
    p.add_argument("--rates", default="1,3", help="request rates, per second (default: 1,3)")
    p.add_argument("--requests", type=int, default=40, help="requests per rate and way (default: 40)")
    p.add_argument("--unloaded", type=int, default=8,
                   help="the trace's first requests sent one at a time per way: the unloaded figures (default: 8)")
    p.add_argument("--lengths", default="256,2000", help="prompt lengths MIN,MAX in tokens, drawn uniformly "
                                                         "(default: 256,2000)")
    p.add_argument("--new-tokens", type=int, default=32, help="tokens generated per request (default: 32)")
    p.add_argument("--seed", type=int, default=0, help="the trace's seed (default: 0)")
    p.add_argument("--ways", default=",".join(DEFAULT_WAYS),
                   help=f"which ways, of {', '.join(WAYS)} (default: {','.join(DEFAULT_WAYS)})")
    p.add_argument("--warm-settle", type=float, default=SETTLE_S, metavar="S",
                   help="the warm and ab-warm ways: seconds between the source's maps ahead of the way's prompts "
                        "done and the way's run, for the target's memory tier to load them, as it would between a "
                        "conversation's source turns and its escalation (default: %(default)s)")
    p.add_argument("--prewarm-lead", type=float, default=LEAD_S, metavar="S",
                   help="the prewarm ways: seconds from an arrival (its source turn sent) to its escalated request "
                        "(default: %(default)s)")
    p.add_argument("--json", help="write the report to this file (and its table beside it as .md)")
    p.add_argument("--log", default="kvbridge-load-bench", help="the started servers' logs: PREFIX-plain.log, "
                                                                "PREFIX-kvbridge.log and PREFIX-source.log (default: "
                                                                "%(default)s)")


def run_load_bench(args) -> int:
    """Every option checked first; then the servers the ways need started, the traces replayed against each way,
    and the report."""
    from ..serving.bench.load import poisson_trace

    rates, lengths, ways = _load_settings(args)
    require("openai", "serve", "kvbridge load-bench")
    rest = list(args.serve_args)
    _check_server_flags(rest, ways)
    tokenizer, stream = _load_stream(rest)
    traces = {rate: poisson_trace(rate, args.requests, (lengths[0], lengths[1]), args.seed, len(stream))
              for rate in rates}
    results = _replay(args, rest, ways, rates, traces, stream, tokenizer)
    report = _load_report(args, rest, rates, lengths, ways, traces, results)
    _show_load(args, report, lengths)
    return 0


def _load_settings(args) -> tuple[list[float], list[int], list[str]]:
    """load-bench's own options, checked before anything starts: its rates, its prompt lengths (MIN, MAX) and its
    ways."""
    from ..serving.bench.load import WAYS

    try:
        rates = [float(r) for r in args.rates.split(",") if r.strip()]
    except ValueError:
        rates = []
    if not rates or any(not (0 < r < 1e6) for r in rates):
        raise KVBridgeError(f"--rates must be comma-separated positive request rates, e.g. 1,3, not {args.rates!r}.")
    lengths = counts(args.lengths, minimum=2, flag="--lengths")
    if len(lengths) != 2 or lengths[0] > lengths[1]:
        raise KVBridgeError(f"--lengths must be MIN,MAX with MIN <= MAX, e.g. 256,2000, not {args.lengths!r}.")
    ways = [w.strip() for w in args.ways.split(",") if w.strip()]
    if not ways or set(ways) - set(WAYS) or len(set(ways)) != len(ways):
        raise KVBridgeError(f"--ways must be distinct names of {', '.join(WAYS)}, not {args.ways!r}.")
    if not 0 <= args.warm_settle <= 3600:
        raise KVBridgeError(f"--warm-settle must be between 0 and 3600 seconds, not {args.warm_settle}.")
    if not 0 <= args.prewarm_lead <= 600:
        raise KVBridgeError(f"--prewarm-lead must be between 0 and 600 seconds, not {args.prewarm_lead}.")
    if args.requests < 2 or args.unloaded < 2 or args.new_tokens < 1:
        raise KVBridgeError("--requests and --unloaded must be at least 2, --new-tokens at least 1.")
    if args.json:
        check_output_file(args.json, "--json")
    return rates, lengths, ways


def _check_server_flags(rest: list[str], ways: list[str]) -> None:
    """The servers' options load-bench sets itself are refused among those it passes on."""
    from ..serving.bench.load import SOURCED
    from ..serving.launch import given_flags

    if {"--port", "--served-model-name", "--plain"} & given_flags(rest):
        raise KVBridgeError("kvbridge load-bench picks the servers' ports and names itself; drop --port, "
                            "--served-model-name and --plain.")
    if set(ways) & set(SOURCED) and {"--store", "--lmcache"} & given_flags(rest):
        raise KVBridgeError("the warm and prewarm ways store into a folder of their own, which load-bench creates and "
                            "removes; drop --store and --lmcache.")


def _load_stream(rest: list[str]):
    """The served target's tokenizer (the kvbridge server's --target, else the embedded family's) and the held-out
    token stream the trace's prompts are cut from."""
    from transformers import AutoTokenizer

    from .. import family
    from ..core.models import resolve_model
    from ..serving.bench.ttft import heldout_stream
    from ..serving.launch import flag_value

    target = flag_value(rest, "--target")
    target = resolve_model(target, flag_value(rest, "--target-revision")) if target else family.target_path()
    tokenizer = AutoTokenizer.from_pretrained(target)
    return tokenizer, heldout_stream(tokenizer)


def _replay(args, rest, ways, rates, traces, stream, tokenizer):
    """The ways' results: their servers started, the traces replayed against each way, the servers stopped."""
    import asyncio

    from ..serving.bench.load import PAIRED, PLAIN_SERVER, run_ways

    unloaded = traces[rates[0]][:args.unloaded]
    say = lambda m: log(f"  {m}")  # noqa: E731
    run_id = os.urandom(4).hex()
    import openai

    with contextlib.ExitStack() as stack:
        source, urls, store = _start_servers(stack, args, rest, ways)
        served = {w: "plain" if w in PLAIN_SERVER else "kvbridge" for w in ways if w not in PAIRED}
        for way in set(ways) & set(PAIRED):  # its two halves: plain vLLM and the kvbridge server
            served.update(zip(PAIRED[way], ("plain", "kvbridge")))
        by_way = {w: urls[server] for w, server in served.items()}
        models = {w: f"load-{server}" for w, server in served.items()}
        try:
            return asyncio.run(run_ways(by_way, models, ways, rates, traces, unloaded, stream,
                                        tokenizer.bos_token_id, args.new_tokens, run_id, say, source=source,
                                        store=store, settle_s=args.warm_settle, lead_s=args.prewarm_lead))
        except openai.OpenAIError as exc:
            raise KVBridgeError(f"a server refused a benchmark request ({type(exc).__name__}: "
                                f"{str(exc).splitlines()[0][:300]}); check --lengths against the servers' "
                                f"--max-model-len, and the logs {args.log}-*.log.") from None


def _start_servers(stack: contextlib.ExitStack, args, rest: list[str], ways: list[str]):
    """The servers ``ways`` need, started at once and stopped with ``stack``: plain vLLM (`kvbridge serve --plain`),
    `kvbridge serve`, and for the ways that need the source `kvbridge serve-source`, storing into a folder of its own
    that the kvbridge server reads. Returns the source's (URL, model) or None, the other servers' URLs by name, and
    the store folder or None."""
    from ..serving.bench.load import PLAIN_SERVER, SOURCED
    from ..serving.launch import launched_together

    servers = {"plain": ["--plain"]} if set(ways) & set(PLAIN_SERVER) else {}
    if set(ways) - {"plain", "native-prewarm"}:
        servers["kvbridge"] = []
    sourced = bool(set(ways) & set(SOURCED))
    started, store = [], None  # (kvbridge arguments, log, command), all started at once
    if sourced:  # the kvbridge server reads the store the source creates (once it exists: lazily)
        import shutil
        import tempfile

        store = tempfile.mkdtemp(prefix="kvbridge-load-store-")
        stack.callback(shutil.rmtree, store, True)
        if "kvbridge" in servers:
            servers["kvbridge"] = ["--store", store]
        started.append((_load_source_argv(rest, store), f"{args.log}-source.log", "serve-source"))
    started += [([*extra, *rest, "--served-model-name", f"load-{name}"], f"{args.log}-{name}.log", "serve")
                for name, extra in servers.items()]
    for argv, path, command in started:
        log(f"starting kvbridge {command} {' '.join(argv)} (log: {path})")
    started_urls = stack.enter_context(launched_together(started, timeout_s=900))
    source = (started_urls[0], "load-source") if sourced else None
    return source, dict(zip(servers, started_urls[1:] if source else started_urls)), store


def _load_source_argv(rest: list[str], store: str) -> list[str]:
    """``kvbridge serve-source`` arguments for load-bench's ways that need the source (warm, ab-warm, prewarm,
    native-prewarm): storing into ``store`` and mapping ahead with the
    kvbridge server's own pair and mapper (those of its flags in ``rest``), at its engine sizes."""
    from ..serving.launch import flag_value

    argv = ["--store", store, "--map-ahead", "--served-model-name", "load-source"]
    for flag in ("--source", "--source-revision", "--mapper", "--mapper-revision", "--target", "--target-revision",
                 "--max-model-len", "--max-num-seqs", "--block-size", "--gpu-memory-utilization"):
        value = flag_value(rest, flag)
        if value is not None:
            argv += [flag, value]
    dtype = flag_value(rest, "--connector-dtype")  # the target reads entries mapped in its connector's dtype only
    if dtype not in (None, "auto"):
        argv += ["--map-dtype", dtype]
    return argv


def _load_report(args, rest, rates, lengths, ways, traces, results) -> dict:
    """The run's record: its command and commit, the machine, the settings, the trace and every way's results, and
    the loaded-against-unloaded ratios."""
    import platform
    import sys
    from datetime import datetime, timezone

    import torch
    import vllm

    from ..measure.suite import _commit
    from ..serving.bench.load import loaded_ratios, to_dict

    report = {"command": "kvbridge load-bench " + " ".join(args.argv), "argv": sys.argv, "commit": _commit(),
              "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
              "machine": {"platform": platform.platform(), "processor": platform.processor() or platform.machine(),
                          "cores": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
                          "torch_threads": torch.get_num_threads(), "vllm": vllm.__version__,
                          "device": serving_device()},
              "rates": rates, "requests": args.requests, "unloaded": args.unloaded, "lengths": lengths,
              "new_tokens": args.new_tokens, "seed": args.seed, "ways": ways, "server_args": rest,
              "warm_settle_s": args.warm_settle if {"warm", "ab-warm"} & set(ways) else None,
              "prewarm_lead_s": args.prewarm_lead if {"prewarm", "native-prewarm"} & set(ways) else None,
              "trace_lengths": {str(r): [a.length for a in t] for r, t in traces.items()},
              "results": to_dict(results)}
    report["load"] = loaded_ratios(report)
    return report


def _show_load(args, report: dict, lengths: list[int]) -> None:
    """The report's table and ratios on stdout; with --json, the report and (beside it, .md) its table."""
    import json

    from ..core.outputs import write_text
    from ..serving.bench.load import load_table

    table = load_table(report)
    print(f"\n{report['machine']['device']}; {args.requests} requests per rate and way, prompts "
          f"{lengths[0]}–{lengths[1]} tokens, {args.new_tokens} new tokens each; commit {report['commit']}\n")
    print(table)
    for line in report["load"]:
        print(line)
    if args.json:
        write_text(args.json, json.dumps(report, indent=2) + "\n")
        header = (f"`{report['command']}` — commit {report['commit']}, {report['date']}, {report['machine']['device']}"
                  f", vLLM {report['machine']['vllm']}\n\n")
        write_text(str(Path(args.json).with_suffix(".md")),
                   header + table + "\n\n" + "\n".join(f"- {x}" for x in report["load"]) + "\n")
