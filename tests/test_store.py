"""The source KV store (warm transfer) without an engine: keys, lookups, refusals, the cap; and Bridge's mapped cache
from stored source K/V equal to the one from a fresh source prefill."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kvbridge.errors import InputError
from kvbridge.serving.store.folder import KVStore
from kvbridge.serving.store.keys import chain, chain_seed, identity, next_key

L, H, D, S, BT = 2, 2, 4, 6, 8  # layers, kv heads, head dim, hidden, block tokens
ME = identity("weights", "tok", L, H, D, S)


def block(seed: int, n: int = BT):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(L, n, H, D, generator=g), torch.randn(L, n, H, D, generator=g), torch.randn(n, S, generator=g))


def fill(store: KVStore, ids: list[int], salt=None, who: str = ME, tail: bool = True):
    """Store every full block of ``ids`` (and the rest as a tail) the way the source engine's connector does."""
    parent = chain_seed(ME, salt)
    whole = block(len(ids), len(ids))
    for start in range(0, len(ids) - BT + 1, BT):
        key = next_key(parent, ids[start:start + BT])
        assert store.put(key, parent, who, ids[start:start + BT], *(t[:, start:start + BT] if t.dim() == 4
                                                                      else t[start:start + BT] for t in whole))
        parent = key
    rest = len(ids) % BT
    if tail and rest:
        start = len(ids) - rest
        assert store.put(parent, parent, who, ids[start:], *(t[:, start:] if t.dim() == 4 else t[start:]
                                                             for t in whole), tail=True)
    return whole


def test_identity_and_salt_decide_the_keys():
    ids = list(range(20))
    a = chain(chain_seed(ME, None), ids, BT)
    assert len(a) == 2 and a == chain(chain_seed(ME, None), ids + [5], BT)
    assert a != chain(chain_seed(ME, "tenant"), ids, BT)
    assert a != chain(chain_seed(identity("other", "tok", L, H, D, S), None), ids, BT)
    assert a[0] != chain(chain_seed(ME, None), [99] + ids[1:], BT)[0]


def test_lookup_full_blocks_then_the_tail_that_matches(tmp_path):
    store = KVStore(tmp_path, block_tokens=BT, create=True)
    ids = list(range(1, 20))  # 2 full blocks and a 3-token tail
    keys, values, hidden = fill(store, ids)
    found = store.lookup(chain_seed(ME, None), ME, ids + [7, 7, 7], 100)
    assert found.tokens == 19 and found.refused == 0
    assert found.chain == chain(chain_seed(ME, None), ids, BT)  # the full blocks' keys, walked once
    assert torch.equal(found.keys[1][0].transpose(0, 1), keys[1]) and torch.equal(found.hidden[0], hidden)
    assert store.lookup(chain_seed(ME, None), ME, ids[:17] + [0, 0], 100).tokens == 17  # the tail's shared part
    assert store.lookup(chain_seed(ME, None), ME, ids, 12).tokens == 12  # never past the limit
    assert store.lookup(chain_seed(ME, None), ME, [0] + ids[1:], 100).tokens == 0  # another first block
    assert store.lookup(chain_seed(ME, "other"), ME, ids, 100).tokens == 0  # another client's salt
    # what a scheduler counts from the entries' presence (and the tail's ids) is what the lookup finds
    for prompt, limit in ((ids + [7, 7, 7], 100), (ids + list(range(50, 60)), 100), (ids[:17] + [0, 0], 100),
                          (ids, 12), (ids, 19), (ids, 8), ([0] + ids[1:], 100)):
        assert store.stored_tokens(chain_seed(ME, None), prompt, limit) == \
            store.lookup(chain_seed(ME, None), ME, prompt, limit).tokens, (prompt, limit)
    assert store.stored_tokens(chain_seed(ME, "other"), ids, 100) == 0
    store.tail_path(chain(chain_seed(ME, None), ids, BT)[-1]).write_bytes(b"torn")  # the reader decides on it
    assert store.stored_tokens(chain_seed(ME, None), ids, 100) == 16


