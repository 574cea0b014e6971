"""The GPU fast paths, checked on CPU: the mapped path can be recorded as a CUDA graph (it reads no device value on
the host), graph plumbing and the fused and low-precision map give the eager results, statistics on the device."""

import pytest
import torch

from kvbridge.core import graphs, rope
from kvbridge.core.transfer import Bridge, content_features, map_source_cache, token_major
from kvbridge.errors import InputError
from kvbridge.measure.bench_real import build, random_mapper


@pytest.fixture(scope="module")
def tiny_pair():
    torch.manual_seed(0)
    return build("ministral3-3b-text", "cpu", torch.float32, True), build("ministral3-8b-text", "cpu", torch.float32,
                                                                          True)


@pytest.mark.parametrize("levers", [False, True])
def test_the_mapped_path_reads_nothing_back_while_a_graph_records(tiny_pair, levers):
    """Under a graph's rules (any host read of a device value raises) the whole time-to-first-token path of an
    unpadded batch runs — kvbridge fit's levers included, with a selective recompute by the source's logits —
    and gives exactly the eager logits; a padded-batch read is caught."""
    source, target = tiny_pair
    runtime = dict(hold_back=1, recompute=0.04) if levers else {}  # 48-token prompts: one token held back
    bridge = Bridge(source, target, random_mapper(source, target, "cpu", torch.float32, levers=levers), **runtime)
    assert (bridge.recompute > 0) == levers
    ids = torch.randint(12, 500, (2, 48), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    eager = {mode: bridge.first_token_logits(ids, mask, mode)[1] for mode in ("native", "mapped")}
    with graphs.unpadded(), graphs.capture_rules():
        recorded = {mode: bridge.first_token_logits(ids, mask, mode)[1] for mode in eager}
    assert all(torch.equal(recorded[mode], eager[mode]) for mode in eager)
    with graphs.capture_rules(), pytest.raises(RuntimeError, match="reads a device value on the host"):
        bridge.first_token_logits(ids, mask, "mapped")  # without the promise, the held-back count reads the mask


def test_graph_cache_copies_each_call_into_its_static_inputs_and_says_why_it_runs_eagerly():
    calls = []

    def double(x):
        calls.append(graphs.assumed_unpadded())
        return x * 2

    cache = graphs.GraphCache(double, "cpu", size=1)
    assert torch.equal(cache(torch.tensor([1, 2])), torch.tensor([2, 4]))
    assert torch.equal(cache(torch.tensor([3, 4])), torch.tensor([6, 8]))  # same signature: new values copied in
    assert torch.equal(cache(torch.tensor([[5]])), torch.tensor([[10]]))  # a new signature evicts the old one
    assert all(calls) and len(cache.entries) == 1
    assert cache.reasons() == ["CUDA graphs need a CUDA device, not cpu: run eagerly"]


def test_bridge_cuda_graphs_fall_back_to_eager_off_cuda(tiny_pair):
    source, target = tiny_pair
    mapper = random_mapper(source, target, "cpu", torch.float32, levers=True)
    ids = torch.randint(12, 500, (1, 40), generator=torch.Generator().manual_seed(2))
    mask = torch.ones_like(ids)
    plain = Bridge(source, target, mapper).first_token_logits(ids, mask)[1]
    assert torch.equal(Bridge(source, target, mapper, cuda_graphs=True).first_token_logits(ids, mask)[1], plain)
    with pytest.raises(InputError, match="cuda_graphs"):
        Bridge(source, target, mapper, cuda_graphs="yes")


def test_the_fused_rotation_equals_the_eager_one_on_any_layout():
    """rotate_cast_ compiled (inductor on CPU here) against the float32 eager path: from one buffer's slice into
    another's (in place, the eager path), and from a permuted cache view into another tensor."""
    g = torch.Generator().manual_seed(3)
    c, s = (torch.randn(32, 1, 1, 1, 16, generator=g) for _ in range(2))
    base = torch.randn(2, 32, 1, 3, 2, 16, generator=g).to(torch.bfloat16)
    source = torch.randn(1, 2, 32, 16, generator=g).to(torch.bfloat16)
    results = {}
    try:
        for fused in (False, True):
            rope.fuse(fused)
            buffer = base.clone()
            rope.rotate_cast_(buffer[0], base[0], c, s)
            rope.rotate_cast_(buffer[1], buffer[1], c, s)
            out = torch.empty(32, 1, 2, 16, dtype=torch.bfloat16)
            rope.rotate_cast_(out, source.permute(2, 0, 1, 3), c[:, :, 0], s[:, :, 0])
            results[fused] = (buffer, out)
        assert rope.fuse_failure() is None
    finally:
        rope.fuse(None)
    for eager, fused in zip(results[False], results[True]):
        assert (eager.float() - fused.float()).abs().max() <= 1e-2 * eager.float().abs().max()
    assert not torch.equal(results[True][0][1], base[1])


def test_low_precision_features_are_the_float32_ones_rounded(tiny_pair):
    """The map's input in bfloat16 (each layer's keys rotated on their way into the buffer) against the float32
    path's buffer cast: the same values to bfloat16 rounding."""
    source, _ = tiny_pair
    ids = torch.randint(12, 500, (1, 24), generator=torch.Generator().manual_seed(4))
    mask = torch.ones_like(ids)
    from kvbridge.core.models import cache_kv, positions_from_mask, prefill
    from kvbridge.core.rope import rope_factors

    keys, values = cache_kv(prefill(source.model, ids, mask, logits="none")[0])
    unrotate = token_major(rope_factors(source.model, positions_from_mask(mask), inverse=True))
    exact = content_features(keys, values, slice(2, 20), [f[2:20] for f in unrotate], torch.float32, "cpu")
    low = content_features(keys, values, slice(2, 20), [f[2:20] for f in unrotate], torch.bfloat16, "cpu")
    assert low.dtype == torch.bfloat16 and torch.equal(low, exact.to(torch.bfloat16))


def test_a_map_gathers_only_the_source_layers_it_reads(tiny_pair):
    """A mapper whose every target layer reads source layer 1 alone maps from that layer's K/V only: the others may
    hold anything."""
    source, target = tiny_pair
    mapper = random_mapper(source, target, "cpu", torch.float32, top_k=1)
    last = source.info.num_layers - 1
    assert mapper.config.read_layers == (last,)
    ids = torch.randint(12, 500, (1, 20), generator=torch.Generator().manual_seed(5))
    from kvbridge.core.models import make_cache, positions_from_mask, prefill

    cache = prefill(source.model, ids, torch.ones_like(ids), logits="none")[0]
    positions = positions_from_mask(torch.ones_like(ids))
    mapped = map_source_cache(source.model, target.model, mapper, cache, positions)
    junk = make_cache(source.model, [torch.full_like(l.keys, float("nan")) if i != last else l.keys
                                     for i, l in enumerate(cache.layers)],
                      [torch.full_like(l.values, float("nan")) if i != last else l.values
                       for i, l in enumerate(cache.layers)])
    again = map_source_cache(source.model, target.model, mapper, junk, positions)
    assert all(torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values) for a, b in zip(mapped.layers,
                                                                                                again.layers))


def test_statistics_go_where_they_are_told():
    from kvbridge.fit.stats import statistics_bytes, totals_device

    assert totals_device("auto", torch.device("cpu"), 8, 8) == torch.device("cpu")
    assert totals_device("device", torch.device("cpu"), 8, 8) == torch.device("cpu")
    assert totals_device("cpu", torch.device("meta"), 8, 8) == torch.device("cpu")
    assert totals_device("device", torch.device("meta"), 8, 8) == torch.device("meta")
    assert totals_device("auto", torch.device("meta"), 8, 8) == torch.device("cpu")  # not CUDA: host memory
    assert statistics_bytes(3, 5) == 2 * 8 * (9 + 15 + 3 + 10)
    with pytest.raises(InputError, match="'auto', 'cpu' or 'device'"):
        totals_device("gpu", torch.device("cpu"), 8, 8)
