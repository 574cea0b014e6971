"""The serving layer's pure parts, without an engine: settings, request modes, the mapper's namespace, the HTTP
rewrite, vLLM's arguments (the llama-4 query scaling override pinned)."""

from __future__ import annotations

import json
import os
import shutil

import pytest

from kvbridge import family
from kvbridge.errors import InputError
from kvbridge.serving.engine.config import (
    NAMESPACE_PREFIX,
    ServeConfig,
    engine_kwargs,
    in_namespace,
    llama4_scaling,
    namespace,
    request_mode,
    salted,
)
from kvbridge.serving.engine.middleware import rewrite


def config(**kw) -> ServeConfig:
    return ServeConfig(mapper=family.mapper_path(), source=family.source_path(), target=family.target_path(), **kw)


def test_request_modes_and_their_errors():
    assert request_mode(None, "auto") == "auto"
    assert request_mode({}, "native") == "native"
    assert request_mode({"kvbridge": "mapped", "other_connector": 1}, "native") == "mapped"
    for bad in ({"kvbridge": "fast"}, {"kvbridge": None}, "mapped", [1], 3):
        with pytest.raises(InputError, match="kv_transfer_params"):
            request_mode(bad, "mapped")


def test_settings_are_validated_and_unknown_options_refused():
    assert ServeConfig.from_extra(config().to_extra()) == config()
    with pytest.raises(InputError, match="unknown connector option"):
        ServeConfig.from_extra({**config().to_extra(), "hold_bak": 2})
    for bad in (dict(mode="fast"), dict(min_tokens=1), dict(min_tokens=True), dict(runtime={"recompte": 0.1})):
        with pytest.raises(InputError):
            config(**bad)


def test_namespace_belongs_to_the_mapper_and_its_runtime_options(tmp_path):
    a = namespace(family.mapper_path(), {"recompute": 0.04})
    assert a.startswith(NAMESPACE_PREFIX) and a == namespace(family.mapper_path(), {"recompute": 0.04})
    assert a != namespace(family.mapper_path(), {"recompute": 0.0})
    other = tmp_path / "m"
    shutil.copytree(family.mapper_path(), other)
    (other / "checksums.sha256").write_text((other / "checksums.sha256").read_text().replace("a", "b", 1))
    assert namespace(other, {"recompute": 0.04}) != a
    assert in_namespace(salted(a, None), a) and in_namespace(salted(a, "user-1"), a)
    assert not in_namespace(None, a) and not in_namespace("user-1", a) and not in_namespace(a + "x", a)
    with pytest.raises(InputError, match="at most"):
        salted(a, "s" * 120)


def test_rewrite_sets_the_default_mode_and_salts_only_requests_that_may_be_mapped():
    ns = NAMESPACE_PREFIX + "0" * 32
    assert rewrite({"prompt": "x"}, "mapped", ns) == {"prompt": "x", "kv_transfer_params": {"kvbridge": "mapped"},
                                                       "cache_salt": ns}
    native = rewrite({"prompt": "x", "cache_salt": "mine", "kv_transfer_params": {"kvbridge": "native"}}, "auto", ns)
    assert native["cache_salt"] == "mine"  # native requests keep the exact namespace they asked for
    assert rewrite({"prompt": "x", "cache_salt": "mine"}, "auto", ns)["cache_salt"] == f"{ns}:mine"
    with pytest.raises(InputError):
        rewrite({"prompt": "x", "kv_transfer_params": {"kvbridge": "all"}}, "mapped", ns)


def test_the_llama4_query_scaling_reaches_vllm(tmp_path):
    """vLLM applies Ministral-3's position-dependent query scaling only from a top-level llama_4_scaling; the
    family's config keeps it in rope_parameters (beta 0.1, original 512): without the override vLLM serves another
    model past 512 positions (the engine tests pin the outputs)."""
    rope = json.loads((family.CHECKPOINTS / "target" / "config.json").read_text())["rope_parameters"]
    expected = {"llama_4_scaling": {"original_max_position_embeddings": rope["original_max_position_embeddings"],
                                    "beta": rope["llama_4_scaling_beta"]}}
    assert llama4_scaling(family.target_path()) == expected
    kwargs = engine_kwargs(config(), dtype="float32")
    assert kwargs["hf_overrides"] == expected and kwargs["model"] == family.target_path()
    assert kwargs["kv_transfer_config"]["kv_load_failure_policy"] == "recompute"  # a failed map is prefilled natively
    assert engine_kwargs(model=family.target_path())["hf_overrides"] == expected  # the native baseline too
    # a multimodal repo keeps it in its text config
    vlm = tmp_path / "vlm"
    vlm.mkdir()
    (vlm / "config.json").write_text(json.dumps({"text_config": {"rope_parameters": rope}}))
    assert llama4_scaling(vlm) == {"text_config": expected}
    plain = tmp_path / "plain"
    plain.mkdir()
    (plain / "config.json").write_text(json.dumps({"rope_parameters": {"rope_type": "default"}}))
    assert llama4_scaling(plain) is None


