"""The target's memory tier of the KV store: blocks mapped ahead, loaded before a request needs them.

Letters: L target layers, t tokens of a block, H kv heads, D head dim.

When a conversation escalates, the target's connector reads the blocks the source engine mapped ahead — on the
embedded family at 2,000 tokens, 16 files of 512 KB: reading, checking (CRC-32, identity, shapes, finite values) and
parsing them took most of the connector's few milliseconds on the request's path. Those blocks were written well
before the escalation (as the source served its turns), so the target's connector loads them into memory as they
appear: the source engine announces each mapped entry in the store's journal (:meth:`KVStore.announce`), and a
thread of the target's worker reads the journal, waits for an idle engine (:class:`~kvbridge.serving.engine.idle
.StepClock`), and loads the entries of its own map, checked as a read from the folder checks them — plus finite
values, so that a block in memory needs no check on the request's path. The request's lookup then finds them in
memory (:meth:`KVStore.lookup`'s ``hot``), and the connector writes them block by block into the engine's cache.

Memory is bounded (``cap_bytes``, least recently used out first). Entries are content-addressed (a block's key
names its whole token prefix, the source model and the map), so an entry held here stays right when the folder's
copy is evicted; a tail rewritten under its key is reloaded when the journal announces it again (the lookup still
compares its token ids). Everything here is a hint: an entry not loaded in time, or not at all, is read from the
folder as before. Multi-node deployments would announce through their store's own notifications (an object
store's events, LMCache's controller); here the journal is a file beside the entries.
"""

from __future__ import annotations

import queue
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path

import torch

from ..engine.idle import Backoff, StepClock, single_threaded
from .folder import RefusedEntry, all_finite
from .keys import mapped_suffix

POLL_S = 0.05  # how often the journal is read while it grows ...
IDLE_POLL_S = 0.5  # ... and, backing off, while it does not
DEFAULT_CAP = 1 << 30  # 1 GiB of mapped blocks in memory
BATCH_LOG = 32  # a run of at least this many announced entries is logged with its load time


def _nbytes(tensors: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors.values())


class HotEntries:
    """Mapped entries of ``map_id`` held in memory, up to ``cap_bytes``; ``store()`` returns the
    :class:`~kvbridge.serving.store.folder.KVStore` (None until it exists). :meth:`start` runs the prefetch thread;
    :meth:`get` is the lookup's ``hot``."""

    def __init__(self, store: Callable, map_id: str, cap_bytes: int = DEFAULT_CAP, clock: StepClock | None = None,
                 logger=None):
        self.store, self.map_id, self.cap_bytes = store, map_id, cap_bytes
        self.clock = clock or StepClock()
        self.logger = logger
        self.suffix = mapped_suffix(map_id)
        self._entries: OrderedDict[Path, dict[str, torch.Tensor]] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()  # work handed off the request's path (marking used)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.loaded = 0  # entries loaded so far
        self.skipped = 0  # announced entries not loaded (absent by then, refused, not finite)

    @property
    def nbytes(self) -> int:
        return self._bytes

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, path: Path) -> dict[str, torch.Tensor] | None:
        """The entry at ``path`` if it is held (and now the most recently used), else None."""
        with self._lock:
            tensors = self._entries.get(path)
            if tensors is not None:
                self._entries.move_to_end(path)
            return tensors

    def later(self, job: Callable[[], object]) -> None:
        """Run ``job`` on the prefetch thread, off the request's path (when the thread is not running: now)."""
        if self._thread_alive():
            self._jobs.put(job)
        else:
            job()

    def load(self, path: Path) -> bool:
        """Read ``path`` from the folder (checked as any read) and hold it; False when it is absent, refused or not
        finite (the request's lookup then meets it in the folder and decides as before)."""
        store = self.store()
        if store is None or not path.name.endswith(self.suffix):
            return False
        try:
            got = store.get(path, self.map_id, None, mapped=True)
        except RefusedEntry:
            got = None
        ok = got is not None and all_finite((got["key"], got["value"]))
        size = _nbytes(got) if ok else 0
        with self._lock:
            old = self._entries.pop(path, None)  # written again under its key (a tail): the newer one, or none
            if old is not None:
                self._bytes -= _nbytes(old)
            if not ok or size > self.cap_bytes:
                self.skipped += 1
                return False
            self._entries[path] = got
            self._bytes += size
            while self._bytes > self.cap_bytes:
                _, out = self._entries.popitem(last=False)
                self._bytes -= _nbytes(out)
        self.loaded += 1
        return True

    # -- the prefetch thread -------------------------------------------------------------------------
    def start(self) -> HotEntries:
        self._thread = threading.Thread(target=self._run, name="kvbridge-prefetch", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()

    def _thread_alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and not self._stop.is_set()

    def _run(self) -> None:
        single_threaded()
        cursor = None
        run: tuple[float | None, int] = (None, 0)  # (when a run of announcements began, self.loaded before it)
        backoff = Backoff(POLL_S, IDLE_POLL_S)
        while not self._stop.wait(backoff.wait_s):
            backoff.next(False)  # (a read that finds something below waits the low time again)
            try:
                self._jobs_now()
                store = self.store()
                if store is None:
                    continue
                paths, cursor = store.announced(cursor)
                if paths:
                    backoff.next(True)
                since = time.monotonic()
                batch = list(dict.fromkeys(p for p in paths if p.name.endswith(self.suffix)))
                before = self.loaded
                for path in batch:
                    self.clock.wait(since)  # the engine's steps first (at most DEFER_S for the whole batch)
                    try:
                        self.load(path)
                    except Exception as exc:  # one entry: the rest of the batch is still loaded
                        self.skipped += 1
                        self._warn(exc)
                    self._jobs_now()
                if batch:  # a run of announcements: logged once the journal is quiet again
                    run = run if run[0] is not None else (since, before)
                elif run[0] is not None:
                    if self.loaded - run[1] >= BATCH_LOG and self.logger is not None:
                        self.logger.info("kvbridge connector: %d announced blocks loaded into memory over %.2f s "
                                         "(%d held, %.0f MB)", self.loaded - run[1], time.monotonic() - run[0],
                                         len(self), self._bytes / 1e6)
                    run = (None, 0)
            except Exception as exc:  # prefetching is a hint: a failure leaves the folder's path as it was
                self._warn(exc)

    def _warn(self, exc: Exception) -> None:
        if self.logger is not None:
            self.logger.warning("kvbridge connector: prefetching mapped blocks failed (%s)", exc)

    def _jobs_now(self) -> None:
        while True:
            try:
                job = self._jobs.get_nowait()
            except queue.Empty:
                return
            try:
                job()
            except Exception:  # marking entries used is a hint too
                pass
