"""The target's memory tier of the KV store without an engine: the journal of mapped entries, what the prefetch
loads and refuses, its cap, and lookups from memory equal to lookups from the folder."""

from __future__ import annotations

import time

import torch

from kvbridge.serving.store import folder as store_module
from kvbridge.serving.store.folder import KVStore
from kvbridge.serving.store.hot import HotEntries
from kvbridge.serving.store.keys import chain_seed, identity, map_identity, next_key

L, H, D, BT = 3, 2, 4, 8  # target layers, kv heads, head dim, block tokens
ME = identity("weights", "tok", 2, 2, 4, 6)
MAP = map_identity(ME, "checksums A", {"t": 1}, torch.float32)
OTHER = map_identity(ME, "checksums B", {"t": 1}, torch.float32)


def mapped_blocks(store: KVStore, ids: list[int], map_id: str = MAP, seed: int = 0, salt=None) -> torch.Tensor:
    """Every full block of ``ids`` (and the rest as a tail) mapped ahead as the source engine writes them; returns
    the whole prompt's (K/V, L, T, H, D)."""
    mapped = torch.randn(2, L, len(ids), H, D, generator=torch.Generator().manual_seed(seed))
    parent = chain_seed(ME, salt)
    for start in range(0, len(ids) - BT + 1, BT):
        key = next_key(parent, ids[start:start + BT])
        assert store.put(key, parent, map_id, ids[start:start + BT], *mapped[:, :, start:start + BT], None,
                         map_id=map_id)
        parent = key
    if len(ids) % BT:
        start = len(ids) - len(ids) % BT
        assert store.put(parent, parent, map_id, ids[start:], *mapped[:, :, start:], None, tail=True, map_id=map_id)
    return mapped


def test_the_journal_announces_mapped_entries(tmp_path, monkeypatch):
    store = KVStore(tmp_path, block_tokens=BT, create=True)
    assert store.announced(None) == ([], None)  # no journal yet: what comes is read from its start
    mapped_blocks(store, list(range(1, 12)), seed=1)  # before the reader's first look: read too (a restart)
    paths, cursor = store.announced(None)
    assert len(paths) == 2 and all(p.exists() for p in paths)
    ids = list(range(100, 119))  # two blocks and a tail
    mapped_blocks(store, ids, seed=2)
    paths, cursor = store.announced(cursor)
    assert len(paths) == 3 and all(p.exists() and p.name.endswith(".mapped.safetensors") for p in paths)
    assert store.announced(cursor)[0] == []  # read once
    # a line being written is read when it is whole; lines naming paths outside the store are ignored
    with open(tmp_path / store_module.JOURNAL_FILE, "a") as journal:
        journal.write("../elsewhere.safetensors\n/etc/passwd\nentries/../../x\nentries/a\x00b\nentries/ab/half")
    paths, cursor = store.announced(cursor)
    assert paths == []
    with open(tmp_path / store_module.JOURNAL_FILE, "a") as journal:
        journal.write("-line\n")
    paths, cursor = store.announced(cursor)
    assert paths == [tmp_path / "entries/ab/half-line"]
    # a full journal is replaced by an empty one: a reader sees another file and reads it from its start
    monkeypatch.setattr(store_module, "JOURNAL_BYTES", (tmp_path / store_module.JOURNAL_FILE).stat().st_size + 1)
    mapped_blocks(store, list(range(200, 208)), seed=3)  # this write fills it: the journal starts anew
    assert (tmp_path / store_module.JOURNAL_FILE).stat().st_size == 0
    mapped_blocks(store, list(range(300, 308)), seed=4)
    paths, _ = store.announced(cursor)
    assert len(paths) == 1 and paths[0].exists()
    # source entries are not announced
    before = (tmp_path / store_module.JOURNAL_FILE).read_bytes()
    store.put("k" * 64, "p" * 64, ME, list(range(BT)), torch.zeros(2, BT, 2, 4), torch.zeros(2, BT, 2, 4),
              torch.zeros(BT, 6))
    assert (tmp_path / store_module.JOURNAL_FILE).read_bytes() == before