def test_another_model_torn_and_corrupted_entries_are_refused_and_named(tmp_path):
    store = KVStore(tmp_path, block_tokens=BT, create=True)
    ids = list(range(1, 25))
    fill(store, ids, who=identity("another", "tok", L, H, D, S))
    found = store.lookup(chain_seed(ME, None), ME, ids, 100)
    assert found.tokens == 0 and found.refused == 1 and "another source model" in found.reason

    store = KVStore(tmp_path / "b", block_tokens=BT, create=True)
    fill(store, ids)
    second = store.path(chain(chain_seed(ME, None), ids, BT)[1])
    raw = bytearray(second.read_bytes())
    raw[-3] ^= 0xFF  # one flipped bit in the data
    second.write_bytes(bytes(raw))
    assert KVStore(tmp_path / "b", verify=False).lookup(chain_seed(ME, None), ME, ids, 100).tokens == 3 * BT
    found = store.lookup(chain_seed(ME, None), ME, ids, 100)
    assert found.tokens == BT and found.refused == 1 and "CRC" in found.reason
    assert not second.exists()  # discarded: the source engine stores the block again the next time it computes it
    second.write_bytes(bytes(raw[:40]))  # a torn file
    found = store.lookup(chain_seed(ME, None), ME, ids, 100)
    assert found.tokens == BT and found.refused == 1 and not second.exists()
    second.write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00" + b'{"__metadata__":[]}  ')  # a header of another kind
    assert store.lookup(chain_seed(ME, None), ME, ids, 100).reason.startswith("torn or not an entry")


def test_writes_are_atomic_and_a_failed_write_leaves_nothing(tmp_path, monkeypatch):
    import kvbridge.serving.store.folder as store_module

    store = KVStore(tmp_path, block_tokens=BT, create=True)
    (tmp_path / "entries" / "ab").mkdir(parents=True)
    (tmp_path / "entries" / "ab" / ".abc.safetensors.1.2.tmp").write_bytes(b"half")  # a killed writer's leftover
    assert store.entries() == []

    def full_disk(*args):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(store_module.os, "replace", full_disk)
    assert not store.put("cd" + "0" * 62, "p", ME, list(range(BT)), *block(0))
    assert store.entries() == [] and not list((tmp_path / "entries" / "cd").iterdir())


def test_the_cap_holds_and_evicts_the_least_recently_used(tmp_path, monkeypatch):
    """The cap holds at every moment: when an entry lands, the folder with it is within the cap (a reader counting
    the folder between a write and its eviction never sees more), counting an entry another thread of this process
    has made room for and is still writing (not in the folder yet, so not in a recount or an eviction's count)."""
    from kvbridge.serving.store import folder as store_module

    one = len(__import__("safetensors.torch").torch.save(
        {"key": block(0)[0], "value": block(0)[1], "hidden": block(0)[2], "ids": torch.zeros(BT, dtype=torch.int64)}))
    store = KVStore(tmp_path, block_tokens=BT, cap_bytes=20 * (one + 400), create=True)
    replace = store_module.os.replace
    writing = one + 400  # another thread's entry, counted, not landed
    assert store._make_room(writing)

    def landing(tmp, path):
        assert store.size() + Path(tmp).stat().st_size + writing <= store.cap_bytes
        replace(tmp, path)

    monkeypatch.setattr(store_module.os, "replace", landing)
    prompts = [[1000 + p] + list(range(2 * BT - 1)) for p in range(50)]
    keep = prompts[0]
    for p in prompts:
        fill(store, p, tail=False)
        store.lookup(chain_seed(ME, None), ME, keep, 100)  # read: recently used
        assert store.size() <= store.cap_bytes
    assert store.lookup(chain_seed(ME, None), ME, keep, 100).tokens == 2 * BT
    assert store.lookup(chain_seed(ME, None), ME, prompts[1], 100).tokens == 0
    assert KVStore(tmp_path).size() == store.size()


def test_an_entry_larger_than_the_cap_is_not_stored(tmp_path):
    store = KVStore(tmp_path, block_tokens=BT, cap_bytes=1000, create=True)  # one block takes about 1.8 kB
    assert not store.put("ab" + "0" * 62, "p", ME, list(range(BT)), *block(0))
    assert store.entries() == [] and store.size() == 0


