"""Standard benchmarks through lm-evaluation-harness: native vs mapped (vs source), the card's table.

Also the two offline tasks shipped with kvbridge (``kvbridge_family_cloze``: multiple choice,
``kvbridge_family_recall``: generative), built once from the embedded family's held-out split, so the
harness integration is exercised with no network. lm-eval is imported here and in
:mod:`kvbridge.measure.lm_eval_model` only (``pip install "kvbridge[eval]"``).
"""

from __future__ import annotations

import json
import math
import random
import shutil
import tempfile
from pathlib import Path

from ..errors import InputError
from .evaluate import CHOICE_TOKENS, cloze_items, frequent_ids, heldout_rows, recall_items, retention

TASKS_DIR = Path(__file__).parents[1] / "tasks"  # kvbridge/tasks
# the two offline tasks at the two lengths of the family tasks (contexts of 256 and 1,024 tokens)
LOCAL_TASKS = ("kvbridge_family_cloze", "kvbridge_family_recall", "kvbridge_family_cloze_1024",
               "kvbridge_family_recall_1024")
LOCAL_LENGTHS = {"": 256, "_1024": 1024}
# chance level per task family (prefix match): 4-way multiple choice, 2-way WinoGrande, free answers 0
FLOORS = {"arc": 0.25, "hellaswag": 0.25, "mmlu": 0.25, "winogrande": 0.5, "gsm8k": 0.0,
          "kvbridge_family_cloze": 0.25, "kvbridge_family_recall": 0.0}
# The one metric of each task that enters the mean (prefix match, longest first); the card's choices.
# Other metrics of a task are listed after the mean. Unknown tasks: "acc" if reported, else the first metric.
PRIMARY = {"arc": "acc_norm", "hellaswag": "acc_norm", "mmlu": "acc", "winogrande": "acc",
           "gsm8k": "exact_match,strict-match", "kvbridge_family_cloze": "acc", "kvbridge_family_recall": "exact_match"}
# Few-shot examples per task. "default": each task's own (or --num-fewshot for all). "card": the published
# card's protocol, which lm-eval's defaults do not give (its mmlu is 0-shot, and --num-fewshot is global).
PROTOCOLS: dict[str, dict[str, int]] = {
    "default": {},
    "card": {"arc_challenge": 0, "hellaswag": 0, "winogrande": 0, "mmlu": 5, "gsm8k_cot": 8, "gsm8k": 8},
}
LOWER_IS_BETTER = ("perplexity", "bits_per_byte")
RECALL_ANSWER_TOKENS = 3

_CLOZE_YAML = """task: {name}
dataset_path: json
dataset_kwargs:
  data_files:
    test: {path}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{context}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{label}}}}"
target_delimiter: ""
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
metadata:
  version: 1.0
"""

_RECALL_YAML = """task: {name}
dataset_path: json
dataset_kwargs:
  data_files:
    test: {path}
test_split: test
output_type: generate_until
doc_to_text: "{{{{context}}}}"
doc_to_target: "{{{{answer}}}}"
target_delimiter: ""
generation_kwargs:
  until: ["\\n\\n\\n"]
  max_gen_toks: {max_tokens}
  do_sample: false
metric_list:
  - metric: exact_match
    aggregation: mean
    higher_is_better: true
metadata:
  version: 1.0
"""


