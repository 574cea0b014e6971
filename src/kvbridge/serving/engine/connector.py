"""A vLLM KV connector that fills a target engine's paged cache with mapped K/V (vLLM's v1 connector API).

Letters: T prompt tokens, m held-back tokens, n tokens the connector loads, H kv heads, D head dim.

The engine asks the connector, per new request, how many prompt tokens it can supply beyond the engine's own
prefix-cache hit (``get_num_new_matched_tokens``). For a request that asks for mapped K/V the answer is every
prompt token but the last ``m`` (``hold_back``) — with the source engine's KV store, when the prompt's stored
prefix leaves at most ``native_rest`` tokens before them (a conversation's new turn), that prefix only, and the
engine computes the rest itself; the scheduler allocates their blocks and, in the same step,
the worker side runs the source prefill and the mapper through kvbridge's own transformers path
(:class:`kvbridge.Bridge`: every lever of the artifact, selective recompute included, RoPE re-applied at the
positions vLLM uses) and writes the post-RoPE K/V through the attention backend's own cache-update op
(``do_kv_cache_update`` with a slot mapping: the paged layout is the backend's business). The engine then
computes the held-back tokens itself, over the mapped prefix, and decodes as usual, batched with everything else.

Asynchronous loads (``sync_load: false`` in the settings, ``kvbridge serve --async-load``, or ``"kvbridge_load":
"async"`` per request; synchronous is the default: it measured better on a 2-core CPU): the connector answers vLLM
that the request's prefix loads asynchronously, the scheduler allocates its blocks and parks it in
``WAITING_FOR_REMOTE_KVS``, and the worker runs the source prefill and the map (cold), or the store read and the map
(warm), in a thread of its own (on a GPU, on a side CUDA stream) while the engine keeps stepping the other requests;
once the blocks are written the worker reports the request in ``get_finished`` and it joins the batch. Synchronous
loads run inside ``start_load_kv``, before the step's forward, every running request waiting for them. One map runs
at a time either way. While the engine has nothing else to step, the worker waits for
a load to finish (at most ``IDLE_WAIT_S``) rather than spin through empty steps.

Transfer is an optimization, never a dependency: when mapping fails for a request (an exception, a non-finite
cache) its blocks are reported as failed loads and vLLM (``kv_load_failure_policy="recompute"``) prefills them
natively; the request is answered, the fallback counted, logged, and named in the response's
``kv_transfer_params`` (``{"kvbridge": "mapped" | "native" | "short" | "cached: …" | "fallback: <reason>", ...}``).
A prompt the source cannot hold (longer than its positions) is prefilled natively from the start.

Approximate K/V stay approximate: with prefix caching on, the connector maps only requests whose
``cache_salt`` lies in the mapper's namespace (:func:`kvbridge.serving.engine.config.namespace`; ``kvbridge serve``
sets it), so mapped blocks are never a prefix-cache hit for a native request or another mapper's.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorWorkerMetadata,
)
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics, KVConnectorStats
from vllm.logger import init_logger

from ...errors import CompatibilityError, UnsupportedModelError
from .config import (
    PARAM,
    ServeConfig,
    client_salt,
    in_namespace,
    mapper_namespace,
    request_hold_back,
    request_load,
    request_mode,
    request_native_rest,
    request_use_store,
)

IDLE_WAIT_S = 0.01  # an empty engine step waits this long at most for an asynchronous load to finish
logger = init_logger("vllm.kvbridge")  # under vLLM's own logger: its handlers and level
STATUSES = ("mapped", "cached", "native", "short", "fallback")
# counters beside them: name -> /metrics documentation
COUNTS = {"stored_tokens": "prompt tokens mapped from the source engine's stored K/V (warm transfer: no source "
                           "prefill)",
          "premapped_tokens": "prompt tokens whose target K/V the source engine mapped ahead (read, not mapped)",
          "hot_tokens": "of those, prompt tokens read from the connector's memory (loaded as the source engine "
                        "announced them)",
          "store_refused": "mapped requests whose store lookup refused an entry (another source model or map, "
                           "torn or corrupted)"}


# a load's time reading a stored source prefix, by phase: from LMCache (connect, when the read dialed the server;
# lookup, retrieve, decode of the source engine's page layout, check of the values' range) or from the store's folder
# (read: the entries found, checked); then the map and the writes into the engine's paged cache
PHASES = ("connect", "lookup", "retrieve", "decode", "check", "read", "map", "write")
# a finished load: (outcome, ms, stored tokens, refusal, premapped tokens, of them from memory, write ms, ms by phase
# (empty when no store was consulted))
Outcome = tuple[str, float, int, str | None, int, int, float, dict]


@dataclass
class Load:
    """One request's mapped prefix: K/V of prompt positions [start, end) into ``block_ids`` (the request's blocks,
    in order); the source reads ``token_ids`` (its first ``end`` prompt tokens)."""

    request_id: str
    token_ids: list[int]
    start: int
    end: int
    block_ids: list[int]
    salt: str | None = None  # the client's own cache_salt: the store's entries are keyed by it too
    use_store: bool | str = True  # True, False, "folder" or "source" (config.request_use_store)
    asynchronous: bool = False  # mapped in the worker's thread, beside the engine's steps


@dataclass
class KVBridgeMetadata(KVConnectorMetadata):
    loads: list[Load] = field(default_factory=list)
    idle: bool = False  # the step schedules no token: the worker may wait for an asynchronous load


@dataclass
class KVBridgeWorkerMetadata(KVConnectorWorkerMetadata):
    """Worker → scheduler: each loaded request's outcome (``"mapped"`` or ``"fallback: …"``), map time, prefix tokens
    read from the store, why a store entry was refused (None: none was), and prefix tokens whose target K/V the
    source engine had mapped ahead (of them, read from the connector's memory), of the map time, the writes into
    the engine's paged cache, and where the time of a load that read the store went (:data:`PHASES`)."""

    outcomes: dict[str, Outcome] = field(default_factory=dict)

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        merged = dict(self.outcomes)
        for rid, outcome in getattr(other, "outcomes", {}).items():
            if rid in merged and merged[rid][0] == "mapped" and outcome[0] != "mapped":
                merged[rid] = outcome  # one worker's failure makes the request's load a failure
            elif rid in merged and merged[rid][0] == outcome[0] == "mapped":  # each worker has its own memory tier:
                # what all of them read there; the slowest worker's writes and phases
                phases = {k: max(merged[rid][7].get(k, 0.0), outcome[7].get(k, 0.0))
                          for k in {**merged[rid][7], **outcome[7]}}
                merged[rid] = merged[rid][:5] + (min(merged[rid][5], outcome[5]), max(merged[rid][6], outcome[6]),
                                                 phases)
            else:
                merged.setdefault(rid, outcome)
        return KVBridgeWorkerMetadata(merged)


@dataclass
class KVBridgeStats(KVConnectorStats):
    """Request counts by outcome, the map's time, prefix tokens read from the source's KV store (and of them, mapped
    ahead) and store entries refused, since the last interval (vLLM logs and exports them)."""

    def __post_init__(self):
        if not self.data:
            self.reset()

    def reset(self):
        self.data = {**{s: 0 for s in STATUSES}, "map_ms": 0.0, "write_ms": 0.0, **{c: 0 for c in COUNTS},
                     **{f"read_{p}_ms": 0.0 for p in PHASES}}

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        for key, value in other.data.items():
            self.data[key] = self.data.get(key, 0) + value
        return self

    def reduce(self) -> dict[str, int | float]:
        return {**{s: self.data.get(s, 0) for s in STATUSES}, "map_ms": round(self.data.get("map_ms", 0.0), 1),
                "write_ms": round(self.data.get("write_ms", 0.0), 1),
                **{c: self.data.get(c, 0) for c in COUNTS},
                **{f"read_{p}_ms": round(self.data[f"read_{p}_ms"], 1) for p in PHASES
                   if self.data.get(f"read_{p}_ms")}}

    def is_empty(self) -> bool:
        return not any(self.data.get(s) for s in STATUSES)


class KVBridgePromMetrics(KVConnectorPromMetrics):
    """``/metrics``: ``vllm:kvbridge_requests_total{outcome=…}``, ``vllm:kvbridge_map_seconds_total`` (of it
    ``vllm:kvbridge_write_seconds_total``, the cache writes),
    ``vllm:kvbridge_stored_tokens_total``, ``vllm:kvbridge_premapped_tokens_total``,
    ``vllm:kvbridge_hot_tokens_total``, ``vllm:kvbridge_store_refused_total`` and
    ``vllm:kvbridge_read_seconds_total{phase=…}`` (the loads that read a stored source prefix, by phase:
    :data:`PHASES`)."""

    def __init__(self, vllm_config, metric_types, labelnames, per_engine_labelvalues):
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        requests = self._counter_cls(name="vllm:kvbridge_requests", documentation="kvbridge requests by outcome "
                                     "(mapped, native, short, fallback)", labelnames=[*labelnames, "outcome"])
        seconds = self._counter_cls(name="vllm:kvbridge_map_seconds", documentation="time the kvbridge connector "
                                    "spent building mapped caches", labelnames=labelnames)
        writes = self._counter_cls(name="vllm:kvbridge_write_seconds", documentation="of that time, writing the "
                                   "mapped K/V into the engine's paged cache (its own cache-update op)",
                                   labelnames=labelnames)
        counters = {c: self._counter_cls(name=f"vllm:kvbridge_{c}", documentation=doc, labelnames=labelnames)
                    for c, doc in COUNTS.items()}
        reads = self._counter_cls(name="vllm:kvbridge_read_seconds", documentation="time of the loads that read a "
                                  "stored source prefix (the store's folder or LMCache), by phase: connect, lookup, "
                                  "retrieve, decode, check (LMCache), read (the folder), map, write",
                                  labelnames=[*labelnames, "phase"])
        self._requests = {(e, s): requests.labels(*values, s) for e, values in per_engine_labelvalues.items()
                          for s in STATUSES}
        self._seconds = {e: seconds.labels(*values) for e, values in per_engine_labelvalues.items()}
        self._writes = {e: writes.labels(*values) for e, values in per_engine_labelvalues.items()}
        self._counts = {(e, c): counter.labels(*values) for e, values in per_engine_labelvalues.items()
                        for c, counter in counters.items()}
        self._reads = {(e, p): reads.labels(*values, p) for e, values in per_engine_labelvalues.items()
                       for p in PHASES}

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0):
        for status in STATUSES:
            if transfer_stats_data.get(status):
                self._requests[(engine_idx, status)].inc(transfer_stats_data[status])
        if transfer_stats_data.get("map_ms"):
            self._seconds[engine_idx].inc(transfer_stats_data["map_ms"] / 1000)
        if transfer_stats_data.get("write_ms"):
            self._writes[engine_idx].inc(transfer_stats_data["write_ms"] / 1000)
        for c in COUNTS:
            if transfer_stats_data.get(c):
                self._counts[(engine_idx, c)].inc(transfer_stats_data[c])
        for phase in PHASES:
            if transfer_stats_data.get(f"read_{phase}_ms"):
                self._reads[(engine_idx, phase)].inc(transfer_stats_data[f"read_{phase}_ms"] / 1000)