def test_store_settings_are_checked(tmp_path):
    with pytest.raises(InputError, match="no kvbridge KV store"):
        KVStore(tmp_path / "none")
    KVStore(tmp_path, block_tokens=BT, create=True)
    with pytest.raises(InputError, match="blocks of 8 tokens"):
        KVStore(tmp_path, block_tokens=16, create=True)
    (tmp_path / "store.json").write_text("{broken")
    with pytest.raises(InputError, match="not a kvbridge KV store"):
        KVStore(tmp_path)


@pytest.fixture(scope="module")
def family_bridge():
    from kvbridge import Bridge, Mapper, family

    source, target = family.load_family()
    # its earlier runtime (one token held back, 4 % recomputed): the default 256-token hold-back would leave these
    # 128-300-token prompts almost nothing to map, and the selective recompute is part of what warm must equal
    return Bridge(source, target, Mapper.from_pretrained(family.mapper_path()), hold_back=1, recompute=0.04)


@pytest.mark.parametrize("stored", [128, 200, 299])
def test_mapped_cache_from_stored_source_kv_equals_a_fresh_prefill(family_bridge, stored):
    """Warm == cold: the shipped mapper (levers, 4 % selective recompute by the source's logits) from stored K/V and
    hidden states of the first tokens (the source computes the rest over them) equals the fresh prefill's cache."""
    from kvbridge.core.models import cache_kv, prefill
    from kvbridge.core.recompute import Stored

    b = family_bridge
    ids = torch.tensor([[1] + list(range(300, 598))])
    mask = torch.ones_like(ids)
    cold = cache_kv(b.mapped_cache(ids, mask))
    cache, hidden = prefill(b.source.model, ids[:, :stored], mask[:, :stored], logits="hidden")
    keys, values = cache_kv(cache)
    warm = cache_kv(b.mapped_cache(ids, mask, stored=Stored(stored, keys, values, hidden)))
    for a, w in zip(cold[0] + cold[1], warm[0] + warm[1]):
        torch.testing.assert_close(w, a, rtol=1e-4, atol=1e-4)


def test_stored_kv_of_another_shape_is_refused(family_bridge):
    from kvbridge.core.recompute import Stored

    ids = torch.tensor([[1] + list(range(300, 340))])
    bad = Stored(16, [torch.zeros(1, 4, 16, 32)] * 3, [torch.zeros(1, 4, 16, 32)] * 3, torch.zeros(1, 16, 160))
    with pytest.raises(InputError, match="do not match"):
        family_bridge.mapped_cache(ids, torch.ones_like(ids), stored=bad)


def test_mapped_entries_are_read_per_map_and_refused_for_another(tmp_path):
    """Map-ahead entries sit beside the source's, keyed by the same chain and the map: another map's never match
    (another path), one whose metadata names another map is refused, a tail is read as far as the prompt shares."""
    from kvbridge.serving.store.keys import map_identity

    store = KVStore(tmp_path, block_tokens=BT, create=True)
    ids = list(range(1, 20))
    fill(store, ids)
    f32 = torch.float32
    ours, theirs = map_identity(ME, "checksums A", {"t": 1}, f32), map_identity(ME, "checksums B", {"t": 1}, f32)
    assert len({ours, theirs, map_identity(ME, "checksums A", {"t": 2}, f32),
                map_identity(ME, "checksums A", {"t": 1}, torch.bfloat16)}) == 4
    mapped = torch.randn(2, 3, 19, 2, 4)  # (K/V, target layers, tokens, heads, dim)
    parent = chain_seed(ME, None)
    for start in (0, 8):
        key = next_key(parent, ids[start:start + BT])
        assert store.put(key, parent, ours, ids[start:start + BT], *mapped[:, :, start:start + BT], None, map_id=ours)
        parent = key
    assert store.put(parent, parent, ours, ids[16:], *mapped[:, :, 16:], None, tail=True, map_id=ours)
    found = store.lookup(chain_seed(ME, None), ME, ids[:18] + [0], 100, map_id=ours)
    assert found.tokens == 18 and found.hidden is None and len(found.keys) == 3
    assert torch.equal(found.values[2][0].transpose(0, 1), mapped[1, 2, :18])
    assert store.lookup(chain_seed(ME, None), ME, ids, 100, map_id=theirs).tokens == 0
    assert store.lookup(chain_seed(ME, None), ME, ids, 100).tokens == 19  # the source entries are untouched
    first = store.mapped_path(chain(chain_seed(ME, None), ids, BT)[0], theirs)
    first.parent.mkdir(parents=True, exist_ok=True)
    first.write_bytes(store.mapped_path(chain(chain_seed(ME, None), ids, BT)[0], ours).read_bytes())
    found = store.lookup(chain_seed(ME, None), ME, ids, 100, map_id=theirs)
    assert found.tokens == 0 and found.refused == 1 and "another map" in found.reason


