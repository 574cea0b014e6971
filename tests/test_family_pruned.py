"""The deep-pruned embedded family: the deep target with a source pruned from it and distilled (the way Ministral 3's
sizes are built), beside the deep family whose source was trained apart."""

from pathlib import Path

import pytest
from conftest import long_recall

from kvbridge import family
from kvbridge.measure.evaluate import band_perplexity, heldout_rows

NAME = "deep-pruned"


@pytest.fixture(scope="module")
def pair():
    return family.load_family(name=NAME)


@pytest.fixture(scope="module")
def recorded():
    return family.report(NAME)


def test_the_target_is_the_deep_familys_and_the_source_its_pruned_layers(pair, recorded):
    source, target = pair
    deep_source, deep_target = family.load_family(name="deep")
    assert target.info.weights_sha256 == deep_target.info.weights_sha256
    assert source.info.weights_sha256 != deep_source.info.weights_sha256
    assert source.info.tokenizer_sha256 == target.info.tokenizer_sha256
    cfg, deep_cfg = source.model.config, deep_source.model.config  # the deep source's geometry and RoPE
    for key in ("num_hidden_layers", "hidden_size", "intermediate_size", "num_key_value_heads", "head_dim",
                "max_position_embeddings", "rope_parameters"):
        assert getattr(cfg, key) == getattr(deep_cfg, key), key
    kept = recorded["stages"]["prune"]["layers"]
    assert len(kept) == 4 and kept == sorted(set(kept)) and all(0 <= i < 8 for i in kept)
    assert {"distil", "long"} <= set(recorded["stages"]) and recorded["target"]["layers"] == 8
    assert sum(f.stat().st_size for f in Path(family.source_path(NAME)).rglob("*.safetensors")) <= 8e6


def test_target_reads_better_at_every_distance_and_recalls_far_where_the_source_does_not(pair, recorded):
    # distilled from it, the pruned source nearly matches the target on short contexts (held-out perplexity 33.1 vs
    # 32.8, family.json), is worse in every position band to 2,048, and cannot recall ~950 tokens back
    source, target = pair
    bands = {role: recorded[role]["band_ppl_2048"] for role in ("source", "target")}
    assert all(bands["target"][band] < bands["source"][band] for band in bands["target"]), bands
    assert recorded["source"]["heldout_ppl"] > recorded["target"]["heldout_ppl"]
    assert recorded["source"]["heldout_ppl_no_context"] > 1.5 * recorded["source"]["heldout_ppl"]
    long_rows = heldout_rows(target.tokenizer, family.heldout_texts(), 16, 1024)
    source_bands = band_perplexity(source.model, long_rows)
    assert source_bands["768-1024"] <= source_bands["128-256"], source_bands
    target_acc, source_acc, floor = long_recall(pair, long_rows)
    # recorded on 48 documents (task_recall_random_1024): target 38.8 %, source 2.5 %
    assert target_acc > floor + 0.2 and target_acc > source_acc + 0.2, (target_acc, source_acc, floor)
