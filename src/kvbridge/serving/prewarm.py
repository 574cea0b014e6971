"""Prewarming: the target's server loads a conversation the source has served into its own prefix cache, ahead of
an escalation.

Warm transfer's last cost at the switch is the connector's: reading the blocks mapped ahead (from memory) and
writing them into the engine's paged cache — a few milliseconds, beside the engine's own cost of a request whose
history is a prefix-cache hit (the ceiling of any transfer). When a client expects a conversation may move to the
target (a router's low confidence, a cascade's policy), it asks the source for it: ``kv_transfer_params=
{"kvbridge_prewarm": true}`` on the source's request (``kvbridge serve-source --prewarm``: every request). Once the
source engine has stored and mapped ahead that request's blocks, it announces the conversation in the store's
prewarm journal (:meth:`~kvbridge.serving.store.KVStore.announce_prewarm`: the tail entry it ended with, and the
request's client salt). A thread of ``kvbridge serve`` (this module) reads the journal, walks the conversation's
chain of stored entries back to its first block (:meth:`~kvbridge.serving.store.KVStore.conversation`: every key
checked against its parent and tokens) and sends the target's server a one-token mapped completion of those token
ids, with the client's salt: the connector loads them (mapped ahead, no source prefill) and vLLM commits the full
blocks to its prefix cache — in the mapper's namespace, so only mapped requests of this mapper and salt ever hit
them. The escalated turn, sent mapped, then finds its history in the prefix cache, as a native re-send would find
its own; the connector loads at most the last, partial block.

What it costs: the target engine runs one short request per announced turn (the connector's load, a one-token
prefill over it, one decoded token), and the prewarmed blocks take room in its prefix cache that native requests'
blocks would otherwise keep (vLLM evicts least recently used free blocks first). So it is the client's choice per
request; ``kvbridge serve --no-prewarm`` ignores the journal. Not prewarmed: a request that ends exactly on a block
boundary (no tail is stored), a conversation whose entries were evicted or whose announcement is older than
``MAX_AGE_S`` when read (the thread fell behind). Everything here is a hint: a conversation not prewarmed is loaded
at the switch as before.
"""

from __future__ import annotations

import json
import threading
import time
import urllib.error
import urllib.request
from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path

from .config import PARAM

POLL_S = 0.05  # how often the journal is read
MAX_AGE_S = 30.0  # an announcement older than this when read is skipped: the thread is behind, the turn moved on
TIMEOUT_S = 120.0  # one prewarm request
SEEN = 4096  # announcements remembered (a tail announced twice is prewarmed once)


class Prewarmer:
    """Reads ``store()``'s prewarm journal (``store``: returns the :class:`~kvbridge.serving.store.KVStore`, None
    until it exists) and sends each conversation to ``url`` (the server's base URL) as a one-token mapped completion
    of ``model``; ``max_tokens``: the longest conversation sent (the server's context). :meth:`start` runs the
    thread; ``sent``, ``skipped``, ``failed`` count its work."""

    def __init__(self, store: Callable, url: str, model: str, max_tokens: int, logger=None):
        self.store, self.url, self.model, self.max_tokens = store, url.rstrip("/"), model, max_tokens
        self.logger = logger
        self.sent = self.skipped = self.failed = 0
        self._seen: OrderedDict[tuple[Path, str | None, float], None] = OrderedDict()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> Prewarmer:
        self._thread = threading.Thread(target=self._run, name="kvbridge-prewarm", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()

    def _run(self) -> None:
        cursor = None
        while not self._stop.wait(POLL_S):
            try:
                store = self.store()
                if store is None:
                    continue
                records, cursor = store.prewarms(cursor)
                for record in records:
                    self.prewarm(store, *record)
            except Exception as exc:  # a hint: the switch loads what is not prewarmed
                self._log("warning", "kvbridge prewarm: reading the journal failed (%s)", exc)

    def prewarm(self, store, tail: Path, salt: str | None, when: float) -> bool:
        """Send one announced conversation; False when it is skipped (seen, too old, its chain broken or too long)
        or the request fails."""
        if (tail, salt, when) in self._seen:
            return False
        self._seen[(tail, salt, when)] = None
        while len(self._seen) > SEEN:
            self._seen.popitem(last=False)
        if time.time() - when > MAX_AGE_S:
            self.skipped += 1
            return False
        ids = store.conversation(tail, salt, self.max_tokens // store.block_tokens + 1)
        if ids is None or not 1 < len(ids) < self.max_tokens:
            self.skipped += 1
            return False
        body = {"model": self.model, "prompt": ids, "max_tokens": 1, "temperature": 0,
                "kv_transfer_params": {PARAM: "mapped"}}
        if salt is not None:
            body["cache_salt"] = salt
        request = urllib.request.Request(self.url + "/v1/completions", data=json.dumps(body).encode(),
                                         headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=TIMEOUT_S) as response:
                status = (json.loads(response.read()).get("kv_transfer_params") or {}).get(PARAM)
        except (urllib.error.URLError, OSError, ValueError) as exc:
            self.failed += 1
            self._log("warning", "kvbridge prewarm: a conversation of %d tokens was not prewarmed (%s)", len(ids), exc)
            return False
        self.sent += 1
        self._log("info", "kvbridge prewarm: a conversation of %d tokens loaded ahead (%s), %.0f ms after the source "
                  "announced it", len(ids), status, 1000 * (time.time() - when))
        return True

    def _log(self, level: str, message: str, *args) -> None:
        if self.logger is not None:
            getattr(self.logger, level)(message, *args)