def test_vllm_arguments_and_the_pair_check(tmp_path):
    from kvbridge.errors import CompatibilityError
    from kvbridge.serving.launch import preflight, vllm_argv

    argv = vllm_argv(config(), "fam", "127.0.0.1", 8123, ["--max-num-seqs", "4"])
    assert argv[:2] == ["serve", family.target_path()] and argv[-2:] == ["--max-num-seqs", "4"]
    assert argv[argv.index("--dtype") + 1] == "float32"  # the connector's dtype on CPU: one dtype on both sides
    assert json.loads(argv[argv.index("--kv-transfer-config") + 1])["kv_connector"] == "KVBridgeConnector"
    assert "--enforce-eager" in argv and argv[argv.index("--served-model-name") + 1] == "fam"
    assert vllm_argv(config(), "fam", "127.0.0.1", 1, ["--dtype", "bfloat16"]).count("--dtype") == 1
    # --plain (the load benchmark's baseline): the same engine settings, no connector, no middleware
    plain = vllm_argv(config(), "fam", "127.0.0.1", 8123, ["--max-num-seqs", "4"], plain=True)
    assert "--kv-transfer-config" not in plain and "--middleware" not in plain
    assert [a for a in argv if a not in plain] == argv[argv.index("--kv-transfer-config"):][:4]  # (and nothing else)
    assert preflight(config())["hold_back"] >= 1
    # swapped pair: refused before any engine starts
    with pytest.raises(CompatibilityError):
        preflight(ServeConfig(mapper=family.mapper_path(), source=family.target_path(), target=family.source_path()))
    broken = tmp_path / "broken"
    shutil.copytree(family.mapper_path(), broken)
    data = bytearray((broken / "mapper.safetensors").read_bytes())
    data[-1] ^= 1
    (broken / "mapper.safetensors").write_bytes(bytes(data))
    with pytest.raises(Exception, match="does not verify"):
        preflight(ServeConfig(mapper=str(broken), source=family.source_path(), target=family.target_path()))


def test_serve_refuses_bad_pairs_in_one_line(capsys, tmp_path):
    from kvbridge.cli import main

    assert main(["serve", "--source", family.source_path()]) == 1
    assert "together" in capsys.readouterr().err
    assert main(["serve", "--mapper", str(tmp_path / "missing")]) == 1
    err = capsys.readouterr().err
    assert err.startswith("kvbridge serve: error:") and "Traceback" not in err
    assert main(["serve", "--mapper", family.mapper_path(), "--source", family.target_path(), "--target",
                 family.source_path()]) == 1
    assert "kvbridge serve: error:" in capsys.readouterr().err


def test_break_even_reads_a_bench_file(tmp_path):
    from kvbridge.serving.launch import break_even

    path = tmp_path / "bench.json"
    path.write_text(json.dumps({"rows": [{"context_tokens": 64, "ttft_speedup": 0.7},
                                         {"context_tokens": 512, "ttft_speedup": 1.2},
                                         {"context_tokens": 256, "ttft_speedup": 1.01}]}))
    assert break_even(str(path)) == 256
    path.write_text(json.dumps({"rows": [{"context_tokens": 64, "ttft_speedup": 0.7}]}))
    with pytest.raises(InputError, match="never map"):
        break_even(str(path))
    path.write_text("{")
    with pytest.raises(InputError, match="not a kvbridge bench"):
        break_even(str(path))
    # a serve-bench report: one request at a time decides (concurrency 8 beat native at 256, a lone request did not)
    rows = [{"context_tokens": n, "concurrency": c, "ttft_speedup": x}
            for n, c, x in ((256, 1, 0.89), (256, 8, 1.09), (1024, 1, 1.18), (1024, 8, 1.10), (2000, 1, 1.41))]
    path.write_text(json.dumps({"rows": rows}))
    assert break_even(str(path)) == 1024
    path.write_text(json.dumps({"rows": [dict(r, concurrency=4) for r in rows if r["concurrency"] == 8]}))
    assert break_even(str(path)) == 256  # no single-request rows: the lowest concurrency measured