def _same_model(a: str, b: str) -> bool:
    try:
        return Path(a).resolve() == Path(b).resolve()
    except OSError:
        return a == b


def worker_heads(num_kv_heads: int, tensor_parallel: int) -> slice:
    """The target's KV heads this worker's cache holds, as vLLM shards them over ``tensor_parallel`` workers: an
    equal run of heads each, or, with more workers than heads, one head each, replicated across neighbours."""
    if tensor_parallel == 1:
        return slice(None)
    from vllm.distributed import get_tensor_model_parallel_rank

    rank = get_tensor_model_parallel_rank()
    if num_kv_heads >= tensor_parallel:
        share = num_kv_heads // tensor_parallel
        return slice(rank * share, (rank + 1) * share)
    head = rank // (tensor_parallel // num_kv_heads)
    return slice(head, head + 1)


def target_copy(config: ServeConfig, runtime, dtype: torch.dtype):
    """The target as the connector's worker loads it beside the engine's own weights: a transformers copy of its
    weights only when ``runtime`` (the mapper's options with the server's overrides) runs them (selective
    recompute, a native sink, the target's own first layers); otherwise its config and rotary module, what the map's
    RoPE needs (on the real 8B in bfloat16 the copy would be another 15.8 GiB on the engine's device)."""
    from ...core.models import load_model, load_rope_model

    load = load_model if runtime.recompute > 0 or runtime.sink or runtime.native_layers else load_rope_model
    return load(config.target, device=config.device, dtype=dtype)


