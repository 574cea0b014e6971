"""Bad input loses nothing and gets a clear error: folders that are not artifacts, corrupted files, bad text."""


import json
import os
import random
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch
from conftest import FAST_FIT
from safetensors.torch import save_file
from test_artifact import random_mapper

from kvbridge import Mapper
from kvbridge.cli import main
from kvbridge.core.artifact import (
    CHECKSUMS_FILE,
    CONFIG_FILE,
    WEIGHTS_FILE,
    leftovers,
    read_checksums,
    recover_interrupted_save,
    verify_artifact,
)
from kvbridge.core.hashing import sha256_file
from kvbridge.core.mapper import check_mapper
from kvbridge.errors import ArtifactError, CompatibilityError, InputError, KVBridgeError
from kvbridge.fit.texts import read_texts


def _reseal(folder):
    (folder / CHECKSUMS_FILE).write_text("".join(f"{sha256_file(folder / n)}  {n}\n"
                                                 for n in (CONFIG_FILE, WEIGHTS_FILE)))


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
    assert check_mapper(folder) == [] and set(read_checksums(folder)) == {CONFIG_FILE, WEIGHTS_FILE}
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
    assert check_mapper(folder)  # verify sees it
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


# -- the battery: each class of bad input, poisoned artifact and interrupted write ----------------
FAST = FAST_FIT


@pytest.fixture(scope="module")
def fitted(tiny_pair, fast_mapper):
    source, target, texts = tiny_pair
    return source, target, texts, fast_mapper  # read only here


def _edit(folder, change):
    data = json.loads((folder / CONFIG_FILE).read_text())
    data = change(data)
    (folder / CONFIG_FILE).write_text(data if isinstance(data, str) else json.dumps(data))
    _reseal(folder)


def _set(path, value):
    def change(data):
        node = data
        for key in path[:-1]:
            node = node[key]
        if value is KeyError:
            del node[path[-1]]
        else:
            node[path[-1]] = value
        return data
    return change


MAPPER_JSON_EDITS = {
    "a list": lambda d: [],
    "null": lambda d: None,
    "a number": lambda d: 7,
    "deep nesting": lambda d: "[" * 100_000 + "]" * 100_000,
    "null head count": _set(("source", "num_kv_heads"), None),
    "float layer count": _set(("target", "num_layers"), 4.0),
    "string head dim": _set(("target", "head_dim"), "8"),
    "negative positions": _set(("source", "max_positions"), -1),
    "boolean layers": _set(("source", "num_layers"), True),
    "missing target": _set(("target",), KeyError),
    "missing selection": _set(("selection",), KeyError),
    "selection of strings": _set(("selection", "key"), [["0"]] * 4),
    "selection too short": _set(("selection", "value"), [[0]]),
    "selection out of range": _set(("selection", "key"), [[0, 9]] * 4),
    "version 0": _set(("format_version",), 0),
    "version -7": _set(("format_version",), -7),
    "version '1'": _set(("format_version",), "1"),
    "version 1.0": _set(("format_version",), 1.0),
    "version 99": _set(("format_version",), 99),
    "format other": _set(("format",), "something-else"),
    "rope not an object": _set(("target", "rope"), "yarn"),
    "rope parameters nested": _set(("target", "rope", "parameters"), {"a": {"b": 1}}),
    "runtime hold_back 0": _set(("runtime",), {"hold_back": 0}),
    "runtime hold_back true": _set(("runtime",), {"hold_back": True}),
    "runtime recompute 2": _set(("runtime",), {"recompute": 2}),
    "runtime criterion unknown": _set(("runtime",), {"recompute_by": "magic"}),
    "runtime window even": _set(("runtime",), {"recompute_window": 4}),
    "runtime window 0": _set(("runtime",), {"recompute_window": 0}),
    "runtime native layers -1": _set(("runtime",), {"native_layers": -1}),
    "runtime every layer native": _set(("runtime",), {"native_layers": 99}),
    "levers not a list": _set(("levers",), {"kind": "key"}),
    "lever of a missing layer": _set(("levers",), [{"kind": "key", "layer": 9}]),
    "lever with a bad kind": _set(("levers",), [{"kind": "query", "layer": 0}]),
    "lever lags unsorted": _set(("levers",), [{"kind": "key", "layer": 0, "lags": [2, 0]}]),
    "fit a list": _set(("fit",), []),
    "tokenizer hash a number": _set(("source", "tokenizer_sha256"), 5),
}


