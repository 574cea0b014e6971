"""kvbridge plan: the fit's predicted peak memory against a measured one, and the published geometry's plan."""

import json

import pytest
import torch
from conftest import build_tokenizer, corpus_texts, ministral3_config, save_model

from kvbridge.cli import main
from kvbridge.core.models import load_model
from kvbridge.errors import InputError, KVBridgeError
from kvbridge.fit import FitConfig, fit_mapper
from kvbridge.measure.plan import measured_peak, model_shape, plan, read_config

PLAIN = dict(lags=(0,), lever_inputs="same", mlp_hidden=0)


@pytest.fixture(scope="module")
def wide_pair(tmp_path_factory):
    """Small models with wide caches (4 layers × 4 KV heads × 64), so the fit's memory is the statistics'."""
    from transformers import Ministral3ForCausalLM

    root = tmp_path_factory.mktemp("wide")
    tokenizer = build_tokenizer(root / "tok")
    torch.manual_seed(0)
    source = Ministral3ForCausalLM(ministral3_config(len(tokenizer), 4, 64, 4, 64, theta=10000.0)).eval()
    target = Ministral3ForCausalLM(ministral3_config(len(tokenizer), 4, 96, 4, 64, theta=50000.0)).eval()
    return (load_model(save_model(source, tokenizer, root / "source")),
            load_model(save_model(target, tokenizer, root / "target")))


@pytest.mark.parametrize("texts, levers", [(8, False), (32, False), (16, True)])
def test_fit_peak_within_15_percent_of_the_plan(wide_pair, texts, levers):
    """A tensor-bytes account of the whole fit (CPU: host and device are one) against the plan's peak."""
    source, target = wide_pair
    config = FitConfig(num_texts=texts, seq_len=64, heldout_texts=0, batch_size=2, hold_back=4, mlp_steps=10,
                       tune_steps=5, **({} if levers else PLAIN))
    _, measured = measured_peak(lambda: fit_mapper(source, target, corpus_texts(200), config, progress=False))
    planned = plan(model_shape(source.model.config), model_shape(target.model.config), config, "cpu", "float32")
    assert abs(measured - planned["fit_peak_bytes"]) <= 0.15 * planned["fit_peak_bytes"], (measured, planned)


# The card's fit (500 × 1,024 tokens, stride 4, every source layer) measured on an NVIDIA H200 (bfloat16, random
# weights; `python -m kvbridge.measure.bench_real --fit`, CUDA allocator peak beyond the models): statistics in host
# memory (before they could live on the GPU) and on the GPU (the suite, docs/results/suite/suite-run1.json)
MEASURED_PUBLISHED_FIT_GIB = {"host": 11.17, "device": 35.345}


@pytest.mark.parametrize("totals", ["host", "device"])
def test_the_plan_predicts_the_published_fit_measured_on_a_gpu(totals):
    """The plan of the card's fit, statistics on either side, within 15 % of the peak an H200 measured."""
    from kvbridge.measure.bench_real import published_fit
    from kvbridge.measure.plan import Phase, device_peak

    planned = plan(model_shape(read_config("ministral3-3b-text")), model_shape(read_config("ministral3-8b-text")),
                   published_fit(500, 1024, 4), "cuda", "bfloat16", totals=totals)
    peak = device_peak([Phase(**p) for p in planned["fit_phases"]], "cuda", ("capture", "solve")) / 2**30
    assert abs(peak - MEASURED_PUBLISHED_FIT_GIB[totals]) <= 0.15 * MEASURED_PUBLISHED_FIT_GIB[totals], peak
    assert planned["fit_totals"] == totals


