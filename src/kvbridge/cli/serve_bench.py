"""The serving benchmarks: ``kvbridge serve-bench`` (TTFT through vLLM, native vs mapped), ``cascade-bench``
(escalated turns through a cascade) and ``serve-eval`` (retention through the engine); ``load-bench`` is in
:mod:`.load_bench`.

Each parses its own options; serve-bench and cascade-bench pass the ones they do not know on to the servers they
start.
"""

from __future__ import annotations

import argparse
import contextlib
from pathlib import Path

from ..core.outputs import check_output_file
from ..errors import KVBridgeError
from .args import add_lmcache, add_native_rest, add_pair, add_store_memory
from .console import check_results, counts, log, require
from .serve import lmcache_server, pair_argv, pair_config, store_config, store_memory_bytes


def add_serve_eval(p: argparse.ArgumentParser) -> None:
    """`kvbridge serve-eval`'s options."""
    p.description = ("Retention through vLLM: the family tasks (perplexity, 4-way cloze, random- and real-span "
                     "recall) scored by a vLLM engine from prefixes the kvbridge connector mapped, next to Bridge's "
                     "mapped scores on the same held-out rows (native, source and floors from Bridge). The engine "
                     "runs in this process (vllm.LLM) in the connector's dtype.")
    add_pair(p, "engine")
    p.add_argument("--items", type=int, default=48, help="held-out documents per length (default: 48)")
    p.add_argument("--lengths", default="256,1024", help="document lengths in tokens (default: 256,1024)")
    p.add_argument("--json", help="write every figure to this file (and the table beside it as .md)")


def run_serve_eval(args) -> int:
    import json

    from .. import family
    from ..core.outputs import write_text
    from ..core.transfer import Bridge
    from ..serving.bench.quality import engine_retention, retention_rows
    from ..serving.engine.config import engine_kwargs
    from ..serving.launch import cpu_defaults

    lengths = counts(args.lengths, minimum=64, flag="--lengths")
    if args.items < 4:
        raise KVBridgeError("--items must be at least 4 (the cloze task draws its distractors from other rows).")
    if args.json:
        check_output_file(args.json, "--json")
    config, _, _ = pair_config(args)
    require("vllm", "serve", "kvbridge serve-eval")
    from ..serving.launch import preflight

    preflight(config)
    if config.device == "cpu":
        cpu_defaults()
    from vllm import LLM

    from ..core.models import resolve_dtype

    dtype = resolve_dtype(config.dtype, config.device)
    bridge = Bridge.from_pretrained(config.source, config.target, config.mapper, device=config.device, dtype=dtype,
                                    allow_revision_mismatch=config.allow_revision_mismatch, **config.runtime)
    llm = LLM(**engine_kwargs(config, dtype=str(dtype).replace("torch.", ""), enforce_eager=config.device == "cpu"))
    try:
        report = engine_retention(llm, config, bridge, family.heldout_texts(), args.items, lengths, log)
    except RuntimeError as exc:
        raise KVBridgeError(f"the engine could not score the family tasks: {exc}") from None
    finally:
        llm.llm_engine.engine_core.shutdown()  # now: vLLM's threads abort the process at interpreter exit
    print(retention_rows(report))
    if args.json:
        write_text(args.json, json.dumps(report, indent=2) + "\n")
        write_text(str(Path(args.json).with_suffix(".md")), retention_rows(report) + "\n")
    return 0