@pytest.mark.parametrize("edit", sorted(MAPPER_JSON_EDITS))
def test_every_mapper_json_edit_is_one_clear_refusal(tmp_path, edit, capsys):
    folder = tmp_path / "m"
    random_mapper().save_pretrained(folder)
    _edit(folder, MAPPER_JSON_EDITS[edit])
    with pytest.raises(ArtifactError) as caught:
        Mapper.from_pretrained(str(folder))
    assert "\n" not in str(caught.value) and len(str(caught.value)) < 400
    assert check_mapper(folder)
    assert main(["verify", str(folder)]) == 1 and main(["inspect", str(folder)]) == 1
    assert "Traceback" not in capsys.readouterr().err


def test_optional_fields_may_be_missing(tmp_path, capsys):
    folder = tmp_path / "m"
    random_mapper().save_pretrained(folder)
    _edit(folder, lambda d: {k: v for k, v in d.items() if k not in ("fit", "levers", "runtime", "num_parameters")})
    Mapper.from_pretrained(str(folder))
    assert main(["inspect", str(folder)]) == 0 and main(["verify", str(folder)]) == 0


@pytest.mark.parametrize("name", [CONFIG_FILE, WEIGHTS_FILE, CHECKSUMS_FILE])
def test_sampled_byte_flips_in_every_file_are_refused(tmp_path, name):
    folder = tmp_path / "m"
    random_mapper().save_pretrained(folder)
    original = (folder / name).read_bytes()
    rng = random.Random(name)
    for offset in rng.sample(range(len(original)), 24):
        data = bytearray(original)
        data[offset] ^= 1 << rng.randrange(8)
        (folder / name).write_bytes(bytes(data))
        with pytest.raises(ArtifactError):
            Mapper.from_pretrained(str(folder))
        assert check_mapper(folder), offset
    (folder / name).write_bytes(original)
    assert check_mapper(folder) == []


def test_loading_reads_no_tensor_before_the_header_matches(tmp_path, monkeypatch):
    import safetensors

    mapper = random_mapper()
    folder = tmp_path / "m"
    mapper.save_pretrained(folder)
    tensors = {n: t.clone() for n, t in mapper.weights.items()} | {"junk": torch.zeros(1 << 22)}  # 16 MB unknown
    save_file(tensors, str(folder / WEIGHTS_FILE), metadata={"format": "kvbridge-mapper/2"})
    _reseal(folder)
    reads = []
    real = safetensors.safe_open

    class Counting:
        def __init__(self, *args, **kwargs):
            self.handle = real(*args, **kwargs)

        def __enter__(self):
            self.inner = self.handle.__enter__()
            return self

        def __exit__(self, *exc):
            return self.handle.__exit__(*exc)

        def get_tensor(self, name):
            reads.append(name)
            return self.inner.get_tensor(name)

        def __getattr__(self, name):
            return getattr(self.inner, name)

    monkeypatch.setattr(safetensors, "safe_open", Counting)
    with pytest.raises(ArtifactError, match="unexpected tensor junk"):
        Mapper.from_pretrained(str(folder))
    assert reads == []


def test_identical_fits_have_identical_checksums(tiny_pair, tmp_path):
    from kvbridge.core.models import load_model
    from kvbridge.fit import FitConfig, fit_mapper

    source_dir, target_dir, texts = tiny_pair
    source, target = load_model(source_dir), load_model(target_dir)
    config = FitConfig(num_texts=6, seq_len=64, heldout_texts=2, mlp_steps=20, tune_steps=10, hold_back=4)
    for name in ("a", "b"):
        fit_mapper(source, target, read_texts(texts), config, progress=False).save_pretrained(tmp_path / name)
    assert (tmp_path / "a" / CHECKSUMS_FILE).read_bytes() == (tmp_path / "b" / CHECKSUMS_FILE).read_bytes()
    assert json.loads((tmp_path / "a" / "fit_report.json").read_text())["fit_seconds"] > 0