def build_local_tasks(tokenizer, texts: list[str], out_dir: str | Path = TASKS_DIR, items: int = 40,
                      seq_len: int = 256, seed: int = 0, suffix: str = "") -> None:
    """Write the two offline tasks' JSONL from held-out texts (run once per length; the files are shipped).

    ``python -c "from kvbridge import family; from kvbridge.measure.lm_eval_tasks import build_local_tasks as b; t =
    family.load_family()[1].tokenizer; b(t, family.heldout_texts()); b(t, family.heldout_texts(), seq_len=1024,
    suffix='_1024')"``
    """
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    rows = heldout_rows(tokenizer, texts, items, seq_len)
    decode = lambda ids: tokenizer.decode(ids, skip_special_tokens=True)  # noqa: E731
    with open(out_dir / f"kvbridge_family_cloze{suffix}.jsonl", "w", encoding="utf-8") as handle:
        for i, (context, choices) in enumerate(cloze_items(rows, seq_len - CHOICE_TOKENS)):
            order = list(range(4))
            random.Random(seed + i).shuffle(order)
            record = {"context": decode(context), "choices": [decode(choices[j]) for j in order],
                      "label": order.index(0)}
            handle.write(json.dumps(record) + "\n")
    # Words only (" name"-like tokens): their text re-encodes to the same tokens, so the harness's
    # round trip through text keeps the span a span (random sub-word tokens merge differently).
    words = [i for i in frequent_ids(rows, set(tokenizer.all_special_ids), 4096)
             if (w := tokenizer.decode([i])).startswith(" ") and w[1:].isalpha() and tokenizer.encode(
                 w, add_special_tokens=False) == [i]]
    # the repeat's first 8 tokens are given; the model continues the span
    contexts, _, continuations = recall_items(rows, words[:512], seed, given=8)
    with open(out_dir / f"kvbridge_family_recall{suffix}.jsonl", "w", encoding="utf-8") as handle:
        for context, continuation in zip(contexts, continuations):
            record = {"context": decode(context), "answer": decode(continuation[:RECALL_ANSWER_TOKENS])}
            handle.write(json.dumps(record) + "\n")


def local_task_dir(data_dir: str | Path = TASKS_DIR) -> Path:
    """A folder of YAML task configs pointing at the task JSONL (lm-eval needs absolute paths)."""
    data_dir = Path(data_dir).resolve()
    for name in LOCAL_TASKS:
        if not (data_dir / f"{name}.jsonl").is_file():
            raise InputError(f"the task data {data_dir / name}.jsonl is missing; reinstall kvbridge.")
    folder = Path(tempfile.mkdtemp(prefix="kvbridge-tasks-"))
    for suffix in LOCAL_LENGTHS:
        cloze, recall = f"kvbridge_family_cloze{suffix}", f"kvbridge_family_recall{suffix}"
        (folder / f"{cloze}.yaml").write_text(_CLOZE_YAML.format(name=cloze, path=data_dir / f"{cloze}.jsonl"),
                                              encoding="utf-8")
        (folder / f"{recall}.yaml").write_text(
            _RECALL_YAML.format(name=recall, path=data_dir / f"{recall}.jsonl", max_tokens=RECALL_ANSWER_TOKENS),
            encoding="utf-8")
    return folder


def fewshot_plan(tasks: list[str], protocol: str = "default", num_fewshot: int | None = None) -> dict[str, int | None]:
    """Task → few-shot examples (None: the task's own default) under ``protocol``."""
    if protocol not in PROTOCOLS:
        raise InputError(f"unknown protocol {protocol!r}; choose one of {', '.join(PROTOCOLS)}.")
    if protocol != "default" and num_fewshot is not None:
        raise InputError("--num-fewshot and --protocol card both set the few-shot count; pass only one.")
    shots = PROTOCOLS[protocol]
    return {task: shots.get(task, num_fewshot) for task in tasks}


def _merge(into: dict, results: dict) -> dict:
    for key, value in results.items():
        if isinstance(value, dict) and isinstance(into.get(key), dict):
            into[key].update(value)
        else:
            into.setdefault(key, value)
    return into