def add_serve_bench(p: argparse.ArgumentParser) -> None:
    """`kvbridge serve-bench`'s options."""
    p.description = ("Time to first token through vLLM, native vs mapped, side by side: starts `kvbridge serve` "
                     "(every option this command does not know goes to it, and through it to vLLM) or measures a "
                     "running one (--url), then sends streamed completions of distinct prompts of each length, "
                     "alternating native and mapped waves of --concurrency simultaneous requests. Medians, p90, "
                     "decode throughput; the connector's time per mapped request; and the ceiling: each native wave "
                     "sent again one token longer, a prefix-cache hit on its full blocks, what a transfer whose "
                     "connector cost nothing would take.")
    p.add_argument("--url", help="measure this running kvbridge server instead of starting one")
    p.add_argument("--model", help="the served model name (with --url; default: the server's first model)")
    p.add_argument("--contexts", default="256,1024,2000", help="prompt lengths in tokens (default: 256,1024,2000)")
    p.add_argument("--concurrency", default="1,4,8", help="simultaneous requests per wave (default: 1,4,8)")
    p.add_argument("--warmup", type=int, default=2, help="untimed rounds first (default: 2)")
    p.add_argument("--rounds", type=int, default=5,
                   help="timed rounds; a round is a native wave, its re-send (the ceiling) and a mapped wave "
                        "(default: 5)")
    p.add_argument("--new-tokens", type=int, default=16, help="tokens generated per request (default: 16)")
    p.add_argument("--json", help="write every row to this file (and the table beside it as .md)")
    p.add_argument("--plot", help="write a PNG: TTFT and speed-up vs context")
    p.add_argument("--log", default="kvbridge-serve-bench.log", help="the started server's log (default: %(default)s)")


def run_serve_bench(args) -> int:
    from transformers import AutoTokenizer

    from .. import family
    from ..core.models import resolve_model
    from ..serving.bench.ttft import engine_table, plot_engine, run_engine_bench, write_report
    from ..serving.launch import launched

    contexts = counts(args.contexts, minimum=2)
    concurrency = counts(args.concurrency, minimum=1, flag="--concurrency")
    if args.warmup < 0 or args.rounds < 1 or args.new_tokens < 1:
        raise KVBridgeError("--warmup must be >= 0, --rounds >= 1 and --new-tokens >= 1.")
    check_results(args, "kvbridge serve-bench")
    require("openai", "serve", "kvbridge serve-bench")
    from ..serving.launch import flag_value, given_flags

    rest = list(args.serve_args)
    given = given_flags(rest)
    target = flag_value(rest, "--target")
    target = resolve_model(target, flag_value(rest, "--target-revision")) if target else family.target_path()
    tokenizer = AutoTokenizer.from_pretrained(target)
    say = lambda m: log(f"  {m}")  # noqa: E731
    import openai

    try:
        if args.url:
            import json
            import urllib.request

            try:
                with urllib.request.urlopen(args.url.rstrip("/") + "/v1/models", timeout=30) as r:
                    model = args.model or json.loads(r.read())["data"][0]["id"]
            except (ValueError, KeyError, IndexError, TypeError):
                raise KVBridgeError(f"--url {args.url}: no OpenAI-compatible /v1/models there; give the base URL "
                                    "of a kvbridge serve server (http://HOST:PORT).") from None
            report = run_engine_bench(args.url.rstrip("/"), model, tokenizer, contexts, concurrency, args.warmup,
                                      args.rounds, args.new_tokens, say)
        else:
            if "--served-model-name" not in given:
                rest += ["--served-model-name", "kvbridge-bench"]
            model = flag_value(rest, "--served-model-name")
            log(f"starting kvbridge serve {' '.join(rest)} (log: {args.log})")
            with launched(rest, args.log) as url:
                report = run_engine_bench(url, model, tokenizer, contexts, concurrency, args.warmup, args.rounds,
                                          args.new_tokens, say)
    except openai.OpenAIError as exc:
        raise KVBridgeError(f"the server refused a benchmark request ({type(exc).__name__}: "
                            f"{str(exc).splitlines()[0][:300]}); check --model, --contexts against the server's "
                            "--max-model-len, and the server's log.") from None
    report["device"] = serving_device()
    print(f"\n{report['device']}; median of {report['rounds']} rounds after {report['warmup_rounds']} warm-ups; "
          f"{report['new_tokens']} tokens per request; cold transfer (the source prefills inside the connector)\n")
    print(engine_table(report))
    if args.json:
        write_report(report, args.json)
    if args.plot:
        plot_engine(report, args.plot)
    return 0


