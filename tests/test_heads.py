"""Head-blocked (head-matched) maps: the runtime against a block-diagonal formula, the fit's exact case, the format."""

from __future__ import annotations

import json
import shutil
from dataclasses import replace

import pytest
import torch
from conftest import TINY_FIT, mapped

from kvbridge import Mapper
from kvbridge.core.artifact import CHECKSUMS_FILE, CONFIG_FILE, WEIGHTS_FILE
from kvbridge.core.hashing import sha256_file
from kvbridge.core.mapper import check_mapper
from kvbridge.core.mapper_config import KINDS, MapperConfig
from kvbridge.errors import ArtifactError, InputError
from kvbridge.fit import FitConfig, fit_mapper
from kvbridge.measure.bench import map_flops


@pytest.fixture(scope="module")
def blocked(tiny_models):
    torch.manual_seed(0)
    return fit_mapper(*tiny_models, FitConfig(**TINY_FIT, head_blocks=2, top_k=None), progress=False)  # every layer


def block_diagonal(weight: torch.Tensor, sources: tuple[int, ...], source_heads: int, head_dim: int,
                   target_features: int) -> torch.Tensor:
    """The dense (F_in, Ft) map a head-blocked weight (n, F_in / n, Ft / n) stands for, from the layout's
    definition: input row (source layer s, head h, dim d) = s·Hs·D + h·D + d; block g holds heads
    [g·Hs/n, (g+1)·Hs/n) of each selected layer, layer by layer, and the target's g-th run of Ft / n outputs."""
    n = weight.shape[0]
    per = source_heads // n
    dense = torch.zeros(len(sources) * source_heads * head_dim, target_features)
    width = target_features // n
    for g in range(n):
        rows = [s * source_heads * head_dim + h * head_dim + d
                for s in range(len(sources)) for h in range(g * per, (g + 1) * per) for d in range(head_dim)]
        dense[rows, g * width : (g + 1) * width] = weight[g]
    return dense


def test_a_head_blocked_map_is_its_block_diagonal_full_map(tiny_models, blocked):
    source = tiny_models[0]
    config = blocked.config
    assert config.heads and config.levers  # the lever's layer keeps its full map, the others are blocked
    lever_layers = {v.layer for v in config.levers}
    assert all(config.blocks(k, l) == (1 if l in lever_layers else 2) for k in KINDS for l in range(3))
    dense = Mapper(replace(config, heads={}), _dense(blocked))
    ids = torch.randint(4, 300, (2, 40))
    for a, b in zip(sum(mapped(dense, source, ids), []), sum(mapped(blocked, source, ids), [])):
        torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-4)
    full = map_flops(dense, 1)
    saved = sum(2 * config.features(k, l).width(config.source.kv_features) * config.target.kv_features / 2
                for k in KINDS for l in range(3) if config.blocks(k, l) > 1)
    assert map_flops(blocked, 1) == pytest.approx(full - saved)  # a blocked layer costs 1/n of its full map


@pytest.mark.parametrize("role, blocks", [(0, 2), (1, 2), (1, 4)])  # 1 head a block (source), 2 and 1 (target)
def test_head_matched_fit_recovers_a_map_that_is_head_matched(tiny_models, role, blocks):
    """Exact case: a model mapped onto itself is head-matched (head h → head h), so head blocks lose nothing:
    held-out R² of the head-blocked map, measured through the run-time map, is near 1 and no worse than the full
    map's (a grouping of heads in the fit that the run time did not share would lose most of it)."""
    model, texts = tiny_models[role], tiny_models[2]
    torch.manual_seed(0)
    plain = dict(TINY_FIT, lags=(0,), lever_inputs="same", mlp_hidden=0)
    full = fit_mapper(model, model, texts, FitConfig(**plain), progress=False)
    matched = fit_mapper(model, model, texts, FitConfig(**plain, head_blocks=blocks), progress=False)
    assert matched.config.heads == {k: (blocks,) * model.info.num_layers for k in KINDS}
    for kind in KINDS:
        for a, b in zip(full.config.fit[f"{kind}_r2_heldout"], matched.config.fit[f"{kind}_r2_heldout"]):
            assert b > 0.98 and b > a - 2e-3  # nothing lost (fewer weights can even generalize a little better)


