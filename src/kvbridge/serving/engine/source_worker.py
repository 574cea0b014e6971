"""The worker's side of the source's storing connector (:mod:`kvbridge.serving.engine.producer`): it observes, in
each step, the K/V the engine writes into its paged cache (at the attention backend's own cache-update call) and the
served model's final hidden states (a forward hook), follows each captured request's tokens since its last full block
(:class:`Pending`), and hands every block they complete to the writer (:class:`~kvbridge.serving.engine.source_writer.
StoreWriter`)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ...errors import UnsupportedModelError
from ..store.keys import next_key
from .idle import StepClock
from .source_scheduler import Capture
from .source_setup import SourceSetup, logger
from .source_writer import Announce, Block, StoreWriter, Touch, map_ahead


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
class Step:
    """What one step's forward showed of its captured requests."""

    captures: list[Capture]
    rows: dict[str, slice] | None = None  # each capture's rows in the step's flattened tokens (found at a layer)
    kv: dict[int, dict[str, tuple[torch.Tensor, torch.Tensor]]] = field(default_factory=dict)  # layer -> id -> (k, v)
    hidden: dict[str, tuple[torch.Tensor, torch.Tensor]] | None = None  # request id -> (hidden states, token ids)


class KVBridgeSourceWorker:
    """The storing connector on the worker (:class:`~kvbridge.serving.engine.producer.KVBridgeSourceConnector`
    delegates to it): observes each step's K/V and hidden states, queues the blocks they complete."""

    def __init__(self, setup: SourceSetup, vllm_config):
        self.setup = setup
        self.config = setup.config
        self.block_size = setup.block_size
        self.store = setup.store
        self._vllm_config = vllm_config
        ahead = None
        if self.config.mapper:
            ahead = map_ahead(self.config, setup.source, setup.identity, vllm_config.device_config.device_type)
        self._pending: dict[str, Pending] = {}
        self._step: Step | None = None
        self._layers: dict[str, int] = {}
        self._clock = StepClock()  # the threads write and map while the engine is idle (kvbridge.serving.engine.idle)
        self.writer = StoreWriter(setup, ahead, self._clock)
        self._model_hook = torch.nn.modules.module.register_module_forward_hook(self._find_model, with_kwargs=True)
        logger.info("kvbridge source connector: storing %s-token blocks of %s in %s (cap %.1f GiB)%s",
                    self.block_size, self.config.source or vllm_config.model_config.model, self.config.store,
                    self.store.cap_bytes / 2**30,
                    f"; mapping each into {self.config.target}'s K/V with {self.config.mapper} in "
                    f"{ahead.mapper.dtype} (map-ahead)" if ahead else "")

    # -- observing -----------------------------------------------------------------------------
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

    def step_begins(self, meta) -> None:
        """The scheduler's metadata is bound: the engine's forward follows."""
        self._clock.begin()
        captures = getattr(meta, "captures", None)
        self._step = Step(captures) if captures else None

    def _rows(self, slot_mapping: torch.Tensor) -> dict[str, slice]:
        """Each capture's rows in this step's flattened tokens (consecutive), found by its slots."""
        slots = slot_mapping.detach().to("cpu", torch.long)
        rows = {}
        bs = self.block_size
        for cap in self._step.captures:
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
            if step.rows is None:
                step.rows = self._rows(slot_mapping)
            index = self._layers.get(getattr(layer, "layer_name", None))
            if index is not None and step.rows:
                shape = (-1, layer.num_kv_heads, layer.head_size)  # (n, H, D)
                step.kv[index] = {rid: (key[rows].detach().to("cpu", copy=True).reshape(shape),
                                        value[rows].detach().to("cpu", copy=True).reshape(shape))
                                  for rid, rows in step.rows.items()}
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
            step.hidden = {rid: (output[rows].detach().to("cpu", copy=True),
                                 ids[rows].detach().to("cpu", torch.long, copy=True))
                           for rid, rows in (step.rows or {}).items()}
        except Exception as exc:
            logger.warning("kvbridge source connector: a step's hidden states were not captured (%s)", exc)
            self._step = None

    # -- storing -------------------------------------------------------------------------------
    def step_ends(self, meta) -> None:
        """After the step's forward: append each request's captured tokens; queue every block they complete."""
        step, self._step = self._step, None
        try:
            self._save(step, meta)
        except Exception as exc:  # storing must never break serving: this step's blocks are lost, nothing else
            logger.warning("kvbridge source connector: a step's blocks were not stored (%s)", exc)
            self._pending.clear()
        finally:
            self._clock.end()

    def _finish(self, meta) -> None:
        """The requests that finished or were preempted before this step: the partial block a finished one ended
        with queued (as its tail), or, when it ended on a block boundary and asked for prewarm, its conversation
        announced."""
        for rid in getattr(meta, "preempted", ()):
            self._pending.pop(rid, None)
        prewarm = getattr(meta, "prewarm", {})
        for rid in getattr(meta, "finished", ()):
            pend = self._pending.pop(rid, None)
            if pend is not None and pend.end > pend.start and not pend.broken:  # the partial block it ended with
                self.writer.put(Block(pend.parent, pend.parent, torch.cat(pend.ids).tolist(),
                                      torch.cat(pend.keys, dim=1), torch.cat(pend.values, dim=1),
                                      torch.cat(pend.hidden), True, pend.start, rid in prewarm, prewarm.get(rid)))
            elif pend is not None and not pend.broken and pend.start > 0 and rid in prewarm:
                # it ended on a block boundary (no tail): its conversation ends with its last full block, announced
                # once that block (queued before) is stored and mapped ahead
                self.writer.put(Announce(self.store.path(pend.parent), prewarm[rid]))

    def _save(self, step: Step | None, meta) -> None:
        self._finish(meta)
        if step is None or step.hidden is None or len(step.kv) != len(self._layers):
            return
        layers = sorted(step.kv)
        for cap in step.captures:
            if cap.touch:
                self.writer.put(Touch(cap.touch))
            if cap.request_id not in step.hidden or any(cap.request_id not in step.kv[i] for i in layers):
                self._pending.pop(cap.request_id, None)  # a gap: start again at the next block boundary
                continue
            pend = self._pending.get(cap.request_id)
            if cap.parent is not None:
                pend = Pending(cap.parent, cap.start, end=cap.start)
            elif pend is None or pend.end != cap.start:
                self._pending.pop(cap.request_id, None)
                continue
            hidden, ids = step.hidden[cap.request_id]
            pend.ids.append(ids)
            pend.hidden.append(hidden)
            pend.keys.append(torch.stack([step.kv[i][cap.request_id][0] for i in layers]))
            pend.values.append(torch.stack([step.kv[i][cap.request_id][1] for i in layers]))
            pend.end += cap.count
            self._pending[cap.request_id] = pend
            self._emit(pend)

    def _emit(self, pend: Pending) -> None:
        """Queue each full block of ``pend`` (its chain continued); keep the rest."""
        bs = self.block_size
        if pend.end - pend.start < bs:
            return
        ids, hidden = torch.cat(pend.ids), torch.cat(pend.hidden)
        keys, values = torch.cat(pend.keys, dim=1), torch.cat(pend.values, dim=1)
        while pend.end - pend.start >= bs:
            block = ids[:bs].tolist()
            key = next_key(pend.parent, block)
            if not pend.broken:
                pend.broken = not self.writer.put(Block(key, pend.parent, block, keys[:, :bs], values[:, :bs],
                                                        hidden[:bs], False, pend.start))
            pend.parent, pend.start = key, pend.start + bs
            ids, hidden, keys, values = ids[bs:], hidden[bs:], keys[:, bs:], values[:, bs:]
        pend.ids, pend.hidden, pend.keys, pend.values = [ids], [hidden], [keys], [values]

    def flush(self) -> None:
        """Wait until every queued block is written and mapped ahead (tests, shutdown)."""
        self.writer.flush()
