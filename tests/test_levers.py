"""Levers: lagged features, both caches, residual MLPs — exact cases of the hot path, format v2, and a real fit."""

import json

import pytest
import torch
import torch.nn.functional as F
from conftest import model_info

from kvbridge import Mapper
from kvbridge.core.artifact import CHECKSUMS_FILE, CONFIG_FILE, WEIGHTS_FILE
from kvbridge.core.hashing import sha256_file
from kvbridge.core.mapper_config import Lever, MapperConfig
from kvbridge.core.rope import RopeSpec
from kvbridge.errors import ArtifactError

ROPE = RopeSpec("ministral3", "yarn", 4, {"rope_theta": 1e4})
SOURCE = model_info("org/small", 2, 2, 4, rope=ROPE, max_positions=512)  # Fs = 8
TARGET = model_info("org/large", 3, 1, 4, rope=ROPE, max_positions=512)  # Ft = 4
ALL = {k: ((0, 1),) * 3 for k in ("key", "value")}


def mapper(levers=(), seed=0) -> Mapper:
    config = MapperConfig(source=SOURCE, target=TARGET, selection=ALL, levers=levers)
    g = torch.Generator().manual_seed(seed)
    return Mapper(config, {n: torch.randn(s, generator=g) for n, s in config.weight_shapes().items()})


def cache(tokens=7, batch=2, seed=1):
    g = torch.Generator().manual_seed(seed)
    return ([torch.randn(batch, 2, tokens, 4, generator=g) for _ in range(2)],
            [torch.randn(batch, 2, tokens, 4, generator=g) for _ in range(2)])


def feats(layers, t):
    """Source layers' features of token t (B, Ls·Fs), heads head-major; zeros before the first token."""
    if t < 0:
        return torch.zeros(layers[0].shape[0], len(layers) * 8)
    return torch.cat([x[:, :, t].flatten(1) for x in layers], dim=1)


def test_a_lag_zero_lever_without_mlp_is_the_version_1_map():
    """Both the plain map and a lag-0 lever (which joins the plain GEMM group: the same code runs for both) must
    equal the version-1 formula computed here independently, token by token: x_t · W + b."""
    plain = mapper()
    lever = Mapper(MapperConfig(source=SOURCE, target=TARGET, selection=ALL, levers=(Lever("key", 2),)), plain.weights)
    keys, values = cache()
    for m in (plain, lever):
        mk, mv = m.map(keys, values)
        for kind, out, src in (("key", mk, keys), ("value", mv, values)):
            for layer in range(3):
                w, b = plain.weights[f"{kind}.{layer}.weight"], plain.weights[f"{kind}.{layer}.bias"]
                for t in range(7):
                    expected = feats(src, t) @ w + b  # (B, Ft)
                    assert torch.allclose(out[layer][:, 0, t], expected, atol=1e-5), (kind, layer, t)


def test_lagged_kv_features_with_an_mlp_match_the_formula():
    lever = Lever("key", 1, lags=(0, 2), inputs=("key", "value"), hidden=5)
    m = mapper((lever,))
    keys, values = cache(tokens=6)
    mk, _ = m.map(keys, values)
    w, b = m.weights["key.1.weight"], m.weights["key.1.bias"]
    w1, b1, w2, b2 = (m.weights[f"key.1.mlp.{n}"] for n in ("in.weight", "in.bias", "out.weight", "out.bias"))
    for t in range(6):
        x = torch.cat([feats(keys, t), feats(values, t), feats(keys, t - 2), feats(values, t - 2)], dim=1)
        y = x @ w + b + F.gelu(x @ w1 + b1) @ w2 + b2  # (B, Ft)
        assert torch.allclose(mk[1][:, 0, t], y, atol=1e-4)


def test_lags_respect_positions_and_chunk_context():
    """Left padding: lags before position 0 read zeros. Chunks: the tokens before a chunk feed its lags."""
    m = mapper((Lever("value", 0, lags=(0, 1, 3)),))
    keys, values = cache(tokens=9, batch=1)
    whole = m.map(keys, values)[1][0]  # (1, Ht, 9, Dt)
    # the same row left-padded by 2 columns of garbage: positions make the pads invisible to the lags
    pad = lambda xs: [torch.cat([torch.full((1, 2, 2, 4), 7.0), x], dim=2) for x in xs]  # noqa: E731
    positions = torch.tensor([[0, 0] + list(range(9))])
    padded = m.map(pad(keys), pad(values), positions)[1][0][:, :, 2:]
    assert torch.allclose(padded, whole, atol=1e-5)
    # a chunk [5, 9) with 3 tokens of lag context equals the same columns of the whole map
    chunk = m.map([k[:, :, 2:] for k in keys], [v[:, :, 2:] for v in values], torch.arange(2, 9)[None], past=3)
    assert torch.allclose(chunk[1][0], whole[:, :, 5:], atol=1e-5)


