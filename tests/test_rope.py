"""Content space: RoPE removal ∘ application is the identity, using each model's own rotary module."""

import pytest
import torch

from kvbridge.core.models import cache_kv, positions_from_mask, prefill
from kvbridge.core.rope import apply_rope, remove_rope, rope_factors, rope_spec, rotary_factors, rotation, unrotation
from kvbridge.errors import UnsupportedModelError

ROPES = {
    "default": {"rope_type": "default", "rope_theta": 10000.0},
    "linear": {"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0},
    "dynamic": {"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0},
    "llama3": {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 16},
    # beta/mscale defaults give an attention factor 0.1·ln(4) + 1 ≠ 1: cos² + sin² ≠ 1 is exercised
    "yarn": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 16},
}
ARCHS = ("llama", "mistral", "ministral3", "qwen2", "qwen3")
SEQ = 24  # beyond max_position_embeddings=16, so dynamic scaling really rescales


def tiny_model(arch: str, rope: dict):
    from transformers import AutoConfig, AutoModelForCausalLM

    params = dict(rope)
    if arch == "ministral3":  # Ministral3 also scales queries by position (llama-4 scaling)
        params.setdefault("original_max_position_embeddings", 16)
        params["llama_4_scaling_beta"] = 0.1
    config = AutoConfig.for_model(
        arch, vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, max_position_embeddings=16, rope_parameters=params,
    )
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config).eval()


def pre_rope_keys(model, layer: int, ids):
    """Keys of ``layer`` just before RoPE, captured with a hook (after k_norm for Qwen3)."""
    attn = model.model.layers[layer].self_attn
    module = getattr(attn, "k_norm", None) or attn.k_proj
    captured = {}

    def hook(_module, _inputs, output):
        captured["k"] = output

    handle = module.register_forward_hook(hook)
    try:
        model(input_ids=ids)
    finally:
        handle.remove()
    k = captured["k"]
    b, t = ids.shape
    return k.view(b, t, -1, model.config.head_dim).transpose(1, 2)  # (B, H, T, D)


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("rope_type", list(ROPES))
def test_remove_then_apply_is_identity(arch, rope_type):
    model = tiny_model(arch, ROPES[rope_type])
    spec = rope_spec(model)
    assert spec.rope_type == rope_type and spec.model_type == arch
    ids = torch.randint(4, 64, (2, SEQ))
    mask = torch.ones_like(ids)
    mask[1, :5] = 0  # a left-padded row
    positions = positions_from_mask(mask)
    cache, _ = prefill(model, ids, mask, positions)
    keys, _ = cache_kv(cache)
    cos, sin = rotary_factors(model, positions)
    for k in keys:
        content = remove_rope(k, cos, sin)
        assert (apply_rope(content, cos, sin) - k).abs().max().item() <= 1e-5
    # and the content keys are the keys before RoPE (unpadded batch: the hook sees one forward)
    plain = torch.randint(4, 64, (1, SEQ))
    cache, _ = prefill(model, plain, torch.ones_like(plain))
    cos, sin = rotary_factors(model, torch.arange(SEQ)[None])
    for layer, k in enumerate(cache_kv(cache)[0]):
        assert torch.allclose(remove_rope(k, cos, sin), pre_rope_keys(model, layer, plain), atol=1e-5)


@pytest.mark.parametrize("rope_type", list(ROPES))
def test_rope_factors_once_per_length_equal_the_module_at_every_call(rope_type):
    """The per-length table (views for plain rows, a gather for padded ones) gives the module's own factors,
    grows for a longer call, and is remade when the module's frequencies change in place."""
    model = tiny_model("llama", ROPES[rope_type])
    padded = positions_from_mask(torch.tensor([[0, 0, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1]]))
    for positions in (torch.arange(6)[None], padded, torch.arange(40).expand(2, -1), padded + 30):
        for inverse, factors in ((False, rotation), (True, unrotation)):
            for got, want in zip(rope_factors(model, positions, inverse), factors(*rotary_factors(model, positions))):
                assert torch.equal(got, want), (rope_type, positions.shape, inverse)
    model.model.rotary_emb.inv_freq.mul_(0.5)  # e.g. a user rescaling RoPE: the table must not go stale
    for got, want in zip(rope_factors(model, padded), rotation(*rotary_factors(model, padded))):
        assert torch.equal(got, want)