def test_published_geometry_fits_in_12_gib_beyond_the_models(tmp_path, capsys):
    """The card's fit (500 texts × 1,024 tokens, stride 4, all 26 source layers) and kvbridge fit's defaults,
    planned from the shipped configs: with the statistics in host memory the fit's own device memory stays under
    12 GiB (card: 16.08 GiB); kept on the GPU (the default there) they add their 24 GiB."""
    out = tmp_path / "plan.json"
    published = ["plan", "--source", "ministral3-3b-text", "--target", "mistralai/Ministral-3-8B-Reasoning-2512",
                 "--num-texts", "500", "--stride", "4", "--top-k", "all", "--lags", "0", "--lever-inputs", "same",
                 "--mlp-hidden", "0", "--json", str(out)]
    assert main(published + ["--statistics-on", "host"]) == 0
    plain = json.loads(out.read_text())
    assert "fit peak on cuda" in capsys.readouterr().out
    assert plain["fit_peak_bytes"] <= 12 * 2**30 and plain["fit_peak_phase"] == "solve"
    assert main(published) == 0
    on_gpu = json.loads(out.read_text())
    assert on_gpu["fit_totals"] == "device" and on_gpu["fit_peak_bytes_totals_on_host"] == plain["fit_peak_bytes"]
    assert on_gpu["fit_peak_bytes"] - plain["fit_peak_bytes"] >= 24 * 2**30
    capsys.readouterr()
    from kvbridge.measure.bench_real import _published_infos, published_config

    infos, _ = _published_infos()
    pair = infos["ministral3-3b-text"], infos["ministral3-8b-text"]
    assert plain["mapper_parameters"] == published_config(*pair, levers=False).num_parameters()  # the card's 1.85 B
    assert plain["fit_device_total_bytes"] == plain["fit_peak_bytes"] + plain["fit_models_bytes"]
    assert main(["plan", "--source", "ministral3-3b-text", "--target", "ministral3-8b-text", "--num-texts", "500",
                 "--stride", "4", "--statistics-on", "host", "--json", str(out)]) == 0
    levered = json.loads(out.read_text())
    assert levered["fit_peak_bytes"] <= 12 * 2**30
    assert levered["mapper_parameters"] == published_config(*pair, levers=True, top_k=1).num_parameters()  # defaults
    assert [p["name"] for p in levered["fit_phases"]] == ["capture", "solve", "lever solve", "lever MLP", "lever tune",
                                                     "mapper"]
    # memory is set by the geometry: a corpus ten times larger plans the same peak
    big = plan(model_shape(read_config("ministral3-3b-text")), model_shape(read_config("ministral3-8b-text")),
               FitConfig(num_texts=5000, stride=4, **PLAIN))
    small = plan(model_shape(read_config("ministral3-3b-text")), model_shape(read_config("ministral3-8b-text")),
                 FitConfig(num_texts=500, stride=4, **PLAIN))
    assert big["fit_peak_bytes"] == small["fit_peak_bytes"]


def test_plan_reads_folders_and_config_files_and_refuses_bad_ones(wide_pair, tmp_path, capsys):
    source, _ = wide_pair
    folder = tmp_path / "m"
    source.model.config.save_pretrained(folder)
    shape = model_shape(read_config(str(folder)))
    assert shape.parameters == sum(p.numel() for p in source.model.parameters())
    assert model_shape(read_config(str(folder / "config.json"))) == shape
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(InputError, match="JSON"):
        read_config(str(tmp_path / "bad.json"))
    (tmp_path / "empty.json").write_text("{}")
    with pytest.raises(InputError, match="model_type"):
        read_config(str(tmp_path / "empty.json"))
    with pytest.raises(KVBridgeError, match="shipped configs"):
        read_config(str(tmp_path / "missing" / "x"))
    (tmp_path / "gpt2.json").write_text(json.dumps({"model_type": "gpt2"}))  # no intermediate_size: not planned
    (tmp_path / "zero.json").write_text(json.dumps({**json.loads((folder / "config.json").read_text()),
                                                    "num_attention_heads": 0}))
    (tmp_path / "odd.json").write_text(json.dumps({"model_type": "no-such-model"}))
    for bad, message in (("gpt2.json", "intermediate_size"), ("zero.json", "heads"), ("odd.json", "cannot build")):
        assert main(["plan", "--source", str(tmp_path / bad), "--target", str(folder)]) == 1
        err = capsys.readouterr().err
        assert message in err and len(err.strip().splitlines()) == 1 and len(err) < 600, err
    for args, message in ((["--contexts", "12,x"], "--contexts"), (["--top-k", "99"], "--top-k"),
                          (["--lever-layers", "9"], "--lever-layers"), (["--contexts", "100000000"], "positions"),
                          (["--processes", "0"], "--processes")):
        assert main(["plan", "--source", str(folder), "--target", str(folder), "--seq-len", "64", *args]) == 1
        assert message in capsys.readouterr().err
    assert main(["plan", "--source", str(folder), "--target", str(folder), "--device", "cpu", "--seq-len", "64"]) == 0
    assert "float32 on cpu" in capsys.readouterr().out