class KVBridgeConnector(KVConnectorBase_V1):
    """The kvbridge connector: ``kv_connector="KVBridgeConnector"``, ``kv_connector_module_path=
    "kvbridge.serving.engine.connector"``, settings in ``kv_connector_extra_config`` (:class:`ServeConfig`)."""

    def __init__(self, vllm_config, role: KVConnectorRole, kv_cache_config=None):
        super().__init__(vllm_config, role, kv_cache_config)
        from ...core.mapper_config import read_config

        self.config = ServeConfig.from_extra(self._kv_transfer_config.kv_connector_extra_config or {})
        served = vllm_config.model_config.model
        if not _same_model(served, self.config.target):
            raise CompatibilityError(f"kvbridge connector: the engine serves {served!r} but the mapper's target is "
                                     f"{self.config.target!r}; serve the target the mapper was fitted for.")
        if vllm_config.cache_config.cache_dtype not in ("auto", None):
            raise UnsupportedModelError(f"kvbridge connector: kv cache dtype {vllm_config.cache_config.cache_dtype!r} "
                                        "is not supported; serve with the model's own dtype (--kv-cache-dtype auto).")
        policy = getattr(self._kv_transfer_config, "kv_load_failure_policy", "recompute")
        if policy != "recompute":
            raise CompatibilityError(f"kvbridge connector: kv_load_failure_policy is {policy!r}; it must be "
                                     "'recompute', so that a failed map is a native prefill, not a failed request.")
        parallel = vllm_config.parallel_config
        sizes = {name: getattr(parallel, name, 1) or 1 for name in ("pipeline_parallel_size",
                                                                     "decode_context_parallel_size",
                                                                     "prefill_context_parallel_size")}
        if any(v != 1 for v in sizes.values()):
            found = ", ".join(f"{k}={v}" for k, v in sizes.items() if v != 1)
            raise UnsupportedModelError(f"kvbridge connector: {found}; the connector writes every layer of the "
                                        "target and each worker's share of its heads, so it serves one device or "
                                        "tensor parallel engines (--tensor-parallel-size), not pipeline or context "
                                        "parallel ones (for now).")
        self.tensor_parallel = getattr(parallel, "tensor_parallel_size", 1) or 1
        mapper_config = read_config(self.config.mapper)
        self.runtime = mapper_config.runtime.override(**self.config.runtime)
        self.hold_back = self.runtime.hold_back
        self.source_positions = mapper_config.source.max_positions or 10**12
        self.block_size = vllm_config.cache_config.block_size
        self.prefix_caching = bool(vllm_config.cache_config.enable_prefix_caching)
        self.namespace = mapper_namespace(self.config)
        # scheduler side
        self._status: dict[str, str] = {}  # request id -> its outcome so far (once the engine allocated it)
        # request id -> (outcome, tokens to load, end of the mapped prefix, asynchronous): asked, not yet allocated
        self._decided: dict[str, tuple[str, int, int, bool]] = {}
        self._tokens: dict[str, int] = {}  # request id -> prompt tokens mapped
        self._map_ms: dict[str, tuple[float, float]] = {}  # request id -> (map ms, of them cache writes)
        self._read_ms: dict[str, dict[str, float]] = {}  # request id -> ms by phase of a load that read the store
        # request id -> prefix tokens from the store, mapped ahead, of them read from memory
        self._stored: dict[str, tuple[int, int, int]] = {}
        self._planned: dict[str, Load] = {}  # allocated this step, sent with the next metadata
        self._counted: dict[str, tuple[int, int]] = {}  # request id -> (limit, stored tokens): asked each step
        self._stats = KVBridgeStats()
        # worker side
        self._bridge = None
        self._layers: list[tuple[int, Any]] | None = None
        self._heads = slice(None)  # this worker's KV heads of the target (its tensor-parallel share)
        self._failed_blocks: set[int] = set()
        self._outcomes: dict[str, Outcome] = {}
        self._map_lock = threading.Lock()  # one map at a time: the engine's thread's (sync) or the loader's (async)
        self._loader: ThreadPoolExecutor | None = None  # the asynchronous loads' thread, once one is asked for
        self._pending: dict[str, tuple[Load, Future]] = {}  # request id -> its asynchronous load
        self._store = None  # the source engine's KV store, once it exists
        self._hot = None  # its blocks mapped ahead by this map, in memory (kvbridge.serving.store.hot)
        self._clock = None  # when the engine's steps run (the prefetch waits for a quiet spell)
        self._identity: str | None = None
        self._map_id: str | None = None  # the map whose entries the source engine mapped ahead
        self._lmcache = None  # the source engine's K/V in LMCache (kvbridge.serving.store.lmcache_store), with lmcache
        self._refusals: dict[str, str] = {}  # request id -> why its stored prefix was not (all) used
        if role == KVConnectorRole.WORKER:
            self._bridge = self._load_bridge()
        elif self.config.lmcache:  # the scheduler counts the stored prefix (lookups only: no pages)
            self._lmcache = self._lmcache_source(vllm_config, reads=False)
        elif self.config.store:  # the scheduler counts how much of a prompt is stored (no weights loaded)
            try:
                from ..store.keys import folder_identity

                self._identity = folder_identity(self.config.source)
            except Exception as exc:  # the store is an optimization: every prompt token is then loaded
                logger.warning("kvbridge connector: cannot tell the source's store identity from %s (%s); the "
                               "rest after a stored prefix is mapped from the source, never left to the engine",
                               self.config.source, exc)

    # -- worker side ---------------------------------------------------------------------------
    def _load_bridge(self):
        """Source, mapper and target (:func:`target_copy`) where the config says; checked against each other."""
        from ...core.mapper import Mapper
        from ...core.models import load_model, resolve_dtype
        from ...core.transfer import Bridge

        dtype = resolve_dtype(self.config.dtype, self.config.device)
        mapper = Mapper.from_pretrained(self.config.mapper, device=self.config.device, dtype=dtype)
        source = load_model(self.config.source, device=self.config.device, dtype=dtype)
        target = target_copy(self.config, self.runtime, dtype)
        bridge = Bridge(source, target, mapper, allow_revision_mismatch=self.config.allow_revision_mismatch,
                        **self.config.runtime)
        recompute = (f"the target recomputes {bridge.recompute:.0%} of each prefix's tokens by "
                     f"{bridge.recompute_by} (window {bridge.recompute_window}) inside the connector"
                     if bridge.selects_tokens else "no selective recompute")
        if bridge.native_layers:
            recompute += f", its first {bridge.native_layers} layers computed over each prompt, not mapped"
        recompute += (", with a transformers copy of its weights" if bridge.runs_target else
                      " (the target's config and RoPE loaded, not its weights)")
        logger.info("kvbridge connector: %s -> %s with %s, hold-back %d, %s; %s, %s", self.config.source,
                    self.config.target, self.config.mapper, bridge.hold_back, recompute, self.config.device, dtype)
        if self.tensor_parallel > 1:
            logger.info("kvbridge connector: each of the %d tensor-parallel workers runs the source and the whole map "
                        "and writes its share of the target's heads%s", self.tensor_parallel,
                        "; each holds its own transformers copy of the target's weights for the recompute (a map "
                        "without recompute needs none)" if bridge.runs_target else "")
        if self.config.lmcache:
            self._lmcache = self._lmcache_source(self._vllm_config, bridge)
            logger.info("kvbridge connector: the source engine's K/V stored in LMCache at %s (model %r) are mapped "
                        "without a source prefill (warm transfer; %s pages, lookups and retrieves within %g s)",
                        self._lmcache.url, self._lmcache.model_name, self._lmcache.layout, self._lmcache.timeout_s)
            if bridge.needs_source_state:
                logger.warning("kvbridge connector: this map reads the source's hidden states (a state lever, or a "
                               "recompute ranked by the source's %s), which LMCache does not keep: every prefix is "
                               "mapped from a fresh source prefill (the cold path); serve a mapper without them, or "
                               "--recompute 0", bridge.recompute_by)
        if self.config.store:
            from ...core.models import source_hidden_size
            from ..store.keys import identity

            info = bridge.source.info
            self._identity = identity(info.weights_sha256, info.tokenizer_sha256, info.num_layers, info.num_kv_heads,
                                      info.head_dim, source_hidden_size(bridge.source.model))
            from ...core.artifact import CHECKSUMS_FILE
            from ..store.keys import map_identity, target_description

            checksums = (Path(self.config.mapper) / CHECKSUMS_FILE).read_text(encoding="utf-8")
            self._map_id = map_identity(self._identity, checksums, target_description(bridge.target.info),
                                        bridge.mapper.dtype)
            logger.info("kvbridge connector: the source's stored K/V in %s are mapped without a source prefill, "
                        "or read where the source engine mapped them ahead (warm transfer)", self.config.store)
            if self.config.store_memory_bytes > 0:
                from ..store.hot import HotEntries
                from .idle import StepClock

                self._clock = StepClock()
                self._hot = HotEntries(self.store, self._map_id, self.config.store_memory_bytes, self._clock,
                                       logger).start()
                logger.info("kvbridge connector: blocks mapped ahead are loaded into memory as the source engine "
                            "announces them (up to %.2f GiB)", self.config.store_memory_bytes / 2**30)
        return bridge

    def _lmcache_source(self, vllm_config, bridge=None, reads: bool = True):
        """The reader of the source engine's K/V in LMCache: its geometry from the loaded source (or, on the
        scheduler, its config); its pages laid out as this engine lays out its own (the source engine must use the
        same backend, dtype and block size: a layout the reader cannot decode is refused here, by name)."""
        from ..store.lmcache_store import Geometry, LMCacheSource, page_layout

        if bridge is not None:
            info = bridge.source.info
            geometry = Geometry(info.num_layers, info.num_kv_heads, info.head_dim)
        else:
            source = self._bridge_free_source_geometry()
            geometry = Geometry(*source)
        from vllm.platforms import current_platform

        layout = page_layout(current_platform.device_type, vllm_config.model_config.dtype, self.block_size,
                             geometry.head_dim)
        return LMCacheSource(self.config.lmcache, self.config.lmcache_model or self.config.source, self.block_size,
                             geometry, layout, self.config.lmcache_timeout_s,
                             max_tokens=min(self.source_positions, 8192), logger=logger, reads=reads)

    def _bridge_free_source_geometry(self) -> tuple[int, int, int]:
        """(layers, kv heads, head dim) of the source from its config (no weights loaded)."""
        from ...core.models import text_config

        text = text_config(self.config.source)[0]
        heads = getattr(text, "num_key_value_heads", None) or text.num_attention_heads
        return (text.num_hidden_layers, heads,
                getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads)

    def store(self):
        """The source engine's KV store, None until that engine has created it (or without one)."""
        if self._store is None and self.config.store:
            from pathlib import Path

            from ..store.folder import STORE_FILE, KVStore

            if (Path(self.config.store) / STORE_FILE).exists():
                self._store = KVStore(self.config.store, verify=self.config.store_verify)
        return self._store

    def _attention_layers(self, forward_context) -> list[tuple[int, Any]]:
        if self._layers is None:
            from vllm.model_executor.models.utils import extract_layer_index

            layers = [(extract_layer_index(name), layer) for name, layer in forward_context.no_compile_layers.items()
                      if hasattr(layer, "kv_cache") and hasattr(getattr(layer, "impl", None), "do_kv_cache_update")]
            layers.sort(key=lambda x: x[0])
            expected = self._bridge.mapper.config.target.num_layers
            if [i for i, _ in layers] != list(range(expected)):
                raise UnsupportedModelError(f"the engine has attention layers {[i for i, _ in layers]}, the mapper's "
                                            f"target {expected}: kvbridge cannot tell which layer is which.")
            heads = self._bridge.mapper.config.target.num_kv_heads
            self._heads = worker_heads(heads, self.tensor_parallel)
            held = {getattr(layer, "num_kv_heads", None) for _, layer in layers} - {None}
            share = len(range(heads)[self._heads])
            if held and held != {share}:
                raise UnsupportedModelError(f"this worker's attention layers hold {sorted(held)} KV heads; kvbridge "
                                            f"expected {share} (the target's {heads} over {self.tensor_parallel} "
                                            "tensor-parallel workers).")
            self._layers = layers
        return self._layers

    @torch.no_grad()
    def map_prompt(self, token_ids: list[int], salt: str | None = None, use_store: bool | str = True,
                   phases: dict[str, float] | None = None):
        """``(segments, stored tokens, refusal, premapped tokens, of them from memory)``: post-RoPE target K/V for
        ``token_ids`` as ``(first position, keys, values)`` per run of positions (keys and values per layer, (t, H,
        D)), from the source and the mapper (and the target's recompute of the chosen tokens): what
        :meth:`kvbridge.Bridge.mapped_cache` builds. With a store, its longest prefix of ``token_ids`` (entries of
        the client's ``salt``) is mapped from the source engine's own K/V and the source runs over the rest of
        ``token_ids`` (the scheduler loads only the stored prefix when the rest is the engine's: then there is
        none, unless an entry it counted fails its checks here); of that prefix, the blocks the source engine
        mapped ahead are read, not mapped (a map that recomputes no token and finds all of ``token_ids`` mapped
        ahead reads those entries alone, each block its own segment, held in memory where the prefetch loaded it).
        ``refusal`` says why a store entry was skipped (None: none was); whatever
        fails with the store's entries, the cold path answers. ``phases``: where the time went, added to it in ms
        (:data:`PHASES`; the read's phases only when a store was consulted)."""
        from ...core.models import cache_kv
        from ...core.recompute import Stored

        phases = {} if phases is None else phases

        def mapped(stored=None):  # the map (a source prefill over what was not stored, the mapper, any recompute)
            started = time.perf_counter()
            try:
                return self._bridge.mapped_cache(ids, torch.ones_like(ids), stored=stored)
            finally:
                phases["map"] = phases.get("map", 0.0) + 1000 * (time.perf_counter() - started)

        ids = torch.tensor([token_ids], dtype=torch.long)
        tokens, refusal, cache, premapped, hot = 0, None, None, 0, 0
        if use_store and self._lmcache is not None:
            phases.setdefault("lookup", 0.0)  # (consulted, even when the reader answers at once: backing off)
            try:  # LMCache is an optimization too: a miss, a refused entry or a server down leave the cold path
                found = self._lmcache.lookup(token_ids, salt, len(token_ids), phases)
                tokens, refusal = found.tokens, found.reason
                if found.tokens:
                    if found.hidden is None and self._bridge.needs_source_state:
                        tokens, refusal = 0, ("LMCache holds the source's K/V, not its hidden states, which this "
                                              "map reads")
                    else:
                        cache = mapped(Stored(found.tokens, found.keys, found.values, found.hidden))
            except Exception as exc:
                tokens, cache = 0, None
                refusal = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''}"
        elif use_store and self.config.store:
            started = time.perf_counter()

            def read_lap():  # the folder's reads (entries found, checked), up to now
                phases["read"] = phases.get("read", 0.0) + 1000 * (time.perf_counter() - started)

            try:  # the store is an optimization: whatever goes wrong with it, the cold path answers
                store = self.store()
                if store is not None:
                    from ..store.folder import all_finite
                    from ..store.keys import chain_seed

                    seed, ahead = chain_seed(self._identity, salt), None
                    if use_store in (True, "folder"):  # the blocks mapped ahead, read once ("source": ignored)
                        memory = self._hot is not None and use_store is True  # ("folder": a comparison)
                        ahead = store.lookup(seed, self._identity, token_ids, len(token_ids), map_id=self._map_id,
                                             hot=self._hot.get if memory else None)
                        refusal = ahead.reason
                        # (blocks from memory were checked finite when loaded; checked again, as the folder's are:
                        # without any torch op before them, the cache writes from memory stalled in 8 of 16 turns
                        # on the 2-core machine, cascade-memory-plain-shuffled.json)
                        if ahead.tokens == len(token_ids) and not self._bridge.runs_target and all(
                                all_finite((k, v)) for k, v, _, _ in ahead.parts):
                            # the map's output is all this map needs: the source's entries are not read, only
                            # marked used (the scheduler counts them: they must not be evicted first), off the
                            # request's path where the prefetch thread runs
                            keys = ahead.chain  # (every full block was found: the prompt's whole chain)
                            (self._hot.later if self._hot is not None else lambda job: job())(
                                lambda: store.touch(keys, self._map_id))
                            segments, start = [], 0
                            for k, v, _, _ in ahead.parts:
                                segments.append((start, k.unbind(0), v.unbind(0)))
                                start += k.shape[1]
                            read_lap()
                            return segments, ahead.tokens, None, ahead.tokens, ahead.hot_tokens
                    found = store.lookup(seed, self._identity, token_ids, len(token_ids))
                    tokens, refusal = found.tokens, found.reason or refusal
                    if found.tokens:  # (the blocks assembled per layer here: the read's time, not the map's)
                        _ = found.keys, found.values, *((ahead.keys, ahead.values) if ahead and ahead.tokens else ())
                    read_lap()
                    if found.tokens:
                        ahead_mapped = None
                        if ahead is not None and ahead.tokens:  # (within the stored source prefix)
                            premapped = min(ahead.tokens, found.tokens)
                            hot = ahead.hot_within(premapped)
                            ahead_mapped = tuple([t[:, :, :premapped] for t in layers]
                                                 for layers in (ahead.keys, ahead.values))
                        cache = mapped(Stored(found.tokens, found.keys, found.values, found.hidden, ahead_mapped))
            except Exception as exc:
                tokens, premapped, hot = 0, 0, 0
                refusal = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''}"
                phases.setdefault("read", 1000 * (time.perf_counter() - started))  # (the store failed reading)
        if cache is None:
            cache = mapped()
        started = time.perf_counter()
        keys, values = cache_kv(cache)
        segments = [(0, [k[0].transpose(0, 1) for k in keys], [v[0].transpose(0, 1) for v in values])]
        phases["map"] = phases.get("map", 0.0) + 1000 * (time.perf_counter() - started)
        return segments, tokens, refusal, premapped, hot

    def start_load_kv(self, forward_context, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        if not isinstance(meta, KVBridgeMetadata) or not meta.loads:
            return
        for load in meta.loads:
            if not load.asynchronous:
                self._record(load, self._load(forward_context, load))
                continue
            if self._loader is None:
                self._loader = ThreadPoolExecutor(1, thread_name_prefix="kvbridge-load")
            ready = None
            if torch.cuda.is_available() and torch.cuda.is_initialized():  # the side stream starts after what the
                ready = torch.cuda.Event()  # engine's stream has queued (its blocks' zeroing, say)
                ready.record()
            self._pending[load.request_id] = (load, self._loader.submit(self._load_beside, forward_context, load,
                                                                        ready))

    def _load_beside(self, forward_context, load: Load, ready) -> Outcome:
        """An asynchronous load, in the loader's thread: on a GPU on a side stream, finished before it returns."""
        if ready is None:
            return self._load(forward_context, load)
        stream = torch.cuda.Stream()
        stream.wait_event(ready)
        with torch.cuda.stream(stream):
            outcome = self._load(forward_context, load)
        stream.synchronize()  # the blocks are written before the request is reported finished
        return outcome

    def _load(self, forward_context, load: Load) -> Outcome:
        """Map one request's prefix and write it into its blocks: ``(outcome, ms, stored, refused, premapped, hot,
        write ms, ms by phase)`` (:data:`Outcome`), outcome ``"mapped"`` or ``"fallback: <reason>"`` (never raises:
        any failure is a native prefill)."""
        with self._map_lock:
            started = time.perf_counter()
            stored, refused, premapped, hot, write_ms, phases = 0, None, 0, 0, 0.0, {}
            try:
                stored, refused, premapped, hot, write_ms = self._write(forward_context, load, phases)
                status = "mapped"
            except Exception as exc:  # any failure: this request is prefilled natively, the engine goes on
                status = f"fallback: {type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''}"
            if not phases.keys() & {"connect", "lookup", "read"}:  # no store consulted: a cold load, not a read
                phases = {}
            return status, 1000 * (time.perf_counter() - started), stored, refused, premapped, hot, write_ms, phases

    def _record(self, load: Load, outcome: Outcome) -> None:
        """A finished load's outcome, for the scheduler; a failed one's blocks reported as failed loads (vLLM
        recomputes them)."""
        status, refused = outcome[0], outcome[3]
        if status != "mapped":
            self._failed_blocks.update(load.block_ids[load.start // self.block_size:])
            logger.warning("kvbridge connector: request %s falls back to a native prefill (%s)", load.request_id,
                           status[len("fallback: "):])
        if refused:
            logger.warning("kvbridge connector: request %s: a store entry was refused (%s); what it held was "
                           "computed instead", load.request_id, refused)
        self._outcomes[load.request_id] = outcome

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        """The asynchronous loads finished since the last step (their failed blocks reported in the same step, as
        vLLM asks). In a step that schedules nothing, wait a little for one rather than spin."""
        if not self._pending:
            return None, None
        meta = self._get_connector_metadata() if self.has_connector_metadata() else None
        futures = [f for _, f in self._pending.values()]
        if isinstance(meta, KVBridgeMetadata) and meta.idle and not any(f.done() for f in futures):
            wait(futures, timeout=IDLE_WAIT_S, return_when=FIRST_COMPLETED)
        done = set()
        for rid, (load, future) in list(self._pending.items()):
            if not future.done():
                continue
            del self._pending[rid]
            try:
                outcome = future.result()
            except BaseException as exc:  # (_load catches every Exception: a thread's own failure, say)
                outcome = (f"fallback: {type(exc).__name__}: {exc}", 0.0, 0, None, 0, 0, 0.0, {})
            self._record(load, outcome)
            done.add(rid)
        return None, done or None

    def _write(self, forward_context, load: Load, phases: dict[str, float]) -> tuple[int, str | None, int, int, float]:
        layers = self._attention_layers(forward_context)
        segments, stored, refused, premapped, hot = self.map_prompt(load.token_ids[:load.end], load.salt,
                                                                    load.use_store, phases=phases)
        pos = torch.arange(load.start, load.end)
        blocks = torch.tensor(load.block_ids, dtype=torch.long)
        every = blocks[pos // self.block_size] * self.block_size + pos % self.block_size  # slot of each position
        caches = [(layer, layer.kv_cache[0] if isinstance(layer.kv_cache, (list, tuple)) else layer.kv_cache)
                  for _, layer in layers]
        every = every.to(caches[0][1].device)
        started = time.perf_counter()
        for first, keys, values in segments:  # positions [first, first + t) each: written where they are loaded
            lo, hi = max(first, load.start), min(first + keys[0].shape[0], load.end)
            if lo >= hi:
                continue
            slots = every[lo - load.start:hi - load.start]
            for (index, _), (layer, kv_cache) in zip(layers, caches):
                k, v = (x[lo - first:hi - first, self._heads].to(kv_cache.device, kv_cache.dtype).contiguous()
                        for x in (keys[index], values[index]))
                layer.impl.do_kv_cache_update(layer, k, v, kv_cache, slots)
        write_ms = 1000 * (time.perf_counter() - started)
        phases["write"] = phases.get("write", 0.0) + write_ms
        return stored, refused, premapped, hot, write_ms

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        if self._clock is not None and not getattr(connector_metadata, "idle", False):  # (an empty step: quiet)
            self._clock.begin()
        super().bind_connector_metadata(connector_metadata)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # synchronous loads are done in start_load_kv; asynchronous ones before their request is scheduled

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata, **kwargs: Any) -> None:
        return  # a consumer: nothing is saved

    def wait_for_save(self):
        if self._clock is not None and not getattr(self._connector_metadata, "idle", False):  # the forward is done
            self._clock.end()

    def shutdown(self):
        if self._hot is not None:
            self._hot.stop()
        if self._loader is not None:
            self._loader.shutdown(wait=True, cancel_futures=True)
        if self._lmcache is not None:
            self._lmcache.close()
        super().shutdown()

    def get_block_ids_with_load_errors(self) -> set[int]:
        failed, self._failed_blocks = self._failed_blocks, set()
        return failed

    def build_connector_worker_meta(self) -> KVConnectorWorkerMetadata | None:
        if not self._outcomes:
            return None
        outcomes, self._outcomes = self._outcomes, {}
        return KVBridgeWorkerMetadata(outcomes)

    # -- scheduler side ------------------------------------------------------------------------
    def decide(self, request, num_computed_tokens: int) -> tuple[str, int]:
        """``(outcome, tokens to load)`` for a request the engine is about to schedule."""
        try:
            request_load(request.kv_transfer_params, self.config.sync_load)
            mode = request_mode(request.kv_transfer_params, self.config.mode)
            hold_back = request_hold_back(request.kv_transfer_params) or self.hold_back
            use_store = request_use_store(request.kv_transfer_params)
            native_rest = request_native_rest(request.kv_transfer_params)
        except Exception as exc:  # the HTTP layer refuses these with a 400; an offline caller gets native
            return f"fallback: {exc}", 0
        prompt = len(request.prompt_token_ids or ())
        if mode == "native":
            return "native", 0
        if mode == "auto" and prompt < self.config.min_tokens:
            return "short", 0
        end = prompt - hold_back
        if end < 1:  # nothing before the hold-back: the engine reads it all, as Bridge's target reads such a prompt
            return "short", 0
        if end > self.source_positions:
            return f"fallback: the prefix has {end} tokens, more than the source's {self.source_positions} positions", 0
        if getattr(request, "mm_features", None) or getattr(request, "prompt_embeds", None) is not None:
            return ("fallback: the prompt holds images or embeddings, which the source's token-only prefill would "
                    "not see"), 0
        if getattr(request, "skip_reading_prefix_cache", False):  # vLLM would drop what the connector loads
            return ("fallback: the request skips the prefix cache (vLLM's default with prompt_logprobs), and with it "
                    "any loaded K/V; offline, SamplingParams(skip_reading_prefix_cache=False) scores over a mapped "
                    "prefix"), 0
        if self.prefix_caching and not in_namespace(request.cache_salt, self.namespace):
            return ("fallback: prefix caching is on and the request's cache_salt is not in the mapper's namespace "
                    "(send it through kvbridge serve's completions or chat route, or build it with "
                    "kvbridge.serving.mapped_request)"), 0
        end = self._warm_end(request, end, use_store, self.config.native_rest if native_rest is None else native_rest)
        if num_computed_tokens >= end:  # K/V of this mapper's namespace (mapped, or recomputed after a fallback)
            return "cached: the prefix to load was a prefix-cache hit in the mapper's namespace", 0
        return "mapped", end - num_computed_tokens

    def _warm_end(self, request, end: int, use_store: bool | str, native_rest: int) -> int:
        """Where the loaded prefix ends: the end of the prompt's stored prefix when at most ``native_rest`` tokens
        follow it before ``end`` — the engine computes them itself, over the stored prefix, and the source does not
        run — else ``end`` (the source prefills what the store lacks; nothing stored: the cold path). The worker
        reads and checks the entries: one that fails there is computed by the source instead."""
        if use_store and native_rest and self._lmcache is not None:
            limit, stored = self._counted.get(request.request_id, (None, 0))
            if limit != end:  # (asked once per request and limit: a lookup is a round trip to the server)
                stored = self._lmcache.stored_tokens(list(request.prompt_token_ids),
                                                     client_salt(request.cache_salt, self.namespace), end)
                self._counted[request.request_id] = (end, stored)
            return stored if 0 < stored and end - stored <= native_rest else end
        if not use_store or not native_rest or self._identity is None:
            return end
        try:
            store = self.store()
            if store is None:
                return end
            from ..store.keys import chain_seed

            limit, stored = self._counted.get(request.request_id, (None, 0))
            if limit != end:
                seed = chain_seed(self._identity, client_salt(request.cache_salt, self.namespace))
                stored = store.stored_tokens(seed, list(request.prompt_token_ids), end)
                self._counted[request.request_id] = (end, stored)
        except Exception as exc:  # the store is an optimization: the worker's own lookup decides
            logger.warning("kvbridge connector: the store lookup for request %s failed (%s)", request.request_id, exc)
            return end
        return stored if 0 < stored and end - stored <= native_rest else end

    def get_num_new_matched_tokens(self, request, num_computed_tokens: int) -> tuple[int | None, bool]:
        """May be asked again for the same request (no free blocks yet, preemption): the answer is provisional
        until :meth:`update_state_after_alloc`."""
        rid = request.request_id
        if self._status.get(rid, "").startswith("fallback"):  # a failed map stays failed (and native) on a retry
            return 0, False
        status, tokens = self.decide(request, num_computed_tokens)
        if status.startswith("fallback"):
            logger.info("kvbridge connector: request %s is prefilled natively (%s)", rid, status[len("fallback: "):])
        asynchronous = bool(tokens) and request_load(request.kv_transfer_params, self.config.sync_load)
        self._decided[rid] = (status, tokens, num_computed_tokens + tokens, asynchronous)
        return tokens, asynchronous

    def update_state_after_alloc(self, request, blocks, num_external_tokens: int):
        rid = request.request_id
        if rid not in self._decided:
            return
        status, tokens, end, asynchronous = self._decided.pop(rid)
        self._counted.pop(rid, None)
        if num_external_tokens < tokens:  # the engine took less than was claimed: never say mapped
            status = "fallback: the engine did not load the mapped prefix"
        self._status[rid], self._tokens[rid] = status, num_external_tokens if status == "mapped" else 0
        if num_external_tokens:
            self._planned[rid] = Load(rid, list(request.prompt_token_ids[:end]), end - num_external_tokens, end,
                                      list(blocks.get_block_ids()[0]), client_salt(request.cache_salt, self.namespace),
                                      request_use_store(request.kv_transfer_params), asynchronous)

    def build_connector_meta(self, scheduler_output) -> KVConnectorMetadata:
        meta = KVBridgeMetadata(list(self._planned.values()),
                                idle=not getattr(scheduler_output, "total_num_scheduled_tokens", 1))
        self._planned = {}
        return meta

    def update_connector_output(self, connector_output):
        meta = getattr(connector_output, "kv_connector_worker_meta", None)
        for rid, (status, ms, stored, refused, premapped, hot, write_ms, phases) in \
                getattr(meta, "outcomes", {}).items():
            self._stats.data["map_ms"] += ms
            for phase, phase_ms in phases.items():
                self._stats.data[f"read_{phase}_ms"] = self._stats.data.get(f"read_{phase}_ms", 0.0) + phase_ms
            self._stats.data["write_ms"] += write_ms
            self._stats.data["stored_tokens"] += stored
            self._stats.data["premapped_tokens"] += premapped
            self._stats.data["hot_tokens"] += hot
            self._stats.data["store_refused"] += int(refused is not None)
            if refused is not None and rid in self._status:
                self._refusals[rid] = refused
            if rid in self._status:  # (a one-token request may have finished in the step that mapped it)
                self._status[rid] = status
                self._map_ms[rid] = (ms, write_ms)
                if phases:
                    self._read_ms[rid] = phases
                self._stored[rid] = (stored, premapped, hot)

    def request_finished(self, request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        rid = request.request_id
        status = self._status.pop(rid, None)  # None: never allocated (aborted while queued): not counted
        tokens, ms, stored = self._tokens.pop(rid, 0), self._map_ms.pop(rid, None), self._stored.pop(rid, None)
        refused, read_ms = self._refusals.pop(rid, None), self._read_ms.pop(rid, None)
        for state in (self._planned, self._decided, self._counted):
            state.pop(rid, None)
        if status is None:
            return False, None
        self._stats.data[status.split(":")[0]] += 1
        params: dict[str, Any] = {PARAM: status}
        if status == "mapped":
            params["kvbridge_mapped_tokens"] = tokens
            if stored is not None and (self.config.store or self.config.lmcache):
                params["kvbridge_stored_tokens"], params["kvbridge_premapped_tokens"], \
                    params["kvbridge_hot_tokens"] = stored
            if refused is not None:
                params["kvbridge_store_refused"] = refused
        if ms is not None:
            params["kvbridge_map_ms"], params["kvbridge_write_ms"] = round(ms[0], 2), round(ms[1], 2)
        if read_ms is not None:  # the load read a stored prefix: its time by phase
            params["kvbridge_read_ms"] = {p: round(read_ms[p], 2) for p in PHASES if p in read_ms}
        return False, params

    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        if self._stats.is_empty():
            return None
        stats, self._stats = self._stats, KVBridgeStats()
        return stats

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KVConnectorStats | None:
        return KVBridgeStats(data=dict(data)) if data else KVBridgeStats()

    @classmethod
    def build_prom_metrics(cls, vllm_config, metric_types, labelnames, per_engine_labelvalues):
        return KVBridgePromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)
