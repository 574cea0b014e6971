"""`kvbridge serve` as a user runs it: vLLM's OpenAI-compatible server on 127.0.0.1, one server for the module,
answered through the `openai` client — completions, chat, streaming, mapped and native, bad requests, metrics — beside
`kvbridge serve-source` sharing its KV store, as `kvbridge cascade` starts them: a conversation escalated from the
source's server to the target's is mapped from the source's stored KV."""

from __future__ import annotations

import json
import time
import urllib.request

import pytest

pytestmark = pytest.mark.vllm  # (skipped where vLLM does not import, except in CI)

STARTUP_S = 240


@pytest.fixture(scope="module")
def servers(family_fast_mapper, tmp_path_factory):
    """(source url, target url, log folder): `kvbridge serve-source` (mapping ahead) and `kvbridge serve --store` on
    the embedded family with the fast mapper, sharing a store, started once."""
    from kvbridge.serving.bench.cascade import launched_pair

    logs = tmp_path_factory.mktemp("serve")
    store = str(logs / "store")
    target = ["--mapper", family_fast_mapper, "--store", store, "--max-model-len", "2048", "--max-num-seqs", "8"]
    source = ["--store", store, "--mapper", family_fast_mapper, "--max-num-seqs", "8"]  # mapping ahead too
    # started at once: the target's connector finds the store once the source has created it
    with launched_pair(source, target, logs, STARTUP_S, together=True) as urls:
        yield (*urls, logs)


@pytest.fixture(scope="module")
def server(servers):
    """(base url, log path) of the target's `kvbridge serve`."""
    return servers[1], servers[2] / "target.log"


@pytest.fixture(scope="module")
def client(server):
    from openai import OpenAI

    return OpenAI(base_url=server[0] + "/v1", api_key="unused", max_retries=0, timeout=60)


def long_prompt(n_lines: int = 40) -> str:
    from kvbridge import family

    return "\n".join(family.heldout_texts()[3].splitlines()[:n_lines])


def test_completions_mapped_and_native(client):
    prompt = long_prompt()
    mapped = client.completions.create(model="kvbridge-family", prompt=prompt, max_tokens=8, temperature=0,
                                       extra_body={"kv_transfer_params": {"kvbridge": "mapped"}})
    native = client.completions.create(model="kvbridge-family", prompt=prompt, max_tokens=8, temperature=0,
                                       extra_body={"kv_transfer_params": {"kvbridge": "native"}})
    default = client.completions.create(model="kvbridge-family", prompt=prompt, max_tokens=8, temperature=0)
    status = mapped.kv_transfer_params
    assert status["kvbridge"] == "mapped" and status["kvbridge_mapped_tokens"] > 50
    assert native.kv_transfer_params == {"kvbridge": "native"}
    assert default.kv_transfer_params["kvbridge"] == "mapped"  # the server's default mode
    assert default.choices[0].text == mapped.choices[0].text and mapped.choices[0].text


def test_chat_and_streaming(client):
    messages = [{"role": "user", "content": long_prompt(30)}]
    chat = client.chat.completions.create(model="kvbridge-family", messages=messages, max_tokens=8, temperature=0)
    assert chat.choices[0].message.content is not None and chat.kv_transfer_params["kvbridge"] == "mapped"
    stream = client.completions.create(model="kvbridge-family", prompt=long_prompt(), max_tokens=8, temperature=0,
                                       stream=True)
    streamed = "".join(chunk.choices[0].text for chunk in stream if chunk.choices)
    whole = client.completions.create(model="kvbridge-family", prompt=long_prompt(), max_tokens=8, temperature=0)
    assert streamed == whole.choices[0].text
    chunks = client.chat.completions.create(model="kvbridge-family", messages=messages, max_tokens=8, temperature=0,
                                            stream=True, extra_body={"kv_transfer_params": {"kvbridge": "native"}})
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)


DEEP = json.loads('{"kvbridge": "mapped", "j": ' + '{"a": ' * 500 + "1" + "}" * 500 + "}")  # killed the engine


