"""Reliability, third round: each case below failed on the code before it (a card overwriting a user's files, a
config that hung `plan`, values that passed validation then crashed, native output labelled mapped, silent
misreadings, resealed edits that verified, `inspect` printing nonsense, tracebacks)."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from conftest import FAST_FIT
from test_reliability import _edit, _reseal, _set

from kvbridge import Mapper
from kvbridge.cli import main
from kvbridge.core.artifact import CONFIG_FILE
from kvbridge.errors import ArtifactError, InputError


@pytest.fixture()
def artifact(fast_mapper, tmp_path):
    folder = tmp_path / "m"
    shutil.copytree(fast_mapper, folder)
    return folder


def test_card_never_overwrites_files_it_did_not_write(artifact, capsys):
    for name in ("README.md", "example.py", "artifact_manifest.json"):
        (artifact / name).write_text("my own notes\n")
        assert main(["card", str(artifact)]) == 1
        assert "kvbridge card did not write" in capsys.readouterr().err
        assert (artifact / name).read_text() == "my own notes\n"
        (artifact / name).unlink()
    assert main(["card", str(artifact)]) == 0  # its own files: replaced freely, card after card
    assert main(["card", str(artifact), "--license", "apache-2.0"]) == 0
    (artifact / "README.md").write_text("edited by hand\n")
    assert main(["card", str(artifact)]) == 1
    assert (artifact / "README.md").read_text() == "edited by hand\n"
    assert main(["card", str(artifact), "--force"]) == 0
    assert "edited by hand" not in (artifact / "README.md").read_text()


@pytest.mark.parametrize("args", [["--repo-id", "bad id!!"], ["--license", "mit\nextra: injected"]])
def test_card_refuses_what_push_or_yaml_would_not_take(artifact, capsys, args):
    assert main(["card", str(artifact), *args]) == 1
    assert "kvbridge card: error:" in capsys.readouterr().err
    assert not (artifact / "README.md").exists()


@pytest.mark.parametrize("edit,match", [({"num_hidden_layers": 10**12}, "num_hidden_layers"),
                                        ({"num_key_value_heads": 8, "num_attention_heads": 4}, "key-value heads"),
                                        ({"max_position_embeddings": 0}, "max_position_embeddings"),
                                        ({"hidden_size": 2**40}, "hidden_size")])
def test_plan_bounds_every_size_before_any_work(tiny_pair, tmp_path, capsys, edit, match):
    import time

    source, target, _ = tiny_pair
    cfg = tmp_path / "config.json"
    with open(f"{target}/config.json") as handle:
        cfg.write_text(json.dumps({**json.load(handle), **edit}))
    start = time.perf_counter()
    assert main(["plan", "--source", source, "--target", str(cfg), "--contexts", "64", "--device", "cpu"]) == 1
    assert time.perf_counter() - start < 30
    assert match in capsys.readouterr().err


def test_a_huge_recompute_window_is_refused_or_harmless(artifact, fast_mapper, tiny_pair):
    from kvbridge import Bridge
    from kvbridge.core.models import load_model
    from kvbridge.core.recompute import window_mean

    scores, valid = torch.rand(2, 7), torch.ones(2, 7, dtype=torch.bool)
    assert torch.allclose(window_mean(scores, valid, 2**40 + 1), window_mean(scores, valid, 13))  # whole row
    for field in ("recompute_window", "hold_back"):
        shutil.copy(fast_mapper / CONFIG_FILE, artifact / CONFIG_FILE)
        _edit(artifact, _set(("runtime", field), 2**40 + 1))
        with pytest.raises(ArtifactError, match=field):
            Mapper.from_pretrained(artifact)
        assert main(["verify", str(artifact)]) == 1
    source, target, _ = tiny_pair
    s, t, good = load_model(source), load_model(target), Mapper.from_pretrained(fast_mapper)
    for bad in (dict(recompute_window=2**31 + 1), dict(hold_back=10**6)):
        with pytest.raises(InputError, match="positions"):
            Bridge(s, t, good, **bad)


@pytest.mark.parametrize("flag,value", [("--recompute-window", "100001"), ("--hold-back", "5000"),
                                        ("--lever-count", "99"), ("--lags", "0,0,1"), ("--lags", "-1,0")])
def test_fit_refuses_values_it_cannot_honour(tiny_pair, tmp_path, capsys, flag, value):
    source, target, texts = tiny_pair
    assert main(["fit", "--source", source, "--target", target, "--texts", texts, "--out", str(tmp_path / "o"),
                 *FAST_FIT, flag, value]) == 1
    err = capsys.readouterr().err
    assert "kvbridge fit: error:" in err and flag in err and "Traceback" not in err
    assert not (tmp_path / "o").exists()


def test_a_short_prompt_is_never_called_mapped_without_saying_so(fast_mapper, tiny_pair, capsys):
    source, target, _ = tiny_pair
    assert main(["generate", "--source", source, "--target", target, "--mapper", str(fast_mapper), "--prompt",
                 "a b", "--max-new-tokens", "2", "--compare"]) == 0
    out = capsys.readouterr().out
    assert "hold-back 4 was asked for" in out and "less than half of this prompt was mapped" in out
    assert "the source prefilled 1 of" in out


def test_generation_and_scoring_refuse_what_they_would_misread(fast_mapper, tiny_pair, capsys):
    from kvbridge import Bridge

    source, target, _ = tiny_pair
    assert main(["generate", "--source", source, "--target", target, "--mapper", str(fast_mapper), "--prompt",
                 "def f(x):", "--temperature", "0.5"]) == 1
    assert "--sample" in capsys.readouterr().err
    bridge = Bridge.from_pretrained(source, target, str(fast_mapper))
    with pytest.raises(InputError, match="contexts must be a list of strings, not str"):
        bridge.score("hello world", "abcdefghijk")
    g = bridge.generate(["def read(path):\n    with open(path) as handle:"], max_new_tokens=2)
    assert g.held_back == 4 and g.prefilled[0] + 4 == len(bridge.tokenizer("def read(path):\n    with open(path) as "
                                                                             "handle:")["input_ids"])


def test_lm_eval_refuses_unknown_model_args_and_tasks(fast_mapper, tiny_pair, capsys):
    from kvbridge.measure.lm_eval_model import KVBridgeLM

    source, target, _ = tiny_pair
    with pytest.raises(InputError, match="unknown model_args frob"):
        KVBridgeLM(source=source, target=target, mapper=str(fast_mapper), frob="1")
    KVBridgeLM(source=source, target=target, mapper=str(fast_mapper), max_batch_size=None)  # lm-eval's own
    code = main(["lm-eval", "run", "--model", "kvbridge", "--model_args",
                 f"source={source},target={target},mapper={fast_mapper}", "--tasks", "no_such_task"])
    err = capsys.readouterr().err
    assert code != 0 and "Traceback" not in err


@pytest.mark.parametrize("edit", [
    lambda d: {**d, "levers": [{**v, "lags": [x + 1 for x in v["lags"]]} for v in d["levers"]]},
    lambda d: {**d, "weights_dtype": "int8"},
    lambda d: {**d, "num_parameters": d["num_parameters"] + 1},
])
def test_resealed_edits_that_keep_shapes_fail_verification(artifact, edit):
    assert json.loads((artifact / CONFIG_FILE).read_text())["levers"]  # FAST_FIT keeps the default levers
    _edit(artifact, edit)
    assert main(["verify", str(artifact)]) == 1
    with pytest.raises(ArtifactError):
        Mapper.from_pretrained(artifact)


def test_inspect_shows_nothing_of_an_artifact_that_fails_verification(artifact, capsys):
    assert main(["inspect", str(artifact)]) == 0
    capsys.readouterr()
    _edit(artifact, lambda d: {**d, "num_parameters": 10**18})
    assert main(["inspect", str(artifact)]) == 1
    captured = capsys.readouterr()
    assert "fails verification" in captured.err and "params" not in captured.out
    (artifact / "mapper.safetensors").write_bytes(b"junk")
    _reseal(artifact)
    assert main(["inspect", str(artifact)]) == 1


def test_no_traceback_for_a_plot_name_a_dtype_name_or_a_full_disk(artifact, fast_mapper, tiny_pair, capsys,
                                                                   monkeypatch, tmp_path):
    from safetensors import SafetensorError

    import kvbridge.core.artifact as artifact_module

    source, target, _ = tiny_pair
    assert main(["bench", "--source", source, "--target", target, "--mapper", str(fast_mapper), "--contexts", "16",
                 "--plot", str(tmp_path / "out.txt")]) == 1
    assert ".png" in capsys.readouterr().err and not (tmp_path / "out.txt").exists()
    assert Mapper.from_pretrained(fast_mapper, dtype="float16").dtype == torch.float16
    mapper = Mapper.from_pretrained(fast_mapper)

    def full_disk(*args, **kwargs):
        raise SafetensorError("Error while serializing: IoError(No space left on device)")

    monkeypatch.setattr("safetensors.torch.save_file", full_disk)
    with pytest.raises(ArtifactError, match="No space left on device"):
        mapper.save_pretrained(artifact)
    assert Mapper.from_pretrained(artifact) is not None  # the old artifact survives
    assert artifact_module.verify_artifact(artifact) == []


def test_messages_say_what_to_do_once(artifact):
    (artifact / "checksums.sha256").unlink()
    with pytest.raises(ArtifactError) as info:
        Mapper.from_pretrained(artifact)
    assert str(info.value).lower().count("re-download") == 1


def test_diagnose_names_the_position_limit(fast_mapper, tiny_pair, tmp_path, capsys):
    source, target, texts = tiny_pair
    assert main(["diagnose", "--source", source, "--target", target, "--mapper", str(fast_mapper), "--texts", texts,
                 "--seq-len", "99999", "--out", str(tmp_path / "d")]) == 1
    assert "exceeds the 512 positions" in capsys.readouterr().err
