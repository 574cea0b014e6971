"""Statistics and the closed-form fit on synthetic caches with a planted affine relation."""

import pytest
import torch
from conftest import model_info

from kvbridge.core.mapper import Mapper, layer_features
from kvbridge.core.mapper_config import MapperConfig
from kvbridge.core.rope import RopeSpec, apply_rope, remove_rope
from kvbridge.errors import FitError, InputError
from kvbridge.fit import FitConfig, solve
from kvbridge.fit.stats import CalibrationStats, KVStats

# source: 4 layers × 2 heads × 8 dims; target: 3 layers × 3 heads × 8 dims (different depth and heads)
LS, HS, LT, HT, D = 4, 2, 3, 3, 8
PLANTED = ((0, 2), (1, 3), (2, 3))  # target layer l is an affine function of these source layers


def info(layers, heads, theta):
    rope = RopeSpec("ministral3", "default", D, {"rope_theta": theta})
    return model_info("synthetic", layers, heads, D, rope=rope, architecture="Synthetic")


def cos_sin(theta: float, tokens: int):
    """Plain RoPE factors (B=1, T, D), only to make synthetic 'cached' keys."""
    inv = 1.0 / theta ** (torch.arange(0, D, 2, dtype=torch.float64) / D)
    freqs = torch.arange(tokens, dtype=torch.float64)[:, None] * inv
    emb = torch.cat([freqs, freqs], -1)[None]
    return emb.cos().float(), emb.sin().float()


class Planted:
    """Source caches with independent layers; target content = planted affine map of selected source layers."""

    def __init__(self, seed=0):
        g = torch.Generator().manual_seed(seed)
        fs, ft = HS * D, HT * D
        self.maps = {kind: [(torch.randn(2 * fs, ft, generator=g) / 4, torch.randn(ft, generator=g))
                            for _ in range(LT)] for kind in ("key", "value")}
        self.mix = torch.randn(fs, fs, generator=g) / 4 + torch.eye(fs)  # correlated features within a layer

    def sample(self, tokens, seed):
        g = torch.Generator().manual_seed(seed)
        out = {}
        for kind in ("key", "value"):
            src = [(torch.randn(1, tokens, HS * D, generator=g) @ self.mix).view(1, tokens, HS, D).transpose(1, 2)
                   for _ in range(LS)]  # content, (1, Hs, T, D)
            x = layer_features(src)  # (1, T, Ls, Fs)
            tgt = []
            for l, (w, b) in enumerate(self.maps[kind]):
                y = x[:, :, list(PLANTED[l])].flatten(2) @ w + b  # (1, T, Ft)
                tgt.append(y.view(1, tokens, HT, D).transpose(1, 2))
            out[kind] = (src, tgt)
        return out


def accumulate(planted, seeds, tokens=256, stride=1):
    stats = CalibrationStats(key=KVStats(LS * HS * D, LT * HT * D), value=KVStats(LS * HS * D, LT * HT * D))
    s_cos, s_sin = cos_sin(10000.0, tokens)
    for seed in seeds:
        data = planted.sample(tokens, seed)
        for kind in ("key", "value"):
            src, tgt = data[kind]
            if kind == "key":  # go through a rotated cache and back, as at runtime
                src = [remove_rope(apply_rope(k, s_cos, s_sin), s_cos, s_sin) for k in src]
            x = layer_features(src)[:, ::stride].flatten(0, 1).flatten(1)
            y = layer_features(tgt)[:, ::stride].flatten(0, 1).flatten(1)
            getattr(stats, kind).update(x, y)
    return stats