def test_flags_are_read_in_both_forms_and_a_missing_value_is_one_line(capsys):
    from kvbridge.cli import main
    from kvbridge.serving.launch import flag_value, given_flags, vllm_argv

    argv = ["--served-model-name=foo", "--target", "T", "--port", "1"]
    assert flag_value(argv, "--served-model-name") == "foo" and flag_value(argv, "--target") == "T"
    assert flag_value(argv, "--mapper") is None and given_flags(argv) == {"--served-model-name", "--target", "--port"}
    with pytest.raises(InputError, match="needs a value"):
        flag_value(["--target"], "--target")
    assert main(["serve-bench", "--target"]) == 1
    assert "--target needs a value" in capsys.readouterr().err
    with pytest.raises(InputError, match="kv-transfer-config"):
        vllm_argv(config(), "fam", "127.0.0.1", 1, ["--kv-transfer-config={}"])


def test_the_middleware_needs_its_settings_and_survives_any_body(monkeypatch):
    import asyncio

    from kvbridge.serving.engine.middleware import ENV, KVBridgeMiddleware

    monkeypatch.delenv(ENV, raising=False)
    with pytest.raises(RuntimeError, match="kvbridge serve"):
        KVBridgeMiddleware(None)
    monkeypatch.setenv(ENV, json.dumps({"mode": "mapped", "namespace": NAMESPACE_PREFIX + "0" * 32}))
    seen = []

    async def app(scope, receive, send):
        seen.append((await receive())["body"])

    sent = []

    async def send(message):
        sent.append(message)

    for body, passed in ((b"[" * 100000, True), (b'{"prompt": "x", "kv_transfer_params": {"kvbridge": "x"}}', False),
                         (b'{"prompt": "x"}', True)):
        messages = [{"type": "http.request", "body": body, "more_body": False}]

        async def receive():
            return messages.pop(0) if messages else {"type": "http.disconnect"}

        seen.clear(), sent.clear()
        scope = {"type": "http", "method": "POST", "path": "/v1/completions", "headers": []}
        asyncio.run(KVBridgeMiddleware(app)(scope, receive, send))
        assert bool(seen) == passed and (passed or sent[0]["status"] == 400)
    assert json.loads(seen[0])["cache_salt"].startswith(NAMESPACE_PREFIX)


@pytest.mark.parametrize("body,match", [
    ({"kv_transfer_params": {"kvbridge": "mapped", "j": {"a": 1}}}, "unknown keys"),  # rides to the engine's pickle
    ({"kv_transfer_params": {"KVBridge": "native"}}, "unknown keys"),  # a misspelling is not the default mode
    ({"prompt": "x", "cache_salt": NAMESPACE_PREFIX + "0" * 32}, "may not start"),  # a native read of mapped blocks
    ({"prompt": "x", "stop": json.loads("[" * 70 + "]" * 70)}, "nests more than"),  # 500 deep killed the engine
    ({"kv_transfer_params": {"kvbridge_hold_back": "3"}}, "kvbridge_hold_back"),
    ({"kv_transfer_params": {"kvbridge_native_rest": -1}}, "kvbridge_native_rest"),
    ({"kv_transfer_params": {"kvbridge_native_rest": True}}, "kvbridge_native_rest"),
])
def test_what_no_route_may_pass_to_the_engine(body, match):
    from kvbridge.serving.engine.middleware import check_body

    with pytest.raises(InputError, match=match):
        check_body(body)
    with pytest.raises(InputError, match=match):
        rewrite(dict(body), "mapped", NAMESPACE_PREFIX + "1" * 32)


