"""Retention arithmetic against the published card, and the family tasks' mechanics."""

import pytest

from kvbridge.measure.evaluate import TaskResult, retention, retention_table

# (task, native %, mapped %, floor %, card raw %, card floor-normalized %)
CARD = [
    ("ARC-Challenge", 60.15, 57.34, 25, 95.32, 91.99),
    ("HellaSwag", 76.86, 74.13, 25, 96.45, 94.74),
    ("WinoGrande", 71.43, 67.01, 50, 93.81, 79.37),
    ("MMLU", 70.15, 58.96, 25, 84.05, 75.22),
    ("GSM8K strict", 82.94, 19.94, 0, 24.04, 24.04),
]


@pytest.mark.parametrize("task,native,mapped,floor,raw,norm", CARD)
def test_retention_reproduces_the_published_rows(task, native, mapped, floor, raw, norm):
    r, n = retention(native, mapped, floor)
    # the card computed from unrounded accuracies: agree to 0.05 percentage points
    assert 100 * r == pytest.approx(raw, abs=0.05)
    assert 100 * n == pytest.approx(norm, abs=0.05)


def test_mean_row_reproduces_the_card():
    results = [TaskResult(t, "acc", n / 100, m / 100, 0.0, f / 100, 1) for t, n, m, f, _, _ in CARD]
    table = retention_table(results)
    mean = table.splitlines()[-1]
    raw = sum(r.raw_retention for r in results) / len(results)
    norm = sum(r.floor_normalized_retention for r in results) / len(results)
    assert 100 * raw == pytest.approx(78.73, abs=0.05) and 100 * norm == pytest.approx(73.07, abs=0.05)
    assert "**Mean**" in mean


def test_perplexity_retention_is_the_share_of_context_benefit_kept():
    r = TaskResult("perplexity", "ppl", native=10.0, mapped=20.0, source=30.0, floor=40.0, items=1,
                   higher_is_better=False)
    assert r.raw_retention == pytest.approx(0.5)
    assert r.floor_normalized_retention == pytest.approx(0.5)  # log 40 − log 20 over log 40 − log 10
