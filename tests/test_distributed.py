"""A fit across two CPU processes (torchrun, gloo) equals the one-process fit."""

import json
import os
import subprocess
import sys

import torch
from conftest import FAST_FIT
from safetensors.torch import load_file

from kvbridge.cli import main


def test_two_process_torchrun_fit_equals_one_process_fit(tiny_pair, tmp_path):
    source, target, texts = tiny_pair
    # the levers keep their defaults: rank 0 fits them alone, on every sequence, as one process does
    options = ["--source", source, "--target", target, "--texts", texts, *FAST_FIT, "--num-texts", "9"]
    assert main(["fit", *options, "--out", str(tmp_path / "one")]) == 0
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join(sys.path))
    run = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                          "-m", "kvbridge", "fit", *options, "--out", str(tmp_path / "two")],
                         env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.count("saved and verified") == 1  # rank 0 alone writes
    one, two = load_file(str(tmp_path / "one" / "mapper.safetensors")), load_file(str(tmp_path / "two" /
                                                                                        "mapper.safetensors"))
    assert one.keys() == two.keys()
    for name in one:
        a, b = one[name], two[name]
        if a.is_floating_point():
            assert (a - b).norm() <= 1e-6 * a.norm() + 1e-12, name
        else:
            assert torch.equal(a, b), name
    fit_one = json.loads((tmp_path / "one" / "mapper.json").read_text())["fit"]
    fit_two = json.loads((tmp_path / "two" / "mapper.json").read_text())["fit"]
    assert fit_two["observations"] == fit_one["observations"] and fit_two["tokens"] == fit_one["tokens"]
    assert fit_two["calibration_token_ids_sha256"] == fit_one["calibration_token_ids_sha256"]