def test_warm_transfer_settings_and_the_source_servers_arguments(tmp_path, tiny_vlm):
    from kvbridge.serving.engine.config import StoreConfig, StoreUse, client_salt, request_use_store
    from kvbridge.serving.launch import source_argv
    from kvbridge.serving.store.folder import KVStore

    assert request_use_store(None) is request_use_store({"kvbridge_store": True}) is StoreUse.ON
    assert request_use_store({"kvbridge_store": False}) is StoreUse.OFF and not StoreUse.OFF.reads_store
    assert request_use_store({"kvbridge_store": "source"}) is StoreUse.SOURCE and not StoreUse.SOURCE.reads_ahead
    assert request_use_store({"kvbridge_store": "folder"}) is StoreUse.FOLDER and not StoreUse.FOLDER.from_memory
    with pytest.raises(InputError, match="kvbridge_store"):
        request_use_store({"kvbridge_store": "no"})
    from kvbridge.serving.engine.config import request_native_rest

    assert request_native_rest(None) is None and request_native_rest({"kvbridge_native_rest": 0}) == 0
    assert config().native_rest > 0  # a new turn after a stored history is the target's by default
    for bad in (-1, 1.5, "8"):
        with pytest.raises(InputError, match="native_rest"):
            config(native_rest=bad)
    for bad in (-1, 1.5, True):
        with pytest.raises(InputError, match="store_memory_bytes"):
            config(store_memory_bytes=bad)
    space = namespace(family.mapper_path(), {})
    assert client_salt(salted(space, "user-1"), space) == "user-1" and client_salt(space, space) is None
    assert client_salt("user-1", space) == "user-1" and client_salt(None, space) is None
    for bad in (dict(store=""), dict(store="s", cap_bytes=0), dict(store="s", cap_bytes=True),
                dict(store="s", prewarm="yes")):
        with pytest.raises(InputError):
            StoreConfig(**bad)
    with pytest.raises(InputError, match="unknown connector option"):
        StoreConfig.from_extra({"store": "s", "cap": 1})

    store = StoreConfig(str(tmp_path / "store"))
    argv = source_argv(store, family.source_path(), "src", "127.0.0.1", 8001, [])
    kv = json.loads(argv[argv.index("--kv-transfer-config") + 1])
    assert kv["kv_role"] == "kv_producer" and kv["kv_connector_extra_config"]["store"] == store.store
    assert "--enforce-eager" in argv and "--block-size" not in argv and "--language-model-only" not in argv
    assert json.loads(argv[argv.index("--hf-overrides") + 1]) == llama4_scaling(family.source_path())
    KVStore(store.store, block_tokens=64, create=True)  # an existing store: the engine takes its block size
    argv = source_argv(store, family.source_path(), "src", "127.0.0.1", 8001, [])
    assert argv[argv.index("--block-size") + 1] == "64"
    assert "--language-model-only" in source_argv(store, tiny_vlm[0], "vlm", "127.0.0.1", 8001, [])
    with pytest.raises(InputError, match="kv-transfer-config"):
        source_argv(store, family.source_path(), "src", "127.0.0.1", 8001, ["--kv-transfer-config", "{}"])
    plain = source_argv(None, family.source_path(), "src", "127.0.0.1", 8001, ["--block-size", "64"])
    assert "--kv-transfer-config" not in plain and "--enforce-eager" in plain and "--hf-overrides" in plain
    ahead = source_argv(StoreConfig(store.store, prewarm=True), family.source_path(), "src", "127.0.0.1", 8001, [])
    assert json.loads(ahead[ahead.index("--kv-transfer-config") + 1])["kv_connector_extra_config"]["prewarm"] is True
    assert plain[:2] == argv[:2] and plain[-2:] == ["--block-size", "64"]  # the baseline: same server, no store


def test_bad_store_options_are_one_line(capsys, tmp_path):
    from kvbridge.cli import main

    assert main(["cascade-bench", "--histories", "100"]) == 1
    assert "--histories" in capsys.readouterr().err
    assert main(["cascade-bench", "--source-url", "http://127.0.0.1:1"]) == 1
    assert "together" in capsys.readouterr().err
    (tmp_path / "store.json").write_text("{}")
    assert main(["serve-source", "--store", str(tmp_path), "--store-cap-gb", "0"]) == 1
    assert "--store-cap-gb" in capsys.readouterr().err
    assert main(["serve-source", "--store", str(tmp_path / "s"), "--source", "x", "--mapper", "m"]) == 1
    assert "--mapper and --target" in capsys.readouterr().err
    assert main(["serve-source", "--no-store", "--map-ahead"]) == 1
    assert "--no-store" in capsys.readouterr().err
    assert main(["serve-source", "--no-store", "--prewarm"]) == 1
    assert "--prewarm need the store" in capsys.readouterr().err
    assert main(["cascade-bench", "--baseline-url", "http://127.0.0.1:1"]) == 1
    assert "--source-url" in capsys.readouterr().err
    assert main(["cascade-bench", "--source-baseline", "--source-url", "http://127.0.0.1:1", "--target-url",
                 "http://127.0.0.1:2"]) == 1
    assert "--baseline-url" in capsys.readouterr().err
    for argv in (["serve", "--store", str(tmp_path)], ["cascade", "--store", str(tmp_path / "c")]):
        for bad in ("-1", "inf", "nan"):
            assert main(argv + ["--store-memory-gb", bad]) == 1
            assert "--store-memory-gb" in capsys.readouterr().err