def test_format_2_round_trip_and_version_1_files_load_as_before(tmp_path):
    m = mapper((Lever("key", 2, lags=(0, 1), inputs=("key", "value"), hidden=3),))
    m.save_pretrained(tmp_path / "v2")
    data = json.loads((tmp_path / "v2" / CONFIG_FILE).read_text())
    assert data["format_version"] == 2 and data["levers"][0]["lags"] == [0, 1]
    loaded = Mapper.from_pretrained(str(tmp_path / "v2"))
    assert loaded.config == m.config and all(torch.equal(loaded.weights[n], t) for n, t in m.weights.items())

    plain = mapper()
    plain.save_pretrained(tmp_path / "v1")
    folder = tmp_path / "v1"
    data = json.loads((folder / CONFIG_FILE).read_text())
    data["format_version"] = 1
    del data["levers"]  # exactly what version-1 kvbridge wrote
    (folder / CONFIG_FILE).write_text(json.dumps(data, indent=2) + "\n")
    (folder / CHECKSUMS_FILE).write_text("".join(f"{sha256_file(folder / n)}  {n}\n"
                                                 for n in (CONFIG_FILE, WEIGHTS_FILE)))
    old = Mapper.from_pretrained(str(folder))
    assert old.config.levers == ()
    keys, values = cache()
    for a, b in zip(plain.map(keys, values), old.map(keys, values)):
        assert all(torch.equal(x, y) for x, y in zip(a, b))


@pytest.mark.parametrize("bad", [dict(lags=()), dict(lags=(2, 1)), dict(lags=(-1,)), dict(inputs=("query",)),
                                 dict(hidden=-1), dict(kind="keys")])
def test_bad_levers_are_refused(bad):
    with pytest.raises(ArtifactError):
        Lever(**({"kind": "key", "layer": 0} | bad))
    with pytest.raises(ArtifactError, match="target layer 5"):
        MapperConfig(source=SOURCE, target=TARGET, selection=ALL, levers=(Lever("key", 5),))


def test_fit_with_levers_end_to_end(tiny_pair, tmp_path):
    """Lags over both caches and a residual MLP fit, save, verify, reload and generate; the lever helps held-out R²."""
    from kvbridge.core.models import load_model
    from kvbridge.core.transfer import Bridge
    from kvbridge.fit import FitConfig, fit_mapper
    from kvbridge.fit.texts import read_texts

    source, target = load_model(tiny_pair[0]), load_model(tiny_pair[1])
    texts = read_texts(tiny_pair[2])
    # every source layer for every map and the lever (the defaults read one: both cases are in the counts below)
    base = dict(num_texts=24, seq_len=48, stride=1, heldout_texts=4, mlp_steps=30, tune_steps=20, top_k=None,
                lever_top_k=None)
    plain = fit_mapper(source, target, texts, FitConfig(**base), progress=False)
    levered = fit_mapper(source, target, texts, FitConfig(**base, lags=(0, 1), lever_inputs="kv", mlp_hidden=8,
                                                          lever_layers=(2,)), progress=False)
    assert [(v.kind, v.layer, v.lags, v.hidden) for v in levered.config.levers] == [("key", 2, (0, 1), 8)]
    report = levered.config.fit["levers"]["key.2"]
    assert report["features"] == 2 * 2 * 2 * 32 and 0 < report["r2_fit_linear"] <= 1
    assert levered.config.fit["key_r2_heldout"][2] > plain.config.fit["key_r2_heldout"][2]
    levered.save_pretrained(tmp_path / "m")
    bridge = Bridge(source, target, Mapper.from_pretrained(str(tmp_path / "m")), chunk_tokens=5)
    out = bridge.generate(["Return a new dictionary initialized from", "The logging module"], max_new_tokens=4)
    assert all(len(t) == 4 for t in out.token_ids)