def add_cascade_bench(p: argparse.ArgumentParser) -> None:
    """`kvbridge cascade-bench`'s options."""
    p.description = ("Escalation through two vLLM servers: conversations whose first two turns the source answers, "
                     "then a third turn escalated to the target seven ways — native (the target re-prefills the "
                     "history), warm (the source's stored KV, mapped ahead and read from the target's memory, the new "
                     "turn computed by the target: --native-rest), warm from the store's folder, warm with the new "
                     "turn mapped too (a native rest of 0), mapped at the switch (warm, blocks mapped ahead ignored), "
                     "cold (mapped from a fresh source prefill) and prewarmed (warm, the conversation loaded into the "
                     "target's prefix cache before the switch: its source request asks for it, kv_transfer_params "
                     "kvbridge_prewarm; every other source request says false) — in a random order of each "
                     "conversation's own, native sent again right after native (a hit in the target's own prefix "
                     "cache: the ceiling of any transfer); median time to the first streamed token of each, and the "
                     "escalated answers compared with native's and with each other. Starts `kvbridge cascade`'s two "
                     "servers (every option this command does not know goes to the target's `kvbridge serve`) or "
                     "measures running ones (--source-url, --target-url). With --lmcache, an eighth way: a second "
                     "pair whose source stores through LMCache and whose target reads from there.")
    add_pair(p, "engine")
    p.add_argument("--source-url", help="a running `kvbridge serve-source` server (with --target-url)")
    p.add_argument("--target-url", help="a running `kvbridge serve --store` server sharing its store")
    p.add_argument("--source-baseline", action="store_true",
                   help="also start the source without a store (`kvbridge serve-source --no-store`, the storing "
                        "server's block size) and send each source turn to both, in alternating order: what storing "
                        "(and mapping ahead) costs the source's own requests, and whether their answers stay the same")
    p.add_argument("--baseline-url", help="with --source-url: a running `kvbridge serve-source --no-store` server as "
                                          "the baseline, started with the storing server's --block-size (implies "
                                          "--source-baseline)")
    p.add_argument("--histories", default="1024,2000", help="conversation lengths in tokens (default: 1024,2000)")
    p.add_argument("--conversations", type=int, default=12, help="timed conversations per length (default: 12)")
    p.add_argument("--warmup", type=int, default=2, help="untimed conversations first (default: 2)")
    p.add_argument("--new-tokens", type=int, default=16, help="tokens of each escalated answer (default: 16)")
    p.add_argument("--question-tokens", type=int, default=24,
                   help="tokens of the escalated turn's new user message (default: 24)")
    p.add_argument("--store", help="the store the started servers share (default: a new temporary folder)")
    p.add_argument("--store-cap-gb", type=float, default=2.0, help="its size cap (default: 2)")
    p.add_argument("--no-map-ahead", dest="map_ahead", action="store_false",
                   help="the started source server stores its K/V only, the target maps them on escalation "
                        "(default: the source server maps each stored block ahead)")
    add_native_rest(p)
    add_store_memory(p)
    add_lmcache(p, owner=True, bench=True)
    p.add_argument("--json", help="write every figure to this file (and the table beside it as .md)")
    p.add_argument("--table", metavar="REPORT", help="no servers: print the tables of a saved report (a --json file of "
                                                     "this command) with its per-conversation figures, and write them "
                                                     "beside it as .md")
    p.add_argument("--log-dir", default="kvbridge-cascade-logs",
                   help="the started servers' logs (default: %(default)s)")


def _cascade_table_of(path: str) -> int:
    import json

    from ..core.outputs import write_text
    from ..serving.bench.cascade_report import cascade_table, per_conversation

    try:
        report = json.loads(Path(path).read_text(encoding="utf-8"))
        report["per_conversation"] = per_conversation(report)  # anew: a file from before a figure gets it too
        table = cascade_table(report)
    except OSError as exc:
        raise KVBridgeError(f"--table: cannot read {path} ({exc.strerror or exc}).") from None
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise KVBridgeError(f"--table: {path} is not a report of this version of `kvbridge cascade-bench --json` "
                            f"({type(exc).__name__}: {exc}).") from None
    print(table)
    write_text(str(Path(path).with_suffix(".md")), table + "\n")
    return 0


