"""The workers' side of the target's connector (:mod:`kvbridge.serving.engine.connector`): each worker holds the
source, the mapper and the target's RoPE (:class:`kvbridge.Bridge`), maps each planned request's prefix (from a fresh
source prefill, or from the source engine's stored K/V) and writes its share of the target's heads into the engine's
paged cache; it reports each load's :class:`~kvbridge.serving.engine.target_messages.LoadOutcome` to the scheduler."""

from __future__ import annotations

import threading
import time
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

import torch

from ...errors import UnsupportedModelError
from .config import ServeConfig, StoreUse
from .target_messages import KVBridgeMetadata, KVBridgeWorkerMetadata, Load, LoadOutcome
from .target_setup import StoreOpener, TargetSetup, failure, lmcache_source, logger

IDLE_WAIT_S = 0.01  # an empty engine step waits this long at most for an asynchronous load to finish


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


class MappedPrompt(NamedTuple):
    """:meth:`KVBridgeWorker.map_prompt`'s answer."""

    segments: list  # post-RoPE target K/V as (first position, keys, values) per run of positions (per layer, (t, H, D))
    stored: int  # prefix tokens read from the store
    refused: str | None  # why a store entry was refused (None: none was)
    premapped: int  # prefix tokens whose target K/V the source engine mapped ahead (read, not mapped)
    hot: int  # of them, read from the connector's memory


@dataclass
class StoreRead:
    """What a read of the stored source prefix gave the map: stored tokens read, a refusal, tokens mapped ahead (of
    them from memory), and the map over them (None: the cold path maps)."""

    tokens: int = 0
    refused: str | None = None
    premapped: int = 0
    hot: int = 0
    cache: Any = None


