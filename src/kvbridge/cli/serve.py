"""The serving commands that start servers: ``kvbridge serve`` (the target, its prefixes mapped by the connector),
``serve-source`` (the source, storing its KV) and ``cascade`` (both, sharing a store); and the steps the benchmarks
that start them share (the pair's settings, a cascade's two command lines, an LMCache server).

Each parses its own options and passes the ones it does not know on to ``vllm serve``.
"""

from __future__ import annotations

import argparse
import contextlib
import os
from pathlib import Path

from ..errors import KVBridgeError
from .args import add_lmcache, add_native_rest, add_pair, add_prewarm, add_store_memory
from .console import EPILOG, log


def add_serve(p: argparse.ArgumentParser) -> None:
    """`kvbridge serve`'s options."""
    from ..serving.engine.config import MODES, ServeConfig

    d = ServeConfig(mapper="-", source="-", target="-")
    p.description = ("Start vLLM's OpenAI-compatible server for the target with the kvbridge KV connector: a request "
                     "whose kv_transfer_params say {\"kvbridge\": \"mapped\"} has its prompt prefilled by the source "
                     "and mapped into the engine's paged cache; the engine computes the held-back tokens and decodes. "
                     "Any failure for a request falls back to a native prefill. With no pair, the embedded family and "
                     "its shipped mapper. Options kvbridge does not know are passed to `vllm serve`.")
    p.epilog = ("Each response's kv_transfer_params say what happened: mapped, native, short (auto, below "
                "--min-tokens) or 'fallback: <reason>'. " + EPILOG)
    add_pair(p, "engine")
    r = p.add_argument_group("requests")
    r.add_argument("--mode", choices=MODES, default=d.mode,
                   help=f"default for requests whose kv_transfer_params do not say (default: {d.mode})")
    r.add_argument("--min-tokens", type=int, default=None,
                   help=f"auto maps prompts of at least this many tokens (default: the break-even of --bench, else "
                        f"{d.min_tokens})")
    r.add_argument("--async-load", action="store_true",
                   help="map each request in a thread beside the engine's steps, the request waiting for its blocks, "
                        "instead of inside the step, every running request waiting for it (default: inside, which "
                        "measured better on a 2-core CPU: docs/serving.md; per request kv_transfer_params "
                        "{\"kvbridge_load\": \"sync\" | \"async\"})")
    r.add_argument("--bench", help="a `kvbridge bench --json` file of this pair, or a `kvbridge serve-bench --json` "
                                   "one of this server's settings (through the engine, one request at a time): "
                                   "auto's threshold is the shortest context whose mapped TTFT beat native")
    w = p.add_argument_group("warm transfer (the source engine's stored KV: see kvbridge serve-source)")
    w.add_argument("--store", help="the KV store a `kvbridge serve-source` engine writes: prompt blocks found there "
                                   "are read where it mapped them ahead, else mapped without a source prefill; "
                                   "a short rest after them is computed by the target (--native-rest) (default: "
                                   "none, every mapped prefix is cold)")
    w.add_argument("--no-store-verify", dest="store_verify", action="store_false",
                   help="skip the CRC-32 check of each stored block as it is read (large models: saves ~1 ms per "
                        "4 MB)")
    add_native_rest(w)
    add_store_memory(w)
    add_lmcache(p, owner=False)
    w.add_argument("--no-prewarm", dest="prewarm", action="store_false",
                   help="with --store: ignore the conversations a source engine announces for loading ahead "
                        "(serve-source --prewarm, or a source request's kv_transfer_params "
                        "{\"kvbridge_prewarm\": true}); by default they are loaded into this server's prefix cache, "
                        "in the mapper's namespace, as soon as the source has stored them")
    s = p.add_argument_group("server")
    s.add_argument("--host", default="127.0.0.1", help="address to listen on (default: 127.0.0.1)")
    s.add_argument("--port", type=int, default=8000, help="port (default: 8000)")
    s.add_argument("--served-model-name", help="model name clients send (default: the target's hub id or folder "
                                               "name; kvbridge-family for the embedded family)")
    s.add_argument("--plain", action="store_true",
                   help="serve the target with vLLM alone — the engine settings kvbridge gives it, no connector, no "
                        "middleware: the baseline of kvbridge load-bench")