def test_merge_of_halves_equals_one_pass():
    g = torch.Generator().manual_seed(3)
    x = torch.randn(1000, 12, generator=g, dtype=torch.float64) * 5 + 100  # offset: centering matters
    y = (x[:, :5] @ torch.randn(5, 7, generator=g, dtype=torch.float64)
         + torch.randn(1000, 7, generator=g, dtype=torch.float64))
    one = KVStats(12, 7)
    one.update(x, y)
    a, b = KVStats(12, 7), KVStats(12, 7)
    for start in range(0, 600, 150):
        a.update(x[start:start + 150], y[start:start + 150])
    b.update(x[600:], y[600:])
    merged = a.merge(b)
    assert merged.n == one.n == 1000
    for name in ("mean_x", "mean_y", "gram", "cross", "ssq_y"):
        ref = getattr(one, name)
        assert torch.allclose(getattr(merged, name), ref, rtol=1e-12, atol=1e-9 * ref.abs().max()), name
    xc = x - x.mean(0)
    assert torch.allclose(one.gram, xc.T @ xc, rtol=1e-10)


def test_planted_affine_relation_is_recovered():
    planted = Planted()
    stats = accumulate(planted, seeds=range(4), stride=2)
    source, target = info(LS, HS, 10000.0), info(LT, HT, 500000.0)
    weights, selection, report = solve(stats, source, target, top_k=2, ridge=1e-6)
    for kind in ("key", "value"):
        assert selection[kind] == PLANTED
        assert min(report[kind]["r2_fit"]) > 0.999
    mapper = Mapper(MapperConfig(source=source, target=target, selection=selection), weights)
    # held out: fresh tokens, keys through source RoPE → content → map → target RoPE (other base)
    data = planted.sample(128, seed=99)
    s_cos, s_sin = cos_sin(10000.0, 128)
    t_cos, t_sin = cos_sin(500000.0, 128)
    cached = [apply_rope(k, s_cos, s_sin) for k in data["key"][0]]
    mk, mv = mapper.map([remove_rope(k, s_cos, s_sin) for k in cached], data["value"][0])
    for mapped, true in ((mk, data["key"][1]), (mv, data["value"][1])):
        for l in range(LT):
            if mapped is mk:
                mapped_l, true_l = apply_rope(mapped[l], t_cos, t_sin), apply_rope(true[l], t_cos, t_sin)
            else:
                mapped_l, true_l = mapped[l], true[l]
            sse = ((mapped_l - true_l) ** 2).sum()
            sst = ((true_l - true_l.mean(dim=2, keepdim=True)) ** 2).sum()
            assert 1 - sse / sst > 0.999


def test_top_k_all_uses_every_layer_and_one_gemm():
    stats = accumulate(Planted(), seeds=range(2))
    source, target = info(LS, HS, 10000.0), info(LT, HT, 500000.0)
    weights, selection, _ = solve(stats, source, target, top_k=None, ridge=0.01)
    assert all(s == tuple(range(LS)) for s in selection["key"])
    mapper = Mapper(MapperConfig(source=source, target=target, selection=selection), weights)
    assert len(mapper.groups["key"]) == 1 and mapper.groups["key"][0].sources is None


def test_singular_gram_does_not_produce_nan():
    """Duplicated source features and ridge 0: the solve raises λ until Cholesky succeeds."""
    stats = KVStats(4, 2)
    x = torch.randn(100, 2, dtype=torch.float64)
    stats.update(torch.cat([x, x], 1), x @ torch.ones(2, 2, dtype=torch.float64))
    cal = CalibrationStats(key=stats, value=stats)
    src = model_info("s", 1, 1, 4, max_positions=64, architecture="S", tokenizer="t")
    tgt = model_info("t", 1, 1, 2, max_positions=64, architecture="T", tokenizer="t")
    weights, _, report = solve(cal, src, tgt, top_k=None, ridge=0.0)
    assert all(torch.isfinite(w).all() for w in weights.values())
    assert report["key"]["ridge_used"][0] > 0
    assert report["key"]["r2_fit"][0] > 0.999


def test_non_finite_statistics_raise_a_clear_error():
    stats = KVStats(2, 1)
    stats.update(torch.tensor([[1.0, float("nan")], [2.0, 3.0]]), torch.tensor([[1.0], [2.0]]))
    cal = CalibrationStats(key=stats, value=stats)
    src = model_info("s", 1, 1, 2, max_positions=64, architecture="S", tokenizer="t")
    tgt = model_info("t", 1, 1, 1, max_positions=64, architecture="T", tokenizer="t")
    with pytest.raises(FitError, match="NaN"):
        solve(cal, src, tgt, top_k=None, ridge=0.01)


