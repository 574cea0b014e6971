"""Gap recovered, free generation and the third-party texts (kvbridge gap)."""

import gzip
import json
import math
import sysconfig

import pytest

from kvbridge.cli import main
from kvbridge.errors import InputError
from kvbridge.family import external
from kvbridge.measure.evaluate import TaskResult, gap_cell, gap_recovered, retention_table, target_leads
from kvbridge.measure.freegen import agreement, first_divergence, repetition


def _result(native, mapped, source, higher=True, task="cloze"):
    """A task over len(native) documents, one item each, its means from the per-item lists."""
    agg = (lambda v: sum(v) / len(v)) if higher else (lambda v: math.exp(sum(v) / len(v)))
    per = {"native": native, "mapped": mapped, "source": source}
    return TaskResult(task, "m", agg(native), agg(mapped), agg(source), 0.0, len(native), higher, per_item=per,
                      keys=list(range(len(native))))


def test_gap_recovered_is_the_share_of_the_targets_lead_kept():
    r = TaskResult("cloze", "acc", native=0.8, mapped=0.7, source=0.6, floor=0.25, items=1)
    assert gap_recovered(r) == pytest.approx(0.5)
    # perplexity: on log-perplexity, lower is better
    p = TaskResult("perplexity", "ppl", native=10.0, mapped=20.0, source=40.0, floor=80.0, items=1,
                   higher_is_better=False)
    assert gap_recovered(p) == pytest.approx(0.5)  # log 40 − log 20 over log 40 − log 10
    assert math.isnan(gap_recovered(TaskResult("c", "a", 0.6, 0.7, 0.6, 0.25, 1)))


def test_a_gap_inside_the_noise_is_not_printed_as_a_ratio():
    noisy = _result([1.0, 0.0] * 10, [1.0, 0.0] * 10, [0.0, 1.0] * 10)  # native − source: zero on average
    assert not target_leads(noisy)
    assert gap_cell(noisy).startswith("n/s")
    clear = _result([0.9] * 20, [0.6 + 0.01 * (i % 3) for i in range(20)], [0.3] * 20)
    assert target_leads(clear)
    cell = gap_cell(clear)
    assert cell.startswith(f"{100 * gap_recovered(clear):.0f}%") and "[" in cell
    table = retention_table([clear, noisy])
    assert "Gap recovered" in table.splitlines()[0] and "n/s" in table


def test_generation_measures():
    assert repetition([1, 2, 3, 4, 5, 6]) == 0.0
    assert repetition([1, 2, 3, 4] * 3) == pytest.approx(5 / 9)  # 9 four-grams, the last 5 seen before
    assert first_divergence([1, 2, 3], [1, 2, 4]) == 2 and first_divergence([1, 2], [1, 2]) == 2
    assert agreement([1, 9, 3, 9], [1, 2, 3, 4]) == 0.5


def _records(split, kind):
    path = external.EXTERNAL / f"{split}-{kind}.jsonl.gz"
    return [json.loads(line) for line in gzip.decompress(path.read_bytes()).decode().splitlines()]


def test_third_party_splits_are_other_peoples_packages_and_disjoint():
    stdlib = sysconfig.get_paths()["stdlib"]
    for kind in external.KINDS:
        seen = {}
        for split in external.SPLITS:
            records = _records(split, kind)
            assert len(records) >= 48 and [r["text"] for r in records] == external.external_texts(split, kind)
            seen[split] = {r["package"] for r in records}
            assert all(any(w in r["license"] for w in external.PERMISSIVE) for r in records)
            assert not any(r["path"].startswith(stdlib) for r in records)
            if kind == "code":
                assert seen[split] <= set(external.SPLITS[split])
        assert not seen["validation"] & seen["heldout"]  # choosing on one never sees the other
    with pytest.raises(InputError, match="no external split"):
        external.external_texts("train")


def test_gap_command_runs_and_writes_its_report(tmp_path, capsys):
    out = tmp_path / "gap"
    assert main(["gap", "--family", "default", "--lengths", "128", "--items", "4", "--new-tokens", "4", "--no-ttft",
                 "--quiet", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "Gap recovered" in printed and "agreement" in printed and "recall, written" in printed
    report = json.loads((out / "gap.json").read_text())
    cells = {c["task"]: c for c in report["lengths"][0]["cells"]}
    assert set(cells) == {"perplexity", "cloze", "recall, written", "agreement", "first divergence",
                          "distinct 4-grams"}
    # native agrees with itself everywhere: the generation measures compare like with like
    assert cells["agreement"]["native"] == 1.0 and cells["first divergence"]["native"] == 4.0
    assert report["hold_back"] == 256 and report["provenance"]["command"].startswith("kvbridge gap")
    # a saved report is tabled again without models; a file that is not one is refused clearly
    assert main(["gap", "--table", str(out / "gap.json")]) == 0
    assert "Mapped − native" in capsys.readouterr().out
    (tmp_path / "bad.json").write_text("{")
    assert main(["gap", "--table", str(tmp_path / "bad.json")]) == 1
    assert "not a readable gap.json" in capsys.readouterr().err


@pytest.mark.parametrize("argv,message", [
    (["--tasks", "perplexity,bogus"], "--tasks must name"),
    (["--lengths", "4096"], "positions these models support"),
    (["--family", "deep"], "only the default family ships a mapper"),
])
def test_gap_command_refuses_bad_input_clearly(argv, message, capsys):
    family = [] if "--family" in argv else ["--family", "default"]
    assert main(["gap", *family, "--items", "4", "--no-ttft", "--quiet", *argv]) == 1
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_lm_eval_table_prints_gap_recovered_where_the_target_leads_beyond_its_stderr():
    from kvbridge.measure.lm_eval_tasks import eval_table, metric_rows

    def run(acc, stderr):
        return {"results": {"arc_easy": {"acc,none": acc, "acc_stderr,none": stderr},
                            "piqa": {"acc,none": acc - 0.1, "acc_stderr,none": stderr}}, "n-shot": {}}

    results = {"native": run(0.80, 0.01), "mapped": run(0.70, 0.01), "source": run(0.60, 0.01)}
    results["source"]["results"]["piqa"]["acc,none"] = 0.69  # piqa: native 0.70 vs source 0.69, inside the noise
    rows = {r["task"]: r for r in metric_rows(results, ["arc_easy", "piqa"])}
    assert rows["arc_easy"]["gap_recovered"] == pytest.approx(0.5) and rows["piqa"]["gap_recovered"] is None
    table = eval_table(list(rows.values()))
    assert "| 50.0% |" in table and "n/s (target ≈ source)" in table
    assert len({line.count("|") for line in table.splitlines() if line.startswith("|")}) == 1  # columns line up