def test_mlp_levers_stay_float32_when_the_mapper_runs_in_bfloat16():
    m = mapper((Lever("key", 1, lags=(0, 1), inputs=("key", "value"), hidden=5),))
    low = m.to(dtype=torch.bfloat16)
    assert low.weights["key.1.weight"].dtype == torch.bfloat16
    assert all(low.weights[f"key.1.mlp.{n}"].dtype == torch.float32 for n in ("in.weight", "in.bias", "out.weight",
                                                                               "out.bias"))
    keys, values = cache()
    exact, rounded = m.map(keys, values)[0][1], low.map(keys, values)[0][1]
    assert rounded.dtype == torch.bfloat16
    assert torch.allclose(rounded.float(), exact, rtol=0.05, atol=0.3)


STATE = Lever("key", 1, lags=(0, 1), inputs=("key", "value", "state"), hidden=3, state=5)


def test_a_state_lever_reads_the_source_final_hidden_state_after_the_caches_of_each_lag():
    m = mapper((STATE,))
    keys, values = cache(tokens=6)
    state = torch.randn(2, 6, 5, generator=torch.Generator().manual_seed(3))
    mk, mv = m.map(keys, values, state=state)
    w, b = m.weights["key.1.weight"], m.weights["key.1.bias"]
    w1, b1, w2, b2 = (m.weights[f"key.1.mlp.{n}"] for n in ("in.weight", "in.bias", "out.weight", "out.bias"))
    assert w.shape[0] == 2 * (2 * 2 * 8 + 5)
    for t in range(6):
        before = state[:, t - 1] if t else torch.zeros(2, 5)
        x = torch.cat([feats(keys, t), feats(values, t), state[:, t], feats(keys, t - 1), feats(values, t - 1), before],
                      dim=1)
        assert torch.allclose(mk[1][:, 0, t], x @ w + b + F.gelu(x @ w1 + b1) @ w2 + b2, atol=1e-4)
    # layers without the lever ignore the state: the same as a plain mapper with their weights
    plain = mapper()
    same = Mapper(plain.config, {n: m.weights[n] if n in plain.weights and not n.startswith("key.1.") else t
                                 for n, t in plain.weights.items()})
    plain_k, plain_v = same.map(keys, values)  # (GEMM groups differ: equal up to rounding)
    assert torch.allclose(plain_v[0], mv[0], atol=1e-5) and torch.allclose(plain_k[2], mk[2], atol=1e-5)


def test_a_state_lever_without_its_state_is_one_clear_error():
    from kvbridge.errors import InputError

    m = mapper((STATE,))
    keys, values = cache(tokens=6)
    with pytest.raises(InputError, match="final hidden states"):
        m.map(keys, values)
    with pytest.raises(InputError, match=r"\(2, 6, 5\)"):
        m.map(keys, values, state=torch.zeros(2, 6, 4))


@pytest.mark.parametrize("bad", [dict(inputs=("key", "state")), dict(state=5), dict(inputs=("state",), state=5),
                                 dict(inputs=("key", "state"), state=-1)])
def test_state_inputs_and_widths_must_agree(bad):
    with pytest.raises(ArtifactError):
        Lever(**({"kind": "key", "layer": 0} | bad))


def test_a_mapper_that_reads_the_state_is_format_3_and_others_stay_format_2(tmp_path):
    m = mapper((STATE,))
    m.save_pretrained(tmp_path / "v3")
    data = json.loads((tmp_path / "v3" / CONFIG_FILE).read_text())
    assert data["format_version"] == 3 and data["levers"][0]["state"] == 5
    loaded = Mapper.from_pretrained(str(tmp_path / "v3"))
    assert loaded.config == m.config and loaded.config.reads_state
    mapper((Lever("key", 1, inputs=("key", "value")),)).save_pretrained(tmp_path / "v2")
    assert json.loads((tmp_path / "v2" / CONFIG_FILE).read_text())["format_version"] == 2
    from kvbridge.core.schema import validate

    data["format_version"] = 2  # a state lever in a version-2 file: an edit, refused by name
    with pytest.raises(ArtifactError, match=r"levers\[0\] reads the source's state"):
        validate(data)