def run_cascade_bench(args) -> int:
    import tempfile

    import openai
    from transformers import AutoTokenizer

    from ..serving.bench.cascade import launched_pair, run_cascade_bench
    from ..serving.bench.cascade_report import cascade_table, write_cascade

    if args.table:
        return _cascade_table_of(args.table)
    histories = _cascade_bench_settings(args)
    require("openai", "serve", "kvbridge cascade-bench")
    config, _, _ = pair_config(args)
    tokenizer = AutoTokenizer.from_pretrained(config.target)
    say = lambda m: log(f"  {m}")  # noqa: E731

    def measure(source_url, target_url, baseline_url=None, lmcache=None):
        names = [_first_model(url) for url in (source_url, target_url)]
        pair = (lmcache[0], _first_model(lmcache[0]), lmcache[1], _first_model(lmcache[1])) if lmcache else None
        return run_cascade_bench(source_url, names[0], target_url, names[1], tokenizer, histories,
                                 args.conversations, args.warmup, args.new_tokens, args.native_rest,
                                 args.question_tokens, say, baseline_url,
                                 _first_model(baseline_url) if baseline_url else None, pair)

    try:
        if args.source_url:
            running = (args.lmcache_source_url.rstrip("/"), args.lmcache_target_url.rstrip("/")) \
                if args.lmcache_source_url else None
            report = measure(args.source_url.rstrip("/"), args.target_url.rstrip("/"),
                             args.baseline_url.rstrip("/") if args.baseline_url else None, running)
        else:
            with tempfile.TemporaryDirectory(prefix="kvbridge-store-") as tmp:
                args.store = args.store or tmp
                store_config(args)
                store_memory_bytes(args)  # (checked before anything starts)
                source_args, target_args = pair_argv(args)
                also = " and the source without a store" if args.source_baseline else ""
                log(f"starting the source and target servers{also} (logs in {args.log_dir}/)")
                with launched_pair(source_args, target_args + args.vllm_args, args.log_dir) as urls, \
                        _baseline(args) as baseline, _lmcache_pair(args) as lmcache:
                    report = measure(*urls, baseline, lmcache)
    except openai.OpenAIError as exc:
        raise KVBridgeError(f"a server refused a benchmark request ({type(exc).__name__}: "
                            f"{str(exc).splitlines()[0][:300]}); check --histories against the servers' "
                            "--max-model-len, and their logs.") from None
    report["device"] = serving_device()
    report["command"] = "kvbridge cascade-bench " + " ".join(args.argv)
    if args.lmcache:
        report["lmcache"] = args.lmcache
    print(f"\n{report['device']}; {args.conversations} conversations per length after {args.warmup} warm-ups; "
          f"{args.new_tokens} tokens per escalated answer; median time to the first streamed token; the engine's "
          f"own time for an 8-token prompt: {report['engine_floor_ms']:.1f} ms\n")
    print(cascade_table(report))
    if args.json:
        write_cascade(report, args.json)
    return 0


def _cascade_bench_settings(args) -> list[int]:
    """cascade-bench's options, checked before anything starts; its history lengths."""
    from ..serving.launch import target_parallel

    target_parallel(args.vllm_args)  # (the vLLM options go to the target's server)
    histories = counts(args.histories, minimum=256, flag="--histories")
    if args.conversations < 1 or args.warmup < 0 or args.new_tokens < 1 or args.question_tokens < 1 or \
            args.native_rest < 0:
        raise KVBridgeError("--conversations, --new-tokens and --question-tokens must be >= 1, --warmup and "
                            "--native-rest >= 0.")
    if (args.source_url is None) != (args.target_url is None):
        raise KVBridgeError("give --source-url and --target-url together (two running servers sharing a store), or "
                            "neither to start them.")
    if args.baseline_url and not args.source_url:
        raise KVBridgeError("--baseline-url goes with --source-url and --target-url (running servers); to start one, "
                            "pass --source-baseline.")
    if args.source_baseline and args.source_url and not args.baseline_url:
        raise KVBridgeError("--source-baseline starts its server beside the ones it starts; with --source-url, give a "
                            "running `kvbridge serve-source --no-store` as --baseline-url.")
    _check_lmcache_pair(args)
    if args.json:
        check_output_file(args.json, "--json")
    return histories


