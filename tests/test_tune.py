"""Tuning the levers on the target's output, and the calibration rows that hold a span twice."""

import pytest
import torch
from test_rope import ARCHS, ROPES, tiny_model

from kvbridge.core.models import check_decoder_layers, decoder_layer, layer_inputs, next_token_logprobs
from kvbridge.core.rope import rotary_factors
from kvbridge.errors import InputError, UnsupportedModelError
from kvbridge.fit.texts import SPAN_TOKENS, repeat_spans


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("first", [0, 1])
def test_the_hand_written_layers_reproduce_each_architecture(arch, first):
    model = tiny_model(arch, ROPES["yarn"])  # Ministral3's llama-4 query scaling and Qwen3's k_norm included
    ids = torch.randint(0, 64, (2, 24), generator=torch.Generator().manual_seed(0))
    assert check_decoder_layers(model, ids, first, 1e-6) <= 1e-6


def test_replacing_a_layers_keys_changes_its_output_and_native_keys_do_not():
    model = tiny_model("ministral3", ROPES["yarn"])
    ids = torch.randint(0, 64, (1, 20), generator=torch.Generator().manual_seed(1))
    positions = torch.arange(20)[None]
    with torch.no_grad(), layer_inputs(model, (1,)) as entering:
        own = torch.log_softmax(model(input_ids=ids, position_ids=positions).logits, -1)
    cos, sin = rotary_factors(model, positions)
    block = model.model.layers[1]
    x = block.input_layernorm(entering[1])
    keys = block.self_attn.k_proj(x).view(1, 20, 2, 8).transpose(1, 2)
    with torch.no_grad():
        same = next_token_logprobs(model, decoder_layer(model, 1, entering[1], cos, sin, positions, keys=keys))
        other = next_token_logprobs(model, decoder_layer(model, 1, entering[1], cos, sin, positions, keys=keys * 0))
    assert torch.allclose(same, own, atol=1e-5)
    assert (other - own).abs().max() > 1e-3


def test_a_model_whose_layers_differ_is_refused_before_any_tuning():
    from kvbridge import family

    _, target = family.load_family()  # trained: its output reads every layer (a random model's barely does)
    ids = torch.randint(4, 4096, (1, 32), generator=torch.Generator().manual_seed(0))
    assert check_decoder_layers(target.model, ids, 2, 1e-5) <= 1e-5
    block = target.model.model.layers[2]
    own = block.forward
    block.forward = lambda *args, **kwargs: own(*args, **kwargs) * 1.5  # a step outside the formula
    try:
        with pytest.raises(UnsupportedModelError, match="--lever-objective kv"):
            check_decoder_layers(target.model, ids, 2, 1e-5)
    finally:
        del block.forward


def test_repeated_spans():
    rows = torch.arange(6 * 128).view(6, 128) % 500 + 10
    assert torch.equal(repeat_spans(rows, 0.0), rows)
    out = repeat_spans(rows, 1.0, seed=3, special=[10])
    assert torch.equal(out, repeat_spans(rows, 1.0, seed=3, special=[10]))  # seeded
    assert not torch.equal(out, repeat_spans(rows, 1.0, seed=4, special=[10]))
    assert torch.equal(out[:, 0], rows[:, 0])  # BOS column kept
    for i in range(6):  # one span a row: written in the first half, and again, whole, in the second
        changed = (out[i] != rows[i]).nonzero().flatten()
        first, second = changed[changed < 64], changed[changed >= 64]
        assert len(first) and len(second)
        span = out[i, int(first.min()) : int(first.max()) + 1]
        assert SPAN_TOKENS[0] <= len(span) <= SPAN_TOKENS[1]
        assert any(torch.equal(out[i, s : s + len(span)], span) for s in range(64, 128 - len(span) + 1))
    assert not (torch.isin(out, torch.tensor([10])) & ~torch.isin(rows, torch.tensor([10]))).any()  # no special id
    some = repeat_spans(rows, 0.5, seed=0)
    many = repeat_spans(rows, 3.0, seed=0)
    assert (some != rows).any(1).sum() < 6 and (many != rows).sum() > (out != rows).sum()
    with pytest.raises(InputError, match="spans per row"):
        repeat_spans(rows, -1.0)


def test_tuning_keeps_only_what_lowers_the_validation_divergence():
    """On the embedded family (trained models: random ones barely read their keys), a short tuning of the last
    layer's key lever lowers the divergence on rows it did not train on, moves only that lever, and is seeded."""
    from kvbridge import family
    from kvbridge.fit import FitConfig, fit_mapper

    source, target = family.load_family()
    texts = family.calibration_texts()
    base = dict(num_texts=40, seq_len=128, heldout_texts=2, mlp_hidden=16, mlp_steps=50, lever_layers=(3,),
                tune_steps=60, tune_lr=1e-3, tune_plain=False)
    kv = fit_mapper(source, target, texts, FitConfig(**base, lever_objective="kv"), progress=False)
    tuned = fit_mapper(source, target, texts, FitConfig(**base), progress=False)
    again = fit_mapper(source, target, texts, FitConfig(**base), progress=False)
    report = tuned.config.fit["tune"]
    assert kv.config.fit["tune"] is None
    assert report["rows"] == 40 and report["validation_rows"] == 2 and report["budget"]["steps"] == 60
    assert report["kept"] and report["validation_kl_after"] < report["validation_kl_before"]
    changed = {n for n in kv.weights if not torch.equal(kv.weights[n], tuned.weights[n])}
    assert changed == {n for n in kv.weights if n.startswith("key.3.")}
    assert all(torch.equal(tuned.weights[n], again.weights[n]) for n in tuned.weights)  # seeded
    # tune_plain: layer 3's plain value map trains with its key lever; the map's shapes (its cost) do not change
    both = fit_mapper(source, target, texts, FitConfig(**(base | dict(tune_plain=True))), progress=False)
    changed = {n for n in kv.weights if not torch.equal(kv.weights[n], both.weights[n])}
    assert changed == {n for n in kv.weights if n.startswith(("key.3.", "value.3."))}
    assert all(both.weights[n].shape == kv.weights[n].shape for n in kv.weights)
    assert both.config.fit["tune"]["kept"]
    assert both.config.fit["tune"]["validation_kl_after"] < both.config.fit["tune"]["validation_kl_before"]


def test_tuning_settings_are_checked():
    from kvbridge.fit import FitConfig

    for bad in (dict(lever_objective="logits"), dict(tune_steps=0), dict(tune_lr=0.0), dict(tune_rows=1),
                dict(repeat_spans=-0.1)):
        with pytest.raises(InputError):
            FitConfig(**bad)
    with pytest.raises(InputError, match="tune_lr"):
        FitConfig(tune_lr="fast")
