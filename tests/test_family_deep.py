"""The deep embedded family (a source trained apart from its target, the hard case for a map): a real instrument."""

from pathlib import Path

import pytest
import torch
from conftest import long_recall

from kvbridge import family
from kvbridge.measure.evaluate import band_perplexity, heldout_rows

DEEP = "deep"


@pytest.fixture(scope="module")
def pair():
    return family.load_family(name=DEEP)


@pytest.fixture(scope="module")
def recorded():
    return family.report(DEEP)


def test_loads_offline_with_the_first_familys_tokenizer_and_architecture(pair, recorded):
    source, target = pair
    for loaded, layers, hidden in ((source, 4, 192), (target, 8, 256)):
        cfg = loaded.model.config
        assert type(loaded.model).__name__ == "Ministral3ForCausalLM"
        assert (cfg.num_hidden_layers, cfg.hidden_size) == (layers, hidden)
        assert (cfg.num_key_value_heads, cfg.head_dim, cfg.max_position_embeddings) == (4, 32, 2048)
        assert cfg.rope_parameters["rope_type"] == "yarn"
    first = family.load_family()[1]
    assert source.info.tokenizer_sha256 == target.info.tokenizer_sha256 == first.info.tokenizer_sha256
    assert "no pruning, no distillation" in recorded["independent"]
    stages = ("copy", "main", "induce", "recall", "stretch", "long", "polish")
    assert all(f"{role}/{stage}" in recorded["stages"] for role in ("target", "source") for stage in stages)
    shipped = sum(f.stat().st_size for f in Path(family.target_path(DEEP)).parent.rglob("*.safetensors"))
    assert shipped <= 40e6  # bfloat16 weights


def test_target_is_clearly_better_than_the_source_and_both_use_context(pair, recorded):
    source, target = pair
    rows = heldout_rows(target.tokenizer, family.heldout_texts(), 16, 256)
    with torch.no_grad():
        ppl = [torch.nn.functional.cross_entropy(m.model(input_ids=rows).logits[:, -65:-1].flatten(0, 1),
                                                 rows[:, -64:].flatten()).exp() for m in pair]
    margin = recorded["source"]["heldout_ppl"] / recorded["target"]["heldout_ppl"]
    assert margin > 1.1 and ppl[0] > ppl[1] * (1 + (margin - 1) / 2), (margin, ppl)
    for role in ("target", "source"):  # the no-context gap: context lowers perplexity a lot
        assert recorded[role]["heldout_ppl_no_context"] > 1.5 * recorded[role]["heldout_ppl"]


@pytest.fixture(scope="module")
def long_rows(pair):
    return heldout_rows(pair[1].tokenizer, family.heldout_texts(), 16, 1024)  # (the recorded margins hold at 16)


def test_both_read_long_contexts_better_the_further_they_read(pair, long_rows, recorded):
    for loaded, role in zip(pair, ("source", "target")):
        bands = band_perplexity(loaded.model, long_rows)
        assert bands["768-1024"] <= bands["128-256"], (role, bands)
        assert recorded[role]["band_ppl_2048"]["1536-2048"] <= recorded[role]["band_ppl_2048"]["128-256"]


def test_target_recalls_a_span_stated_900_tokens_earlier_and_the_source_does_not(pair, long_rows):
    target_acc, source_acc, floor = long_recall(pair, long_rows)
    # recorded on 48 documents (family.json, task_recall_random_1024): target 38.8 %, source 1.1 %
    assert target_acc > floor + 0.2 and target_acc > source_acc + 0.2, (target_acc, source_acc, floor)