def test_a_head_blocked_map_round_trips_and_its_fields_are_checked(tiny_models, blocked, tmp_path):
    blocked.save_pretrained(tmp_path / "m")
    data = json.loads((tmp_path / "m" / "mapper.json").read_text())
    assert data["format_version"] == 5 and data["heads"] == {k: list(v) for k, v in blocked.config.heads.items()}
    assert data["fit"]["settings"]["head_blocks"] == 2
    loaded = Mapper.from_pretrained(str(tmp_path / "m"))
    ids = torch.randint(4, 300, (1, 30))
    for a, b in zip(sum(mapped(blocked, tiny_models[0], ids), []), sum(mapped(loaded, tiny_models[0], ids), [])):
        assert torch.equal(a, b)
    half = Mapper.from_pretrained(str(tmp_path / "m"), dtype=torch.bfloat16)
    assert mapped(half, tiny_models[0], ids)[0][0].dtype == torch.bfloat16
    with pytest.raises(ArtifactError, match="version 5"):
        MapperConfig.from_dict(dict(data, format_version=4))
    lever = blocked.config.levers[0]
    on_lever = {k: [2 if (k == lever.kind and l == lever.layer) else n for l, n in enumerate(v)]
                for k, v in data["heads"].items()}
    for bad in (on_lever, {k: [3] * 3 for k in KINDS}, {k: [0] * 3 for k in KINDS}):
        with pytest.raises(ArtifactError):
            MapperConfig.from_dict(dict(data, heads=bad))
    # heads decide what the weights compute: an edit with resealed checksums still fails verification
    edited = tmp_path / "edited"
    shutil.copytree(tmp_path / "m", edited)
    data["heads"] = {k: [1 if n == 2 else n for n in v] for k, v in data["heads"].items()}
    (edited / CONFIG_FILE).write_text(json.dumps(data))
    (edited / CHECKSUMS_FILE).write_text("".join(f"{sha256_file(edited / n)}  {n}\n"
                                                 for n in (CONFIG_FILE, WEIGHTS_FILE)))
    assert check_mapper(edited)
    with pytest.raises(ArtifactError):
        Mapper.from_pretrained(str(edited))


def test_head_block_options_are_checked(tiny_models):
    for bad in (dict(head_blocks=1), dict(head_blocks=2, rank=4), dict(head_blocks=2, rank_flops=0.5),
                dict(head_blocks="2")):
        with pytest.raises(InputError):
            FitConfig(**bad)
    with pytest.raises(InputError, match="divide both models' KV heads"):  # 2 and 4 KV heads: 4 does not divide 2
        fit_mapper(*tiny_models, FitConfig(**TINY_FIT, head_blocks=4), progress=False)


def test_plan_arithmetic_prices_head_blocks_at_the_real_geometry(tiny_models, blocked):
    """A head-blocked map costs 1/n of the full one at the Ministral-3 geometry too, and the frontier's real-geometry
    limit of a head-blocked point is the plan's for the same blocks (a head-matched one: one block per head there)."""
    from kvbridge.core.transfer import Bridge
    from kvbridge.measure.bench import path_flops, prefill_flops
    from kvbridge.measure.bench_real import _published_infos, published_config
    from kvbridge.measure.frontier import real_flop_limit

    infos, configs = _published_infos()
    pair = infos["ministral3-3b-text"], infos["ministral3-8b-text"]
    plain, matched = published_config(*pair, levers=False), published_config(*pair, levers=False, head_blocks=8)
    assert map_flops(matched, 1) == pytest.approx(map_flops(plain, 1) / 8)
    bridge = Bridge(tiny_models[0], tiny_models[1], blocked)
    real = published_config(*pair, levers=True, source_hidden=configs["ministral3-3b-text"].hidden_size,
                            head_blocks=2)  # 2 of the tiny source's 2 heads, but not of the target's 4: 2 blocks
    src, tgt = configs["ministral3-3b-text"], configs["ministral3-8b-text"]
    expected = prefill_flops(tgt, 1024, 1) / path_flops(src, tgt, real, 1024, bridge.hold_back, bridge.recompute,
                                                        bridge.sink, bridge.recompute_by)
    assert real_flop_limit(bridge, 1024) == pytest.approx(expected)
    full = Mapper(replace(blocked.config, heads={}), _dense(blocked))
    assert expected > real_flop_limit(Bridge(tiny_models[0], tiny_models[1], full), 1024)


def _dense(mapper):
    weights = dict(mapper.weights)
    c = mapper.config
    for kind in KINDS:
        for layer in range(c.target.num_layers):
            if c.blocks(kind, layer) > 1:
                weights[f"{kind}.{layer}.weight"] = block_diagonal(
                    weights[f"{kind}.{layer}.weight"], c.selection[kind][layer], c.source.num_kv_heads,
                    c.source.head_dim, c.target.kv_features)
    return weights


def test_fit_command_writes_a_head_matched_map_and_refuses_blocks_that_do_not_divide(tiny_pair, tmp_path, capsys):
    from conftest import FAST_FIT

    from kvbridge.cli import main

    source, target, texts = tiny_pair
    args = ["fit", "--source", source, "--target", target, "--texts", texts, *FAST_FIT]
    assert main([*args, "--head-blocks", "4", "--out", str(tmp_path / "bad")]) != 0
    err = capsys.readouterr().err
    assert "divide both models' KV heads" in err and "Traceback" not in err and not (tmp_path / "bad").exists()
    assert main([*args, "--head-blocks", "2", "--out", str(tmp_path / "m")]) == 0
    assert Mapper.from_pretrained(str(tmp_path / "m")).config.heads