@pytest.mark.parametrize("params", [{"kvbridge": "fast"}, "mapped", [1], {"kvbridge": 3}, DEEP])
def test_a_malformed_request_gets_a_400_and_the_next_is_answered(client, params):
    import openai

    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model="kvbridge-family", prompt="def f(x):", max_tokens=4,
                                  extra_body={"kv_transfer_params": params})
    assert "kv_transfer_params" in str(info.value)
    ok = client.completions.create(model="kvbridge-family", prompt="def f(x):\n    return", max_tokens=4)
    assert ok.choices[0].text is not None


def test_too_long_salt_and_broken_json(server, client):
    import openai

    with pytest.raises(openai.BadRequestError, match="cache_salt"):
        client.completions.create(model="kvbridge-family", prompt="def f(x):", max_tokens=4,
                                  extra_body={"cache_salt": "s" * 120})
    request = urllib.request.Request(server[0] + "/v1/completions", data=b"{not json", method="POST",
                                     headers={"content-type": "application/json"})
    with pytest.raises(urllib.error.HTTPError) as info:
        urllib.request.urlopen(request, timeout=30)
    assert 400 <= info.value.code < 500


def test_metrics_count_outcomes(server, client):
    client.completions.create(model="kvbridge-family", prompt=long_prompt(), max_tokens=2)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:  # vLLM publishes connector stats at its logging interval
        with urllib.request.urlopen(server[0] + "/metrics", timeout=10) as r:
            text = r.read().decode()
        mapped = [line for line in text.splitlines() if line.startswith("vllm:kvbridge_requests_total")
                  and 'outcome="mapped"' in line]
        if mapped and float(mapped[0].split()[-1]) >= 1:
            break
        time.sleep(1)
    assert mapped and float(mapped[0].split()[-1]) >= 1, [x for x in text.splitlines() if "kvbridge" in x]
    assert "vllm:kvbridge_map_seconds_total" in text


def test_an_escalated_conversation_is_mapped_from_the_sources_stored_kv(servers, client):
    """Two turns on the source's server, the third on the target's: the target reads the stored blocks of the
    history, mapped ahead (no source prefill, no map), computes the new turn itself and answers as it does from a
    cold transfer that holds the new turn back."""
    from openai import OpenAI

    source = OpenAI(base_url=servers[0] + "/v1", api_key="unused", max_retries=0, timeout=60)
    assert source.models.list().data[0].id == "kvbridge-family-source"
    messages = [{"role": "user", "content": long_prompt(60)}]
    for question in ("# and then", None):
        answer = source.chat.completions.create(model="kvbridge-family-source", messages=messages, max_tokens=24,
                                                temperature=0).choices[0].message.content
        messages.append({"role": "assistant", "content": answer})
        messages.append({"role": "user", "content": question or "# finally"})
    time.sleep(1.0)  # the source engine stores its blocks behind its steps
    warm = client.chat.completions.create(model="kvbridge-family", messages=messages, max_tokens=8, temperature=0)
    status = warm.kv_transfer_params
    assert status["kvbridge"] == "mapped" and status["kvbridge_stored_tokens"] >= 128, status
    assert status["kvbridge_premapped_tokens"] == status["kvbridge_stored_tokens"], status  # read, not mapped
    assert {"read", "write"} <= set(status["kvbridge_read_ms"]) <= {"read", "map", "write"}, status  # (by phase)
    # the stored history is loaded, the new turn is the target's: the cold path's answer with that much held back
    # (mapped_tokens: what the connector loaded beyond the engine's own prefix-cache hit on the first turn's blocks)
    assert status["kvbridge_mapped_tokens"] <= status["kvbridge_stored_tokens"] < warm.usage.prompt_tokens - 2
    cold = client.chat.completions.create(model="kvbridge-family", messages=messages, max_tokens=8, temperature=0,
                                          extra_body={"kv_transfer_params": {
                                              "kvbridge_store": False, "kvbridge_hold_back":
                                                  warm.usage.prompt_tokens - status["kvbridge_stored_tokens"]},
                                              "cache_salt": "cold"})
    assert cold.kv_transfer_params["kvbridge_stored_tokens"] == 0
    assert warm.choices[0].message.content == cold.choices[0].message.content
    import openai

    with pytest.raises(openai.BadRequestError, match="kvbridge_store"):
        client.completions.create(model="kvbridge-family", prompt="def f(x):", max_tokens=2,
                                  extra_body={"kv_transfer_params": {"kvbridge_store": "yes"}})


