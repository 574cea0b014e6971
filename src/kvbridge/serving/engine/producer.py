"""The source engine's side of warm transfer: a vLLM KV connector that stores what the source computes.

Letters: L source layers, n tokens a request computes in a step, H kv heads, D head dim, S hidden size.

A vLLM engine serving the *source* model runs this connector (``kv_role="kv_producer"``). It changes nothing in how
the engine serves: every request is prefilled and decoded as usual. Alongside, for every token a request computes
(prompt or generated), the connector keeps the post-RoPE keys and values the engine writes into its paged cache and
the model's final hidden state at that token; each time a request's tokens fill a block of ``block_size`` tokens
(the engine's own block size, so that the engine's prefix-cache hits — whole blocks — are always blocks some
earlier request stored), the block is written to the :class:`~kvbridge.serving.store.folder.KVStore` by a background
thread. The target's engine (:mod:`kvbridge.serving.engine.connector`) then maps stored blocks instead of running the
source again: the map alone replaces the target's prefill. With map-ahead (``StoreConfig.mapper`` and ``target``),
a second thread maps each stored block (:func:`kvbridge.core.transfer.map_block`) and stores the target's K/V beside
it: the target's connector then reads the block instead of mapping it.

What it observes, and how, without a fork of vLLM: the keys and values reach it through the attention backend's own
cache-update call (``impl.do_kv_cache_update``, wrapped once per layer: the paged layout stays the backend's
business), and the hidden states through a forward hook on the served model (the module whose output the engine
turns into logits). Tokens are matched to requests through the slot mapping of the step. Both need the Python code
of those calls to run at every step: engines that replay CUDA graphs do not, so the connector refuses to start
unless the engine runs eagerly (``--enforce-eager``), as it does on CPU.
"""

from __future__ import annotations

import queue
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)
from vllm.logger import init_logger

from ...errors import UnsupportedModelError
from ..store.folder import KVStore, RefusedEntry
from ..store.keys import chain_seed, folder_identity, map_identity, next_key
from .config import PREWARM, USE_STORE, StoreConfig
from .idle import StepClock, single_threaded

logger = init_logger("vllm.kvbridge")
QUEUE_BYTES = 512 << 20  # blocks waiting to be written; beyond, new blocks are dropped (counted), never waited for
LAG_TAILS = 4096  # map-ahead: the last source tokens of this many recent blocks, for the lags of the block after
MAP_QUEUE_BYTES = 256 << 20  # stored blocks waiting to be mapped; beyond, blocks are not mapped ahead (logged)
@dataclass
class Capture:
    """One request's tokens of this step: positions [start, start + count) in ``block_ids[0]``'s block onward;
    ``parent``: the chain key of the block before ``start`` when ``start`` is a block boundary (else None: the
    worker continues what it holds). ``touch``: on a request's first step, the keys of the blocks it reads from the
    engine's prefix cache, marked used in the store so that least-recently-used eviction does not drop a
    conversation's first blocks while its later ones stay."""

    request_id: str
    start: int
    count: int
    block_ids: list[int]
    parent: str | None
    touch: list[str] = field(default_factory=list)  # keys of the blocks the engine's prefix cache supplied


@dataclass
class StoreMetadata(KVConnectorMetadata):
    captures: list[Capture] = field(default_factory=list)
    finished: list[str] = field(default_factory=list)  # their partial last block is stored as a tail, then dropped
    prewarm: dict[str, str | None] = field(default_factory=dict)  # finished ones to load ahead: their client salt
    preempted: list[str] = field(default_factory=list)  # dropped: a resumed request starts a block anew


@dataclass
class Pending:
    """A request's computed tokens since its last full block: chain key of that block, per-token tensors."""

    parent: str
    start: int
    ids: list[torch.Tensor] = field(default_factory=list)
    keys: list[torch.Tensor] = field(default_factory=list)  # each (L, n, H, D)
    values: list[torch.Tensor] = field(default_factory=list)
    hidden: list[torch.Tensor] = field(default_factory=list)  # each (n, S)
    end: int = 0
    broken: bool = False  # a block of its chain was dropped: the blocks after it could never be reached


