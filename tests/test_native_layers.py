"""A transfer that runs only what it reads: the source's prefill stopped at the deepest layer the maps read
(``--source-depth``), and the target's own first layers in place of their maps (``--native-layers``)."""

import json
from dataclasses import replace

import pytest
import torch
from conftest import TINY_FIT

from kvbridge import Mapper
from kvbridge.core.mapper_config import MapperConfig
from kvbridge.core.models import cache_kv, prefill
from kvbridge.core.transfer import Bridge
from kvbridge.errors import ArtifactError, InputError
from kvbridge.fit import FitConfig, fit_mapper
from kvbridge.measure.bench import cache_prefill_flops, path_flops, source_flops


@pytest.fixture(scope="module")
def ids(tiny_models):
    _, target, texts = tiny_models
    return target.tokenizer(texts[0], return_tensors="pt").input_ids[:, :40]


@pytest.fixture(scope="module")
def shallow(tiny_models):
    """A mapper of the tiny pair (2-layer source, 3-layer target) whose maps read the source's first layer only
    and whose target computes its first layer itself."""
    source, target, texts = tiny_models
    torch.manual_seed(0)
    return fit_mapper(source, target, texts, FitConfig(**TINY_FIT, source_depth=1, native_layers=1), progress=False)


def test_a_prefill_stopped_at_a_depth_keeps_those_layers_bit_for_bit(tiny_models, ids):
    _, target, _ = tiny_models
    mask = torch.ones_like(ids)
    full_k, full_v = cache_kv(prefill(target.model, ids, mask, logits="none")[0])
    for depth in (1, 2, 3):
        keys, values = cache_kv(prefill(target.model, ids, mask, logits="none", depth=depth)[0])
        assert len(keys) == len(values) == depth
        assert all(torch.equal(a, b) for a, b in zip(keys + values, full_k[:depth] + full_v[:depth]))
    for depth in (0, 4):
        with pytest.raises(InputError, match="decoder layers"):
            prefill(target.model, ids, mask, logits="none", depth=depth)
    with pytest.raises(InputError, match="logits='none'"):
        prefill(target.model, ids, mask, logits="last", depth=1)


def test_the_fit_keeps_to_the_source_depth_and_records_the_native_layers(shallow, tmp_path):
    config = shallow.config
    assert all(chosen == (0,) for kind in config.selection for chosen in config.selection[kind])
    assert config.source_depth == 1 and config.runtime.native_layers == 1
    assert all(v.layer >= 1 for v in config.levers)  # a native layer needs no lever
    assert config.fit["settings"]["source_depth"] == 1 and config.fit["settings"]["native_layers"] == 1
    shallow.save_pretrained(tmp_path / "m")
    assert Mapper.from_pretrained(tmp_path / "m").config.runtime.native_layers == 1
    # a mapper.json that asks the target to compute every layer itself (or more) is refused
    meta = json.loads((tmp_path / "m" / "mapper.json").read_text())
    meta["runtime"]["native_layers"] = 3
    with pytest.raises(ArtifactError, match="native_layers is 3"):
        MapperConfig.from_dict(meta)


def test_older_artifacts_map_every_layer(fast_mapper):
    meta = json.loads((fast_mapper / "mapper.json").read_text())
    assert "native_layers" not in meta["runtime"] and "native_layers" not in meta["fit"]["settings"]
    assert Mapper.from_pretrained(fast_mapper).config.runtime.native_layers == 0


def test_the_source_runs_only_to_the_deepest_layer_the_maps_read(tiny_models, shallow, ids):
    source, target, _ = tiny_models
    mask = torch.ones_like(ids)
    bridge = Bridge(source, target, shallow, native_layers=0)
    cache, positions, state = bridge.source_prefill(ids, mask)
    assert state is None and len(cache_kv(cache)[0]) == 1 == bridge.source_depth
    full = prefill(source.model, ids, mask, logits="none")[0]  # every layer: the map reads the same one
    a, b = bridge.map_cache(cache, positions), bridge.map_cache(full, positions)
    assert all(torch.equal(x, y) for x, y in zip(sum(cache_kv(a), []), sum(cache_kv(b), [])))
    assert source_flops(source.model.config, shallow, 40) < source_flops(source.model.config,
                                                                       replace(shallow.config, selection={
                                                                           k: ((0, 1),) * 3 for k in ("key", "value")}),
                                                                       40)


@pytest.mark.parametrize("recompute", [0.0, 0.2])
def test_native_layers_are_the_targets_own_and_the_rest_are_mapped(tiny_models, shallow, ids, recompute):
    source, target, _ = tiny_models
    mask = torch.ones_like(ids)
    own_k, own_v = cache_kv(prefill(target.model, ids, mask, logits="none")[0])
    with_native = Bridge(source, target, shallow, recompute=recompute, recompute_by="random")
    assert with_native.native_layers == 1
    mapped_only = Bridge(source, target, shallow, recompute=recompute, recompute_by="random", native_layers=0)
    nk, nv = cache_kv(with_native.mapped_cache(ids, mask))
    mk, mv = cache_kv(mapped_only.mapped_cache(ids, mask))
    torch.testing.assert_close(nk[0], own_k[0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(nv[0], own_v[0], rtol=1e-5, atol=1e-5)
    assert not torch.allclose(mk[0], own_k[0], atol=1e-3)  # the map alone is not exact (else the test proves nothing)
    if recompute == 0:  # the mapped layers are the same maps of the same source cache
        assert all(torch.equal(a, b) for a, b in zip(nk[1:] + nv[1:], mk[1:] + mv[1:]))
    cache, logits = with_native.first_token_logits(ids, mask)
    assert torch.isfinite(logits).all() and cache.get_seq_length() == ids.shape[1]


def test_bad_native_layer_and_depth_settings_are_refused(tiny_models, shallow):
    source, target, texts = tiny_models
    with pytest.raises(InputError, match="at least one must be mapped"):
        Bridge(source, target, shallow, native_layers=3)
    with pytest.raises(InputError, match="native_layers must be an integer"):
        Bridge(source, target, shallow, native_layers=-1)
    with pytest.raises(InputError, match="--native-layers"):
        FitConfig(native_layers=-1)
    with pytest.raises(InputError, match="--source-depth must be at least 1"):
        FitConfig(source_depth=0)
    with pytest.raises(InputError, match="--top-k 2"):
        FitConfig(top_k=2, source_depth=1)
    for settings, message in ((dict(native_layers=3), "--native-layers 3"), (dict(source_depth=3), "--source-depth 3"),
                              (dict(native_layers=2, lever_layers=(1,)), "--lever-layers")):
        with pytest.raises(InputError, match=message):
            fit_mapper(source, target, texts, FitConfig(**TINY_FIT, **settings), progress=False)


def test_the_flop_count_adds_the_native_layers_and_drops_the_unread_source_layers(tiny_models, shallow):
    source, target, _ = tiny_models
    s, t = source.model.config, target.model.config
    with_native = path_flops(s, t, shallow, 100, native_layers=1)
    assert with_native - path_flops(s, t, shallow, 100) == pytest.approx(cache_prefill_flops(t, 99, depth=1))
    assert cache_prefill_flops(t, 99, depth=3) == cache_prefill_flops(t, 99)
    assert source_flops(s, shallow, 99) == cache_prefill_flops(s, 99, depth=1)
