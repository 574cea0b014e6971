"""Prewarming: the target's server loads a conversation the source has served into its own prefix cache, ahead of
an escalation.

Warm transfer's last cost at the switch is the connector's: reading the blocks mapped ahead (from memory) and
writing them into the engine's paged cache — a few milliseconds, beside the engine's own cost of a request whose
history is a prefix-cache hit (the ceiling of any transfer). When a client expects a conversation may move to the
target (a router's low confidence, a cascade's policy), it asks the source for it: ``kv_transfer_params=
{"kvbridge_prewarm": true}`` on the source's request (``kvbridge serve-source --prewarm``: every request). Once the
source engine has stored and mapped ahead that request's blocks, it announces the conversation in the store's
prewarm journal (:meth:`~kvbridge.serving.store.folder.KVStore.announce_prewarm`: the tail entry it ended with, and the
request's client salt). A thread of ``kvbridge serve`` (this module) reads the journal, walks the conversation's
chain of stored entries back to its first block (:meth:`~kvbridge.serving.store.folder.KVStore.conversation`: every key
checked against its parent and tokens) and sends the target's server a one-token mapped completion of those token
ids, with the client's salt: the connector loads them (mapped ahead, no source prefill) and vLLM commits the full
blocks to its prefix cache — in the mapper's namespace, so only mapped requests of this mapper and salt ever hit
them. The escalated turn, sent mapped, then finds its history in the prefix cache, as a native re-send would find
its own; the connector loads at most the last, partial block.

What it costs: the target engine runs one short request per announced turn (the connector's load, a one-token
prefill over it, one decoded token), and the prewarmed blocks take room in its prefix cache that native requests'
blocks would otherwise keep (vLLM evicts least recently used free blocks first). So it is the client's choice per
request; ``kvbridge serve --no-prewarm`` ignores the journal. (A request that ends exactly on a block boundary
stores no tail: its last full block is announced instead.) Not prewarmed: a conversation whose entries were evicted
or whose announcement is older than ``MAX_AGE_S`` when read (the thread fell behind). Everything here is a hint:
a conversation not prewarmed is loaded at the switch as before.
"""

from __future__ import annotations

import http.client
import json
import threading
import time
import urllib.error
import urllib.request
from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path

from ..engine.config import PARAM
from ..engine.idle import Backoff

POLL_S = 0.05  # how often the journal is read while it grows ...
IDLE_POLL_S = 0.5  # ... and, backing off, while it does not (an escalation comes seconds after its source turn)
MAX_AGE_S = 30.0  # an announcement older than this when read is skipped: the thread is behind, the turn moved on
TIMEOUT_S = 120.0  # one prewarm request
SEEN = 4096  # announcements remembered (each is sent once; a tail announced again, rewritten, is sent again)


class Prewarmer:
    """Reads ``store()``'s prewarm journal (``store``: returns the :class:`~kvbridge.serving.store.folder.KVStore`, None
    until it exists) and sends each conversation to ``url`` (the server's base URL; ``api_key``: its key, if it
    has one) as a one-token mapped completion of ``model``. The journal is read once the server answers
    ``/v1/models``, which also gives the longest conversation it takes (``max_model_len``). ``identity``: the
    source whose entries it sends (None: any). :meth:`start` runs the thread; ``sent``, ``skipped``, ``failed``
    count its work."""

    def __init__(self, store: Callable, url: str, model: str, api_key: str | None = None,
                 identity: str | None = None, logger=None):
        import ssl

        self.store, self.url, self.model, self.identity = store, url.rstrip("/"), model, identity
        self.headers = {"Content-Type": "application/json"} | ({"Authorization": f"Bearer {api_key}"}
                                                               if api_key else {})
        self.logger = logger
        self.max_tokens: int | None = None  # the server's context, once it answers
        self.sent = self.skipped = self.failed = 0
        self._seen: OrderedDict[tuple[Path, str | None, float], None] = OrderedDict()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        # its own server on this machine: no proxy, and its certificate (often self-signed) taken as it is
        context = ssl.create_default_context()
        context.check_hostname, context.verify_mode = False, ssl.CERT_NONE
        self._opener = urllib.request.build_opener(urllib.request.ProxyHandler({}),
                                                   urllib.request.HTTPSHandler(context=context))

    def start(self) -> Prewarmer:
        self._thread = threading.Thread(target=self._run, name="kvbridge-prewarm", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=TIMEOUT_S)

    def ready(self) -> bool:
        """Whether the server answers, and its context (``max_tokens``) is known."""
        if self.max_tokens is None:
            try:
                request = urllib.request.Request(self.url + "/v1/models", headers=self.headers)
                with self._opener.open(request, timeout=10) as response:
                    models = json.loads(response.read())["data"]
                self.max_tokens = int(next(m for m in models if m["id"] == self.model)["max_model_len"])
            except Exception:  # not up yet (or not this model): the journal waits
                return False
        return True

    def _run(self) -> None:
        cursor = None
        backoff = Backoff(POLL_S, IDLE_POLL_S)
        while not self._stop.wait(backoff.wait_s):
            backoff.next(False)  # (a read that finds something below waits the low time again)
            try:
                store = self.store()
                if store is None or not self.ready():
                    continue
                records, cursor = store.prewarms(cursor)
                if records:
                    backoff.next(True)
            except Exception as exc:  # a hint: the switch loads what is not prewarmed
                self._log("warning", "kvbridge prewarm: reading the journal failed (%s)", exc)
                continue
            for record in records:
                try:
                    self.prewarm(store, *record)
                except Exception as exc:  # one conversation: the rest are still sent
                    self.failed += 1
                    self._log("warning", "kvbridge prewarm: a conversation was not prewarmed (%s)", exc)

    def prewarm(self, store, tail: Path, salt: str | None, when: float) -> bool:
        """Send one announced conversation; False when it is skipped (seen, too old, its chain broken, another
        source's or too long for the server) or the request fails."""
        if (tail, salt, when) in self._seen:
            return False
        self._seen[(tail, salt, when)] = None
        while len(self._seen) > SEEN:
            self._seen.popitem(last=False)
        if time.time() - when > MAX_AGE_S or not self.ready():
            self.skipped += 1
            return False
        ids = store.conversation(tail, salt, self.max_tokens // store.block_tokens + 1, self.identity)
        if ids is None or not 1 < len(ids) < self.max_tokens:
            self.skipped += 1
            return False
        body = {"model": self.model, "prompt": ids, "max_tokens": 1, "temperature": 0,
                "kv_transfer_params": {PARAM: "mapped"}}
        if salt is not None:
            body["cache_salt"] = salt
        request = urllib.request.Request(self.url + "/v1/completions", data=json.dumps(body).encode(),
                                         headers=self.headers)
        try:
            with self._opener.open(request, timeout=TIMEOUT_S) as response:
                reply = json.loads(response.read())
            status = (reply.get("kv_transfer_params") or {}).get(PARAM) if isinstance(reply, dict) else None
        except (urllib.error.URLError, OSError, ValueError, http.client.HTTPException) as exc:
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
