"""Loading: text-only decoders out of multimodal Ministral-3 checkpoints, and loud failures."""

import json

import pytest
import torch

from kvbridge.core.models import load_model, tokenizer_fingerprint
from kvbridge.errors import ModelLoadError


def test_text_only_loading_of_a_multimodal_ministral3(tiny_vlm):
    path, vlm = tiny_vlm
    assert json.load(open(f"{path}/config.json"))["architectures"] == ["Mistral3ForConditionalGeneration"]
    loaded = load_model(path)
    assert loaded.info.architecture == "Ministral3ForCausalLM"
    assert loaded.info.geometry == (2, 4, 16) and loaded.info.rope.rope_type == "yarn"
    names = [n for n, _ in loaded.model.named_parameters()]
    assert not any("vision" in n or "projector" in n for n in names)  # no vision tower in memory
    ids = torch.randint(4, 300, (1, 12))
    with torch.no_grad():
        assert torch.equal(loaded.model(input_ids=ids).logits, vlm(input_ids=ids).logits)


def test_missing_decoder_weights_fail_loudly(tmp_path, tiny_pair):
    import shutil

    from safetensors.torch import load_file, save_file

    broken = tmp_path / "broken"
    shutil.copytree(tiny_pair[1], broken)
    weights = load_file(str(broken / "model.safetensors"))
    del weights["model.layers.1.self_attn.k_proj.weight"]
    save_file(weights, str(broken / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ModelLoadError, match="missing.*random"):
        load_model(str(broken))


def test_missing_folder_and_uncached_hub_id(tmp_path):
    with pytest.raises(ModelLoadError, match="does not exist"):
        load_model(str(tmp_path / "nope"))
    with pytest.raises(ModelLoadError, match="not available"):
        load_model("mistralai/not-a-cached-model")


def test_tokenizer_fingerprint_is_stable_and_discriminating(tiny_pair, tmp_path):
    import conftest
    from transformers import AutoTokenizer

    a = AutoTokenizer.from_pretrained(tiny_pair[0])
    b = AutoTokenizer.from_pretrained(tiny_pair[1])
    assert tokenizer_fingerprint(a) == tokenizer_fingerprint(b)
    other = conftest.build_tokenizer(tmp_path / "t", vocab_size=300)
    assert tokenizer_fingerprint(other) != tokenizer_fingerprint(a)