def test_other_weights_in_the_same_folder_layout_are_refused(tiny_pair, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from kvbridge.core.models import load_model
    from kvbridge.core.transfer import Bridge

    _, target_dir, _ = tiny_pair
    model = AutoModelForCausalLM.from_pretrained(target_dir)
    torch.manual_seed(123)
    with torch.no_grad():  # re-initialized: same config, same tokenizer, other weights
        for param in model.parameters():
            param.normal_(0.0, 0.02)
    model.save_pretrained(tmp_path / "reinit")
    AutoTokenizer.from_pretrained(target_dir).save_pretrained(tmp_path / "reinit")
    original, reinit = load_model(target_dir), load_model(str(tmp_path / "reinit"))
    assert original.info.weights_sha256 and original.info.weights_sha256 != reinit.info.weights_sha256
    mapper = Mapper.identity(original.info)
    Bridge(original, original, mapper)
    with pytest.raises(CompatibilityError, match="weights differ"):
        Bridge(reinit, reinit, mapper)
    Bridge(reinit, reinit, mapper, allow_revision_mismatch=True)  # the override, as for revisions


# -- interrupted and concurrent saves -----------------------------------------------------------------
_KILL = r"""
import os, shutil, sys
sys.path.insert(0, sys.argv[3])
from kvbridge.core import artifact
from test_artifact import random_mapper
point, dest = sys.argv[1], sys.argv[2]
die = lambda *a, **k: os._exit(9)
if point == "writing":
    import safetensors.torch
    real = safetensors.torch.save_file
    def partial(tensors, path, metadata=None):
        open(path, "wb").write(b"half")
        die()
    safetensors.torch.save_file = partial
elif point == "before-swap":
    artifact._swap_in = die
elif point == "after-exchange":
    shutil.rmtree = die
elif point == "between-renames":
    artifact._rename_exchange = lambda a, b: False
    real_rename, calls = os.rename, []
    def rename(a, b):
        calls.append(a)
        if len(calls) == 2:
            die()
        real_rename(a, b)
    os.rename = rename
elif point == "removing-old":
    artifact._rename_exchange = lambda a, b: False
    real_rmtree = shutil.rmtree
    def half(path, *a, **k):
        os.remove(os.path.join(path, "mapper.safetensors"))
        die()
    shutil.rmtree = half
random_mapper(1).save_pretrained(dest)
"""


@pytest.mark.parametrize("point", ["writing", "before-swap", "after-exchange", "between-renames", "removing-old"])
def test_a_save_killed_at_any_step_loses_nothing_and_the_next_save_cleans_up(tmp_path, point):
    dest = tmp_path / "m"
    random_mapper(0).save_pretrained(dest)
    old = (dest / WEIGHTS_FILE).read_bytes()
    new_mapper = random_mapper(1)
    tests_dir = str(Path(__file__).parent)
    run = subprocess.run([sys.executable, "-c", _KILL, point, str(dest), tests_dir], capture_output=True, text=True)
    assert run.returncode == 9, run.stderr
    if point == "between-renames":  # the one window without a folder: load names the leftovers
        assert not dest.exists()
        with pytest.raises(ArtifactError, match="interrupted save"):
            Mapper.from_pretrained(str(dest))
        assert main(["verify", str(dest)]) == 1
        done = recover_interrupted_save(dest)  # the interrupted save's complete new artifact comes back
        assert done[0].startswith("restored") and verify_artifact(dest) == []
        assert torch.equal(Mapper.from_pretrained(str(dest)).weights["key.0.weight"],
                           new_mapper.weights["key.0.weight"])
        random_mapper(0).save_pretrained(tmp_path / ".m.old-zzzzzzzz")  # a leftover for the save below
    else:  # the old artifact, or the complete new one, is in place and verifies
        assert verify_artifact(dest) == []
        loaded = Mapper.from_pretrained(str(dest))
        expected = new_mapper if point in ("after-exchange", "removing-old") else random_mapper(0)
        assert torch.equal(loaded.weights["key.0.weight"], expected.weights["key.0.weight"])
        if point in ("writing", "before-swap"):
            assert (dest / WEIGHTS_FILE).read_bytes() == old
    assert leftovers(dest)  # the kill left its temporary folder ...
    random_mapper(2).save_pretrained(dest)  # ... which the next save removes (or restores first)
    assert leftovers(dest) == [] and sorted(p.name for p in tmp_path.iterdir()) == ["m"]
    assert torch.equal(Mapper.from_pretrained(str(dest)).weights["key.0.weight"],
                       random_mapper(2).weights["key.0.weight"])


def test_a_missing_artifact_is_restored_only_in_the_two_renames_state(tmp_path):
    dest = tmp_path / "m"
    random_mapper(3).save_pretrained(tmp_path / ".m.tmp-abcd1234")  # complete new artifact ...
    assert recover_interrupted_save(dest) == ["removed .m.tmp-abcd1234"]  # ... alone: no evidence of a swap
    assert not dest.exists()
    random_mapper(3).save_pretrained(tmp_path / ".m.tmp-abcd1234")
    random_mapper(4).save_pretrained(tmp_path / ".m.old-abcd5678")  # killed between the two renames
    (tmp_path / ".m.tmp-half0000").mkdir()  # a save killed while writing: incomplete
    done = recover_interrupted_save(dest)
    assert done[0] == f"restored {dest} from .m.tmp-abcd1234" and len(done) == 3
    assert verify_artifact(dest) == [] and leftovers(dest) == []
    assert torch.equal(Mapper.from_pretrained(str(dest)).weights["key.0.weight"],
                       random_mapper(3).weights["key.0.weight"])


def test_leftovers_match_exactly_their_folder(tmp_path):
    for name in (".run[1].tmp-abcd1234", ".run1.tmp-abcd1234", ".run[1].tmp-x", ".run[1].tmp.tmp-abcd1234"):
        (tmp_path / name).mkdir()
    assert [p.name for p in leftovers(tmp_path / "run[1]")] == [".run[1].tmp-abcd1234"]


def test_rename_exchange_swaps_two_folders(tmp_path):
    from kvbridge.core.artifact import _rename_exchange

    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    (tmp_path / "a" / "x").write_text("a")
    (tmp_path / "b" / "x").write_text("b")
    if not _rename_exchange(tmp_path / "a", tmp_path / "b"):
        pytest.skip("no rename-exchange on this platform or filesystem (saves use two renames)")
    assert (tmp_path / "a" / "x").read_text() == "b" and (tmp_path / "b" / "x").read_text() == "a"


def test_saving_through_a_symlink_replaces_its_target_and_keeps_the_link(tmp_path):
    (tmp_path / "real").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "real", target_is_directory=True)
    random_mapper(0).save_pretrained(tmp_path / "link")
    random_mapper(1).save_pretrained(tmp_path / "link")
    assert (tmp_path / "link").is_symlink() and verify_artifact(tmp_path / "real") == []
    assert torch.equal(Mapper.from_pretrained(str(tmp_path / "link")).weights["key.0.weight"],
                       random_mapper(1).weights["key.0.weight"])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["link", "real"]


