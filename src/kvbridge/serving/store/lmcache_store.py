"""The source engine's KV read from LMCache: warm transfer across machines without a folder of kvbridge's own.

Letters: L source layers, T tokens, H kv heads, D head dim, B the engines' block size.

The source engine stores its K/V through vLLM's stock ``LMCacheMPConnector`` (:func:`source_transfer_config`) into an
LMCache server (``lmcache server``, :func:`start_server`) that both engines reach; LMCache keys a chunk by the
engine's model name, its token prefix and the request's ``cache_salt``. The target's connector reads from there
(:class:`LMCacheSource`) through LMCache's multi-process adapters, as a second vLLM worker would: a lookup (how many
of a prompt's tokens are stored, whole chunks only), a retrieve into pages of the source engine's layout registered
with the server, then those pages decoded into per-layer K/V (:func:`decode_pages`: the CPU backend's fp32 layout;
any other is refused by name) and range-checked (NaN, Inf and magnitudes no model's K/V reach are refused like a
corrupted entry). The answer has the folder store's shape (:class:`kvbridge.serving.store.folder.Found`, without hidden
states: LMCache keeps K/V only), so the connector's warm path takes it as it takes the folder's.

Nothing here raises into the engine: a miss is zero tokens, a foreign entry (another model name or salt) is a miss
by LMCache's keys, an unreachable server or a timeout is zero tokens with a reason, and the reader waits
:data:`RETRY_S` before dialing a server that failed again. Every wait is bounded by ``timeout_s``.
"""

from __future__ import annotations

import itertools
import math
import os
import shutil
import socket
import subprocess
import threading
import time
from dataclasses import dataclass

import torch

from ...errors import InputError, UnsupportedModelError
from .folder import Found

os.environ.setdefault("LMCACHE_TRACK_USAGE", "false")  # (LMCache reports usage unless told not to)

DEFAULT_TIMEOUT_S = 2.0  # each LMCache round trip (connect, lookup, retrieve) waits at most this long
RETRY_S = 10.0  # after a failure to reach the server, the reader answers "unreachable" this long before retrying
MAX_ABS = 65504.0  # beyond float16's range: no model's K/V, a corrupted or hostile entry
DEFAULT_MAX_TOKENS = 4096  # the longest stored prefix one retrieve reads (the registered pages' capacity)
DEFAULT_CHUNK = 256  # LMCache's chunk size for a server kvbridge starts (a multiple of the engines' block size)
LAYOUTS = ("cpu/vec/float32",)  # the source page layouts decode_pages reads
READ_PHASES = ("connect", "lookup", "retrieve", "decode", "check")  # LMCacheSource.lookup's time, by phase


def parse_url(url: str) -> tuple[str, int]:
    """``(host, port)`` of an LMCache server URL (``tcp://host:port`` or ``host:port``); InputError otherwise."""
    if not isinstance(url, str) or not url:
        raise InputError(f"kvbridge: an LMCache server is tcp://HOST:PORT, not {url!r}.")
    rest = url.split("://", 1)[1] if "://" in url else url
    host, _, port = rest.rpartition(":")
    if url.split("://", 1)[0] not in ("tcp", url) or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise InputError(f"kvbridge: an LMCache server is tcp://HOST:PORT, not {url!r}.")
    return host, int(port)


def normal_url(url: str) -> str:
    host, port = parse_url(url)
    return f"tcp://{host}:{port}"


def source_transfer_config(url: str, timeout_s: float = 60.0) -> dict:
    """vLLM's ``kv_transfer_config`` for a source engine that stores its K/V in the LMCache server at ``url``
    through vLLM's own ``LMCacheMPConnector`` (no kvbridge code in that engine)."""
    host, port = parse_url(url)
    return {"kv_connector": "LMCacheMPConnector", "kv_role": "kv_both",
            "kv_connector_extra_config": {"lmcache.mp.host": f"tcp://{host}", "lmcache.mp.port": port,
                                          "lmcache.mp.mq_timeout": timeout_s}}


