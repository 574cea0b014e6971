"""Prewarming without an engine: the prewarm journal, a conversation walked back from its stored tail (every key
checked), and the thread that sends it to a server (here a stand-in HTTP server that records the request)."""

from __future__ import annotations

import http.server
import json
import threading
import time

import pytest
from test_store import BT, ME, fill

from kvbridge.serving.store.folder import PREWARM_FILE, KVStore
from kvbridge.serving.store.keys import chain, chain_seed
from kvbridge.serving.store.prewarm import Prewarmer


def tail_of(store: KVStore, ids: list[int], salt=None):
    return store.tail_path(chain(chain_seed(ME, salt), ids, BT)[-1])


def test_a_conversation_is_walked_back_from_its_last_block(tmp_path):
    store = KVStore(tmp_path, block_tokens=BT, create=True)
    ids = list(range(1, 30))  # 3 full blocks and a 5-token tail
    fill(store, ids, salt="tenant")
    tail = tail_of(store, ids, "tenant")
    assert store.conversation(tail, "tenant", 10) == ids
    assert store.conversation(tail, None, 10) is None  # another salt: the walk never meets its seed
    assert store.conversation(tail, "tenant", 2) is None  # longer than allowed
    # one that ended on a block boundary (no tail) is announced by its last full block's entry
    full = chain(chain_seed(ME, "tenant"), ids, BT)
    assert store.conversation(store.path(full[0]), "tenant", 10) == ids[:BT]
    assert store.conversation(store.path(full[2]), "tenant", 10) == ids[:3 * BT]
    assert store.conversation(store.path(full[2]), None, 10) is None
    renamed = store.path("cd" * 32)  # a block's entry under another key's name: never walked
    renamed.parent.mkdir(parents=True, exist_ok=True)
    renamed.write_bytes(store.path(full[2]).read_bytes())
    assert store.conversation(renamed, "tenant", 10) is None
    short = [5, 6, 7]  # shorter than a block: the tail is the whole conversation
    fill(store, short)
    assert store.conversation(store.tail_path(chain_seed(ME, None)), None, 10) == short
    # a block in the middle evicted, or replaced by another block's entry: no conversation (never a wrong one)
    keys = chain(chain_seed(ME, "tenant"), ids, BT)
    saved = store.path(keys[1]).read_bytes()
    store.path(keys[1]).write_bytes(store.path(keys[0]).read_bytes())
    assert store.conversation(tail, "tenant", 10) is None
    store.path(keys[1]).unlink()
    assert store.conversation(tail, "tenant", 10) is None
    store.path(keys[1]).write_bytes(saved)
    assert store.conversation(tail, "tenant", 10) == ids
    assert store.conversation(tail, "tenant", 10, source_identity=ME) == ids
    assert store.conversation(tail, "tenant", 10, source_identity="another source") is None
    moved = store.tail_path("ab" * 32)  # a tail under another parent's name: its name and its metadata disagree
    moved.parent.mkdir(parents=True, exist_ok=True)
    moved.write_bytes(tail.read_bytes())
    assert store.conversation(moved, "tenant", 10) is None
    tail.write_bytes(b"torn")
    assert store.conversation(tail, "tenant", 10) is None


def test_the_prewarm_journal(tmp_path):
    store = KVStore(tmp_path, block_tokens=BT, create=True)
    assert store.prewarms(None) == ([], None)
    store.announce_prewarm(store.tail_path("ab" * 32), "tenant")
    store.announce_prewarm(store.tail_path("cd" * 32), None)
    with open(tmp_path / PREWARM_FILE, "a") as journal:  # what a reader skips
        journal.write("not json\n" + json.dumps({"tail": "../outside", "salt": None, "time": 0}) + "\n" +
                      json.dumps({"tail": "entries/ab/x.tail.safetensors", "salt": 7, "time": 0}) + "\n")
    records, cursor = store.prewarms(None)
    assert [(r[0], r[1]) for r in records] == [(store.tail_path("ab" * 32), "tenant"),
                                               (store.tail_path("cd" * 32), None)]
    assert abs(records[0][2] - time.time()) < 60
    assert store.prewarms(cursor)[0] == []  # read once
    assert store.announced(None) == ([], None)  # the mapped entries' journal is another file


class Recorder(http.server.BaseHTTPRequestHandler):
    """A stand-in server: /v1/models names "target" with a context of ``Recorder.context``; each POST is recorded
    (path, body, its Authorization header)."""

    bodies: list = []
    context = 1000

    def _reply(self, payload) -> None:
        reply = json.dumps(payload).encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(reply)))
        self.end_headers()
        self.wfile.write(reply)

    def do_GET(self):  # noqa: N802 (http.server's name)
        self._reply({"data": [{"id": "target", "max_model_len": Recorder.context}]})

    def do_POST(self):  # noqa: N802
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        Recorder.bodies.append((self.path, body, self.headers.get("Authorization")))
        self._reply({"kv_transfer_params": {"kvbridge": "mapped"}})

    def log_message(self, *args):
        pass