def test_an_artifact_folder_with_other_files_is_not_replaced(tmp_path):
    random_mapper(0).save_pretrained(tmp_path / "m")
    (tmp_path / "m" / ".gitattributes").write_text("*.safetensors filter=lfs")
    with pytest.raises(ArtifactError, match=r"also holds \.gitattributes"):
        random_mapper(1).save_pretrained(tmp_path / "m")
    assert (tmp_path / "m" / ".gitattributes").exists()


def test_concurrent_saves_to_one_folder_queue_and_one_wins(tmp_path):
    dest = tmp_path / "m"
    mappers = [random_mapper(seed) for seed in range(4)]
    errors = []

    def save(mapper):
        try:
            for _ in range(3):
                mapper.save_pretrained(dest)
        except Exception as exc:  # noqa: BLE001  (any exception fails the test below)
            errors.append(exc)

    threads = [threading.Thread(target=save, args=(m,)) for m in mappers]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == [] and verify_artifact(dest) == [] and leftovers(dest) == []
    final = Mapper.from_pretrained(str(dest)).weights["key.0.weight"]
    assert any(torch.equal(final, m.weights["key.0.weight"]) for m in mappers)


def test_artifact_folders_follow_the_umask(tmp_path):
    old = os.umask(0o022)
    try:
        random_mapper().save_pretrained(tmp_path / "m")
    finally:
        os.umask(old)
    assert (tmp_path / "m").stat().st_mode & 0o777 == 0o755
    assert (tmp_path / "m" / WEIGHTS_FILE).stat().st_mode & 0o777 == 0o644


