"""End to end through the command line on two tiny Ministral3 models of different depth."""

import json

import pytest

from kvbridge.cli import main


@pytest.fixture(scope="module")
def fitted(tiny_pair, tmp_path_factory):
    source, target, texts = tiny_pair
    out = tmp_path_factory.mktemp("fit") / "mapper"
    code = main(["fit", "--source", source, "--target", target, "--texts", texts, "--out", str(out),
                 "--num-texts", "12", "--seq-len", "64", "--stride", "2", "--top-k", "1", "--heldout-texts", "2",
                 "--mlp-steps", "30", "--tune-steps", "10", "--quiet"])  # (short lever training: not what it tests)
    assert code == 0
    return source, target, out


def test_fit_writes_a_verified_artifact_with_its_report(fitted, capsys):
    _, _, out = fitted
    meta = json.loads((out / "mapper.json").read_text())
    fit = meta["fit"]
    assert meta["format_version"] == 2 and meta["source"]["num_layers"] == 2 and meta["target"]["num_layers"] == 3
    assert meta["source"]["rope"]["parameters"]["rope_theta"] == 10000.0
    assert meta["target"]["rope"]["parameters"]["rope_theta"] == 50000.0
    assert all(len(sel) == 1 for sel in meta["selection"]["key"])  # --top-k 1
    assert fit["observations"] == 12 * 32 and fit["settings"]["stride"] == 2
    run = json.loads((out / "fit_report.json").read_text())  # volatile figures: beside, not in, the identity
    assert run["observations_per_second"] > 0 and run["peak_memory_bytes"] > 0 and "peak_memory_bytes" not in fit
    assert "fit_report.json" not in (out / "checksums.sha256").read_text()
    assert len(fit["key_r2_heldout"]) == 3 and len(fit["value_single_layer_r2"]) == 2
    assert "mean(diag(G_SS))" in fit["ridge_scaling"] and len(fit["calibration_sha256"]) == 64
    assert main(["verify", str(out)]) == 0
    assert main(["inspect", str(out)]) == 0
    shown = capsys.readouterr().out
    assert "2 layers × 2 kv heads × 16 dims" in shown and "held-out" in shown


def test_generate_compare_prints_both(fitted, capsys):
    source, target, out = fitted
    code = main(["generate", "--source", source, "--target", target, "--mapper", str(out), "--compare",
                 "--prompt", "Return a new dictionary", "--prompt", "The logging module provides a flexible",
                 "--max-new-tokens", "5"])
    assert code == 0
    shown = capsys.readouterr().out
    assert shown.count("--- native") == 2 and shown.count("--- mapped") == 2 and "ms for the batch" in shown
    assert "agreement:" in shown


def test_placement_options_name_each_part_s_device(fitted, capsys):
    """Source, mapper and target placed by name (here all CPU devices): the same answer as the default."""
    source, target, out = fitted
    common = ["generate", "--source", source, "--target", target, "--mapper", str(out), "--prompt",
              "Return a new dictionary", "--max-new-tokens", "4"]
    import re

    def answer():  # everything but the timing
        return re.sub(r"[0-9.]+ ms for the batch", "", capsys.readouterr().out)

    assert main(common) == 0
    default = answer()
    assert main([*common, "--device", "cpu", "--target-device", "cpu:0", "--mapper-device", "cpu"]) == 0
    assert answer() == default and "--- mapped" in default


def test_errors_are_messages_not_tracebacks(fitted, tiny_pair, tmp_path, capsys):
    source, target, out = fitted
    assert main(["fit", "--source", source, "--target", target, "--texts", str(tmp_path / "none.txt"),
                 "--out", str(tmp_path / "m")]) == 1
    err = capsys.readouterr().err
    assert "does not exist" in err and "Traceback" not in err
    assert not (tmp_path / "m").exists()
    # wrong pair: the mapper expects a 2-layer source
    assert main(["generate", "--source", target, "--target", target, "--mapper", str(out), "--prompt", "x y z"]) == 1
    assert "geometry" in capsys.readouterr().err
    # not enough text for the asked calibration size
    assert main(["fit", "--source", source, "--target", target, "--texts", tiny_pair[2], "--out", str(tmp_path / "m"),
                 "--num-texts", "100000", "--seq-len", "64", "--quiet"]) == 1
    assert "lower --num-texts" in capsys.readouterr().err
    assert not (tmp_path / "m").exists()


def test_family_stands_for_the_pair_and_is_checked(fitted, capsys, monkeypatch, tmp_path):
    import kvbridge.family as family

    source, target, out = fitted
    assert main(["generate", "--mapper", str(out), "--prompt", "def f(x):", "--max-new-tokens", "2"]) == 1
    assert "--family default|deep|deep-pruned" in capsys.readouterr().err
    assert main(["generate", "--family", "default", "--source", source, "--mapper", str(out), "--prompt", "x"]) == 1
    assert "not both" in capsys.readouterr().err
    monkeypatch.setitem(family.FAMILIES, "deep", tmp_path / "none")  # a deep family that was never trained here
    assert main(["generate", "--family", "deep", "--mapper", str(out), "--prompt", "x"]) == 1
    assert "train_deep" in capsys.readouterr().err
    # deep-pruned's target is the deep family's: missing, the error names the deep family's training
    assert main(["generate", "--family", "deep-pruned", "--mapper", str(out), "--prompt", "x"]) == 1
    assert "train_deep" in capsys.readouterr().err
    monkeypatch.setitem(family.FAMILIES, "deep-pruned", tmp_path / "none")
    assert main(["generate", "--family", "deep-pruned", "--mapper", str(out), "--prompt", "x"]) == 1
    assert "train_pruned" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["generate", "--family", "huge", "--mapper", str(out), "--prompt", "x"])
    # the family's models with a mapper of another pair: refused as any wrong pair is
    assert main(["generate", "--family", "default", "--mapper", str(out), "--prompt", "def f(x):"]) == 1
    assert "mapper" in capsys.readouterr().err


def test_help_lists_every_command(capsys):
    """`kvbridge --help` names every command main() dispatches, the serving ones (own parsers) included."""
    from kvbridge.cli.registry import COMMANDS, own_parser

    with pytest.raises(SystemExit):
        main(["--help"])
    listed = [line.split()[0] for line in capsys.readouterr().out.splitlines()
              if line.startswith("    ") and line[4] != " "]  # (a long name's summary on the next line, deeper)
    assert listed == [command.name for command in COMMANDS]
    for command in COMMANDS:  # each serving command's own parser is built (its --help)
        if command.serving:
            assert own_parser(command).prog == f"kvbridge {command.name}"