@pytest.fixture
def recorder():
    Recorder.bodies, Recorder.context = [], 1000
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Recorder)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}", Recorder.bodies
    server.shutdown()


def test_the_prewarmer_sends_each_announced_conversation_once(tmp_path, recorder, monkeypatch):
    url, bodies = recorder
    store = KVStore(tmp_path, block_tokens=BT, create=True)
    ids, other, third = list(range(1, 30)), list(range(40, 61)), list(range(70, 83))
    fill(store, ids, salt="tenant")
    fill(store, other)
    fill(store, third, salt="third")
    prewarmer = Prewarmer(lambda: store, url, "target", api_key="secret", identity=ME)
    assert prewarmer.prewarm(store, tail_of(store, ids, "tenant"), "tenant", time.time())
    assert prewarmer.max_tokens == 1000  # the server's context, from /v1/models
    assert bodies == [("/v1/completions", {"model": "target", "prompt": ids, "max_tokens": 1, "temperature": 0,
                                           "kv_transfer_params": {"kvbridge": "mapped"}, "cache_salt": "tenant"},
                       "Bearer secret")]
    # through the journal: each announcement once; one whose walk fails, a broken chain: skipped, the rest sent
    real = store.conversation

    def failing(tail, salt, *args):
        if salt == "third":
            raise OSError("a disk error")
        return real(tail, salt, *args)

    monkeypatch.setattr(store, "conversation", failing)
    store.announce_prewarm(tail_of(store, third, "third"), "third")
    store.announce_prewarm(tail_of(store, other), None)
    store.announce_prewarm(tail_of(store, ids, "tenant"), "other salt")  # its chain never meets that seed
    prewarmer.start()
    deadline = time.time() + 10
    while len(bodies) < 2 and time.time() < deadline:
        time.sleep(0.05)
    time.sleep(0.3)
    prewarmer.stop()
    assert [b["prompt"] for _, b, _ in bodies] == [ids, other] and "cache_salt" not in bodies[1][1]
    assert (prewarmer.sent, prewarmer.skipped, prewarmer.failed) == (2, 1, 1)
    assert not prewarmer.prewarm(store, tail_of(store, ids, "tenant"), "tenant", time.time() - 3600)  # stale
    prewarmer.max_tokens = 20
    assert not prewarmer.prewarm(store, tail_of(store, other), None, time.time())  # over the server's context
    assert not Prewarmer(lambda: store, url, "target", identity="another source").prewarm(
        store, tail_of(store, other), None, time.time())  # another source's entries
    assert len(bodies) == 2


def test_a_server_that_does_not_answer_is_counted_not_raised(tmp_path):
    store = KVStore(tmp_path, block_tokens=BT, create=True)
    ids = list(range(1, 30))
    fill(store, ids)
    prewarmer = Prewarmer(lambda: store, "http://127.0.0.1:9", "target")  # nothing listens there
    assert not prewarmer.ready()  # the journal waits for the server
    prewarmer.max_tokens = 1000  # (as if it had answered once)
    assert not prewarmer.prewarm(store, tail_of(store, ids), None, time.time())
    assert prewarmer.failed == 1


@pytest.mark.vllm
def test_a_source_request_asks_for_prewarm_or_takes_the_engines_default():
    """The source connector's choice per finished request: its kv_transfer_params' kvbridge_prewarm (true or false)
    over the engine's --prewarm; anything else is no prewarm (logged), never an error in the engine."""
    from types import SimpleNamespace

    from kvbridge.serving.engine.source_scheduler import wants_prewarm

    def asks(params, default: bool) -> bool:
        return wants_prewarm(SimpleNamespace(kv_transfer_params=params, request_id="r"), default)

    assert asks({"kvbridge_prewarm": True}, False) and not asks({"kvbridge_prewarm": False}, True)
    assert asks(None, True) and asks({}, True) and not asks(None, False)
    assert not asks({"kvbridge_prewarm": "yes"}, True) and not asks({"kvbridge_prewarm": 1}, True)


@pytest.mark.vllm
def test_a_source_request_can_stay_out_of_the_store():
    """kv_transfer_params kvbridge_store false on a source request: the scheduler side never follows it (nothing
    captured, nothing stored or mapped ahead); absent or true: followed; anything else: followed (logged)."""
    from types import SimpleNamespace

    from kvbridge.serving.engine.source_scheduler import KVBridgeSourceScheduler

    scheduler = KVBridgeSourceScheduler(SimpleNamespace(block_size=16, identity="source", config=None))
    for rid, params in (("a", None), ("b", {"kvbridge_store": True}), ("c", {"kvbridge_store": False}),
                        ("d", {"kvbridge_store": "no"}), ("e", {"kvbridge_prewarm": False, "kvbridge_store": False})):
        scheduler.update_state_after_alloc(SimpleNamespace(kv_transfer_params=params, request_id=rid), [], 0)
    assert sorted(scheduler._requests) == ["a", "b", "d"]