# -- bad inputs: one line from kvbridge, before any model is loaded where it can be ------------------
def _fails(argv, capsys, *needles):
    assert main(argv) == 1, argv
    err = capsys.readouterr().err
    assert "Traceback" not in err and "error:" in err, err
    for needle in needles:
        assert needle in err, (needle, err)
    return err


def test_output_paths_are_checked_before_the_work(fitted, tmp_path, capsys):
    source, target, texts, mapper = fitted
    a_file = tmp_path / "file"
    a_file.write_text("x")
    pair = ["--source", source, "--target", target]
    _fails(["fit", *pair, "--texts", texts, "--out", str(a_file / "m"), *FAST], capsys, "is a file")
    _fails(["fit", *pair, "--texts", texts, "--out", "/proc/kvbridge-test", *FAST], capsys, "cannot write")
    _fails(["fit", *pair, "--texts", texts, "--out", ".", *FAST], capsys, "names no folder")
    _fails(["bench", *pair, "--mapper", str(mapper), "--json", str(tmp_path)], capsys, "is a folder")
    _fails(["bench", *pair, "--mapper", str(mapper), "--plot", str(a_file / "p.png")], capsys, "is a file")
    _fails(["diagnose", *pair, "--mapper", str(mapper), "--texts", texts, "--out", str(a_file)], capsys, "is a file")
    _fails(["demo", "--out", str(a_file)], capsys, "is a file")
    _fails(["frontier", "--out", str(a_file / "x"), "--quick"], capsys, "is a file")
    for items, says in (("3", "at least 4"), ("100000", "rows of 128 tokens")):  # before any fit, nothing written
        _fails(["frontier", "--out", str(tmp_path / "f"), "--quick", "--items", items], capsys, says)
        assert not (tmp_path / "f").exists()
    assert a_file.read_text() == "x" and sorted(p.name for p in tmp_path.iterdir()) == ["file"]