def test_the_escalation_benchmark_reads_what_the_servers_did(servers):
    """`kvbridge cascade-bench`'s measurement against the running pair (tiny: one conversation): the warm way's
    prefix came from the store, mapped ahead (read from the target's memory; the folder way from the store's folder,
    with the same answer), the new turn computed by the target; with the new turn mapped too it
    answered as the cold way, and the way mapped at the switch as warm;
    the ceiling (a prefix-cache hit on the history) is measured beside them. Timings are the benchmark's business,
    not checked here."""
    from transformers import AutoTokenizer

    from kvbridge import family
    from kvbridge.serving.bench.cascade import run_cascade_bench
    from kvbridge.serving.bench.cascade_report import cascade_table

    tokenizer = AutoTokenizer.from_pretrained(family.target_path())
    # the source server stands in as its own baseline here (the baseline's server is `serve-source --no-store`): this
    # checks the plumbing (each source turn sent to both, its fields and table), not what storing costs
    report = run_cascade_bench(servers[0], "kvbridge-family-source", servers[1], "kvbridge-family", tokenizer, [400],
                               conversations=1, warmup=0, new_tokens=4, progress=lambda _: None,
                               baseline_url=servers[0], baseline_model="kvbridge-family-source")
    row = report["rows"][0]
    assert row["source_answers_equal"] == 1.0 and row["source_ttft_ratio"] > 0 and row["source_answer_ratio"] > 0
    assert len(report["conversations"]["400"][0]["source_turns"]) == 2 and "without a store" in cascade_table(report)
    assert row["stored_fraction"] > 0.5 and row["premapped_fraction"] == row["stored_fraction"], row
    assert 0 < row["native_fraction"] < 0.5 and row["native_rest"] == 256, row  # the new turn: the target's
    assert row["whole_equals_cold"] == row["remap_equals_warm"] == 1.0 and row["cached_ttft_ms"] > 0
    assert min(row[f"{w}_connector_ms"] for w in ("warm", "folder", "whole", "remap", "cold")) > 0
    assert "mapped ahead" in cascade_table(report)
    # the warm way read the blocks mapped ahead from the target connector's memory (loaded during the settle), the
    # folder way from the store's folder: the same K/V, the same answer
    assert row["hot_fraction"] > 0.5, row
    conversation = report["conversations"]["400"][0]
    assert conversation["warm"]["tokens"] == conversation["folder"]["tokens"]
    paired = report["per_conversation"]["400"]  # one conversation: its own difference
    assert paired["folder_minus_warm_ms"] == conversation["folder"]["ttft_ms"] - conversation["warm"]["ttft_ms"]
    assert "Paired per conversation" in cascade_table(report) and 0 <= paired["stalled_share"] <= 1
    # of the connector's time, the writes into the engine's cache (read from /metrics per way)
    assert 0 < conversation["warm_write_ms"] <= conversation["warm_connector_ms"], conversation
    assert "writing into the engine's paged cache" in cascade_table(report)
    # prewarmed: the source's copy asked for it, the target's server loaded the conversation before the switch, and
    # the escalated turn found the history's full blocks in the prefix cache, with warm's answer
    assert row["prewarm_landed"] == 1.0 and row["prewarmed_equals_warm"] == 1.0, row
    assert conversation["prewarmed_cached_tokens"] >= 256 and row["prewarmed_cached_fraction"] > 0.5, conversation
    assert "Prewarmed (the source asked" in cascade_table(report)