def _check_lmcache_pair(args) -> None:
    """cascade-bench's LMCache options, checked before anything starts."""
    from ..serving.store.lmcache_store import normal_url

    if (args.lmcache_source_url is None) != (args.lmcache_target_url is None):
        raise KVBridgeError("give --lmcache-source-url and --lmcache-target-url together (a running `kvbridge "
                            "serve-source --lmcache` and `kvbridge serve --lmcache` sharing an LMCache server).")
    if args.lmcache_source_url and not args.source_url:
        raise KVBridgeError("--lmcache-source-url and --lmcache-target-url go with --source-url and --target-url "
                            "(running servers); to start an LMCache pair beside the started ones, pass --lmcache "
                            "URL|auto.")
    if args.lmcache and args.source_url:
        raise KVBridgeError("--lmcache starts a second pair beside the servers this command starts; with --source-url, "
                            "give a running LMCache pair as --lmcache-source-url and --lmcache-target-url.")
    if args.lmcache and args.lmcache != "auto":
        normal_url(args.lmcache)  # (InputError, in words: tcp://HOST:PORT)
    if args.lmcache:
        import importlib.util

        if importlib.util.find_spec("lmcache") is None:
            raise KVBridgeError("--lmcache needs the lmcache package (pip install lmcache==0.5.6, or kvbridge[serve]).")


@contextlib.contextmanager
def _lmcache_pair(args):
    """With --lmcache: `kvbridge cascade --lmcache`'s pair (and, with auto, its LMCache server), logs in
    ``LOG_DIR/lmcache/``, stopped when the block ends: yields (source URL, target URL); None without it."""
    if not args.lmcache:
        yield None
        return
    from ..serving.bench.cascade import launched_pair

    logs = Path(args.log_dir) / "lmcache"
    with lmcache_server(args, logs) as url:
        source_args, target_args = pair_argv(args, url)
        log(f"starting the LMCache pair (the source storing in {url}, the target reading it; logs in {logs}/)")
        with launched_pair(source_args, target_args + args.vllm_args, logs, together=True) as urls:
            yield urls


@contextlib.contextmanager
def _baseline(args):
    """The source served without a store, with the storing server's block size (cascade-bench --source-baseline);
    None without that option."""
    if not args.source_baseline:
        yield None
        return
    from ..serving.launch import launched
    from ..serving.store.folder import STORE_FILE, KVStore

    argv = ["--no-store"]
    for flag in ("source", "source_revision"):
        if getattr(args, flag):
            argv += [f"--{flag.replace('_', '-')}", getattr(args, flag)]
    if (Path(args.store) / STORE_FILE).exists():
        argv += ["--block-size", str(KVStore(args.store).block_tokens)]
    with launched(argv, Path(args.log_dir) / "baseline.log", command="serve-source") as url:
        yield url


def _first_model(url: str) -> str:
    import json
    import urllib.request

    try:
        with urllib.request.urlopen(url + "/v1/models", timeout=30) as r:
            return json.loads(r.read())["data"][0]["id"]
    except (OSError, ValueError, KeyError, IndexError, TypeError):
        raise KVBridgeError(f"{url}: no OpenAI-compatible /v1/models there; give the base URL of a kvbridge server "
                            "(http://HOST:PORT).") from None


def serving_device() -> str:
    import platform

    import torch

    return (torch.cuda.get_device_name(0) if torch.cuda.is_available()
            else f"CPU ({platform.processor() or platform.machine()}, {torch.get_num_threads()} threads)")


