"""Artifact round trips, integrity checks and atomic writes."""

import json

import pytest
import torch
from conftest import model_info

from kvbridge import Mapper
from kvbridge.cli import main
from kvbridge.core.artifact import CHECKSUMS_FILE, CONFIG_FILE, WEIGHTS_FILE, verify_artifact
from kvbridge.core.mapper_config import MapperConfig
from kvbridge.core.rope import RopeSpec
from kvbridge.errors import ArtifactError


def random_mapper(seed=0) -> Mapper:
    rope = RopeSpec("ministral3", "yarn", 8, {"rope_theta": 1e6, "factor": 16.0})
    source = model_info("org/small", 3, 2, 8, revision="a" * 40, rope=rope)
    target = model_info("org/large", 4, 2, 8, revision="b" * 40, rope=rope)
    selection = {"key": ((0, 1, 2),) * 4, "value": ((0, 2), (1, 2), (0, 1), (2,))}
    config = MapperConfig(source=source, target=target, selection=selection, fit={"note": "random"})
    g = torch.Generator().manual_seed(seed)
    weights = {name: torch.randn(shape, generator=g) for name, shape in config.weight_shapes().items()}
    return Mapper(config, weights)


def test_round_trip_is_bit_exact(tmp_path):
    mapper = random_mapper()
    mapper.save_pretrained(tmp_path / "m")
    assert sorted(p.name for p in (tmp_path / "m").iterdir()) == sorted([WEIGHTS_FILE, CONFIG_FILE, CHECKSUMS_FILE])
    loaded = Mapper.from_pretrained(str(tmp_path / "m"))
    assert loaded.weights.keys() == mapper.weights.keys()
    for name, tensor in mapper.weights.items():
        assert torch.equal(loaded.weights[name], tensor), name
    assert loaded.config == mapper.config
    # saving the loaded mapper again writes identical bytes
    loaded.save_pretrained(tmp_path / "again")
    for name in (WEIGHTS_FILE, CONFIG_FILE, CHECKSUMS_FILE):
        assert (tmp_path / "m" / name).read_bytes() == (tmp_path / "again" / name).read_bytes()
    bf16 = Mapper.from_pretrained(str(tmp_path / "m"), dtype=torch.bfloat16)
    assert bf16.dtype == torch.bfloat16


def test_flipped_byte_is_detected_before_any_tensor_is_used(tmp_path, monkeypatch):
    random_mapper().save_pretrained(tmp_path / "m")
    path = tmp_path / "m" / WEIGHTS_FILE
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))

    import safetensors.torch

    def must_not_load(*args, **kwargs):
        raise AssertionError("tensors were read before verification")

    monkeypatch.setattr(safetensors.torch, "load_file", must_not_load)
    with pytest.raises(ArtifactError, match="mapper.safetensors does not match its SHA-256"):
        Mapper.from_pretrained(str(tmp_path / "m"))
    assert main(["verify", str(tmp_path / "m")]) == 1


@pytest.mark.parametrize("missing", [WEIGHTS_FILE, CONFIG_FILE, CHECKSUMS_FILE])
def test_missing_file_is_a_clear_error(tmp_path, missing):
    random_mapper().save_pretrained(tmp_path / "m")
    (tmp_path / "m" / missing).unlink()
    with pytest.raises(ArtifactError, match=f"{missing}.*missing|missing.*{missing}"):
        Mapper.from_pretrained(str(tmp_path / "m"))


def test_unknown_keys_are_ignored_and_newer_format_refused(tmp_path):
    random_mapper().save_pretrained(tmp_path / "m")
    cfg = tmp_path / "m" / CONFIG_FILE
    data = json.loads(cfg.read_text())
    data["from_the_future"] = {"x": 1}
    data["source"]["new_field"] = 3
    cfg.write_text(json.dumps(data))
    Mapper.from_pretrained(str(tmp_path / "m"), verify=False)  # newer files still load
    data["format_version"] = 99
    cfg.write_text(json.dumps(data))
    with pytest.raises(ArtifactError, match="Upgrade kvbridge"):
        Mapper.from_pretrained(str(tmp_path / "m"), verify=False)


def test_shape_mismatch_is_refused(tmp_path):
    mapper = random_mapper()
    weights = dict(mapper.weights)
    weights["value.3.weight"] = torch.zeros(32, 16)
    with pytest.raises(ArtifactError, match="value.3.weight"):
        Mapper(mapper.config, weights)


def test_crash_during_save_leaves_old_artifact_intact(tmp_path, monkeypatch):
    first = random_mapper(0)
    first.save_pretrained(tmp_path / "m")
    before = {p.name: p.read_bytes() for p in (tmp_path / "m").iterdir()}

    import safetensors.torch

    def crash(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(safetensors.torch, "save_file", crash)
    with pytest.raises(ArtifactError, match="disk full.*nothing was changed"):
        random_mapper(1).save_pretrained(tmp_path / "m")
    assert {p.name: p.read_bytes() for p in (tmp_path / "m").iterdir()} == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m"]  # no temporary folder left behind
    assert verify_artifact(tmp_path / "m") == []


def test_uncached_hub_id_offline_is_a_clear_error(monkeypatch, tmp_path):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))
    with pytest.raises(ArtifactError, match="HF_HUB_OFFLINE"):
        Mapper.from_pretrained("someone/kvbridge-mapper-that-is-not-cached")


def test_hub_cache_snapshot_loads_and_records_revision(monkeypatch, tmp_path):
    """A hub id resolves through huggingface_hub's cache layout (models--org--name/snapshots/<commit>)."""
    commit = "0123456789abcdef0123456789abcdef01234567"
    repo = tmp_path / "models--org--mapper"
    random_mapper().save_pretrained(repo / "snapshots" / commit)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))
    import huggingface_hub.constants as constants

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    mapper = Mapper.from_pretrained("org/mapper", revision=commit)
    assert mapper.config.target.name_or_path == "org/large"


def test_the_mapper_is_resident_once(tmp_path):
    """Per-layer weights are views of the group GEMM operands: no second copy of the map in memory."""
    mapper = random_mapper()
    mapper.save_pretrained(tmp_path / "m")
    for loaded in (mapper, Mapper.from_pretrained(str(tmp_path / "m")),
                   Mapper.from_pretrained(str(tmp_path / "m"), dtype=torch.bfloat16)):
        expected = sum(t.numel() * t.element_size() for t in loaded.weights.values())
        assert loaded.resident_bytes == expected


def test_loading_writes_each_tensor_into_its_group_buffer(tmp_path, monkeypatch):
    """from_pretrained and to() assemble group operands layer by layer: no concatenation, no second copy."""
    random_mapper().save_pretrained(tmp_path / "m")
    calls = []
    real = torch.cat
    monkeypatch.setattr(torch, "cat", lambda *a, **k: calls.append(1) or real(*a, **k))
    loaded = Mapper.from_pretrained(str(tmp_path / "m"), dtype=torch.bfloat16)
    moved = loaded.to(dtype=torch.float32)
    assert calls == []
    assert moved.resident_bytes == sum(t.numel() * t.element_size() for t in moved.weights.values())
    for name, t in random_mapper().weights.items():
        assert torch.equal(moved.weights[name], t.to(torch.bfloat16).to(t.dtype)) or ".mlp." in name or \
            "recompute" in name, name