@dataclass
class MapAhead:
    """What the map-ahead thread needs to map each stored block: the mapper, the source's and the target's config and
    rotary module (no weights: :func:`kvbridge.core.models.load_rope_model`), the map's identity."""

    mapper: Any
    source: Any
    target: Any
    map_id: str


def map_ahead(config: StoreConfig, source_dir: str, source_identity: str, device: str) -> MapAhead:
    """Load and check the map-ahead parts: the mapper must be fitted for this source (and its ``config.target``),
    neither RoPE may depend on a prompt's length. The map runs in ``config.dtype`` (``auto``: the target
    connector's default on this device), so that its entries equal what that connector would map."""
    from ...core.artifact import CHECKSUMS_FILE
    from ...core.mapper import Mapper
    from ...core.models import load_rope_model, resolve_dtype
    from ..store.keys import target_description
    from .config import check_map_ahead

    check_map_ahead(config.mapper)
    dtype = resolve_dtype(config.dtype, device)
    mapper = Mapper.from_pretrained(config.mapper, device=device, dtype=dtype)
    source = load_rope_model(source_dir, device=device, dtype=dtype)
    target = load_rope_model(config.target, device=device, dtype=dtype)
    mapper.check_models(source.info, target.info)
    checksums = (Path(config.mapper) / CHECKSUMS_FILE).read_text(encoding="utf-8")
    return MapAhead(mapper, source.model, target.model,
                    map_identity(source_identity, checksums, target_description(target.info), dtype))