def test_memory_holds_checked_finite_entries_of_its_map_and_lookups_read_them(tmp_path):
    store = KVStore(tmp_path, block_tokens=BT, create=True)
    hot = HotEntries(lambda: store, MAP, cap_bytes=1 << 20)
    _, cursor = store.announced(None)
    ids = list(range(1, 20))  # two blocks and a 3-token tail
    mapped = mapped_blocks(store, ids, seed=5)
    mapped_blocks(store, ids, map_id=OTHER, seed=6)  # another map's: not this tier's
    paths, cursor = store.announced(cursor)
    assert sum(hot.load(p) for p in paths) == 3 and len(hot) == 3
    seed = chain_seed(ME, None)
    folder = store.lookup(seed, ME, ids[:18] + [0], 100, map_id=MAP)
    memory = store.lookup(seed, ME, ids[:18] + [0], 100, map_id=MAP, hot=hot.get)
    assert folder.tokens == memory.tokens == 18 and folder.hot_tokens == 0 and memory.hot_tokens == 18
    assert memory.hot_within(10) == 10 and all(p[3] for p in memory.parts)
    for a, b in zip(folder.keys + folder.values, memory.keys + memory.values):
        assert torch.equal(a, b)
    assert torch.equal(memory.keys[2][0].transpose(0, 1), mapped[0, 2, :18])
    # a held entry whose ids are not the prompt's block (a damaged copy): the folder's is read instead
    first = next(iter(hot._entries))
    held = hot._entries[first]
    hot._entries[first] = dict(held, ids=held["ids"] + 1)
    found = store.lookup(seed, ME, ids, 100, map_id=MAP, hot=hot.get)
    assert found.tokens == 19 and found.hot_tokens == 19 - BT and not found.refused
    hot._entries[first] = held
    # the files gone (evicted from the folder): the copies in memory still answer (content-addressed)
    for p in paths:
        p.unlink()
    assert store.lookup(seed, ME, ids, 100, map_id=MAP, hot=hot.get).tokens == 19
    assert store.lookup(seed, ME, ids, 100, map_id=MAP).tokens == 0


def test_corrupted_non_finite_and_rewritten_entries_are_not_held(tmp_path):
    from safetensors.torch import load

    store = KVStore(tmp_path, block_tokens=BT, create=True)
    hot = HotEntries(lambda: store, MAP, cap_bytes=1 << 20)
    _, cursor = store.announced(None)
    ids = list(range(1, 17))
    mapped_blocks(store, ids, seed=7)
    paths, cursor = store.announced(cursor)
    raw = bytearray(paths[0].read_bytes())
    raw[-5] ^= 0x40  # corrupted: the CRC differs (and the folder's copy is removed, as a read from it does)
    paths[0].write_bytes(bytes(raw))
    assert not hot.load(paths[0]) and not paths[0].exists() and hot.skipped == 1
    assert hot.load(paths[1]) and len(hot) == 1
    # the same key written again with NaN keys (a valid CRC): the held copy is dropped, the new one not held
    tensors = load(paths[1].read_bytes())
    paths[1].unlink()
    parent = chain_seed(ME, None)
    key = next_key(next_key(parent, ids[:BT]), ids[BT:])
    assert store.mapped_path(key, MAP) == paths[1]
    assert store.put(key, next_key(parent, ids[:BT]), MAP, ids[BT:], tensors["key"] * float("nan"),
                     tensors["value"], None, map_id=MAP)
    assert not hot.load(paths[1]) and len(hot) == 0 and hot.nbytes == 0


def test_memory_keeps_its_cap_least_recently_used_out_first(tmp_path):
    store = KVStore(tmp_path, block_tokens=BT, create=True)
    _, cursor = store.announced(None)
    mapped_blocks(store, list(range(1, 1 + 5 * BT)), seed=8)  # five blocks
    paths, _ = store.announced(cursor)
    size = paths[0].stat().st_size
    hot = HotEntries(lambda: store, MAP, cap_bytes=3 * size)  # about three blocks (the tensors, not the headers)
    for p in paths[:3]:
        assert hot.load(p)
    assert hot.get(paths[0]) is not None  # used: the second is now the least recently used
    hot.load(paths[3])
    assert hot.nbytes <= 3 * size and len(hot) == 3
    assert hot.get(paths[1]) is None and hot.get(paths[0]) is not None and hot.get(paths[3]) is not None


def test_the_prefetch_thread_loads_what_is_announced_while_the_engine_is_idle(tmp_path):
    from kvbridge.serving.engine.idle import IDLE_S, StepClock

    class Failing(HotEntries):  # the first entry's load fails: the rest of its batch is still loaded
        failed = False

        def load(self, path):
            if not self.failed:
                self.failed = True
                raise ValueError("injected")
            return super().load(path)

    created = []
    clock = StepClock()
    hot = Failing(lambda: created[0] if created else None, MAP, cap_bytes=1 << 20, clock=clock).start()
    try:
        time.sleep(0.15)  # no store yet: the thread waits for one
        created.append(KVStore(tmp_path, block_tokens=BT, create=True))
        clock.begin()  # a step runs: nothing is loaded until it ends and a quiet spell passes
        mapped_blocks(created[0], list(range(1, 25)), seed=9)  # three blocks
        time.sleep(0.3)
        assert len(hot) == 0
        clock.end()
        deadline = time.monotonic() + 5
        while len(hot) < 2 and time.monotonic() < deadline:
            time.sleep(IDLE_S)
        assert len(hot) == 2 and hot.loaded == 2 and hot.skipped == 1  # (counted by the thread)
        done = []
        hot.later(lambda: done.append(True))  # work handed off the request's path runs on the thread
        deadline = time.monotonic() + 5
        while not done and time.monotonic() < deadline:
            time.sleep(IDLE_S)
        assert done
    finally:
        hot.stop()
    hot.later(lambda: created.append("now"))  # a stopped thread: at once, on the caller's
    assert created[-1] == "now"