@pytest.mark.lmcache
def test_the_escalation_benchmark_through_lmcache(servers, family_fast_mapper, tmp_path):
    """`kvbridge cascade-bench` with the lmcache way, run by the command line against the running folder pair and a
    second pair sharing an LMCache server (tiny: two conversations, 4 tokens each): every escalated answer through
    LMCache is the cold path's at the same split, the stored chunks were read (not mapped from a source prefill),
    where the loads' time went is reported by phase, LMCache minus folder is paired per conversation, and the report
    tables again from its file."""
    from kvbridge.cli import main
    from kvbridge.serving.bench.cascade import launched_pair
    from kvbridge.serving.store.lmcache_store import start_server, stop_server

    with open(tmp_path / "lmcache.log", "w") as log:
        process, url = start_server("127.0.0.1", l1_gb=0.25, log=log)
        try:
            target = ["--mapper", family_fast_mapper, "--lmcache", url, "--max-model-len", "2048", "--max-num-seqs",
                      "8"]
            with launched_pair(["--lmcache", url, "--max-num-seqs", "8"], target, tmp_path, STARTUP_S,
                               together=True) as pair:
                out = tmp_path / "cascade.json"
                assert main(["cascade-bench", "--source-url", servers[0], "--target-url", servers[1],
                             "--lmcache-source-url", pair[0], "--lmcache-target-url", pair[1], "--histories", "400",
                             "--conversations", "2", "--warmup", "0", "--new-tokens", "4", "--json", str(out)]) == 0
        finally:
            stop_server(process)
    report = json.loads(out.read_text())
    (row,) = report["rows"]
    conversations = report["conversations"]["400"]
    # the cold path's answer at the lmcache way's split, in both conversations: LMCache's K/V are the source's
    assert row["lmcache_equal_cold"] == 2 and row["lmcache_equals_cold"] == 1.0, row
    for c in conversations:
        assert c["lmcache"]["tokens"] == c["lmcache_cold"]["tokens"] and len(c["lmcache"]["tokens"]) == 4, c
        # one whole chunk (256 tokens) of the ~400-token history read from LMCache, the rest the target's
        assert c["lmcache_stored_tokens"] == c["lmcache_loaded_tokens"] == 256, c
        read = c["lmcache_read_ms"]  # (/metrics; connect: the target connector's first read dialed the server)
        assert set(read) - {"connect"} == {"lookup", "retrieve", "decode", "check", "map", "write"}, read
        assert {"read", "write"} <= set(c["folder_read_ms"]) <= {"read", "map", "write"}, c["folder_read_ms"]
    assert "connect" in conversations[0]["lmcache_read_ms"] and "connect" not in conversations[1]["lmcache_read_ms"]
    assert row["lmcache_ttft_ms"] > 0 and row["lmcache_speedup"] == row["native_ttft_ms"] / row["lmcache_ttft_ms"]
    assert row["lmcache_stored_fraction"] > 0.5 and row["lmcache_connector_ms"] > 0, row
    paired = report["per_conversation"]["400"]
    diffs = [c["lmcache"]["ttft_ms"] - c["folder"]["ttft_ms"] for c in conversations]
    assert paired["lmcache_minus_folder_mean_ms"] == pytest.approx(sum(diffs) / 2)
    assert paired["lmcache_minus_folder_interval"][0] <= paired["lmcache_minus_folder_ms"]
    assert set(paired["read_ms"]) >= {"lmcache", "folder", "warm"}, paired["read_ms"]
    table = out.with_suffix(".md").read_text()
    assert "Through LMCache" in table and "| 2/2 |" in table and "| 400 | LMCache | " in table, table
    out.with_suffix(".md").unlink()
    assert main(["cascade-bench", "--table", str(out)]) == 0 and out.with_suffix(".md").read_text() == table


def test_the_engine_benchmark_reports_the_connector_and_the_ceiling(server):
    """`kvbridge serve-bench`'s measurement against the running target (tiny: one round of one request per mode):
    each row carries the connector's time per mapped request (from /metrics) and the ceiling, the native prompts sent
    again one token longer, every full block of them a prefix-cache hit (256 of 257 tokens with blocks of 128); the
    table shows both, and a report from before them still tables. Timings are the benchmark's business, not checked
    here."""
    from transformers import AutoTokenizer

    from kvbridge import family
    from kvbridge.serving.bench.ttft import engine_table, run_engine_bench

    tokenizer = AutoTokenizer.from_pretrained(family.target_path())
    report = run_engine_bench(server[0], "kvbridge-family", tokenizer, [256], [1], warmup=0, rounds=1, new_tokens=2,
                              progress=lambda _: None)
    (row,) = report["rows"]
    assert row["connector_ms"] > 0 and row["ceiling_ttft_ms"] > 0 and row["requests_per_mode"] == 1, row
    assert row["ceiling_cached_fraction"] == 256 / 257, row
    assert row["ceiling_speedup"] == row["native_ttft_ms"] / row["ceiling_ttft_ms"]
    assert f"{row['connector_ms']:.1f} ms" in engine_table(report)
    assert "100% cached" in engine_table(report)
    new = ("connector_ms", "ceiling_ttft_ms", "ceiling_speedup", "ceiling_cached_fraction")
    old = {"rows": [{k: v for k, v in row.items() if k not in new}]}
    assert "| – | – |" in engine_table(old)


