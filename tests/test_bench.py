"""FLOP accounting against hand counts, and the bench command's output."""

import json
from types import SimpleNamespace

import pytest
import torch
from conftest import model_info

from kvbridge.cli import main
from kvbridge.core.mapper import Mapper
from kvbridge.core.mapper_config import MapperConfig
from kvbridge.core.rope import RopeSpec
from kvbridge.measure.bench import cache_prefill_flops, map_flops, path_flops, prefill_flops, recompute_flops


def test_prefill_flops_match_a_hand_count():
    cfg = SimpleNamespace(hidden_size=4, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                          head_dim=2, intermediate_size=8, vocab_size=10)
    t = 3
    q = o = 2 * t * 4 * (2 * 2)  # d → Hq·hd
    k = v = 2 * t * 4 * (1 * 2)  # d → Hkv·hd
    mlp = 2 * t * 3 * 4 * 8  # gate, up, down
    pairs = t * (t + 1) // 2  # causal query-key pairs
    attn = 2 * (pairs * 2 * 2 * 2)  # QKᵀ and AV: pairs × heads × 2·hd
    logits = 2 * 4 * 10  # last token only
    assert prefill_flops(cfg, t, logits_tokens=1) == q + k + v + o + mlp + attn + logits
    assert prefill_flops(cfg, t, logits_tokens=0) == q + k + v + o + mlp + attn
    # two layers double the per-layer work
    assert (prefill_flops(SimpleNamespace(**{**vars(cfg), "num_hidden_layers": 2}), t, 0)
            == 2 * (q + k + v + o + mlp + attn))


def test_recompute_flops_skip_the_last_layers_attention_and_mlp():
    """n recomputed queries over a prefix: every layer but the last in full, the last one's K and V only."""
    cfg = SimpleNamespace(hidden_size=4, num_hidden_layers=3, num_attention_heads=2, num_key_value_heads=1,
                          head_dim=2, intermediate_size=8, vocab_size=10)
    n, prefix = 2, 5
    one = SimpleNamespace(**{**vars(cfg), "num_hidden_layers": 1})
    full_layer = prefill_flops(one, n, 0, past=prefix - n)
    kv = 2 * (2 * n * 4 * (1 * 2))  # d → Hkv·hd, keys and values
    assert recompute_flops(cfg, n, prefix) == pytest.approx(2 * full_layer + kv)


def test_map_flops_match_a_hand_count():
    rope = RopeSpec("llama", "default", 4)
    src = model_info("s", 3, 2, 4, rope=rope, max_positions=64, architecture="S", tokenizer="t")  # Fs = 8
    tgt = model_info("t", 2, 1, 4, rope=rope, max_positions=64, architecture="T", tokenizer="t")  # Ft = 4
    selection = {"key": ((0, 1, 2), (1,)), "value": ((0,), (0, 2))}
    config = MapperConfig(source=src, target=tgt, selection=selection)
    mapper = Mapper(config, {n: torch.zeros(s) for n, s in config.weight_shapes().items()})
    # keys: 24·4 + 8·4; values: 8·4 + 16·4 → 224 multiply-adds per token
    assert map_flops(mapper, 5) == 2 * 5 * 224


@pytest.fixture(scope="module")
def tiny_mapper(tiny_pair, tmp_path_factory):
    source, target, texts = tiny_pair
    out = tmp_path_factory.mktemp("bench") / "mapper"
    assert main(["fit", "--source", source, "--target", target, "--texts", texts, "--out", str(out),
                 "--num-texts", "4", "--seq-len", "32", "--heldout-texts", "0", "--mlp-steps", "30",
                 "--tune-steps", "10", "--quiet"]) == 0
    return source, target, str(out)


KEYS = ["context_tokens", "native_prefill_ms", "source_prefill_ms", "warm_map_ms", "cold_ms", "warm_speedup",
        "cold_speedup", "map_gflop", "map_efficiency", "cold_speedup_limit", "native_ttft_ms", "mapped_ttft_ms",
        "ttft_speedup", "ttft_speedup_limit"]