def test_fit_with_the_state_lever_end_to_end(tiny_pair, tmp_path):
    """--lever-inputs kvs: fitted, saved, reloaded; chunked maps equal whole ones; every recompute criterion runs;
    the surprisal computed from the state equals the one from the model's own logits."""
    from kvbridge.core.models import cache_kv, load_model, logits_from_hidden, prefill
    from kvbridge.core.recompute import surprisal
    from kvbridge.core.transfer import Bridge
    from kvbridge.fit import FitConfig, fit_mapper
    from kvbridge.fit.texts import read_texts

    source, target = load_model(tiny_pair[0]), load_model(tiny_pair[1])
    texts = read_texts(tiny_pair[2])
    base = dict(num_texts=24, seq_len=48, stride=1, heldout_texts=4, lags=(0, 1), mlp_hidden=8, mlp_steps=30,
                lever_layers=(2,), tune_steps=20, top_k=None, lever_top_k=None)  # every source layer
    kv = fit_mapper(source, target, texts, FitConfig(**base, lever_inputs="kv"), progress=False)
    kvs = fit_mapper(source, target, texts, FitConfig(**base, lever_inputs="kvs"), progress=False)
    (lever,) = kvs.config.levers
    assert lever.inputs == ("key", "value", "state") and lever.state == 48
    assert kvs.config.fit["levers"]["key.2"]["features"] == 2 * (2 * 2 * 32 + 48)
    assert all(0 < m.config.fit["key_r2_heldout"][2] <= 1 for m in (kv, kvs))
    kvs.save_pretrained(tmp_path / "m")
    loaded = Mapper.from_pretrained(str(tmp_path / "m"))
    whole, chunked = Bridge(source, target, loaded), Bridge(source, target, loaded, chunk_tokens=5)
    ids, mask = whole.pad([[5, 9, 13, 7, 21, 30, 8, 11, 40, 3, 17, 19], [6, 12, 14, 25, 9, 2, 33]])
    a, b = cache_kv(whole.mapped_cache(ids, mask)), cache_kv(chunked.mapped_cache(ids, mask))
    assert all(torch.allclose(x, y, atol=1e-5) for xs, ys in zip(a, b) for x, y in zip(xs, ys))
    for by in ("logit", "surprisal", "bigram", "random"):
        assert Bridge(source, target, loaded, recompute=0.2, recompute_by=by).score_ids([[5, 9, 13, 7, 21]], [[30]])
    _, hidden = prefill(source.model, ids, mask, logits="hidden")
    _, logits = prefill(source.model, ids, mask, logits="all")
    assert torch.allclose(surprisal(logits_from_hidden(source.model, hidden), ids), surprisal(logits, ids), atol=1e-5)


def test_state_widths_must_agree_with_each_other_and_with_the_source():
    from kvbridge import family
    from kvbridge.core.transfer import Bridge
    from kvbridge.errors import CompatibilityError, InputError

    other = Lever("value", 0, inputs=("key", "state"), state=6)
    with pytest.raises(ArtifactError, match=r"different widths \[5, 6\]"):
        MapperConfig(source=SOURCE, target=TARGET, selection=ALL, levers=(STATE, other))
    source, target = family.load_family()  # hidden size 160, not the 5 the mapper reads
    with pytest.raises(CompatibilityError, match="5 features; this source's is 160"):
        Bridge(source, target, mapper((STATE,)))
    with pytest.raises(InputError, match="unknown Bridge option.*hold_bak"):  # before any path is looked at
        Bridge.from_pretrained("/nonexistent/s", "/nonexistent/t", "/nonexistent/m", hold_bak=4)


def test_random_recompute_control_is_seeded_by_the_prompt():
    from kvbridge.core.recompute import random_scores

    ids = torch.tensor([[5, 9, 13, 7, 21], [5, 9, 13, 7, 21], [6, 9, 13, 7, 21]])
    scores = random_scores(ids)
    assert scores.shape == ids.shape and bool(((scores >= 0) & (scores < 1)).all())
    assert torch.equal(scores[0], scores[1]) and not torch.equal(scores[0], scores[2])
    padded = torch.tensor([[0, 0, 6, 9, 13, 7, 21]])  # the third prompt left-padded in a longer batch
    mask = torch.tensor([[0, 0, 1, 1, 1, 1, 1]])
    assert torch.equal(random_scores(padded, mask)[0, 2:], scores[2]) and not random_scores(padded, mask)[0, :2].any()