def test_a_saved_escalation_report_is_tabled_again(capsys, tmp_path):
    """`kvbridge cascade-bench --table`: a saved report's tables with its per-conversation figures (the paired
    folder-minus-warm difference, warm's agreement with native minus cold's, the stalls), written beside it; another
    file is refused in one line."""
    import json
    import shutil
    from pathlib import Path

    from kvbridge.cli import main

    saved = Path(__file__).parent.parent / "docs/results/cascade-bench/cascade-memory-plain-run3.json"
    report = tmp_path / "r.json"
    shutil.copy(saved, report)
    assert main(["cascade-bench", "--table", str(report)]) == 0
    out = capsys.readouterr().out
    assert "Paired per conversation" in out and "Stalls" in out and (tmp_path / "r.md").read_text() == out
    rows = json.loads(saved.read_text())["conversations"]["2000"]
    diffs = sorted(r["folder"]["ttft_ms"] - r["warm"]["ttft_ms"] for r in rows)
    assert f"{(diffs[15] + diffs[16]) / 2:+.1f} ms" in out  # the median of 32 paired differences

    def agreement(r, way):
        return sum(a == b for a, b in zip(r[way]["tokens"], r["native"]["tokens"])) / len(r["native"]["tokens"])

    # the answers' agreement with native's, warm's minus cold's, conversation by conversation (a mean, in points)
    mean = sum(agreement(r, "warm") - agreement(r, "cold") for r in rows) / len(rows)
    assert "the way's minus the cold path's" in out and f"history 2000 warm {100 * mean:+.1f} points [" in out
    report.write_text(json.dumps({"rows": [{"history_tokens": 1}]}))
    assert main(["cascade-bench", "--table", str(report)]) == 1
    assert "not a report" in capsys.readouterr().err


def test_map_ahead_settings_are_checked_before_an_engine_starts(tmp_path):
    from kvbridge import family
    from kvbridge.cli.registry import parse
    from kvbridge.cli.serve import pair_argv, store_config
    from kvbridge.errors import CompatibilityError, KVBridgeError
    from kvbridge.serving.engine.config import StoreConfig

    with pytest.raises(InputError, match="both"):
        StoreConfig(store=str(tmp_path), mapper=family.mapper_path())
    args = parse(["serve-source", "--store", str(tmp_path), "--map-ahead"])
    config = store_config(args, family.source_path())
    assert (config.mapper, config.target) == (family.mapper_path(), family.target_path())
    assert store_config(parse(["serve-source", "--store", str(tmp_path)]), family.source_path()).mapper is None
    # the mapper is fitted for the embedded source: a map-ahead for another source is refused in one line
    with pytest.raises((CompatibilityError, KVBridgeError), match="source"):
        store_config(args, family.target_path())
    cascade = argparse_cascade(["--store", str(tmp_path)])
    assert "--map-ahead" in pair_argv(cascade)[0]
    assert "--map-ahead" not in pair_argv(argparse_cascade(["--store", str(tmp_path), "--no-map-ahead"]))[0]
    # prewarm is the source's to ask (every request with --prewarm); the source engine's settings carry it
    assert "--prewarm" not in pair_argv(cascade)[0]
    assert "--prewarm" in pair_argv(argparse_cascade(["--store", str(tmp_path), "--prewarm"]))[0]
    args.prewarm = True
    assert store_config(args, family.source_path()).prewarm is True
    # the memory tier's size goes to the target's server
    target = pair_argv(argparse_cascade(["--store", str(tmp_path), "--store-memory-gb", "0.5"]))[1]
    assert target[target.index("--store-memory-gb") + 1] == "0.5"


def argparse_cascade(argv):
    from kvbridge.cli.registry import parse

    return parse(["cascade", *argv])