class KVBridgeWorker:
    """The connector on a worker (:class:`~kvbridge.serving.engine.connector.KVBridgeConnector` delegates to it):
    loads the source, the mapper and the target's RoPE at start; maps and writes the prefixes the scheduler plans."""

    def __init__(self, setup: TargetSetup, vllm_config):
        self.setup = setup
        self.config = setup.config
        self.block_size = setup.block_size
        self.store = StoreOpener(self.config)
        self._vllm_config = vllm_config
        self._layers: list[tuple[int, Any]] | None = None
        self._heads = slice(None)  # this worker's KV heads of the target (its tensor-parallel share)
        self._failed_blocks: set[int] = set()
        self._outcomes: dict[str, LoadOutcome] = {}
        self._map_lock = threading.Lock()  # one map at a time: the engine's thread's (sync) or the loader's (async)
        self._loader: ThreadPoolExecutor | None = None  # the asynchronous loads' thread, once one is asked for
        self._pending: dict[str, tuple[Load, Future]] = {}  # request id -> its asynchronous load
        self._hot = None  # the store's blocks mapped ahead by this map, in memory (kvbridge.serving.store.hot)
        self._clock = None  # when the engine's steps run (the prefetch waits for a quiet spell)
        self._identity: str | None = None  # the source's identity in the store
        self._map_id: str | None = None  # the map whose entries the source engine mapped ahead
        self._lmcache = None  # the source engine's K/V in LMCache (kvbridge.serving.store.lmcache_store), with lmcache
        self.bridge = self._load_bridge()

    # -- start ---------------------------------------------------------------------------------
    def _load_bridge(self):
        """Source, mapper and target (:func:`target_copy`) where the config says; checked against each other."""
        from ...core.mapper import Mapper
        from ...core.models import load_model, resolve_dtype
        from ...core.transfer import Bridge

        dtype = resolve_dtype(self.config.dtype, self.config.device)
        mapper = Mapper.from_pretrained(self.config.mapper, device=self.config.device, dtype=dtype)
        source = load_model(self.config.source, device=self.config.device, dtype=dtype)
        target = target_copy(self.config, self.setup.runtime, dtype)
        bridge = Bridge(source, target, mapper, allow_revision_mismatch=self.config.allow_revision_mismatch,
                        **self.config.runtime)
        self._log_bridge(bridge, dtype)
        if self.config.lmcache:
            self._open_lmcache(bridge)
        if self.config.store:
            self._open_store(bridge)
        return bridge

    def _log_bridge(self, bridge, dtype) -> None:
        recompute = (f"the target recomputes {bridge.recompute:.0%} of each prefix's tokens by "
                     f"{bridge.recompute_by} (window {bridge.recompute_window}) inside the connector"
                     if bridge.selects_tokens else "no selective recompute")
        if bridge.native_layers:
            recompute += f", its first {bridge.native_layers} layers computed over each prompt, not mapped"
        recompute += (", with a transformers copy of its weights" if bridge.runs_target else
                      " (the target's config and RoPE loaded, not its weights)")
        logger.info("kvbridge connector: %s -> %s with %s, hold-back %d, %s; %s, %s", self.config.source,
                    self.config.target, self.config.mapper, bridge.hold_back, recompute, self.config.device, dtype)
        if self.setup.tensor_parallel > 1:
            logger.info("kvbridge connector: each of the %d tensor-parallel workers runs the source and the whole map "
                        "and writes its share of the target's heads%s", self.setup.tensor_parallel,
                        "; each holds its own transformers copy of the target's weights for the recompute (a map "
                        "without recompute needs none)" if bridge.runs_target else "")

    def _open_lmcache(self, bridge) -> None:
        info = bridge.source.info
        self._lmcache = lmcache_source(self.setup, self._vllm_config,
                                       (info.num_layers, info.num_kv_heads, info.head_dim))
        logger.info("kvbridge connector: the source engine's K/V stored in LMCache at %s (model %r) are mapped "
                    "without a source prefill (warm transfer; %s pages, lookups and retrieves within %g s)",
                    self._lmcache.url, self._lmcache.model_name, self._lmcache.layout, self._lmcache.timeout_s)
        if bridge.needs_source_state:
            logger.warning("kvbridge connector: this map reads the source's hidden states (a state lever, or a "
                           "recompute ranked by the source's %s), which LMCache does not keep: every prefix is "
                           "mapped from a fresh source prefill (the cold path); serve a mapper without them, or "
                           "--recompute 0", bridge.recompute_by)

    def _open_store(self, bridge) -> None:
        """The store's identities of the source and of this map; with a memory budget, the thread that loads the
        blocks the source engine announces as mapped ahead."""
        from ...core.artifact import CHECKSUMS_FILE
        from ...core.models import source_hidden_size
        from ..store.keys import identity, map_identity, target_description

        info = bridge.source.info
        self._identity = identity(info.weights_sha256, info.tokenizer_sha256, info.num_layers, info.num_kv_heads,
                                  info.head_dim, source_hidden_size(bridge.source.model))
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

    def _attention_layers(self, forward_context) -> list[tuple[int, Any]]:
        if self._layers is None:
            from vllm.model_executor.models.utils import extract_layer_index

            layers = [(extract_layer_index(name), layer) for name, layer in forward_context.no_compile_layers.items()
                      if hasattr(layer, "kv_cache") and hasattr(getattr(layer, "impl", None), "do_kv_cache_update")]
            layers.sort(key=lambda x: x[0])
            expected = self.bridge.mapper.config.target.num_layers
            if [i for i, _ in layers] != list(range(expected)):
                raise UnsupportedModelError(f"the engine has attention layers {[i for i, _ in layers]}, the mapper's "
                                            f"target {expected}: kvbridge cannot tell which layer is which.")
            heads = self.bridge.mapper.config.target.num_kv_heads
            self._heads = worker_heads(heads, self.setup.tensor_parallel)
            held = {getattr(layer, "num_kv_heads", None) for _, layer in layers} - {None}
            share = len(range(heads)[self._heads])
            if held and held != {share}:
                raise UnsupportedModelError(f"this worker's attention layers hold {sorted(held)} KV heads; kvbridge "
                                            f"expected {share} (the target's {heads} over {self.setup.tensor_parallel}"
                                            " tensor-parallel workers).")
            self._layers = layers
        return self._layers

    # -- the map -------------------------------------------------------------------------------
    @torch.no_grad()
    def map_prompt(self, token_ids: list[int], salt: str | None = None, use_store: StoreUse = StoreUse.ON,
                   phases: dict[str, float] | None = None) -> MappedPrompt:
        """Post-RoPE target K/V for ``token_ids`` (:class:`MappedPrompt`), from the source and the mapper (and the
        target's recompute of the chosen tokens): what :meth:`kvbridge.Bridge.mapped_cache` builds. With a store,
        its longest prefix of ``token_ids`` (entries of the client's ``salt``) is mapped from the source engine's own
        K/V and the source runs over the rest of ``token_ids`` (the scheduler loads only the stored prefix when the
        rest is the engine's: then there is none, unless an entry it counted fails its checks here); of that prefix,
        the blocks the source engine mapped ahead are read, not mapped (a map that recomputes no token and finds all
        of ``token_ids`` mapped ahead reads those entries alone, each block its own segment, held in memory where the
        prefetch loaded it). ``refused`` says why a store entry was skipped (None: none was); whatever fails with the
        store's entries, the cold path answers. ``phases``: where the time went, added to it in ms (:data:`PHASES`;
        the read's phases only when a store was consulted)."""
        phases = {} if phases is None else phases
        ids = torch.tensor([token_ids], dtype=torch.long)
        read = StoreRead()
        if use_store.reads_store and self._lmcache is not None:
            read = self._read_lmcache(ids, token_ids, salt, phases)
        elif use_store.reads_store and self.config.store:
            read = self._read_folder(ids, token_ids, salt, use_store, phases)
            if isinstance(read, MappedPrompt):  # every block read as mapped ahead: no map
                return read
        cache = self._mapped(ids, phases) if read.cache is None else read.cache
        return MappedPrompt(self._segments(cache, phases), read.tokens, read.refused, read.premapped, read.hot)

    def _mapped(self, ids: torch.Tensor, phases: dict[str, float], stored=None):
        """The map (a source prefill over what was not stored, the mapper, any recompute), its time added to
        ``phases["map"]``."""
        started = time.perf_counter()
        try:
            return self.bridge.mapped_cache(ids, torch.ones_like(ids), stored=stored)
        finally:
            phases["map"] = phases.get("map", 0.0) + 1000 * (time.perf_counter() - started)

    @staticmethod
    def _segments(cache, phases: dict[str, float]) -> list:
        """The map's cache as one segment from position 0: keys and values per layer, (t, H, D)."""
        from ...core.models import cache_kv

        started = time.perf_counter()
        keys, values = cache_kv(cache)
        segments = [(0, [k[0].transpose(0, 1) for k in keys], [v[0].transpose(0, 1) for v in values])]
        phases["map"] = phases.get("map", 0.0) + 1000 * (time.perf_counter() - started)
        return segments

    def _read_lmcache(self, ids: torch.Tensor, token_ids: list[int], salt: str | None,
                      phases: dict[str, float]) -> StoreRead:
        """The stored source prefix from LMCache, mapped (an optimization too: a miss, a refused entry or a server
        down leave the cold path)."""
        from ...core.recompute import Stored

        phases.setdefault("lookup", 0.0)  # (consulted, even when the reader answers at once: backing off)
        read = StoreRead()
        try:
            found = self._lmcache.lookup(token_ids, salt, len(token_ids), phases)
            read.tokens, read.refused = found.tokens, found.reason
            if found.tokens:
                if found.hidden is None and self.bridge.needs_source_state:
                    read.tokens, read.refused = 0, ("LMCache holds the source's K/V, not its hidden states, which "
                                                    "this map reads")
                else:
                    read.cache = self._mapped(ids, phases, Stored(found.tokens, found.keys, found.values,
                                                                  found.hidden))
        except Exception as exc:
            return StoreRead(refused=failure(exc))
        return read

    def _read_folder(self, ids: torch.Tensor, token_ids: list[int], salt: str | None, use_store: StoreUse,
                     phases: dict[str, float]) -> StoreRead | MappedPrompt:
        """The stored source prefix from the store's folder, mapped, with the blocks mapped ahead within it read (or,
        when those cover the whole prompt, read alone: a :class:`MappedPrompt`). The store is an optimization:
        whatever goes wrong with it, the cold path answers."""
        from ...core.recompute import Stored

        started = time.perf_counter()

        def read_lap():  # the folder's reads (entries found, checked), up to now
            phases["read"] = phases.get("read", 0.0) + 1000 * (time.perf_counter() - started)

        read = StoreRead()
        try:
            store = self.store()
            if store is None:
                return read
            from ..store.keys import chain_seed

            seed, ahead = chain_seed(self._identity, salt), None
            if use_store.reads_ahead:  # the blocks mapped ahead, read once (SOURCE: ignored)
                ahead = store.lookup(seed, self._identity, token_ids, len(token_ids), map_id=self._map_id,
                                     hot=self._hot.get if self._hot is not None and use_store.from_memory else None)
                read.refused = ahead.reason  # (FOLDER: not from memory, a comparison)
                whole = self._whole_ahead(store, ahead, len(token_ids))
                if whole is not None:
                    read_lap()
                    return whole
            found = store.lookup(seed, self._identity, token_ids, len(token_ids))
            read.tokens, read.refused = found.tokens, found.reason or read.refused
            if found.tokens:  # (the blocks assembled per layer here: the read's time, not the map's)
                _ = found.keys, found.values, *((ahead.keys, ahead.values) if ahead and ahead.tokens else ())
            read_lap()
            if found.tokens:
                ahead_mapped = None
                if ahead is not None and ahead.tokens:  # (within the stored source prefix)
                    read.premapped = min(ahead.tokens, found.tokens)
                    read.hot = ahead.hot_within(read.premapped)
                    ahead_mapped = tuple([t[:, :, :read.premapped] for t in layers]
                                         for layers in (ahead.keys, ahead.values))
                read.cache = self._mapped(ids, phases, Stored(found.tokens, found.keys, found.values, found.hidden,
                                                              ahead_mapped))
        except Exception as exc:
            phases.setdefault("read", 1000 * (time.perf_counter() - started))  # (the store failed reading)
            return StoreRead(refused=failure(exc))
        return read

    def _whole_ahead(self, store, ahead, tokens: int) -> MappedPrompt | None:
        """The prompt's ``tokens`` as the source engine mapped them ahead, block by block, when they all were and the
        map needs nothing else (no target recompute); None otherwise."""
        from ..store.folder import all_finite

        # (blocks from memory were checked finite when loaded; checked again, as the folder's are: without a torch op
        # on them before the cache writes, those writes stalled on a CPU engine, about half the time)
        if ahead.tokens != tokens or self.bridge.runs_target or not all(
                all_finite((k, v)) for k, v, _, _ in ahead.parts):
            return None
        # the map's output is all this map needs: the source's entries are not read, only marked used (the scheduler
        # counts them: they must not be evicted first), off the request's path where the prefetch thread runs
        keys = ahead.chain  # (every full block was found: the prompt's whole chain)
        (self._hot.later if self._hot is not None else lambda job: job())(lambda: store.touch(keys, self._map_id))
        segments, start = [], 0
        for k, v, _, _ in ahead.parts:
            segments.append((start, k.unbind(0), v.unbind(0)))
            start += k.shape[1]
        return MappedPrompt(segments, ahead.tokens, None, ahead.tokens, ahead.hot_tokens)

    # -- loads ---------------------------------------------------------------------------------
    def start_load_kv(self, meta, forward_context) -> None:
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

    def _load_beside(self, forward_context, load: Load, ready) -> LoadOutcome:
        """An asynchronous load, in the loader's thread: on a GPU on a side stream, finished before it returns."""
        if ready is None:
            return self._load(forward_context, load)
        stream = torch.cuda.Stream()
        stream.wait_event(ready)
        with torch.cuda.stream(stream):
            outcome = self._load(forward_context, load)
        stream.synchronize()  # the blocks are written before the request is reported finished
        return outcome

    def _load(self, forward_context, load: Load) -> LoadOutcome:
        """Map one request's prefix and write it into its blocks; outcome ``"mapped"`` or ``"fallback: <reason>"``
        (never raises: any failure is a native prefill)."""
        with self._map_lock:
            started = time.perf_counter()
            mapped, write_ms, phases = MappedPrompt([], 0, None, 0, 0), 0.0, {}
            try:
                mapped, write_ms = self._write(forward_context, load, phases)
                status = "mapped"
            except Exception as exc:  # any failure: this request is prefilled natively, the engine goes on
                status = f"fallback: {failure(exc)}"
            if not phases.keys() & {"connect", "lookup", "read"}:  # no store consulted: a cold load, not a read
                phases = {}
            return LoadOutcome(status, 1000 * (time.perf_counter() - started), mapped.stored, mapped.refused,
                               mapped.premapped, mapped.hot, write_ms, phases)

    def _write(self, forward_context, load: Load, phases: dict[str, float]) -> tuple[MappedPrompt, float]:
        """Map ``load``'s prompt and write positions [start, end) into its blocks: the map, and the writes' ms."""
        layers = self._attention_layers(forward_context)
        mapped = self.map_prompt(load.token_ids[:load.end], load.salt, load.use_store, phases=phases)
        pos = torch.arange(load.start, load.end)
        blocks = torch.tensor(load.block_ids, dtype=torch.long)
        every = blocks[pos // self.block_size] * self.block_size + pos % self.block_size  # slot of each position
        caches = [(layer, layer.kv_cache[0] if isinstance(layer.kv_cache, (list, tuple)) else layer.kv_cache)
                  for _, layer in layers]
        every = every.to(caches[0][1].device)
        started = time.perf_counter()
        for first, keys, values in mapped.segments:  # positions [first, first + t) each: written where they are loaded
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
        return mapped, write_ms

    def _record(self, load: Load, outcome: LoadOutcome) -> None:
        """A finished load's outcome, for the scheduler; a failed one's blocks reported as failed loads (vLLM
        recomputes them)."""
        if not outcome.mapped:
            self._failed_blocks.update(load.block_ids[load.start // self.block_size:])
            logger.warning("kvbridge connector: request %s falls back to a native prefill (%s)", load.request_id,
                           outcome.status[len("fallback: "):])
        if outcome.refused:
            logger.warning("kvbridge connector: request %s: a store entry was refused (%s); what it held was "
                           "computed instead", load.request_id, outcome.refused)
        self._outcomes[load.request_id] = outcome

    def get_finished(self, meta, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        """The asynchronous loads finished since the last step (their failed blocks reported in the same step, as
        vLLM asks). In a step that schedules nothing, wait a little for one rather than spin."""
        if not self._pending:
            return None, None
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
                outcome = LoadOutcome(f"fallback: {type(exc).__name__}: {exc}")
            self._record(load, outcome)
            done.add(rid)
        return None, done or None

    # -- the step ------------------------------------------------------------------------------
    def step_begins(self, meta) -> None:
        """The scheduler's metadata is bound: the engine's forward follows (an empty step: quiet)."""
        if self._clock is not None and not getattr(meta, "idle", False):
            self._clock.begin()

    def step_ends(self, meta) -> None:
        """The step's forward is done."""
        if self._clock is not None and not getattr(meta, "idle", False):
            self._clock.end()

    def get_block_ids_with_load_errors(self) -> set[int]:
        failed, self._failed_blocks = self._failed_blocks, set()
        return failed

    def build_connector_worker_meta(self) -> KVBridgeWorkerMetadata | None:
        if not self._outcomes:
            return None
        outcomes, self._outcomes = self._outcomes, {}
        return KVBridgeWorkerMetadata(outcomes)

    def shutdown(self) -> None:
        if self._hot is not None:
            self._hot.stop()
        if self._loader is not None:
            self._loader.shutdown(wait=True, cancel_futures=True)
        if self._lmcache is not None:
            self._lmcache.close()