def test_the_load_benchmark_replays_a_trace_and_reads_the_engines_prefill_counters(server):
    """A short open-loop trace, mapped and native, against the running server: the /metrics parser on a real scrape
    (prompt tokens = computed + prefix-cache hits + loaded by the connector) and the per-way figures."""
    import asyncio

    from openai import AsyncOpenAI
    from transformers import AutoTokenizer

    from kvbridge import family
    from kvbridge.serving.bench.load import PARAMS, poisson_trace, replay, scrape, settled, way_result
    from kvbridge.serving.bench.ttft import heldout_stream

    url = server[0]
    tokenizer = AutoTokenizer.from_pretrained(family.target_path())
    stream = heldout_stream(tokenizer)
    trace = poisson_trace(4.0, 3, (300, 600), seed=3, stream_tokens=len(stream))

    async def run(way):
        client = AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)
        try:
            return await replay(client, "kvbridge-family", trace, stream, tokenizer.bos_token_id, PARAMS[way],
                                f"load-test-{way}-{time.time_ns()}", 4)
        finally:
            await client.close()

    for way in ("mapped-async", "native"):  # (the server maps synchronously by default: asked here per request)
        before = scrape(url)
        rows = asyncio.run(run(way))
        after = asyncio.run(settled(url, before, 3, counted=True))
        result = way_result(way, 4.0, rows, 1.0, before, after, replicates=100)
        c = result.counters
        prompt = sum(a.length for a in trace)
        assert c["requests"] == 3 and c["prompt_tokens"] == prompt and all(r["tokens"] == 4 for r in rows)
        assert c["local_compute"] + c["local_cache_hit"] + c["external_kv_transfer"] == prompt
        assert result.ttft_ms["p50"] > 0 and result.e2e_ms["p90"] >= result.ttft_ms["p90"]
        if way == "mapped-async":  # the target computes the held-back tokens only
            assert c["kvbridge_mapped"] == 3 and c["external_kv_transfer"] >= prompt - 3 * 8
            assert result.computed_share < 0.05 and c["kvbridge_map_seconds"] > 0
        else:
            assert c["local_compute"] == prompt and c["external_kv_transfer"] == 0 and c["kvbridge_native"] == 3


def test_the_load_benchmarks_warm_way_reads_what_the_source_stored(servers):
    """load-bench's warm way against the running pair: the storing source serves each prompt first, the target's
    requests under the same salts then read its stored blocks (mapped ahead) and compute only the rest."""
    import asyncio

    from transformers import AutoTokenizer

    from kvbridge import family
    from kvbridge.serving.bench.load import poisson_trace, run_ways
    from kvbridge.serving.bench.ttft import heldout_stream

    tokenizer = AutoTokenizer.from_pretrained(family.target_path())
    stream = heldout_stream(tokenizer)
    trace = poisson_trace(4.0, 3, (300, 600), seed=5, stream_tokens=len(stream))
    (unloaded, loaded) = asyncio.run(run_ways(
        {"warm": servers[1]}, {"warm": "kvbridge-family"}, ["warm"], [4.0], {4.0: trace}, trace[:2], stream,
        tokenizer.bos_token_id, 4, f"test-{time.time_ns()}", progress=lambda m: None, replicates=100,
        source=(servers[0], "kvbridge-family-source"), store=str(servers[2] / "store"), settle_s=1.0))
    for result, requests in ((unloaded, 2), (loaded, 3)):
        c = result.counters  # every prompt of 300+ tokens has 2+ full 128-token blocks before its held-back token
        assert c["requests"] == requests and c["kvbridge_mapped"] == requests and c["kvbridge_fallback"] == 0
        assert c["kvbridge_stored_tokens"] >= 256 * requests, c
        assert c["kvbridge_premapped_tokens"] == c["kvbridge_stored_tokens"], c  # mapped ahead: read, not mapped
        assert c["local_compute"] <= c["prompt_tokens"] - c["kvbridge_stored_tokens"]