@pytest.fixture(scope="module")
def rope_models():
    from kvbridge import family
    from kvbridge.core.models import load_rope_model

    return load_rope_model(family.source_path()), load_rope_model(family.target_path())


def test_a_rope_model_is_the_checkpoint_without_its_weights(family_bridge, rope_models):
    from kvbridge.core.rope import rope_factors

    source, target = rope_models
    assert (source.info, target.info) == (family_bridge.source.info, family_bridge.target.info)
    positions = torch.arange(1500)[None]
    for light, full in ((source, family_bridge.source), (target, family_bridge.target)):
        assert not any(p.numel() for p in light.model.parameters())
        for a, b in zip(rope_factors(light.model, positions), rope_factors(full.model, positions)):
            assert torch.equal(a, b)


def test_blocks_mapped_ahead_equal_the_map_of_the_whole_prompt(family_bridge, rope_models):
    """Map-ahead: each 128-token block mapped alone (with the tokens before it its lags read, as the source engine
    does) equals the same tokens of the whole prompt's map; a mapped cache built from them equals the cold one."""
    from kvbridge.core.models import cache_kv, prefill
    from kvbridge.core.recompute import Stored
    from kvbridge.core.transfer import map_block

    b, (source, target) = family_bridge, rope_models
    assert b.mapper.max_lag == 2 and b.selects_tokens  # the shipped mapper: lags, 4 % selective recompute
    ids = torch.tensor([[1] + list(range(300, 598))])
    mask = torch.ones_like(ids)
    n = 256
    cache, hidden = prefill(b.source.model, ids[:, :n], mask[:, :n], logits="hidden")
    keys, values = cache_kv(cache)
    kv = [torch.stack([t[0].transpose(0, 1) for t in layers]) for layers in (keys, values)]  # (Ls, T, Hs, Ds)
    blocks = []
    for start in (0, 128):
        past = min(2, start)
        rows = slice(start - past, start + 128)
        blocks.append(map_block(source.model, target.model, b.mapper, kv[0][:, rows], kv[1][:, rows], hidden[0, rows],
                                start, past))
    ahead = [torch.cat([blk[i] for blk in blocks], dim=1) for i in (0, 1)]  # (Lt, T, Ht, Dt)
    whole = cache_kv(b.map_cache(cache, torch.arange(n)[None], hidden))
    for i in (0, 1):
        for layer, mapped in enumerate(whole[i]):
            torch.testing.assert_close(ahead[i][layer], mapped[0].transpose(0, 1), rtol=1e-5, atol=1e-5)
    with pytest.raises(InputError, match="lags"):
        map_block(source.model, target.model, b.mapper, kv[0][:, 127:256], kv[1][:, 127:256], hidden[0, 127:256],
                  128, 1)
    premapped = tuple([t[:, :200].transpose(0, 1)[None] for t in ahead[i]] for i in (0, 1))  # 200 of 256
    warm = cache_kv(b.mapped_cache(ids, mask, stored=Stored(n, keys, values, hidden, premapped)))
    cold = cache_kv(b.mapped_cache(ids, mask))
    for a, w in zip(cold[0] + cold[1], warm[0] + warm[1]):
        torch.testing.assert_close(w, a, rtol=1e-4, atol=1e-4)