def test_map_ahead_refuses_a_rope_that_depends_on_the_prompts_length(tmp_path):
    import json

    from kvbridge.errors import UnsupportedModelError
    from kvbridge.serving.engine.config import check_map_ahead

    folder = tmp_path / "mapper"
    shutil.copytree(family.mapper_path(), folder)
    check_map_ahead(str(folder))  # the family's YaRN: a pure function of position
    config = json.loads((folder / "mapper.json").read_text())
    config["target"]["rope"]["rope_type"] = "dynamic"
    (folder / "mapper.json").write_text(json.dumps(config))
    with pytest.raises(UnsupportedModelError, match="target's RoPE is 'dynamic'"):
        check_map_ahead(str(folder))


def test_escalation_conversations_have_the_asked_lengths():
    from transformers import AutoTokenizer

    from kvbridge.serving.bench.cascade import conversation_texts

    tokenizer = AutoTokenizer.from_pretrained(family.target_path())
    for question in (24, 200):
        texts = conversation_texts(tokenizer, 3, 1000, seed=1, question_tokens=question)
        assert len(texts) == 3 and len({t[0] for t in texts}) == 3  # distinct conversations
        for first, second, asked in texts:
            assert abs(len(tokenizer(asked, add_special_tokens=False).input_ids) - question) <= 4
            assert abs(len(tokenizer(first + second, add_special_tokens=False).input_ids) - (1000 - 136)) <= 16


def test_parallel_engines_the_connectors_cannot_serve_are_refused_before_they_start(capsys, tmp_path, monkeypatch):
    from kvbridge.cli import main
    from kvbridge.serving.launch import cpu_defaults, parallel_sizes

    assert parallel_sizes(["--tensor-parallel-size", "2"]) == (2, 1)
    assert parallel_sizes(["-tp", "4", "--pipeline-parallel-size=2"]) == (4, 2)
    assert parallel_sizes(["--tensor_parallel_size", "2", "-pp=3"]) == (2, 3)  # vLLM reads underscores too
    assert parallel_sizes(["--tensor-parallel-size", "2", "-tp", "4"]) == (4, 1)  # the last one wins
    assert parallel_sizes(["-pp", "2", "--pipeline-parallel-size", "1"]) == (1, 1)
    assert parallel_sizes(["--port", "1"]) == (1, 1)
    for argv, match in ((["-tp", "two"], "--tensor-parallel-size must be a whole number"),
                        (["-pp", "0"], "--pipeline-parallel-size must be a whole number"),
                        (["--port", "1", "-tp"], "-tp needs a value")):
        with pytest.raises(InputError, match=match):
            parallel_sizes(argv)
    for argv, words in ((["serve", "--pipeline-parallel-size", "2"], "not pipeline-parallel"),
                        (["cascade", "-pp", "2", "--log-dir", str(tmp_path / "logs")], "not pipeline-parallel"),
                        (["serve-source", "--store", str(tmp_path / "s"), "--tensor-parallel-size", "2"],
                         "one-device source engine")):
        assert main(argv) == 1
        err = capsys.readouterr().err
        assert words in err and "Traceback" not in err, argv
    assert not (tmp_path / "s").exists() and not (tmp_path / "logs").exists()  # refused before anything was made
    for name in ("OMP_NUM_THREADS", "VLLM_CPU_KVCACHE_SPACE", "VLLM_CPU_OMP_THREADS_BIND"):
        monkeypatch.setenv(name, "x")  # (recorded, so that the test leaves the environment as it found it)
        monkeypatch.delenv(name)
    monkeypatch.setattr("os.sched_getaffinity", lambda _: {0, 1, 2, 3}, raising=False)
    cpu_defaults(2)  # the cores are shared among the tensor-parallel workers
    assert os.environ["OMP_NUM_THREADS"] == "2"


def test_a_server_gone_mid_benchmark_is_one_error_not_a_traceback():
    """The benchmarks read the server's /metrics between waves: a server that stopped is a KVBridgeError that says
    so (the command prints it in one line), not urllib's traceback."""
    import socket

    from kvbridge.errors import KVBridgeError
    from kvbridge.serving.bench.ttft import metric

    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with pytest.raises(KVBridgeError, match="could not be read"):
        metric(f"http://127.0.0.1:{port}", "vllm:kvbridge_map_seconds_total")