def page_layout(device: str, dtype: torch.dtype, block_size: int, head_dim: int) -> str:
    """The name of the paged layout a vLLM engine on ``device`` keeps K/V in (what :func:`decode_pages` is told):
    ``cpu/<isa>/<dtype>`` for vLLM's CPU backend (its ISA chosen as that backend chooses it), ``<device>/<dtype>``
    otherwise."""
    name = str(dtype).removeprefix("torch.")
    if device != "cpu":
        return f"{device}/{name}"
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    return f"cpu/{_get_attn_isa(dtype, block_size, head_dim)}/{name}"


def check_layout(layout: str) -> None:
    if layout not in LAYOUTS:
        raise UnsupportedModelError(f"kvbridge: the source engine keeps its K/V in the page layout {layout!r}, which "
                                    f"kvbridge does not decode from LMCache (it decodes {', '.join(LAYOUTS)}: "
                                    "vLLM's CPU backend in float32).")


def decode_pages(pages: list[torch.Tensor], blocks: int, tokens: int, layout: str) -> tuple[torch.Tensor,
                                                                                           torch.Tensor]:
    """``(keys, values)`` (L, tokens, H, D) from the first ``blocks`` pages of each layer's cache (``pages``: per
    layer (blocks', H, B, 2·D), as the source engine's attention backend lays them out). ``cpu/vec/float32``: per
    block and head, the keys transposed (D, B), then the values (B, D)."""
    check_layout(layout)
    n, heads, block, width = pages[0].shape
    d = width // 2
    flat = torch.stack([p[:blocks] for p in pages]).reshape(len(pages), blocks, heads, 2 * block * d)
    keys = flat[..., :block * d].reshape(len(pages), blocks, heads, d, block).permute(0, 1, 4, 2, 3)
    values = flat[..., block * d:].reshape(len(pages), blocks, heads, block, d).permute(0, 1, 3, 2, 4)
    shape = (len(pages), blocks * block, heads, d)
    return keys.reshape(shape)[:, :tokens].contiguous(), values.reshape(shape)[:, :tokens].contiguous()


def out_of_range(tensors, bound: float = MAX_ABS) -> str | None:
    """Why ``tensors`` cannot be a model's K/V (NaN, Inf, or a magnitude beyond ``bound``), None when they can."""
    for t in tensors:
        top = float(t.abs().amax()) if t.numel() else 0.0  # (NaN propagates through amax)
        if not math.isfinite(top):
            return "the stored K/V hold NaN or Inf"
        if top > bound:
            return f"the stored K/V hold a magnitude of {top:.3g} (beyond {bound:g})"
    return None


@dataclass(frozen=True)
class Geometry:
    """The source's KV geometry: what the pages registered with LMCache must hold."""

    num_layers: int
    num_kv_heads: int
    head_dim: int


