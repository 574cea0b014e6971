"""Reduced-rank maps (kvbridge.fit.rank): the factorization, the held-out curve, the FLOP budget, the format."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch
from conftest import TINY_FIT, mapped

from kvbridge import Mapper
from kvbridge.core.mapper import layer_features
from kvbridge.core.mapper_config import KINDS
from kvbridge.errors import ArtifactError, InputError
from kvbridge.fit import FitConfig, fit_mapper
from kvbridge.measure.bench import map_flops


@pytest.fixture(scope="module")
def full(tiny_models):
    torch.manual_seed(0)
    return fit_mapper(*tiny_models, FitConfig(**TINY_FIT, top_k=None), progress=False)  # every source layer



def test_a_factored_map_at_full_rank_is_the_full_map(tiny_models, full):
    """D U = W V Vᵀ = W when V is the whole eigenbasis, and the projected bias is the bias."""
    from kvbridge.fit import rank as reduced

    source, target, texts = tiny_models
    pairs = reduced.factorable(full.config.levers, full.config.target.num_layers)
    assert pairs and all((kind, layer) not in {(v.kind, v.layer) for v in full.config.levers} for kind, layer in pairs)
    ft = full.config.target.kv_features
    g = torch.Generator().manual_seed(0)
    found = {key: reduced.Basis(torch.linalg.qr(torch.randn(ft, ft, generator=g, dtype=torch.float64))[0],
                                torch.ones(ft), torch.randn(ft, generator=g, dtype=torch.float64), 0)
             for key in pairs}
    ranks = {key: ft for key in pairs}
    weights = reduced.factor({n: t.clone() for n, t in full.weights.items()}, found, ranks)
    config = replace(full.config, ranks={k: tuple(ranks.get((k, l), 0) for l in range(3)) for k in KINDS})
    factored = Mapper(config, weights)
    ids = torch.randint(4, 300, (2, 40))
    for a, b in zip(sum(mapped(full, source, ids), []), sum(mapped(factored, source, ids), [])):
        torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-4)


def test_rank_choice_measures_what_the_mapper_does_and_keeps_its_budget(tiny_models, full):
    torch.manual_seed(0)
    m = fit_mapper(*tiny_models, FitConfig(**TINY_FIT, rank_flops=0.3, top_k=None), progress=False)  # as `full`
    choice = m.config.fit["rank_choice"]
    assert choice["criterion"] == "held-out" and m.config.factored
    for kind in KINDS:  # the curve's R² at the chosen rank is the R² the mapper's own hot path measures held out
        for layer, r2 in enumerate(m.config.fit[f"{kind}_r2_heldout"]):
            if f"{kind}.{layer}" in choice["layers"]:
                assert choice["layers"][f"{kind}.{layer}"]["r2"] == pytest.approx(r2, abs=1e-6)
                assert choice["layers"][f"{kind}.{layer}"]["r2_full"] == pytest.approx(
                    full.config.fit[f"{kind}_r2_heldout"][layer], abs=1e-6)
    plain = [f"{k}.{l}" for k in KINDS for l in range(3) if m.config.rank(k, l)]
    spent = sum(s[0] * s[1] for n, s in m.config.weight_shapes().items()
                if n.rsplit(".", 2)[0] in plain and n.endswith(".weight"))
    whole = sum(s[0] * s[1] for n, s in full.config.weight_shapes().items()
                if n.endswith(".weight") and f"{n.split('.')[0]}.{n.split('.')[1]}" in choice["layers"])
    assert spent <= 0.3 * whole and map_flops(m, 1) < map_flops(full, 1)


def test_a_fixed_rank_round_trips_and_older_formats_refuse_it(tiny_models, tmp_path):
    torch.manual_seed(0)
    m = fit_mapper(*tiny_models, FitConfig(**TINY_FIT, rank=4), progress=False)
    assert all(r in (0, 4) for r in m.config.ranks["key"]) and any(m.config.ranks["key"])
    m.save_pretrained(tmp_path / "m")
    data = json.loads((tmp_path / "m" / "mapper.json").read_text())
    assert data["format_version"] == 4 and data["ranks"] == {k: list(v) for k, v in m.config.ranks.items()}
    loaded = Mapper.from_pretrained(str(tmp_path / "m"))
    ids = torch.randint(4, 300, (1, 30))
    for a, b in zip(sum(mapped(m, tiny_models[0], ids), []), sum(mapped(loaded, tiny_models[0], ids), [])):
        assert torch.equal(a, b)
    half = Mapper.from_pretrained(str(tmp_path / "m"), dtype=torch.bfloat16)
    assert half.dtype == torch.bfloat16 and layer_features(mapped(half, tiny_models[0], ids)[0]).dtype == torch.bfloat16
    from kvbridge.core.mapper_config import MapperConfig

    old = dict(data, format_version=3)
    with pytest.raises(ArtifactError, match="version 4"):
        MapperConfig.from_dict(old)
    lever = m.config.levers[0]
    bad = {k: [4 if (k == lever.kind and l == lever.layer) else r for l, r in enumerate(v)]
           for k, v in data["ranks"].items()}
    with pytest.raises(ArtifactError, match="where a lever is"):
        MapperConfig.from_dict(dict(data, ranks=bad))


def test_rank_options_are_checked():
    for bad in (dict(rank=0), dict(rank_flops=1.5), dict(rank_flops=0), dict(rank=4, rank_flops=0.5),
                dict(rank="4"), dict(rank_flops=True)):
        with pytest.raises(InputError):
            FitConfig(**bad)


def test_a_budget_below_rank_one_is_refused_and_in_sample_curves_are_r2(tiny_models):
    torch.manual_seed(0)
    with pytest.raises(InputError, match="rank 1 in every factorable layer"):
        fit_mapper(*tiny_models, FitConfig(**TINY_FIT, rank_flops=0.001), progress=False)
    m = fit_mapper(*tiny_models, FitConfig(**dict(TINY_FIT, heldout_texts=0), rank_flops=0.3), progress=False)
    choice = m.config.fit["rank_choice"]
    assert choice["criterion"] == "in-sample" and 0 < choice["flops_share"] <= 0.3
    for layer in choice["layers"].values():  # the fit's R² of the full map, not a curve normalized to end at 1
        assert 0 < layer["r2"] <= layer["r2_full"] < 1
