"""Release files: `kvbridge card` renders result files into a Hub card, a manifest and a runnable example;
`kvbridge push` verifies first and fails in one line wherever the hub cannot be used."""

import json
import os
import subprocess
import sys

import pytest
from test_measurements import CARD

from kvbridge.cli import main
from kvbridge.core.hashing import sha256_file
from kvbridge.measure.lm_eval_tasks import metric_rows


@pytest.fixture(scope="module")
def artifact(tiny_pair, fast_mapper, tmp_path_factory):
    import shutil

    source, target, _ = tiny_pair
    out = tmp_path_factory.mktemp("card") / "mapper"  # its own copy: the card tests write into it
    shutil.copytree(fast_mapper, out)
    return source, target, out


def test_a_card_without_results_says_what_was_not_measured(artifact, capsys):
    _, _, out = artifact
    checksums = (out / "checksums.sha256").read_bytes()
    assert main(["card", str(out)]) == 0
    assert "not measured" in capsys.readouterr().out
    card = (out / "README.md").read_text()
    assert card.count("Not measured.") == 2 and "library_name: kvbridge" in card
    assert "base_model" not in card  # local folders are not hub models
    manifest = json.loads((out / "artifact_manifest.json").read_text())
    assert manifest["evaluation"] is None and manifest["latency"] is None
    assert manifest["identity"]["covered_by_checksums"] == ["mapper.safetensors", "mapper.json"]
    assert (out / "checksums.sha256").read_bytes() == checksums  # the card leaves the identity alone
    assert main(["verify", str(out)]) == 0
    assert "deliberately not covered" in capsys.readouterr().out


def test_the_card_renders_eval_and_bench_files_and_example_runs(artifact, tmp_path, capsys):
    source, target, out = artifact
    results = {"native": {"results": {}, "n-shot": {}}, "mapped": {"results": {}}}
    for task, native, mapped, _ in CARD:
        results["native"]["results"][task] = {"acc,none": native / 100}
        results["mapped"]["results"][task] = {"acc,none": mapped / 100}
    rows = metric_rows(results, [t for t, *_ in CARD])
    (tmp_path / "eval").mkdir()
    (tmp_path / "eval" / "results.json").write_text(json.dumps({"protocol": {"name": "card"}, "rows": rows,
                                                                "device": "CPU (2 threads)"}))
    bench = tmp_path / "bench.json"
    assert main(["bench", "--source", source, "--target", target, "--mapper", str(out), "--contexts", "16,32",
                 "--warmup", "0", "--trials", "1", "--json", str(bench)]) == 0
    capsys.readouterr()
    assert main(["card", str(out), "--eval", str(tmp_path / "eval"), "--bench", str(bench),
                 "--repo-id", "someone/tiny-mapper"]) == 0
    card = (out / "README.md").read_text()
    assert "Not measured" not in card and "73.07%" in card  # the card's own mean, rendered from the rows
    for row in json.loads(bench.read_text())["rows"]:
        assert f"**{row['ttft_speedup']:.2f}×**" in card
    assert "--mapper someone/tiny-mapper" in card
    manifest = json.loads((out / "artifact_manifest.json").read_text())
    assert manifest["evaluation"]["lm_eval"]["mean_floor_normalized_retention"] == pytest.approx(0.7307, abs=2e-4)
    assert all(sha256_file(out / f["name"]) == f["sha256"] for f in manifest["files"])
    run = subprocess.run([sys.executable, str(out / "example.py")], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0 and "mapped:" in run.stdout, run.stderr


def test_card_refuses_a_corrupted_artifact_and_bad_result_files(artifact, tmp_path, capsys):
    _, _, out = artifact
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    assert main(["card", str(out), "--bench", str(bad)]) == 1
    assert main(["card", str(out), "--eval", str(tmp_path)]) == 1
    assert main(["card", str(tmp_path)]) == 1
    err = capsys.readouterr().err
    assert "Traceback" not in err and err.count("error:") == 3


def _push(args, env, cwd):
    return subprocess.run([sys.executable, "-m", "kvbridge", "push", *args], capture_output=True, text=True,
                          env=os.environ | env, cwd=cwd, timeout=120)


@pytest.mark.parametrize("case", ["offline", "no token", "unreachable", "bad id", "corrupted"])
def test_push_fails_in_one_line_where_the_hub_cannot_be_used(artifact, tmp_path, case):
    import shutil

    _, _, out = artifact
    folder = tmp_path / "m"
    shutil.copytree(out, folder)
    env = {"HF_HOME": str(tmp_path / "hf"), "HF_HUB_OFFLINE": "0", "HF_TOKEN": "hf_not_a_real_token"}
    repo, needle = "someone/tiny-mapper", None
    if case == "offline":
        env["HF_HUB_OFFLINE"], needle = "1", "HF_HUB_OFFLINE"
    elif case == "no token":
        env["HF_TOKEN"], needle = "", "not logged in"
    elif case == "unreachable":  # huggingface_hub's own client against a closed port: nothing listens
        env["HF_ENDPOINT"], needle = "http://127.0.0.1:9", "cannot reach the hub"
    elif case == "bad id":
        repo, needle = "not a repo id", "not a hub id"
    else:
        (folder / "mapper.json").write_text("{}")
        needle = "does not verify"
    run = _push([str(folder), "--repo-id", repo], env, tmp_path)
    assert run.returncode == 1 and needle in run.stderr and "Traceback" not in run.stderr, run.stderr
    assert len(run.stderr.strip().splitlines()) <= 2


def test_card_refuses_unrenderable_inputs_and_writes_nothing(artifact, tmp_path, capsys):
    import shutil

    from test_reliability import _edit, _set

    _, _, out = artifact
    folder = tmp_path / "m"
    shutil.copytree(out, folder)
    for name in ("README.md", "artifact_manifest.json", "example.py"):
        (folder / name).unlink(missing_ok=True)
    demo = tmp_path / "demo.json"
    demo.write_text(json.dumps({"retention": {}, "latency": []}))
    assert main(["card", str(folder), "--demo", str(demo)]) == 1
    demo.write_text(json.dumps({"retention": {"256": {"recommended": [{"task": "x"}]}}, "latency": [{}]}))
    assert main(["card", str(folder), "--demo", str(demo)]) == 1
    assert main(["card", str(folder), "--license", ""]) == 1
    _edit(folder, _set(("fit", "key_r2_fit_mean"), "x"))  # resealed: verify passes, the card must not crash
    assert main(["card", str(folder)]) == 0
    err = capsys.readouterr().err
    assert "Traceback" not in err and err.count("error:") == 3


def test_a_frontier_json_of_the_old_format_is_refused_with_a_hint(tmp_path):
    import json

    from kvbridge.errors import InputError
    from kvbridge.release.card import read_frontier

    (tmp_path / "frontier.json").write_text(json.dumps({"points": [{"name": "plain", "ttft_speedup": 1.9}]}))
    with pytest.raises(InputError, match="older kvbridge.*kvbridge frontier --out"):
        read_frontier(tmp_path)