def run_serve(args) -> int:
    from .. import family
    from ..serving.launch import break_even, serve

    min_tokens = args.min_tokens if args.min_tokens is not None else (break_even(args.bench) if args.bench else None)
    config, name, is_family = pair_config(args, mode=args.mode, store=args.store, store_verify=args.store_verify,
                                          native_rest=args.native_rest, store_memory_bytes=store_memory_bytes(args),
                                          sync_load=not args.async_load,
                                          lmcache=args.lmcache, lmcache_model=args.lmcache_model,
                                          **({"min_tokens": min_tokens} if min_tokens is not None else {}))
    if is_family and not any(a.split("=")[0] == "--chat-template" for a in args.vllm_args):
        args.vllm_args += ["--chat-template", family.chat_template_path()]  # its tokenizer has none
    return serve(config, args.served_model_name or name, args.host, args.port, args.vllm_args, args.prewarm,
                 args.plain)


def add_serve_source(p: argparse.ArgumentParser) -> None:
    """`kvbridge serve-source`'s options."""
    from ..serving.bench.cascade import default_store

    p.description = ("Start vLLM's OpenAI-compatible server for the source model, storing its KV as it serves: every "
                     "block of tokens a request computes (prompt or answer) goes to the KV store, keyed by the token "
                     "prefix and the source's identity, so that a target served with `kvbridge serve --store` maps it "
                     "without a source prefill (warm transfer: cascades, escalation, routing); with a mapper "
                     "(map-ahead) each stored block is also mapped into the target's K/V, so that the target reads "
                     "it. Serving is unchanged; options kvbridge does not know are passed to `vllm serve`.")
    p.epilog = EPILOG
    p.add_argument("--source", help="source model (folder or hub id; default: the embedded family's)")
    p.add_argument("--source-revision", help="hub revision of the source")
    m = p.add_argument_group("map-ahead (each stored block is also mapped into the target's K/V, in a background "
                             "thread, so that the target's connector reads it instead of mapping it)")
    m.add_argument("--map-ahead", action="store_true",
                   help="map ahead with --mapper and --target (default without --source: the embedded family's "
                        "shipped mapper and target)")
    m.add_argument("--mapper", help="the mapper the target serves with (folder or hub id; implies --map-ahead)")
    m.add_argument("--mapper-revision", help="hub revision of the mapper")
    m.add_argument("--target", help="its target model (folder or hub id: its config, tokenizer and weights "
                                    "fingerprint are read; its weights are not loaded)")
    m.add_argument("--target-revision", help="hub revision of the target")
    m.add_argument("--map-dtype", default="auto",
                   help="dtype of the map (default: auto: float32 on CPU, bfloat16 on GPU, as the target's "
                        "connector; the target reads entries of its own --connector-dtype only)")
    p.add_argument("--store", default=default_store(), help="the KV store's folder (default: %(default)s)")
    p.add_argument("--store-cap-gb", type=float, default=2.0,
                   help="the store's size cap: least recently used blocks are removed beyond it (default: 2)")
    add_prewarm(p)
    p.add_argument("--no-store", dest="storing", action="store_false",
                   help="serve the source with vLLM alone, same settings, nothing stored (--store and "
                        "--store-cap-gb are ignored): the baseline of what storing costs the source's own requests "
                        "(kvbridge cascade-bench --source-baseline)")
    add_lmcache(p, owner=True)
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default: 127.0.0.1)")
    p.add_argument("--port", type=int, default=8001, help="port (default: 8001)")
    p.add_argument("--served-model-name", help="model name clients send (default: the source's hub id or folder "
                                               "name; kvbridge-family-source for the embedded family)")


def run_serve_source(args) -> int:
    from .. import family
    from ..core.models import resolve_model
    from ..serving.launch import serve_source

    if not args.storing and (args.prewarm or args.map_ahead or args.mapper or args.target or args.mapper_revision or
                             args.target_revision or args.map_dtype != "auto"):
        raise KVBridgeError("--no-store serves the source alone: map-ahead (--map-ahead, --mapper, --target and their "
                            "options) and --prewarm need the store; drop one or the other.")
    if args.lmcache and (not args.storing or args.prewarm or args.map_ahead or args.mapper or args.target):
        raise KVBridgeError("--lmcache stores the source's K/V through vLLM's LMCacheMPConnector: --no-store, "
                            "map-ahead (--map-ahead, --mapper, --target) and --prewarm need the store folder; drop "
                            "one or the other.")
    if args.source and (args.map_ahead or args.mapper or args.target) and not (args.mapper and args.target):
        raise KVBridgeError("map-ahead with --source needs the mapper and its target: pass --mapper and --target.")
    if args.source:
        source = resolve_model(args.source, args.source_revision)
        name = args.source if not Path(args.source).exists() else Path(args.source).name
    else:
        source, name = family.source_path(), "kvbridge-family-source"
        if not any(a.split("=")[0] == "--chat-template" for a in args.vllm_args):
            args.vllm_args += ["--chat-template", family.chat_template_path()]
    with lmcache_server(args) as url:
        return serve_source(store_config(args, source) if args.storing and not url else None, source,
                            args.served_model_name or name, args.host, args.port, args.vllm_args, lmcache=url)