def test_bench_writes_json_and_plot(tiny_mapper, tmp_path, capsys):
    source, target, mapper = tiny_mapper
    out, plot = tmp_path / "bench.json", tmp_path / "bench.png"
    assert main(["bench", "--source", source, "--target", target, "--mapper", mapper, "--contexts", "16,48",
                 "--warmup", "1", "--trials", "5", "--json", str(out), "--plot", str(plot)]) == 0
    assert "| Context tokens | Native prefill = TTFT |" in capsys.readouterr().out
    rows = json.loads(out.read_text())["rows"]
    assert [r["context_tokens"] for r in rows] == [16, 48]
    for r in rows:
        assert set(KEYS) <= set(r)
        assert all(r[k] > 0 for k in KEYS)
        # cold = source prefill + warm map, within the slack of a shared 2-core machine
        assert r["cold_ms"] < 3 * (r["source_prefill_ms"] + r["warm_map_ms"]) + 5
        assert r["cold_ms"] > 0.3 * (r["source_prefill_ms"] + r["warm_map_ms"])
        assert r["ttft_speedup"] == pytest.approx(r["native_ttft_ms"] / r["mapped_ttft_ms"])
        assert r["native_ttft_ms"] == r["native_prefill_ms"]  # the native prefill ends with the first token's logits
        # the TTFT bound pays for the target's forward over the held-back token: it is below the cold bound
        assert r["ttft_speedup_limit"] < r["cold_speedup_limit"]
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_bench_refuses_bad_contexts(tiny_mapper, capsys):
    source, target, mapper = tiny_mapper
    assert main(["bench", "--source", source, "--target", target, "--mapper", mapper, "--contexts", "16,x"]) == 1
    assert "comma-separated" in capsys.readouterr().err
    assert main(["bench", "--source", source, "--target", target, "--mapper", mapper, "--contexts", "100000"]) == 1
    assert "exceeds" in capsys.readouterr().err


def test_real_geometry_matches_the_published_artifact():
    """The shipped Ministral-3 text configs give the published artifact's parameter count and ≈3.7 GFLOP/token map."""
    import json

    from transformers import Ministral3Config

    from kvbridge.measure.bench_real import CONFIGS

    configs = {}
    for name in ("ministral3-3b-text", "ministral3-8b-text"):
        data = json.loads((CONFIGS / f"{name}.json").read_text())
        configs[name] = Ministral3Config(**{k: v for k, v in data.items() if k not in ("architectures", "model_type")})
    small, large = configs["ministral3-3b-text"], configs["ministral3-8b-text"]
    assert ((small.num_hidden_layers, small.hidden_size, large.num_hidden_layers, large.hidden_size)
            == (26, 3072, 34, 4096))
    rope = RopeSpec("ministral3", "yarn", 128)
    src = model_info("3b", 26, 8, 128, rope=rope, max_positions=262144, architecture="M", tokenizer="t")
    tgt = model_info("8b", 34, 8, 128, rope=rope, max_positions=262144, architecture="M", tokenizer="t")
    config = MapperConfig(source=src, target=tgt, selection={k: (tuple(range(26)),) * 34 for k in ("key", "value")})
    assert config.num_parameters() == 34 * 2 * (26 * 1024 + 1) * 1024  # 1.854 B, 7.42 GB in float32
    per_token_map = map_flops(config, 1)
    assert per_token_map == 2 * 34 * 2 * 26 * 1024 * 1024
    assert per_token_map / 1e9 == pytest.approx(3.7, abs=0.01)
    # the map is close to a quarter of the 8B's own per-token prefill work
    assert 0.2 < per_token_map / prefill_flops(large, 1, 0) < 0.3