def test_fit_config_validates():
    with pytest.raises(InputError, match="stride"):
        FitConfig(seq_len=16, stride=32)
    with pytest.raises(InputError, match="ridge"):
        FitConfig(ridge=-1)


def test_weighted_statistics_equal_repeated_observations():
    """Integer weights give exactly the statistics of the rows repeated that many times (attention weighting)."""
    g = torch.Generator().manual_seed(5)
    x = torch.randn(60, 5, generator=g, dtype=torch.float64) + 3
    y = torch.randn(60, 2, generator=g, dtype=torch.float64)
    w = torch.randint(1, 5, (60,), generator=g)
    weighted, repeated = KVStats(5, 2), KVStats(5, 2)
    weighted.update(x[:30], y[:30], w[:30].double())
    weighted.update(x[30:], y[30:], w[30:].double())
    repeated.update(x.repeat_interleave(w, 0), y.repeat_interleave(w, 0))
    assert weighted.n == repeated.n
    for name in ("mean_x", "mean_y", "gram", "cross", "ssq_y"):
        assert torch.allclose(getattr(weighted, name), getattr(repeated, name), rtol=1e-10, atol=1e-9), name


def test_blocked_products_and_buffered_updates_equal_one_product():
    """Blocks smaller than the features (and not dividing them) and a buffer that flushes mid-batch change
    nothing but rounding: the accelerator never needs a Gram-sized tensor."""
    from kvbridge.fit.stats import ObservationBuffer

    g = torch.Generator().manual_seed(7)
    x = torch.randn(90, 11, generator=g, dtype=torch.float64) * 3 + 50
    y = x[:, :4] @ torch.randn(4, 6, generator=g, dtype=torch.float64) + torch.randn(90, 6, generator=g,
                                                                                     dtype=torch.float64)
    w = torch.rand(90, generator=g, dtype=torch.float64) + 0.5
    whole, blocked, buffered = KVStats(11, 6, block=1 << 20), KVStats(11, 6, block=3), KVStats(11, 6, block=4)
    whole.update(x, y, w)
    blocked.update(x, y, w)
    ref = KVStats(11, 6)
    ref.update(x, y)
    buffer = ObservationBuffer(buffered, rows=25)
    for start in range(0, 90, 20):  # 20-row batches into a 25-row buffer
        buffer.add(x[start:start + 20], y[start:start + 20])
    assert buffer.held == 15
    buffer.close()
    for name in ("mean_x", "mean_y", "gram", "cross", "ssq_y"):
        assert torch.allclose(getattr(blocked, name), getattr(whole, name), rtol=1e-11, atol=1e-8), name
        assert torch.allclose(getattr(buffered, name), getattr(ref, name), rtol=1e-11, atol=1e-8), name
    assert buffered.n == 90


def test_r2_from_the_factor_equals_r2_from_the_gram():
    """R² = 1 − SSE/SST with SSE computed from G explicitly, and from (G + λI)W = C as the solve does."""
    from kvbridge.fit.stats import ridge_factor

    g = torch.Generator().manual_seed(8)
    x = torch.randn(200, 9, generator=g, dtype=torch.float64)
    y = x @ torch.randn(9, 4, generator=g, dtype=torch.float64) + torch.randn(200, 4, generator=g, dtype=torch.float64)
    s = KVStats(9, 4)
    s.update(x, y)
    before = s.gram.clone()
    f = ridge_factor(s.gram, 0.3)
    w = f.solve(s.cross)
    sst = s.ssq_y.sum()
    sse = sst - 2 * (w * s.cross).sum() + (w * (s.gram @ w)).sum()
    assert f.r2(w, s.cross, sst) == pytest.approx(float(1 - sse / sst), rel=1e-10)
    assert torch.equal(s.gram, before) and f.relative == 0.3  # the statistics are not changed by the factor