def test_yarn_attention_scaling_is_divided_out():
    model = tiny_model("llama", ROPES["yarn"])
    cos, sin = rotary_factors(model, torch.arange(8)[None])
    norm = cos * cos + sin * sin
    assert norm.min() > 1.2  # (0.1·ln 4 + 1)² ≈ 1.30: scaling is present in cos/sin
    k = torch.randn(1, 2, 8, 8)
    assert torch.allclose(remove_rope(apply_rope(k, cos, sin), cos, sin), k, atol=1e-6)


def test_ministral3_real_yarn_spec():
    """Ministral-3's shipped YaRN (θ=1e6, factor 16, original 16,384) through its own rotary module."""
    from transformers import Ministral3Config, Ministral3ForCausalLM

    config = Ministral3Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                              num_attention_heads=4, num_key_value_heads=2, head_dim=8)
    assert config.rope_parameters["rope_type"] == "yarn" and config.rope_parameters["factor"] == 16.0
    model = Ministral3ForCausalLM(config).eval()
    positions = torch.tensor([[0, 1, 4095, 16383, 20000, 100000]])
    cos, sin = rotary_factors(model, positions)
    k = torch.randn(1, 2, positions.shape[1], 8)
    assert (remove_rope(apply_rope(k, cos, sin), cos, sin) - k).abs().max() <= 1e-5


def test_unsupported_layouts_are_refused():
    from transformers import AutoConfig, AutoModelForCausalLM

    neox = AutoModelForCausalLM.from_config(AutoConfig.for_model(
        "gpt_neox", vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
        num_attention_heads=4, rotary_pct=0.5))
    with pytest.raises(UnsupportedModelError, match="not supported"):
        rope_spec(neox)
    partial = tiny_model("llama", {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5})
    with pytest.raises(UnsupportedModelError, match="partial"):
        rope_spec(partial)
    longrope = tiny_model("llama", {"rope_type": "default", "rope_theta": 10000.0})
    longrope.config.rope_parameters = {"rope_type": "longrope", "rope_theta": 10000.0}
    with pytest.raises(UnsupportedModelError, match="longrope"):
        rope_spec(longrope)


@pytest.mark.parametrize("arch", ARCHS)
def test_cache_only_prefill_equals_the_full_forward(arch):
    """``prefill(logits="none")`` stops after the last layer stores its K/V: the cache is the full forward's, bit
    for bit (padded rows too, and continuing a cache), the model is left as it was, and the stop really happens."""
    from kvbridge.core.models import cache_of

    model = tiny_model(arch, ROPES["yarn"])
    ids = torch.randint(4, 64, (2, SEQ))
    mask = torch.ones_like(ids)
    mask[1, :5] = 0
    positions = positions_from_mask(mask)
    full = cache_of(model.get_decoder()(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=True))
    cut, _ = prefill(model, ids, mask, positions, logits="none")
    assert len(cut.layers) == len(full.layers) == 2
    for a, b in zip(cut.layers, full.layers):
        assert torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)
    first, _ = prefill(model, ids[:, :10], mask[:, :10], positions[:, :10], logits="none")
    both, _ = prefill(model, ids[:, 10:], mask, positions[:, 10:], logits="none", cache=first)
    assert "update" not in vars(both)  # the stop is undone: the cache updates as any other afterwards
    for a, b in zip(both.layers, full.layers):
        assert torch.allclose(a.keys, b.keys, atol=1e-5) and torch.allclose(a.values, b.values, atol=1e-5)
    ran = []
    hook = model.get_decoder().norm.register_forward_hook(lambda *_: ran.append(1))
    try:
        prefill(model, ids, mask, positions, logits="none")
        assert ran == []  # the final norm (after the last layer's attention and MLP) never ran
        out = model(input_ids=ids, attention_mask=mask, position_ids=positions)
        assert ran == [1] and torch.isfinite(out.logits).all()
    finally:
        hook.remove()