def test_bad_cli_inputs_are_one_line_errors(fitted, tmp_path, capsys):
    source, target, texts, mapper = fitted
    pair = ["--source", source, "--target", target]
    gen = ["generate", *pair, "--mapper", str(mapper), "--prompt", "def main"]
    out = ["--out", str(tmp_path / "m")]
    _fails(["fit", *pair, "--texts", texts, *out, *FAST, "--seq-len", "100000"], capsys, "positions")
    _fails(["fit", *pair, "--texts", texts, *out, *FAST, "--top-k", "99"], capsys, "--top-k 99")
    _fails(["fit", *pair, "--texts", texts, *out, *FAST, "--native-layers", "3"], capsys, "--native-layers 3")
    _fails(["fit", *pair, "--texts", texts, *out, *FAST, "--source-depth", "5"], capsys, "--source-depth 5")
    _fails(["fit", *pair, "--texts", texts, *out, *FAST, "--source-depth", "0"], capsys, "--source-depth")
    _fails(["fit", *pair, "--texts", texts, *out, *FAST, "--ridge", "inf"], capsys, "--ridge")
    _fails(["fit", *pair, "--texts", texts, *out, *FAST, "--ridge", "1e300"], capsys, "--ridge")
    _fails(["fit", *pair, "--texts", texts, *out, *FAST, "--device", "bogus"], capsys, "not a device")
    _fails(["fit", "--source", "not a/valid id", "--target", target, "--texts", texts, *out, *FAST], capsys,
           "valid hub id")
    _fails(["fit", "--source", "", "--target", target, "--texts", texts, *out, *FAST], capsys,
           "give --source and --target")
    _fails([*gen, "--mapper-device", "bogus"], capsys, "not a device")
    _fails([*gen, "--max-new-tokens", "0"], capsys, "--max-new-tokens")
    _fails([*gen, "--sample", "--temperature", "0"], capsys, "temperature")
    _fails([*gen, "--sample", "--top-p", "1.5"], capsys, "top_p")
    _fails(["diagnose", *pair, "--mapper", str(mapper), "--texts", texts, "--items", "0"], capsys, "--items")
    _fails(["diagnose", *pair, "--mapper", str(mapper), "--texts", texts, "--seq-len", "1"], capsys, "--seq-len")
    _fails([*gen, "--seed", str(2**70), "--sample"], capsys, "--seed")
    _fails([*gen, "--target-device", "meta"], capsys, "not meta")
    assert len(_fails([*gen, "--mapper-device", "xla"], capsys, "not xla").strip().splitlines()) == 1
    _fails(["fit", *pair, "--texts", texts, *out, *FAST, "--mlp-hidden", str(2**62)], capsys, "--mlp-hidden")
    _fails(["fit", *pair, "--texts", str(tmp_path), *out, *FAST], capsys, "is a folder")
    _fails(["fit", *pair, "--texts", "", *out, *FAST], capsys, "no texts file")
    _fails(["eval", *pair, "--mapper", str(mapper), "--limit", "nan"], capsys, "--limit")
    _fails(["eval", *pair, "--mapper", str(mapper), "--batch-size", "0"], capsys, "--batch-size")
    with pytest.raises(SystemExit):  # an empty list is a usage error, not "no levers"
        main(["fit", *pair, "--texts", texts, *out, "--lever-layers", ","])
    capsys.readouterr()
    with pytest.raises(SystemExit):  # a usage error that says what --top-k takes
        main(["fit", *pair, "--texts", texts, *out, "--top-k", "most"])
    assert "--top-k: expected a number of source layers or 'all'" in capsys.readouterr().err
    if not torch.cuda.is_available():
        _fails([*gen, "--device", "cuda"], capsys, "no cuda device")
    assert not (tmp_path / "m").exists()


def test_texts_files_with_json_traps_name_the_line(tmp_path):
    deep = tmp_path / "deep.jsonl"
    deep.write_text('{"text": "fine"}\n' + "[" * 100_000 + "]" * 100_000 + "\n")
    with pytest.raises(InputError, match="deep.jsonl:2"):
        read_texts(deep)
    lone = tmp_path / "lone.jsonl"
    lone.write_text('{"text": "a\\ud800b"}\n')
    with pytest.raises(InputError, match="lone.jsonl:1"):
        read_texts(lone)


@pytest.mark.parametrize("edit", ["settings a string", "huge head count", "huge table"])
def test_inspect_survives_what_verify_refuses(tmp_path, edit, capsys):
    folder = tmp_path / "m"
    random_mapper().save_pretrained(folder)
    change = {"settings a string": _set(("fit", "settings"), "junk"),
              "huge head count": _set(("target", "num_kv_heads"), 10**30),
              "huge table": _set(("runtime",), {"bigram_pairs": 10**30})}[edit]
    _edit(folder, change)
    assert main(["inspect", str(folder)]) == 1 and main(["verify", str(folder)]) == 1
    assert "Traceback" not in capsys.readouterr().err


@pytest.mark.parametrize("settings", [{"num_texts": "8"}, {"ridge": "x"}, {"seq_len": None}, {"lags": 5},
                                      {"num_texts": 8.5}, {"lags": "012"}, {"hold_back": True}, {"sink": 1},
                                      {"seed": 2**70}])
def test_fit_settings_of_the_wrong_type_name_the_setting(settings):
    from kvbridge.fit import FitConfig

    with pytest.raises(InputError, match=next(iter(settings))):
        FitConfig(**settings)