def store_config(args, source: str | None = None):
    """The source engine's store settings; with map-ahead (``source``: the served source's folder) the mapper and
    target, resolved and checked against the source before vLLM starts."""
    from .. import family
    from ..core.artifact import resolve
    from ..core.models import resolve_model
    from ..serving.engine.config import ServeConfig, StoreConfig
    from ..serving.launch import preflight

    if not args.store_cap_gb > 0:
        raise KVBridgeError(f"--store-cap-gb must be positive, not {args.store_cap_gb}.")
    store = StoreConfig(store=str(Path(args.store).resolve()), cap_bytes=int(args.store_cap_gb * 2**30),
                        prewarm=bool(getattr(args, "prewarm", False)))
    if source is None or not (getattr(args, "map_ahead", False) or args.mapper or args.target):
        return store
    mapper = str(resolve(args.mapper, args.mapper_revision, "mapper")) if args.mapper else family.mapper_path()
    target = resolve_model(args.target, args.target_revision) if args.target else family.target_path()
    from ..core.models import resolve_dtype
    from ..serving.engine.config import check_map_ahead

    preflight(ServeConfig(mapper=mapper, source=source, target=target))  # one line, before vLLM loads anything
    check_map_ahead(mapper)
    resolve_dtype(args.map_dtype, "cpu")  # a dtype name kvbridge knows
    return StoreConfig(store=store.store, cap_bytes=store.cap_bytes, mapper=mapper, target=target,
                       dtype=args.map_dtype, prewarm=store.prewarm)


def add_cascade(p: argparse.ArgumentParser) -> None:
    """`kvbridge cascade`'s options."""
    from ..serving.bench.cascade import default_store

    p.description = ("Start both servers of a cascade, sharing one KV store: `kvbridge serve-source` for the source "
                     "(it stores its KV as it serves, and maps each stored block ahead into the target's K/V) and "
                     "`kvbridge serve --store` for the target (it reads the stored blocks of a conversation escalated "
                     "to it, and computes the new turn itself over them). With no pair, the embedded family and its "
                     "shipped mapper. Stops both on Ctrl-C.")
    p.epilog = ("Options kvbridge does not know are passed to the target's `kvbridge serve` (and through it to vLLM). "
                + EPILOG)
    add_pair(p, "engine")
    p.add_argument("--store", default=default_store(), help="the shared KV store (default: %(default)s)")
    p.add_argument("--store-cap-gb", type=float, default=2.0, help="the store's size cap (default: 2)")
    p.add_argument("--no-map-ahead", dest="map_ahead", action="store_false",
                   help="the source engine stores its K/V only; the target maps them when a turn escalates "
                        "(default: the source engine also maps each stored block ahead, in a background thread)")
    add_prewarm(p)
    add_native_rest(p)
    add_store_memory(p)
    add_lmcache(p, owner=True)
    p.add_argument("--port", type=int, default=8000, help="the target's port (default: 8000)")
    p.add_argument("--source-port", type=int, default=8001, help="the source's port (default: 8001)")
    p.add_argument("--log-dir", default="kvbridge-cascade-logs", help="the servers' logs (default: %(default)s)")


def run_cascade(args) -> int:
    from ..serving.bench.cascade import launched_pair
    from ..serving.launch import target_parallel

    target_parallel(args.vllm_args)  # before anything starts: the target's connector would refuse it later
    store_config(args)
    store_memory_bytes(args)  # (checked before anything starts)
    if args.lmcache and args.prewarm:
        raise KVBridgeError("--prewarm needs the store folder; with --lmcache drop it.")
    with lmcache_server(args, args.log_dir) as url:
        source_args, target_args = pair_argv(args, url)
        log(f"starting the source server (port {args.source_port}) and the target server (port {args.port}); logs "
            f"in {args.log_dir}/")
        with launched_pair(source_args + ["--port", str(args.source_port)],
                           target_args + ["--port", str(args.port)] + args.vllm_args, args.log_dir,
                           together=bool(url)) as (source, target):  # (no store folder to create first)
            _wait_cascade(source, target, url or Path(args.store).resolve())


def _wait_cascade(source: str, target: str, store) -> None:
    import time

    print(f"source: {source}/v1   target: {target}/v1   store: {store}\n"
          "a conversation's turns on the source are stored as it answers; send the escalated turn to the target "
          "with kv_transfer_params {\"kvbridge\": \"mapped\"} (the same cache_salt, if any). Ctrl-C stops both.",
          flush=True)
    while True:
        time.sleep(3600)