def test_mapped_path_flops_add_up_its_parts():
    """Source prefill of T − m tokens, the map, the recompute of ceil(r·(T − m)) tokens, the m held-back tokens."""
    src = SimpleNamespace(hidden_size=4, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                          head_dim=2, intermediate_size=8, vocab_size=10)
    tgt = SimpleNamespace(**{**vars(src), "num_hidden_layers": 2, "hidden_size": 6})
    rope = RopeSpec("llama", "default", 2)
    config = MapperConfig(source=model_info("s", 1, 1, 2, rope=rope, max_positions=64, architecture="S", tokenizer="t"),
                          target=model_info("t", 2, 1, 2, rope=rope, max_positions=64, architecture="T", tokenizer="t"),
                          selection={k: ((0,), (0,)) for k in ("key", "value")})
    rest = map_flops(config, 18) + prefill_flops(tgt, 2, 1, past=18)
    # no final hidden state read: the source's one layer only forms its queries, keys and values
    assert cache_prefill_flops(src, 18) == 2 * 18 * 4 * (2 + 2 * 1) * 2
    # two layers: the first whole, the last's projections (the target geometry: width 6)
    assert cache_prefill_flops(tgt, 18) == prefill_flops(tgt, 18, 0) / 2 + 2 * 18 * 6 * (2 + 2 * 1) * 2
    assert path_flops(src, tgt, config, 20, hold_back=2) == cache_prefill_flops(src, 18) + rest
    # the logit criterion reads the source's final hidden states: its whole forward
    base = prefill_flops(src, 18, 0) + rest
    assert path_flops(src, tgt, config, 20, hold_back=2, recompute=0.1) == base + recompute_flops(tgt, 2, 18)
    assert path_flops(src, tgt, config, 20, hold_back=2, recompute=0.1, recompute_by="bigram") == \
        cache_prefill_flops(src, 18) + rest + recompute_flops(tgt, 2, 18)
    surprisal = path_flops(src, tgt, config, 20, hold_back=2, recompute=0.1, recompute_by="surprisal")
    assert surprisal - path_flops(src, tgt, config, 20, hold_back=2, recompute=0.1) == 2 * 18 * 4 * 10


def test_the_plan_prints_the_ttft_limit_of_the_defaults_at_the_published_geometry():
    from kvbridge.measure.bench_real import plan_table

    table = plan_table()
    assert "TTFT FLOP limit @1,024" in table and "kvbridge fit's defaults (top-k 1, levers, recompute" in table


def test_the_gpu_suite_runs_tiny_on_cpu_and_writes_as_it_goes(tmp_path, capsys):
    """`python -m kvbridge.measure.suite OUT --tiny`: the plan, a map's tables eager and "graphed" (eager here,
    with the reason), the published fit beside its plan and the goals, in suite.json and suite.md."""
    import json

    from kvbridge.measure.suite import main

    main([str(tmp_path / "suite"), "--tiny", "--device", "cpu", "--contexts", "64", "--trials", "1", "--warmup", "1",
          "--maps", "defaults"])
    data = json.loads((tmp_path / "suite" / "suite.json").read_text())
    assert list(data["sections"]) == ["FLOP plan (configs only)", "latency: defaults, CUDA graphs",
                                      "latency: defaults, eager",
                                      "published fit (statistics on the device when they fit)", "goals"]
    assert data["graphs_eager_because"] == ["CUDA graphs need a CUDA device, not cpu: run eagerly"]
    assert data["sections"]["published fit (statistics on the device when they fit)"]["value"]["statistics_on"] == \
        "host"
    goals = data["sections"]["goals"]["value"]
    assert goals["defaults, graphed: TTFT speed-up at 512 ≥ 1.0"] is None  # not measured at 64 tokens only
    assert "| Goal | Measured | Met |" in (tmp_path / "suite" / "suite.md").read_text()
    assert "## goals" in capsys.readouterr().out


def test_bench_real_fit_runs_and_puts_the_plan_beside_it(capsys):
    """`python -m kvbridge.measure.bench_real --fit --tiny`: the fit's time and measured peak beside kvbridge plan's."""
    from kvbridge.measure.bench_real import main

    main(["--fit", "--tiny", "--device", "cpu", "--dtype", "float32", "--fit-texts", "8", "--fit-seq-len", "64"])
    out = capsys.readouterr().out
    assert "8 × 64 tokens" in out and "measured" in out and "planned" in out and "measured/planned" in out