def run_lm_eval(bridge, tasks: list[str], modes: tuple[str, ...] = ("native", "mapped"),
                fewshot: dict[str, int | None] | None = None, limit: int | float | None = None, batch_size: int = 8,
                task_data: str | Path = TASKS_DIR, rolling_chunk: int = 256) -> dict[str, dict]:
    """``lm_eval.simple_evaluate`` per mode (and per few-shot count) on one bridge; returns mode → results.

    Each mode's results also carry ``kvbridge``: task → requests and native fallbacks (see
    :mod:`kvbridge.measure.lm_eval_model`).
    """
    fewshot = fewshot or {task: None for task in tasks}
    folder = local_task_dir(task_data)
    try:
        return _run_modes(bridge, tasks, modes, fewshot, limit, batch_size, folder, rolling_chunk)
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def _run_modes(bridge, tasks, modes, fewshot, limit, batch_size, folder, rolling_chunk) -> dict[str, dict]:
    import lm_eval
    from lm_eval.tasks import TaskManager

    from .lm_eval_model import KVBridgeLM

    groups: dict[int | None, list[str]] = {}
    for task in tasks:
        groups.setdefault(fewshot.get(task), []).append(task)
    # lm-eval indexes its thousands of bundled tasks only when one is asked for (about 10 s a call otherwise)
    local = {path.stem for path in folder.glob("*.yaml")}
    manager = TaskManager(include_path=str(folder), include_defaults=not set(tasks) <= local)
    out = {}
    for mode in modes:
        lm = KVBridgeLM.from_bridge(bridge, mode=mode, batch_size=batch_size, rolling_chunk=rolling_chunk)
        merged: dict = {}
        for shots, names in groups.items():
            _merge(merged, lm_eval.simple_evaluate(
                model=lm, tasks=names, num_fewshot=shots, limit=limit, task_manager=manager, log_samples=False,
                bootstrap_iters=0, random_seed=0, numpy_random_seed=0, torch_random_seed=0, fewshot_random_seed=0))
        merged["kvbridge"] = {"requests": dict(lm.request_counts), "native_fallbacks": dict(lm.native_fallbacks)}
        out[mode] = merged
    return out


def _by_prefix(table: dict, task: str, default):
    for prefix in sorted(table, key=len, reverse=True):
        if task.startswith(prefix):
            return table[prefix]
    return default


def floor_of(task: str) -> float:
    return _by_prefix(FLOORS, task, 0.0)


def primary_metric(task: str, metrics: list[str]) -> str | None:
    """The metric of ``task`` that enters the mean, among the ``metrics`` lm-eval reported."""
    wanted = _by_prefix(PRIMARY, task, "acc")
    if wanted in metrics:
        return wanted
    return metrics[0] if metrics else None


def _task_count(counts: dict[str, int], task: str) -> int:
    """Requests of ``task``, or, for a group such as mmlu that has none of its own, of its mmlu_* subtasks."""
    if task in counts:
        return counts[task]
    return sum(n for name, n in counts.items() if name.startswith(task + "_"))


def metric_rows(results: dict[str, dict], tasks: list[str]) -> list[dict]:
    """One row per (task, metric): native, mapped, source (if run), floor, retention, primary flag, fallbacks."""
    rows = []
    native = results["native"]["results"]
    counts = results["mapped"].get("kvbridge", {})
    shots = results["native"].get("n-shot", {})
    for task in tasks:
        if task not in native:
            continue
        # metrics are "name,filter"; skip sample counts and standard errors
        keys = [k for k, v in native[task].items() if isinstance(v, (int, float)) and "," in k and "_stderr" not in k]
        names = [k.replace(",none", "") for k in keys]
        primary = primary_metric(task, names)
        for key, metric in zip(keys, names):
            row = {"task": task, "metric": metric, "primary": metric == primary,
                   "native": float(native[task][key]), "mapped": float(results["mapped"]["results"][task][key]),
                   "floor": floor_of(task), "num_fewshot": shots.get(task),
                   "requests": _task_count(counts.get("requests", {}), task),
                   "native_fallbacks": _task_count(counts.get("native_fallbacks", {}), task)}
            if "source" in results:
                row["source"] = float(results["source"]["results"][task][key])
                row.update(source_gap(row, native[task], results["source"]["results"][task], key))
            if any(word in metric for word in LOWER_IS_BETTER):  # no floor: raw retention only
                row["floor"] = None
                row["raw_retention"] = row["native"] / row["mapped"] if row["mapped"] else float("nan")
                row["floor_normalized_retention"] = None
            else:
                row["raw_retention"], row["floor_normalized_retention"] = retention(row["native"], row["mapped"],
                                                                                    row["floor"])
            rows.append(row)
    rows.sort(key=lambda r: not r["primary"])  # primary metrics first (stable: task order kept)
    return rows