def test_fit_mapper_refuses_what_is_not_a_model_a_config_or_texts(tiny_pair):
    from kvbridge.core.models import load_model
    from kvbridge.fit import FitConfig, fit_mapper

    source_dir, target_dir, _ = tiny_pair
    source, target = load_model(source_dir), load_model(target_dir)
    for args in ((source_dir, target, ["x"], FitConfig()), (source, target, ["x"], {"num_texts": 8}),
                 (source, target, "hello world", FitConfig())):
        with pytest.raises(InputError):
            fit_mapper(*args, progress=False)


def test_bad_python_inputs_raise_kvbridge_errors(fitted):
    from kvbridge.core.transfer import Bridge

    source, target, _, mapper = fitted
    bridge = Bridge.from_pretrained(source, target, str(mapper))
    import numpy as np

    assert bridge.pad([[np.int64(3), np.int64(4)]])[0].tolist() == [[3, 4]]  # numpy integers are token ids
    for call in (lambda: bridge.generate([]), lambda: bridge.generate(""),
                 lambda: bridge.generate("x", max_new_tokens=0),
                 lambda: bridge.generate("def f", do_sample=True, temperature=0.0),
                 lambda: bridge.generate("def f", do_sample=True, num_return_sequences=2),
                 lambda: bridge.generate("def f", num_beams=3),
                 lambda: bridge.generate("def f", max_new_tokens=2.5), lambda: bridge.score([], []),
                 lambda: bridge.score(["a"], []), lambda: bridge.score(["def f"], [""]),
                 lambda: Bridge.from_pretrained(source, target, str(mapper), device="bogus"),
                 lambda: Mapper.from_pretrained(str(mapper), device="nonsense"),
                 lambda: Mapper.from_pretrained(""), lambda: bridge.generate("def f(x):\udcff"),
                 lambda: bridge.generate(5), lambda: bridge.score(["def f"], [None]),
                 lambda: Mapper.from_pretrained(None), lambda: Mapper.from_pretrained(123),
                 lambda: Bridge(None, bridge.target, bridge.mapper), lambda: Bridge(bridge.source, bridge.target, None),
                 lambda: Bridge(bridge.source, bridge.target, bridge.mapper, hold_back="4"),
                 lambda: Bridge(bridge.source, bridge.target, bridge.mapper, recompute="x"),
                 lambda: Bridge(bridge.source, bridge.target, bridge.mapper, sink="yes"),
                 lambda: bridge.generate("def f", max_new_tokens="3"), lambda: bridge.generate("def f", bogus_kwarg=1),
                 lambda: bridge.score_ids([[1.5, 2]], [[2]]), lambda: bridge.encode("def f", max_new_tokens=-1),
                 lambda: bridge.generate_ids(torch.ones(1, 4), torch.ones(1, 4)),
                 lambda: bridge.generate_ids(torch.ones(1, 4, dtype=torch.long), torch.ones(1, 3)),
                 lambda: bridge.generate_ids(torch.full((1, 4), 10**6), torch.ones(1, 4)),
                 lambda: bridge.first_token_logits([[1, 2, 3]], [[1, 1, 1]]),
                 lambda: bridge.mapper.map([], []), lambda: bridge.mapper.map(None, None),
                 lambda: bridge.mapper.map([torch.zeros(1, 2, 3, 4)], [torch.zeros(1, 2, 3, 4)]),
                 lambda: bridge.mapper.save_pretrained(None)):
        with pytest.raises(KVBridgeError):
            call()


@pytest.mark.parametrize("module", ["matplotlib", "lm_eval"])
def test_a_missing_optional_dependency_is_one_line_before_any_work(fitted, monkeypatch, tmp_path, capsys, module):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == module else real(name, *a))
    source, target, texts, mapper = fitted
    pair = ["--source", source, "--target", target, "--mapper", str(mapper)]
    if module == "matplotlib":
        runs = [["diagnose", *pair, "--texts", texts, "--out", str(tmp_path / "d")],
                ["bench", *pair, "--plot", str(tmp_path / "b.png")], ["frontier", "--out", str(tmp_path / "f")]]
    else:
        runs = [["eval", *pair, "--tasks", "kvbridge_family_cloze"], ["lm-eval", "--tasks", "x"]]
    for argv in runs:
        err = _fails(argv, capsys, 'pip install "kvbridge[')
        assert len(err.strip().splitlines()) == 1, err
