"""The source's storing connector's background threads (:mod:`kvbridge.serving.engine.producer`): the writer, which
stores each block the worker hands it in the :class:`~kvbridge.serving.store.folder.KVStore`, and, with map-ahead,
the mapper, which maps each stored block into the target's K/V (:func:`kvbridge.core.transfer.map_block`) and stores
that beside it. Both work while the engine is idle (:mod:`kvbridge.serving.engine.idle`); neither ever makes the
engine wait: a full queue drops what does not fit."""

from __future__ import annotations

import queue
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from ..store.folder import RefusedEntry
from .config import StoreConfig
from .idle import StepClock, single_threaded
from .source_setup import SourceSetup, logger

QUEUE_BYTES = 512 << 20  # blocks waiting to be written; beyond, new blocks are dropped (counted), never waited for
LAG_TAILS = 4096  # map-ahead: the last source tokens of this many recent blocks, for the lags of the block after
MAP_QUEUE_BYTES = 256 << 20  # stored blocks waiting to be mapped; beyond, blocks are not mapped ahead (logged)


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
    from ..store.keys import map_identity, target_description
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


@dataclass
class Block:
    """A block of a request's computed tokens, to store: its chain key and its parent's, its token ids, and per token
    the source's K/V and final hidden state."""

    key: str
    parent: str
    tokens: list[int]
    keys: torch.Tensor  # (L, n, H, D)
    values: torch.Tensor
    hidden: torch.Tensor  # (n, S)
    tail: bool  # a finished request's last, partial block (stored as its parent's tail)
    start: int  # the position of its first token
    prewarm: bool = False  # (a tail) its request asked the target's server to load the conversation ahead
    salt: str | None = None  # and that request's client salt

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.keys, self.values, self.hidden))


@dataclass
class Touch:
    """Keys of stored blocks to mark used (a request read them from the engine's prefix cache)."""

    keys: list[str]


@dataclass
class Announce:
    """A finished request that ended on a block boundary and asked for prewarm: its last full block's entry, and
    its client salt."""

    entry: Path
    salt: str | None


class StoreWriter:
    """The writer thread and, with ``ahead`` (map-ahead), the mapper thread, each with its queue."""

    def __init__(self, setup: SourceSetup, ahead: MapAhead | None, clock: StepClock):
        self.store = setup.store
        self.identity = setup.identity
        self.ahead = ahead
        self._clock = clock
        self.dropped = 0  # blocks not stored: a full queue, a failed write
        self._queue: queue.Queue = queue.Queue()
        self._queued_bytes = 0
        self._queued_lock = threading.Lock()
        self._map_queue: queue.Queue | None = None
        self._map_bytes = 0
        self._lag_tails: OrderedDict[str, tuple] = OrderedDict()  # block key -> its last source tokens (mapper)
        threading.Thread(target=self._writer, name="kvbridge-store-writer", daemon=True).start()
        if ahead is not None:  # a thread of its own: a slow map never holds back the source's blocks
            self._map_queue = queue.Queue()
            threading.Thread(target=self._mapper_loop, name="kvbridge-map-ahead", daemon=True).start()

    def _write_backlog(self) -> bool:
        return self._queued_bytes > QUEUE_BYTES // 4

    def _map_backlog(self) -> bool:
        return self._map_bytes > MAP_QUEUE_BYTES // 4

    def put(self, item: Block | Touch | Announce) -> bool:
        """Hand a block (or keys to mark used, or a conversation to announce) to the writer; False when its queue
        holds ``QUEUE_BYTES`` already (the store is slower than the engine: the block is not stored, the engine never
        waits)."""
        size = item.nbytes if isinstance(item, Block) else 0
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
                if isinstance(item, Touch):
                    self.store.touch(item.keys, self.ahead.map_id if self.ahead else None)
                elif isinstance(item, Announce):  # (behind the map-ahead thread's blocks, when it has one)
                    if self._map_queue is None or not self._queue_map(item, 0):
                        self._announce_prewarm(item)
                else:  # copies, not views of the step's tensors
                    block = replace(item, keys=item.keys.clone(), values=item.values.clone(),
                                    hidden=item.hidden.clone())
                    if not self.store.put(block.key, block.parent, self.identity, block.tokens, block.keys,
                                          block.values, block.hidden, tail=block.tail):
                        self.dropped += 1
                    elif self._map_queue is None or not self._queue_map(block, size):
                        self._announce_prewarm(block)  # (after the map-ahead thread's turn, when it has one)
            except Exception as exc:  # a store that fails must not stop the writer
                self.dropped += 1
                logger.warning("kvbridge source connector: a block was not stored (%s)", exc)
            finally:
                with self._queued_lock:
                    self._queued_bytes -= size
                self._queue.task_done()

    def _queue_map(self, item: Block | Announce, size: int) -> bool:
        """Hand a stored block to the map-ahead thread, unless ``MAP_QUEUE_BYTES`` wait already (then the target's
        connector maps it from the source entry: False)."""
        with self._queued_lock:
            if self._map_bytes + size > MAP_QUEUE_BYTES:
                logger.info("kvbridge source connector: map-ahead is behind; a block is left to the target to map")
                return False
            self._map_bytes += size
        self._map_queue.put((size, item, time.monotonic()))
        return True

    def _announce_prewarm(self, item: Block | Announce) -> None:
        """A finished request that asked for it: its conversation announced for the target's server to load ahead —
        once its blocks are stored and mapped ahead. ``item``: its tail block, or its last full block's entry when it
        ended on a block boundary."""
        if isinstance(item, Announce):
            self.store.announce_prewarm(item.entry, item.salt)
        elif item.prewarm:
            self.store.announce_prewarm(self.store.tail_path(item.parent), item.salt)

    def _mapper_loop(self) -> None:
        single_threaded()
        while True:
            size, item, since = self._map_queue.get()
            try:
                if isinstance(item, Block):
                    self._clock.wait(since, self._map_backlog)
                    self._premap(item)
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

    def _premap(self, block: Block) -> None:
        """Map one stored block into the target's K/V and store that beside it (map-ahead thread, blocks in the
        order they were stored). Its lags read the last source tokens of the block before: kept from that block's
        own turn, else read from the store; when neither has them the block is not mapped ahead (the target's
        connector maps it from the source entry)."""
        from ...core.transfer import map_block

        ahead, keys, values, hidden = self.ahead, block.keys, block.values, block.hidden
        keep = ahead.mapper.max_lag
        lag = min(keep, block.start)
        if keep and not block.tail:  # the next block's lags read this one's last tokens (copies: the block is let go)
            self._lag_tails[block.key] = (keys[:, -keep:].clone(), values[:, -keep:].clone(), hidden[-keep:].clone())
            while len(self._lag_tails) > LAG_TAILS:
                self._lag_tails.popitem(last=False)
        path = self.store.mapped_path(block.parent if block.tail else block.key, ahead.map_id, block.tail)
        if not block.tail and path.exists():  # the same block, mapped earlier: only marked used
            self.store.touch([block.key], ahead.map_id)
            return
        if lag:
            before = self._lag_tails.get(block.parent)
            if before is None:
                try:
                    got = self.store.get(self.store.path(block.parent), self.identity, None)
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
                                       hidden.to(device), block.start, lag)
        self.store.put(block.key, block.parent, ahead.map_id, block.tokens, mapped_k.cpu(), mapped_v.cpu(), None,
                       tail=block.tail, map_id=ahead.map_id)

    def flush(self) -> None:
        """Wait until every queued block is written and mapped ahead (tests, shutdown)."""
        self._queue.join()
        if self._map_queue is not None:
            self._map_queue.join()