def source_gap(row: dict, native: dict, source: dict, key: str) -> dict:
    """Gap recovered, (mapped − source) ÷ (native − source), where the target beats the source beyond noise: the
    difference is more than 1.96 standard errors of the two (lm-eval's own stderr, unpaired: wider than a paired
    interval, so a lead it accepts is real). Lower-is-better metrics: on their logarithm."""
    name, _, filt = key.partition(",")
    stderr = [d.get(f"{name}_stderr,{filt}") for d in (native, source)]
    n, m, s = row["native"], row["mapped"], row["source"]
    if any(word in row["metric"] for word in LOWER_IS_BETTER):
        if min(n, m, s) <= 0:
            return {"gap_recovered": None, "target_leads": None}
        n, m, s = -math.log(n), -math.log(m), -math.log(s)
        stderr = [None, None]  # no stderr on the log scale: the lead is judged on the point values alone
    if any(not isinstance(e, (int, float)) for e in stderr):
        leads = n > s
    else:
        leads = n - s > 1.96 * math.sqrt(stderr[0] ** 2 + stderr[1] ** 2)
    return {"gap_recovered": (m - s) / (n - s) if leads else None, "target_leads": leads}


def in_mean(row: dict) -> bool:
    """A row enters the mean when it is its task's primary metric and native beats the floor."""
    return row["primary"] and row["floor"] is not None and row["native"] > row["floor"]


def eval_table(rows: list[dict], protocol: str = "default") -> str:
    """The card's table: primary metric of each task, the mean over them, then the other metrics."""
    has_source = any("source" in r for r in rows)
    head = ("| Task | Metric | Shots | Native | Mapped |" + (" Source | Gap recovered |" if has_source else "")
            + " Floor | Raw retention | Floor-normalized retention | Scored natively in mapped mode |")
    lines = [f"Protocol: {protocol}" + (" (MMLU 5-shot, GSM8K 8-shot chain of thought, the others 0-shot)"
                                        if protocol == "card" else " (each task's own few-shot setting)"), "",
             head, "|" + "---|" * (head.count("|") - 1)]

    def value(v, metric):
        return "n/a" if v is None else f"{v:.4g}" if any(w in metric for w in LOWER_IS_BETTER) else f"{100 * v:.2f}%"

    def gap(r):
        if r.get("gap_recovered") is not None:
            return f"{100 * r['gap_recovered']:.1f}%"
        return "n/s (target ≈ source)" if r.get("target_leads") is False else "n/a"

    def line(r):
        shots = "default" if r["num_fewshot"] is None else str(r["num_fewshot"])
        pct = lambda v: "n/a" if v is None else f"{100 * v:.2f}%"  # noqa: E731
        return (f"| {r['task']} | {r['metric']} | {shots} | {value(r['native'], r['metric'])} | "
                f"{value(r['mapped'], r['metric'])} |" + (f" {value(r['source'], r['metric'])} | {gap(r)} |"
                                                          if has_source else "")
                + f" {value(r['floor'], r['metric'])} | {pct(r['raw_retention'])} | "
                f"{pct(r['floor_normalized_retention'])} | {r['native_fallbacks']} of {r['requests']} |")

    lines += [line(r) for r in rows if r["primary"]]
    counted = [r for r in rows if in_mean(r)]
    if counted:
        raw = sum(r["raw_retention"] for r in counted) / len(counted)
        norm = sum(r["floor_normalized_retention"] for r in counted) / len(counted)
        label = f"**Mean** (primary metrics, {len(counted)} tasks)"
        lines.append(f"| {label} | | | |" + (" | |" if has_source else "")
                     + f" | | {100 * raw:.2f}% | {100 * norm:.2f}% | |")
    others = [r for r in rows if not r["primary"]]
    if others:
        lines.append("| *other metrics, not in the mean* | | | | |" + (" | |" if has_source else "") + " | | | |")
        lines += [line(r) for r in others]
    return "\n".join(lines)