def pair_argv(args, lmcache: str | None = None) -> tuple[list[str], list[str]]:
    """``kvbridge serve-source`` and ``kvbridge serve --store`` arguments of a cascade's pair options (``lmcache``: an
    LMCache server's URL both share instead of the store: no map-ahead, no prewarm)."""
    store = ["--store", str(Path(args.store).resolve())] if not lmcache else ["--lmcache", lmcache]
    source = store + (["--store-cap-gb", str(args.store_cap_gb)] if not lmcache else [])
    target = list(store)
    ahead = ("mapper", "mapper_revision", "target", "target_revision") \
        if getattr(args, "map_ahead", False) and not lmcache else ()
    for flag in ("source", "source_revision") + ahead:
        if getattr(args, flag):
            source += [f"--{flag.replace('_', '-')}", getattr(args, flag)]
    if getattr(args, "prewarm", False) and not lmcache:
        source.append("--prewarm")
    if ahead:
        source.append("--map-ahead")
        if args.connector_dtype not in (None, "auto"):
            source += ["--map-dtype", args.connector_dtype]
    for flag in ("mapper", "mapper_revision", "source", "target", "source_revision", "target_revision", "hold_back",
                 "recompute", "connector_device", "connector_dtype", "native_rest", "store_memory_gb"):
        value = getattr(args, flag)
        if value is not None and not (flag.startswith("connector_") and value == "auto"):
            target += [f"--{flag.replace('_', '-')}", str(value)]
    if args.allow_revision_mismatch:
        target.append("--allow-revision-mismatch")
    return source, target


def pair_config(args, **settings):
    """``(ServeConfig, served model name, is the family)`` from the pair options (hub ids resolved to folders)."""
    from .. import family
    from ..core.artifact import resolve
    from ..core.models import check_device, resolve_model
    from ..serving.engine.config import ServeConfig

    if (args.source is None) != (args.target is None) or (args.source and not args.mapper):
        raise KVBridgeError("give --source, --target and --mapper together, or none of them for the embedded family.")
    if args.connector_device == "auto":
        import torch

        args.connector_device = "cuda" if torch.cuda.is_available() else "cpu"
    check_device(args.connector_device, "--connector-device")
    if args.source:
        source = resolve_model(args.source, args.source_revision)
        target = resolve_model(args.target, args.target_revision)
        name = args.target if not Path(args.target).exists() else Path(args.target).name
    else:
        source, target, name = family.source_path(), family.target_path(), "kvbridge-family"
    mapper = str(resolve(args.mapper, args.mapper_revision, "mapper")) if args.mapper else family.mapper_path()
    runtime = {k: v for k, v in (("hold_back", args.hold_back), ("recompute", args.recompute)) if v is not None}
    config = ServeConfig(mapper=mapper, source=source, target=target, device=args.connector_device,
                         dtype=args.connector_dtype, runtime=runtime,
                         allow_revision_mismatch=args.allow_revision_mismatch, **settings)
    return config, name, not args.source


def store_memory_bytes(args) -> int:
    if not 0 <= args.store_memory_gb <= 1 << 20:  # (NaN and infinity fail too)
        raise KVBridgeError(f"--store-memory-gb must be a number of GiB from 0 to 1048576, not {args.store_memory_gb}.")
    return int(args.store_memory_gb * 2**30)


@contextlib.contextmanager
def lmcache_server(args, log_dir: str | Path | None = None):
    """The LMCache URL ``--lmcache`` names (None without it); with ``auto``, a server started here (its log in
    ``log_dir``) and stopped, by its own process id, when the block ends."""
    from ..serving.store.lmcache_store import normal_url, start_server

    if not getattr(args, "lmcache", None):
        yield None
        return
    if args.lmcache != "auto":
        yield normal_url(args.lmcache)
        return
    if not 0 < args.lmcache_l1_gb <= 1 << 20:
        raise KVBridgeError(f"--lmcache-l1-gb must be a positive number of GiB, not {args.lmcache_l1_gb}.")
    if log_dir is not None:
        Path(log_dir).mkdir(parents=True, exist_ok=True)
    with open(Path(log_dir) / "lmcache.log" if log_dir else os.devnull, "w") as out:
        process, url = start_server(l1_gb=args.lmcache_l1_gb, l2=args.lmcache_l2, log=out)
        log(f"LMCache server at {url} (pid {process.pid}, {args.lmcache_l1_gb:g} GiB memory"
            f"{', tier ' + args.lmcache_l2 if args.lmcache_l2 else ''})")
        try:
            yield url
        finally:
            from ..serving.store.lmcache_store import stop_server

            stop_server(process)