class LMCacheSource:
    """The source engine's stored K/V in an LMCache server, read by another process (the target's connector).

    ``model_name``: the string the source engine was given (LMCache keys by it); ``block_size``: the source engine's
    vLLM block size; ``layout``: its page layout (:func:`page_layout`); ``max_tokens``: the longest prefix one read
    takes (the pages registered with the server hold that many tokens); ``reads`` False: lookups only (a scheduler
    counting stored tokens: no pages). Thread-safe; connects on first use."""

    _ids = itertools.count()

    def __init__(self, url: str, model_name: str, block_size: int, geometry: Geometry, layout: str = LAYOUTS[0],
                 timeout_s: float = DEFAULT_TIMEOUT_S, max_tokens: int = DEFAULT_MAX_TOKENS, logger=None,
                 reads: bool = True):
        self.url = normal_url(url)
        if not isinstance(model_name, str) or not model_name:
            raise InputError(f"kvbridge: the source engine's model name must be a string, not {model_name!r}.")
        if not isinstance(timeout_s, (int, float)) or isinstance(timeout_s, bool) or not 0 < timeout_s <= 600:
            raise InputError(f"kvbridge: the LMCache timeout must be in (0, 600] seconds, not {timeout_s!r}.")
        check_layout(layout)
        import importlib.util

        if importlib.util.find_spec("lmcache") is None:
            raise InputError("kvbridge: reading the source's K/V from LMCache needs the lmcache package (pip install "
                             "lmcache==0.5.6, or kvbridge[serve]).")
        self.model_name, self.block_size, self.geometry, self.layout = model_name, block_size, geometry, layout
        self.timeout_s, self.max_tokens, self.logger, self.reads = float(timeout_s), max_tokens, logger, reads
        self._lock = threading.Lock()
        self._context = self._scheduler = self._worker = None
        self._pages: list[torch.Tensor] = []
        self._down_until = 0.0
        self._down_reason: str | None = None
        self.chunk = 0  # LMCache's chunk size, once connected

    # -- connection ---------------------------------------------------------------------------
    def _connect(self) -> None:
        import zmq
        from lmcache.integration.vllm.vllm_multi_process_adapter import (
            LMCacheMPSchedulerAdapter,
            LMCacheMPWorkerAdapter,
            ParallelStrategy,
        )

        self._context = zmq.Context.instance()  # (the process's one: terminating it waits on the adapters' threads)
        strategy = ParallelStrategy(mla_only=False, vllm_world_size=1, vllm_worker_id=0, tp_size=1, pp_size=1,
                                    n_servers=1)
        common = dict(context=self._context, model_name=self.model_name, vllm_block_size=self.block_size,
                      parallel_strategy=strategy, mq_timeout=self.timeout_s, heartbeat_interval=5.0)
        self._scheduler = LMCacheMPSchedulerAdapter(server_urls=[self.url], **common)
        self.chunk = self._scheduler.lmcache_tokens_per_chunk
        if not self.reads:
            return
        self._worker = LMCacheMPWorkerAdapter(server_url=self.url, **common)
        g = self.geometry
        blocks = -(-self.max_tokens // self.block_size)
        self._pages = [torch.zeros(blocks, g.num_kv_heads, self.block_size, 2 * g.head_dim)
                       for _ in range(g.num_layers)]
        self._worker.register_kv_caches({f"model.layers.{i}.self_attn.attn": p for i, p in enumerate(self._pages)},
                                        layout_hints={"kv_layout": "HND"})

    def _ready(self) -> str | None:
        """None when connected (connecting now if needed), else why not (without dialing while backing off)."""
        if self._scheduler is not None:
            if self._scheduler.is_healthy and (self._worker is None or self._worker.is_healthy):
                return None
            self._fail("the LMCache server stopped answering")
            return self._down_reason
        if time.monotonic() < self._down_until:
            return self._down_reason
        try:
            self._connect()
            return None
        except Exception as exc:  # (unreachable: ConnectionError after timeout_s)
            self._fail(f"LMCache at {self.url} unreachable ({type(exc).__name__}: "
                       f"{str(exc).splitlines()[0][:160] if str(exc) else ''})")
            return self._down_reason

    def _fail(self, reason: str) -> None:
        self._close()
        self._down_until, self._down_reason = time.monotonic() + RETRY_S, reason
        if self.logger is not None:
            self.logger.warning("kvbridge: %s; the cold path answers (retrying in %.0f s)", reason, RETRY_S)

    def _close(self) -> None:
        for adapter in (self._worker, self._scheduler):
            if adapter is not None:
                try:
                    adapter.shutdown()
                except Exception:  # (a server gone: nothing to unregister from)
                    pass
        self._context = self._scheduler = self._worker = None
        self._pages = []

    def close(self) -> None:
        with self._lock:
            self._close()

    # -- lookup and retrieve ------------------------------------------------------------------
    def _lookup(self, rid: str, ids: list[int], salt: str) -> int | str:
        """Stored tokens of ``ids`` (whole chunks), or a reason."""
        scheduler = self._scheduler
        scheduler.maybe_submit_lookup_request(rid, ids, cache_salt=salt)
        deadline = time.monotonic() + self.timeout_s
        while (hit := scheduler.check_lookup_result(rid)) is None:
            if time.monotonic() > deadline:
                self._fail(f"an LMCache lookup took over {self.timeout_s:g} s")
                return self._down_reason
            time.sleep(0.002)
        if not scheduler.is_healthy:
            self._fail("the LMCache server stopped answering a lookup")
            return self._down_reason
        return int(hit)

    def _release(self, rid: str, ids: list[int], salt: str, hit: int) -> None:
        """Frees what a lookup locked and not retrieved (all of it, for a count only) and ends its session."""
        scheduler = self._scheduler
        if scheduler is None:
            return
        try:
            if hit:
                scheduler.free_lookup_locks(ids, 0, hit, rid, cache_salt=salt)
            scheduler.end_session(rid)
            scheduler.cleanup_lookup_result(rid)
        except Exception:  # (a server gone meanwhile: its locks went with it)
            pass

    def stored_tokens(self, ids: list[int], salt: str | None, limit: int) -> int:
        """How many of the first ``limit`` tokens of ``ids`` LMCache holds for the source (0 on any failure)."""
        with self._lock:
            if self._ready() is not None:
                return 0
            rid = f"kvbridge-count-{os.getpid()}-{next(self._ids)}"
            ids = list(ids[:min(limit, self.max_tokens)])
            hit = self._lookup(rid, ids, salt or "")
            self._release(rid, ids, salt or "", hit if isinstance(hit, int) else 0)
            return min(hit, limit) if isinstance(hit, int) else 0

    def lookup(self, ids: list[int], salt: str | None, limit: int, phases: dict[str, float] | None = None) -> Found:
        """The longest stored prefix of ``ids`` within its first ``limit`` tokens (whole LMCache chunks), decoded
        and checked: a :class:`Found` (``tokens`` 0 on a miss; ``reason`` says why nothing could be used when
        something failed). ``phases``: where the time went, added to it in ms (:data:`READ_PHASES`: ``connect``
        when this read dialed the server, ``lookup``, ``retrieve``, ``decode`` of the page layout, ``check`` of the
        values' range)."""
        phases = {} if phases is None else phases

        def lap(phase: str, since: float) -> float:
            now = time.perf_counter()
            phases[phase] = phases.get(phase, 0.0) + 1000 * (now - since)
            return now

        with self._lock:
            idle, backoff, started = self._scheduler is None, self._down_until, time.perf_counter()
            reason = self._ready()
            if idle and (self._scheduler is not None or self._down_until != backoff):  # it dialed (a first read, a
                started = lap("connect", started)  # retry after a failure), whether or not the server answered
            if reason is not None:
                return Found(0, refused=1, reason=reason)
            rid = f"kvbridge-read-{os.getpid()}-{next(self._ids)}"
            ids, salt = list(ids[:min(limit, self.max_tokens)]), salt or ""
            hit = self._lookup(rid, ids, salt)
            started = lap("lookup", started)
            if isinstance(hit, str):
                return Found(0, refused=1, reason=hit)
            if hit == 0:
                self._release(rid, ids, salt, 0)
                return Found(0)
            got = self._retrieve(rid, ids, salt, hit, lap)
            if isinstance(got, str):
                return Found(0, refused=1, reason=got)
        keys, values = got
        n = min(hit, limit)
        started = time.perf_counter()
        bad = out_of_range((keys, values))
        lap("check", started)
        if bad is not None:
            return Found(0, refused=1, reason=f"LMCache entry refused: {bad}")
        return Found(n, parts=[(keys[:, :n], values[:, :n], None, False)])

    def _retrieve(self, rid: str, ids: list[int], salt: str, hit: int, lap) -> tuple[torch.Tensor, torch.Tensor] | str:
        """The ``hit`` stored tokens' K/V, retrieved into the registered pages and decoded (``lap(phase, since)``
        counts each phase's time and returns now), or a reason."""
        from lmcache.integration.vllm.vllm_multi_process_adapter import LoadStoreOp

        started = time.perf_counter()
        worker = self._worker
        blocks = hit // self.block_size
        for p in self._pages:  # (a retrieve that writes less than it says must not leave another request's K/V)
            p[:blocks].fill_(float("nan"))
        op = LoadStoreOp(token_ids=ids[:hit], block_ids=[list(range(blocks))], start=0, end=hit)
        try:
            worker.submit_retrieve_request(rid, op, None, cache_salt=salt)
            deadline = time.monotonic() + self.timeout_s
            while True:
                _, done = worker.get_finished(set())
                if done and rid in done:
                    break
                if time.monotonic() > deadline:
                    self._fail(f"an LMCache retrieve took over {self.timeout_s:g} s")
                    return self._down_reason
                time.sleep(0.002)
            failed = worker.get_failed_request_ids()
        finally:
            self._release(rid, ids, salt, 0)
        started = lap("retrieve", started)
        if rid in failed:
            return "LMCache could not retrieve the stored chunks"
        keys, values = decode_pages(self._pages, blocks, hit, self.layout)
        lap("decode", started)
        return keys, values


# -- a server kvbridge owns ---------------------------------------------------------------------
def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def server_command(host: str, port: int, l1_gb: float = 1.0, chunk_size: int = DEFAULT_CHUNK,
                   l2: str | None = None, http_port: int | None = None) -> list[str]:
    """The ``lmcache server`` command kvbridge runs: pages move over its TCP socket (LMCache's default, no shared
    memory: engines on other machines read it too) (``l2``: an ``--l2-adapter`` JSON: a disk or Redis tier;
    ``http_port``: its HTTP status and metrics port, a free one by default: LMCache's own default, 8080, is often
    taken)."""
    exe = shutil.which("lmcache")
    if exe is None:
        raise InputError("kvbridge: the lmcache command is not installed (pip install 'kvbridge[serve]', which "
                         "brings lmcache==0.5.6).")
    command = [exe, "server", "--host", host, "--port", str(port), "--l1-size-gb", f"{l1_gb:g}",
               "--eviction-policy", "LRU", "--chunk-size", str(chunk_size), "--supported-transfer-mode", "auto",
               "--http-host", host,
               "--http-port", str(http_port or free_port(host))]
    return command + (["--l2-adapter", l2] if l2 else [])


def start_server(host: str = "127.0.0.1", port: int | None = None, l1_gb: float = 1.0,
                 chunk_size: int = DEFAULT_CHUNK, l2: str | None = None, log=None,
                 ready_s: float = 60.0) -> tuple[subprocess.Popen, str]:
    """Starts an LMCache server (its own process group) and waits until it answers: ``(process, url)``. Stop it
    with :func:`stop_server`."""
    port = port or free_port(host)
    env = {**os.environ, "LMCACHE_TRACK_USAGE": "false"}
    out = log or subprocess.DEVNULL
    process = subprocess.Popen(server_command(host, port, l1_gb, chunk_size, l2), env=env, start_new_session=True,
                               stdout=out, stderr=subprocess.STDOUT if log else subprocess.DEVNULL)
    url = f"tcp://{host}:{port}"
    deadline = time.monotonic() + ready_s
    while not answers(url, timeout_s=5.0):  # (a client gone before the answer makes the server log an error)
        if process.poll() is not None:
            raise InputError(f"kvbridge: the LMCache server exited with status {process.returncode} at start "
                             f"(command: {' '.join(server_command(host, port, l1_gb, chunk_size, l2))}).")
        if time.monotonic() > deadline:
            stop_server(process)
            raise InputError(f"kvbridge: the LMCache server did not answer at {url} within {ready_s:g} s.")
        time.sleep(0.5)
    return process, url


def answers(url: str, timeout_s: float = 1.0) -> bool:
    """Whether an LMCache server answers at ``url`` (its chunk size asked)."""
    try:
        import zmq
        from lmcache.integration.vllm.vllm_multi_process_adapter import RequestClientFactory, get_lmcache_chunk_size
    except ImportError:
        return False
    context = zmq.Context.instance()
    client = None
    try:
        client = RequestClientFactory.create(normal_url(url), context=context)
        return get_lmcache_chunk_size(client, timeout=timeout_s) > 0
    except Exception:
        return False
    finally:
        if client is not None:
            client.close()


def stop_server(process: subprocess.Popen, timeout_s: float = 10.0) -> None:
    """Stops a server :func:`start_server` started: its own process (by id), then, if it lingers, kills it."""
    if process.poll() is not None:
        return
    process.terminate()
    try:
        process.wait(timeout_s)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait(timeout_s)