class KVBridgeSourceConnector(KVConnectorBase_V1):
    """``kv_connector="KVBridgeSourceConnector"``, ``kv_connector_module_path="kvbridge.serving.engine.producer"``,
    ``kv_role="kv_producer"``, settings in ``kv_connector_extra_config`` (:class:`StoreConfig`)."""

    def __init__(self, vllm_config, role: KVConnectorRole, kv_cache_config=None):
        super().__init__(vllm_config, role, kv_cache_config)
        self.config = StoreConfig.from_extra(self._kv_transfer_config.kv_connector_extra_config or {})
        parallel = vllm_config.parallel_config
        if (parallel.tensor_parallel_size or 1) != 1 or (parallel.pipeline_parallel_size or 1) != 1:
            raise UnsupportedModelError("kvbridge source connector: tensor and pipeline parallel engines are not "
                                        "supported yet (one worker must see every layer and head).")
        if vllm_config.speculative_config is not None:
            raise UnsupportedModelError("kvbridge source connector: speculative decoding is not supported (tokens "
                                        "it rejects would be stored); serve the source without it.")
        model_config = vllm_config.model_config
        eager = model_config.enforce_eager or vllm_config.device_config.device_type == "cpu"
        refusals = {
            "the engine must run eagerly (--enforce-eager): CUDA graph replays skip the calls through which the "
            "connector sees the K/V": not eager,
            "the served model takes images (K/V of an image would be stored under its placeholder tokens): serve "
            "the source with --language-model-only": model_config.supports_multimodal_inputs,
            "LoRA adapters are enabled (an adapter's K/V would be stored as the base model's)":
                vllm_config.lora_config is not None,
            f"the engine quantizes the model ({model_config.quantization}) and the mapper was fitted on its own "
            "weights": model_config.quantization is not None,
            "multi-head latent attention (MLA) caches are not per-head K/V": model_config.use_mla,
            "the KV cache has several groups (sliding-window or hybrid layers)":
                kv_cache_config is not None and len(kv_cache_config.kv_cache_groups) > 1,
        }
        for reason, refused in refusals.items():
            if refused:
                raise UnsupportedModelError(f"kvbridge source connector: {reason}.")
        self.block_size = vllm_config.cache_config.block_size
        source = self.config.source or model_config.model
        if not Path(source).is_dir():  # a hub id: the snapshot vLLM serves
            from ...core.models import resolve_model

            source = resolve_model(source, model_config.revision)
        self.identity = folder_identity(source)
        self.store = KVStore(self.config.store, block_tokens=self.block_size, cap_bytes=self.config.cap_bytes,
                             create=True)
        self.map_ahead: MapAhead | None = None
        if self.config.mapper and role == KVConnectorRole.WORKER:
            self.map_ahead = map_ahead(self.config, source, self.identity, vllm_config.device_config.device_type)
        self._lag_tails: OrderedDict[str, tuple] = OrderedDict()  # block key -> its last source tokens (mapper)
        # scheduler side
        self._requests: dict[str, Any] = {}
        self._chains: dict[str, list[str]] = {}  # request id -> chain keys of its full blocks, as far as computed
        self._finished: list[str] = []
        self._prewarm: dict[str, str | None] = {}
        self._manager = None
        # worker side
        self._pending: dict[str, Pending] = {}
        self._step: dict[str, Any] | None = None
        self._layers: dict[str, int] = {}
        self._model_hook = None
        self._queue: queue.Queue | None = None
        self.dropped = 0
        self._queued_bytes = 0
        self._queued_lock = threading.Lock()
        self._map_queue: queue.Queue | None = None
        self._map_bytes = 0
        self._clock = StepClock()  # the threads write and map while the engine is idle (kvbridge.serving.engine.idle)
        if role == KVConnectorRole.WORKER:
            self._queue = queue.Queue()
            threading.Thread(target=self._writer, name="kvbridge-store-writer", daemon=True).start()
            if self.map_ahead is not None:  # a thread of its own: a slow map never holds back the source's blocks
                self._map_queue = queue.Queue()
                threading.Thread(target=self._mapper_loop, name="kvbridge-map-ahead", daemon=True).start()
            self._model_hook = torch.nn.modules.module.register_module_forward_hook(self._find_model,
                                                                                    with_kwargs=True)
            logger.info("kvbridge source connector: storing %s-token blocks of %s in %s (cap %.1f GiB)%s",
                        self.block_size, self.config.source or vllm_config.model_config.model, self.config.store,
                        self.store.cap_bytes / 2**30,
                        f"; mapping each into {self.config.target}'s K/V with {self.config.mapper} in "
                        f"{self.map_ahead.mapper.dtype} (map-ahead)" if self.map_ahead else "")

    # -- scheduler side ------------------------------------------------------------------------
    def bind_kv_cache_manager(self, kv_cache_manager) -> None:
        self._manager = kv_cache_manager

    def get_num_new_matched_tokens(self, request, num_computed_tokens: int) -> tuple[int | None, bool]:
        return 0, False  # a producer loads nothing

    def update_state_after_alloc(self, request, blocks, num_external_tokens: int):
        if self._wants_store(request):
            self._requests[request.request_id] = request

    def _wants_store(self, request) -> bool:
        """Whether a request's K/V are stored: yes, unless its ``kv_transfer_params`` say ``"kvbridge_store": false``
        (a client that knows the conversation will not move to the target saves the store's writes and maps)."""
        params = request.kv_transfer_params if isinstance(request.kv_transfer_params, dict) else {}
        asked = params.get(USE_STORE, True)
        if asked in ("folder", "source"):  # the target's choices of where to read: stored here either way
            return True
        if not isinstance(asked, bool):
            logger.warning("kvbridge source connector: request %s: kv_transfer_params %s must be true or false, not "
                           "%r; stored", request.request_id, USE_STORE, asked)
            return True
        return asked

    def _parent(self, request, start: int) -> str:
        """The chain key before position ``start`` (a block boundary, every token before it known)."""
        seed = chain_seed(self.identity, request.cache_salt)
        keys = self._chains.setdefault(request.request_id, [])
        bs, tokens = self.block_size, request.all_token_ids
        while len(keys) * bs < start:
            begin = len(keys) * bs
            keys.append(next_key(keys[-1] if keys else seed, list(tokens[begin:begin + bs])))
        return keys[start // bs - 1] if start else seed

    def build_connector_meta(self, scheduler_output) -> KVConnectorMetadata:
        meta = StoreMetadata(finished=self._finished, prewarm=self._prewarm,
                             preempted=list(scheduler_output.preempted_req_ids or ()))
        self._finished, self._prewarm = [], {}
        for rid, count in scheduler_output.num_scheduled_tokens.items():
            try:  # storing is best effort: a request it cannot follow is served, not stored
                capture = self._capture(rid, count)
            except Exception as exc:
                logger.warning("kvbridge source connector: request %s is not stored (%s)", rid, exc)
                self._requests.pop(rid, None)
                continue
            if capture is not None:
                meta.captures.append(capture)
        return meta

    def _capture(self, rid: str, count: int) -> Capture | None:
        request = self._requests.get(rid)
        if request is None or self._manager is None or count < 1:
            return None
        if getattr(request, "mm_features", None) or getattr(request, "prompt_embeds", None) is not None:
            self._requests.pop(rid)  # its K/V depend on more than its token ids
            return None
        start = request.num_computed_tokens  # before this step (the scheduler updates it after the metadata)
        block_ids = self._manager.get_block_ids(rid)[0]
        bs = self.block_size
        first, last = start // bs, (start + count - 1) // bs
        if last >= len(block_ids):
            return None
        first_step = rid not in self._chains
        parent = self._parent(request, start) if start % bs == 0 and start <= len(request.all_token_ids) else None
        touch = list(self._chains.get(rid, ())[:start // bs]) if first_step and parent is not None else []
        return Capture(rid, start, count, list(block_ids[first:last + 1]), parent, touch)

    def request_finished(self, request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        rid = request.request_id
        self._requests.pop(rid, None)
        self._chains.pop(rid, None)
        self._finished.append(rid)
        if self._wants_prewarm(request):
            self._prewarm[rid] = request.cache_salt
        return False, None

    def _wants_prewarm(self, request) -> bool:
        """Whether a finished request asked the target's server to load its conversation ahead: its
        ``kv_transfer_params`` ``"kvbridge_prewarm"`` (true or false), else the engine's default (``--prewarm``)."""
        params = request.kv_transfer_params if isinstance(request.kv_transfer_params, dict) else {}
        asked = params.get(PREWARM, self.config.prewarm)
        if not isinstance(asked, bool):
            logger.warning("kvbridge source connector: request %s: kv_transfer_params %s must be true or false, not "
                           "%r; not prewarmed", request.request_id, PREWARM, asked)
            return False
        return asked

    # -- worker side ---------------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]):
        """Wrap each attention layer's cache update (once): the K/V it writes are the K/V to store."""
        from vllm.model_executor.models.utils import extract_layer_index

        context = self._vllm_config.compilation_config.static_forward_context
        impls = {}
        for name in kv_caches:
            layer = context.get(name)
            backend = getattr(layer, "attn_backend", None)
            if layer is None or not hasattr(getattr(layer, "impl", None), "do_kv_cache_update") or \
                    getattr(backend, "forward_includes_kv_cache_update", False):
                raise UnsupportedModelError(f"kvbridge source connector: layer {name} has no separate cache-update "
                                            "call to observe; this attention backend is not supported.")
            self._layers[name] = extract_layer_index(name)
            impls[id(layer.impl)] = layer.impl
        if sorted(self._layers.values()) != list(range(len(self._layers))):
            raise UnsupportedModelError("kvbridge source connector: the engine's attention layers are not one per "
                                        "decoder layer (shared KV layers?); this model is not supported.")
        for impl in impls.values():
            original = impl.do_kv_cache_update

            def update(layer, key, value, kv_cache, slot_mapping, *args, _original=original, **kwargs):
                self._observe_kv(layer, key, value, slot_mapping)
                return _original(layer, key, value, kv_cache, slot_mapping, *args, **kwargs)

            impl.do_kv_cache_update = update

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        self._clock.begin()
        super().bind_connector_metadata(connector_metadata)
        captures = getattr(connector_metadata, "captures", None)
        self._step = {"captures": captures, "rows": None, "kv": {}} if captures else None

    def _rows(self, slot_mapping: torch.Tensor) -> dict[str, slice]:
        """Each capture's rows in this step's flattened tokens (consecutive), found by its slots."""
        slots = slot_mapping.detach().to("cpu", torch.long)
        rows = {}
        bs = self.block_size
        for cap in self._step["captures"]:
            pos = torch.arange(cap.start, cap.start + cap.count)
            blocks = torch.tensor(cap.block_ids, dtype=torch.long)
            want = blocks[pos // bs - cap.start // bs] * bs + pos % bs
            hit = (slots == want[0]).nonzero()
            if hit.numel() != 1:
                continue
            row = int(hit[0, 0])
            if row + cap.count <= slots.numel() and torch.equal(slots[row:row + cap.count], want):
                rows[cap.request_id] = slice(row, row + cap.count)
        return rows

    def _observe_kv(self, layer, key, value, slot_mapping) -> None:
        step = self._step
        if step is None:
            return
        try:
            if step["rows"] is None:
                step["rows"] = self._rows(slot_mapping)
            index = self._layers.get(getattr(layer, "layer_name", None))
            if index is not None and step["rows"]:
                shape = (-1, layer.num_kv_heads, layer.head_size)  # (n, H, D)
                step["kv"][index] = {rid: (key[rows].detach().to("cpu", copy=True).reshape(shape),
                                           value[rows].detach().to("cpu", copy=True).reshape(shape))
                                     for rid, rows in step["rows"].items()}
        except Exception as exc:  # observing must never break serving
            logger.warning("kvbridge source connector: a step's K/V were not captured (%s)", exc)
            self._step = None

    def _find_model(self, module, args, kwargs, output):
        """Global forward hook until the served model is found (the module that computes logits): then a hook on it."""
        if hasattr(module, "compute_logits") and isinstance(output, torch.Tensor):
            self._model_hook.remove()
            self._model_hook = module.register_forward_hook(self._observe_hidden, with_kwargs=True)
            self._observe_hidden(module, args, kwargs, output)

    def _observe_hidden(self, module, args, kwargs, output) -> None:
        step = self._step
        if step is None or not isinstance(output, torch.Tensor):
            return
        try:
            ids = kwargs.get("input_ids", args[0] if args else None)
            step["hidden"] = {rid: (output[rows].detach().to("cpu", copy=True),
                                    ids[rows].detach().to("cpu", torch.long, copy=True))
                              for rid, rows in (step["rows"] or {}).items()}
        except Exception as exc:
            logger.warning("kvbridge source connector: a step's hidden states were not captured (%s)", exc)
            self._step = None

    def wait_for_save(self):
        """After the step's forward: append each request's captured tokens; queue every block they complete."""
        step, self._step = self._step, None
        try:
            self._save(step, self._connector_metadata)
        except Exception as exc:  # storing must never break serving: this step's blocks are lost, nothing else
            logger.warning("kvbridge source connector: a step's blocks were not stored (%s)", exc)
            self._pending.clear()
        finally:
            self._clock.end()

    def _write_backlog(self) -> bool:
        return self._queued_bytes > QUEUE_BYTES // 4

    def _map_backlog(self) -> bool:
        return self._map_bytes > MAP_QUEUE_BYTES // 4

    def _save(self, step, meta) -> None:
        for rid in getattr(meta, "preempted", ()):
            self._pending.pop(rid, None)
        prewarm = getattr(meta, "prewarm", {})
        for rid in getattr(meta, "finished", ()):
            pend = self._pending.pop(rid, None)
            if pend is not None and pend.end > pend.start and not pend.broken:  # the partial block it ended with
                ids, hidden = torch.cat(pend.ids), torch.cat(pend.hidden)
                self._queue_block((pend.parent, pend.parent, ids.tolist(), torch.cat(pend.keys, dim=1),
                                   torch.cat(pend.values, dim=1), hidden, True, pend.start,
                                   (prewarm[rid],) if rid in prewarm else None))
            elif pend is not None and not pend.broken and pend.start > 0 and rid in prewarm:
                # it ended on a block boundary (no tail): its conversation ends with its last full block, announced
                # once that block (queued before) is stored and mapped ahead
                self._queue_block(("announce", self.store.path(pend.parent), prewarm[rid]))
        if step is None or "hidden" not in step or len(step["kv"]) != len(self._layers):
            return
        layers = sorted(step["kv"])
        for cap in step["captures"]:
            if cap.touch:
                self._queue_block(("touch", cap.touch))
            if cap.request_id not in step["hidden"] or any(cap.request_id not in step["kv"][i] for i in layers):
                self._pending.pop(cap.request_id, None)  # a gap: start again at the next block boundary
                continue
            pend = self._pending.get(cap.request_id)
            if cap.parent is not None:
                pend = Pending(cap.parent, cap.start, end=cap.start)
            elif pend is None or pend.end != cap.start:
                self._pending.pop(cap.request_id, None)
                continue
            hidden, ids = step["hidden"][cap.request_id]
            pend.ids.append(ids)
            pend.hidden.append(hidden)
            pend.keys.append(torch.stack([step["kv"][i][cap.request_id][0] for i in layers]))
            pend.values.append(torch.stack([step["kv"][i][cap.request_id][1] for i in layers]))
            pend.end += cap.count
            self._pending[cap.request_id] = pend
            self._emit(pend)

    def _emit(self, pend: Pending) -> None:
        bs = self.block_size
        if pend.end - pend.start < bs:
            return
        ids, hidden = torch.cat(pend.ids), torch.cat(pend.hidden)
        keys, values = torch.cat(pend.keys, dim=1), torch.cat(pend.values, dim=1)
        while pend.end - pend.start >= bs:
            block = ids[:bs].tolist()
            key = next_key(pend.parent, block)
            if not pend.broken:
                pend.broken = not self._queue_block((key, pend.parent, block, keys[:, :bs], values[:, :bs],
                                                     hidden[:bs], False, pend.start, None))
            pend.parent, pend.start = key, pend.start + bs
            ids, hidden, keys, values = ids[bs:], hidden[bs:], keys[:, bs:], values[:, bs:]
        pend.ids, pend.hidden, pend.keys, pend.values = [ids], [hidden], [keys], [values]

    def _queue_block(self, item: tuple) -> bool:
        """Hand a block (or keys to mark used) to the writer; False when its queue holds ``QUEUE_BYTES`` already
        (the store is slower than the engine: the block is not stored, the engine never waits)."""
        size = sum(t.numel() * t.element_size() for t in item if isinstance(t, torch.Tensor))
        with self._queued_lock:
            if self._queued_bytes + size > QUEUE_BYTES:
                self.dropped += 1
                return False
            self._queued_bytes += size
        self._queue.put((size, item, time.monotonic()))
        return True

    def _writer(self) -> None:
        single_threaded()
        while True:
            size, item, since = self._queue.get()
            try:
                self._clock.wait(since, self._write_backlog)
                if item[0] == "touch":
                    self.store.touch(item[1], self.map_ahead.map_id if self.map_ahead else None)
                elif item[0] == "announce":  # (behind the map-ahead thread's blocks, when it has one)
                    if self._map_queue is None or not self._queue_map(item, 0):
                        self._announce_prewarm(item)
                else:
                    key, parent, block, keys, values, hidden, tail, start, prewarm = item
                    keys, values, hidden = keys.clone(), values.clone(), hidden.clone()  # not views of the step's
                    if not self.store.put(key, parent, self.identity, block, keys, values, hidden, tail=tail):
                        self.dropped += 1
                    elif self._map_queue is None or \
                            not self._queue_map((key, parent, block, keys, values, hidden, tail, start, prewarm), size):
                        self._announce_prewarm(item)  # (after the map-ahead thread's turn, when it has one)
            except Exception as exc:  # a store that fails must not stop the writer
                self.dropped += 1
                logger.warning("kvbridge source connector: a block was not stored (%s)", exc)
            finally:
                with self._queued_lock:
                    self._queued_bytes -= size
                self._queue.task_done()

    def _queue_map(self, item: tuple, size: int) -> bool:
        """Hand a stored block to the map-ahead thread, unless ``MAP_QUEUE_BYTES`` wait already (then the target's
        connector maps it from the source entry: False)."""
        with self._queued_lock:
            if self._map_bytes + size > MAP_QUEUE_BYTES:
                logger.info("kvbridge source connector: map-ahead is behind; a block is left to the target to map")
                return False
            self._map_bytes += size
        self._map_queue.put((size, item, time.monotonic()))
        return True

    def _announce_prewarm(self, item: tuple) -> None:
        """A finished request that asked for it: its conversation announced for the target's server to load ahead —
        once its blocks are stored and mapped ahead. ``item``: its tail block (parent second, ``(salt,)`` or None
        last), or ``("announce", last full block's entry, salt)`` when it ended on a block boundary."""
        if item[0] == "announce":
            self.store.announce_prewarm(item[1], item[2])
        elif item[-1] is not None:
            self.store.announce_prewarm(self.store.tail_path(item[1]), item[-1][0])

    def _mapper_loop(self) -> None:
        single_threaded()
        while True:
            size, item, since = self._map_queue.get()
            try:
                if item[0] != "announce":
                    self._clock.wait(since, self._map_backlog)
                    self._premap(*item[:-1])
            except Exception as exc:  # map-ahead is an optimization: the source entry is stored, the target maps it
                logger.warning("kvbridge source connector: a block was not mapped ahead (%s)", exc)
            finally:
                with self._queued_lock:
                    self._map_bytes -= size
                try:
                    self._announce_prewarm(item)
                except Exception as exc:  # a hint: the conversation is loaded at the switch instead
                    logger.warning("kvbridge source connector: a conversation was not announced for prewarm (%s)", exc)
                self._map_queue.task_done()

    def _premap(self, key: str, parent: str, block: list[int], keys, values, hidden, tail: bool, start: int) -> None:
        """Map one stored block into the target's K/V and store that beside it (map-ahead thread, blocks in the
        order they were stored). Its lags read the last source tokens of the block before: kept from that block's
        own turn, else read from the store; when neither has them the block is not mapped ahead (the target's
        connector maps it from the source entry)."""
        from ...core.transfer import map_block

        ahead = self.map_ahead
        keep = ahead.mapper.max_lag
        lag = min(keep, start)
        if keep and not tail:  # the next block's lags read this one's last tokens (copies: the block is let go)
            self._lag_tails[key] = (keys[:, -keep:].clone(), values[:, -keep:].clone(), hidden[-keep:].clone())
            while len(self._lag_tails) > LAG_TAILS:
                self._lag_tails.popitem(last=False)
        path = self.store.mapped_path(parent if tail else key, ahead.map_id, tail)
        if not tail and path.exists():  # the same block, mapped earlier: only marked used
            self.store.touch([key], ahead.map_id)
            return
        if lag:
            before = self._lag_tails.get(parent)
            if before is None:
                try:
                    got = self.store.get(self.store.path(parent), self.identity, None)
                except RefusedEntry:
                    got = None
                before = None if got is None else (got["key"], got["value"], got["hidden"])
            if before is None:
                logger.info("kvbridge source connector: a block is not mapped ahead (the block before it, whose "
                            "tokens its lags read, is gone); the target maps it")
                return
            keys, values = (torch.cat([b[:, -lag:], x], dim=1) for b, x in zip(before, (keys, values)))
            hidden = torch.cat([before[2][-lag:], hidden])
        device = ahead.mapper.device
        mapped_k, mapped_v = map_block(ahead.source, ahead.target, ahead.mapper, keys.to(device), values.to(device),
                                       hidden.to(device), start, lag)
        self.store.put(key, parent, ahead.map_id, block, mapped_k.cpu(), mapped_v.cpu(), None, tail=tail,
                       map_id=ahead.map_id)

    def flush(self) -> None:
        """Wait until every queued block is written and mapped ahead (tests, shutdown)."""
        if self._queue is not None:
            self._queue.join()
        if self._map_queue is not None:
            self._map_queue.join()

    def shutdown(self):
        self.flush()

    def start_load_kv(self, forward_context, **kwargs: Any) -> None:
        return  # a producer loads nothing

    def wait_for_layer_load(self, layer_name: str) -> None:
        return

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata, **kwargs: Any) -> None:
        return  # the K/V are observed at the cache update (layout-independent), not read back from the paged cache
