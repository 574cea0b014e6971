"""Bad input loses nothing and gets a clear error: folders that are not artifacts, corrupted files, bad text."""


import pytest
import torch
from safetensors.torch import save_file

from kvbridge import Mapper
from kvbridge.artifact import CHECKSUMS_FILE, CONFIG_FILE, WEIGHTS_FILE, check_artifact, read_checksums
from kvbridge.cli import main
from kvbridge.errors import ArtifactError, InputError
from kvbridge.hashing import sha256_file
from kvbridge.stats import read_texts

from test_artifact import random_mapper


def _reseal(folder):
    (folder / CHECKSUMS_FILE).write_text("".join(f"{sha256_file(folder / n)}  {n}\n" for n in (CONFIG_FILE, WEIGHTS_FILE)))


def test_saving_never_replaces_a_folder_that_is_not_an_artifact(tmp_path):
    results = tmp_path / "results"
    results.mkdir()
    (results / "table.md").write_text("precious")
    with pytest.raises(ArtifactError, match="not a kvbridge artifact"):
        random_mapper().save_pretrained(results)
    assert (results / "table.md").read_text() == "precious"
    random_mapper().save_pretrained(tmp_path / "m")  # an earlier artifact is replaced, an empty folder is fine
    random_mapper(seed=1).save_pretrained(tmp_path / "m")
    (tmp_path / "empty").mkdir()
    random_mapper().save_pretrained(tmp_path / "empty")


def test_fit_refuses_a_non_artifact_out_before_loading_models(tiny_pair, tmp_path, capsys):
    source, target, texts = tiny_pair
    model_dir = tmp_path / "model"
    model_dir.mkdir()
    (model_dir / "config.json").write_text("{}")
    assert main(["fit", "--source", source, "--target", target, "--texts", texts, "--out", str(model_dir)]) == 1
    assert "not a kvbridge artifact" in capsys.readouterr().err and (model_dir / "config.json").read_text() == "{}"


def test_checksums_accept_binary_mode_and_upper_case_and_refuse_bytes(tmp_path):
    random_mapper().save_pretrained(tmp_path / "m")
    folder = tmp_path / "m"
    lines = [f"{sha256_file(folder / n).upper()} *{n}\n" for n in (CONFIG_FILE, WEIGHTS_FILE)]  # sha256sum -b
    (folder / CHECKSUMS_FILE).write_text("".join(lines))
    assert check_artifact(folder) == [] and set(read_checksums(folder)) == {CONFIG_FILE, WEIGHTS_FILE}
    (folder / CHECKSUMS_FILE).write_bytes(b"\xff\xfe" + "".join(lines).encode())
    with pytest.raises(ArtifactError, match="not text"):
        Mapper.from_pretrained(str(folder))
    assert main(["verify", str(folder)]) == 1


@pytest.mark.parametrize("poison", ["nan", "inf", "int32"])
def test_poisoned_weights_with_resealed_checksums_are_refused(tmp_path, poison):
    mapper = random_mapper()
    folder = tmp_path / "m"
    mapper.save_pretrained(folder)
    tensors = {n: t.clone() for n, t in mapper.weights.items()}
    if poison == "int32":
        tensors["key.0.weight"] = tensors["key.0.weight"].to(torch.int32)
    else:
        tensors["value.1.bias"][0] = float(poison)
    save_file(tensors, str(folder / WEIGHTS_FILE), metadata={"format": "kvbridge-mapper/2"})
    _reseal(folder)
    assert check_artifact(folder)  # verify sees it
    with pytest.raises(ArtifactError):
        Mapper.from_pretrained(str(folder))


def test_texts_that_are_not_utf8_name_the_file_and_line(tmp_path):
    path = tmp_path / "texts.txt"
    path.write_bytes(b"first line\nsecond \xff line\n")
    with pytest.raises(InputError, match=r"texts.txt:2 is not UTF-8"):
        read_texts(path)
    crlf = tmp_path / "crlf.txt"
    crlf.write_bytes(b"one\r\ntwo\r\n")
    assert read_texts(crlf) == ["one", "two"]
