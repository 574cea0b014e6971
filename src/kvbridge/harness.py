"""Standard benchmarks through lm-evaluation-harness: native vs mapped (vs source), the card's table.

Also the two offline tasks shipped with kvbridge (``kvbridge_family_cloze``: multiple choice,
``kvbridge_family_recall``: generative), built once from the embedded family's held-out split, so the
harness integration is exercised with no network. lm-eval is imported here and in
:mod:`kvbridge.lm_eval_model` only (``pip install "kvbridge[eval]"``).
"""

from __future__ import annotations

import json
import random
import tempfile
from pathlib import Path

from .errors import InputError
from .evaluate import CHOICE_TOKENS, cloze_items, frequent_ids, heldout_rows, recall_items, retention

TASKS_DIR = Path(__file__).parent / "tasks"
LOCAL_TASKS = ("kvbridge_family_cloze", "kvbridge_family_recall")
# chance level per task family (prefix match): 4-way multiple choice, 2-way WinoGrande, free answers 0
FLOORS = {"arc": 0.25, "hellaswag": 0.25, "mmlu": 0.25, "winogrande": 0.5, "gsm8k": 0.0,
          "kvbridge_family_cloze": 0.25, "kvbridge_family_recall": 0.0}
RECALL_ANSWER_TOKENS = 3

_CLOZE_YAML = """task: kvbridge_family_cloze
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

_RECALL_YAML = """task: kvbridge_family_recall
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
                      seq_len: int = 256, seed: int = 0) -> None:
    """Write the two offline tasks' JSONL from held-out texts (run once; the files are shipped)."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    rows = heldout_rows(tokenizer, texts, items, seq_len)
    decode = lambda ids: tokenizer.decode(ids, skip_special_tokens=True)  # noqa: E731
    with open(out_dir / "kvbridge_family_cloze.jsonl", "w", encoding="utf-8") as handle:
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
    with open(out_dir / "kvbridge_family_recall.jsonl", "w", encoding="utf-8") as handle:
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
    (folder / "kvbridge_family_cloze.yaml").write_text(
        _CLOZE_YAML.format(path=data_dir / "kvbridge_family_cloze.jsonl"), encoding="utf-8")
    (folder / "kvbridge_family_recall.yaml").write_text(
        _RECALL_YAML.format(path=data_dir / "kvbridge_family_recall.jsonl", max_tokens=RECALL_ANSWER_TOKENS),
        encoding="utf-8")
    return folder


def run_lm_eval(bridge, tasks: list[str], modes: tuple[str, ...] = ("native", "mapped"), num_fewshot: int | None = None,
                limit: int | float | None = None, batch_size: int = 8,
                task_data: str | Path = TASKS_DIR) -> dict[str, dict]:
    """``lm_eval.simple_evaluate`` once per mode on the same bridge; returns mode → lm-eval results."""
    import lm_eval
    from lm_eval.tasks import TaskManager

    from .lm_eval_model import KVBridgeLM

    manager = TaskManager(include_path=str(local_task_dir(task_data)))
    out = {}
    for mode in modes:
        results = lm_eval.simple_evaluate(
            model=KVBridgeLM.from_bridge(bridge, mode=mode, batch_size=batch_size), tasks=list(tasks),
            num_fewshot=num_fewshot, limit=limit, task_manager=manager, log_samples=False, bootstrap_iters=0,
            random_seed=0, numpy_random_seed=0, torch_random_seed=0, fewshot_random_seed=0)
        out[mode] = results
    return out


def floor_of(task: str) -> float:
    for prefix, floor in FLOORS.items():
        if task.startswith(prefix):
            return floor
    return 0.0


def metric_rows(results: dict[str, dict], tasks: list[str]) -> list[dict]:
    """One row per (task, metric): native, mapped, source (if run), floor, raw and floor-normalized retention."""
    rows = []
    native = results["native"]["results"]
    for task in tasks:
        if task not in native:
            continue
        for key, value in native[task].items():
            if not isinstance(value, (int, float)) or "," not in key or "_stderr" in key:
                continue  # metrics are "name,filter"; skip sample counts and standard errors
            metric = key.replace(",none", "")
            row = {"task": task, "metric": metric, "native": float(value),
                   "mapped": float(results["mapped"]["results"][task][key]), "floor": floor_of(task)}
            if "source" in results:
                row["source"] = float(results["source"]["results"][task][key])
            row["raw_retention"], row["floor_normalized_retention"] = retention(row["native"], row["mapped"],
                                                                                row["floor"])
            rows.append(row)
    return rows


def eval_table(rows: list[dict]) -> str:
    has_source = any("source" in r for r in rows)
    head = "| Task | Metric | Native | Mapped |" + (" Source |" if has_source else "") + \
        " Floor | Raw retention | Floor-normalized retention |"
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    pct = lambda v: f"{100 * v:.2f}%"  # noqa: E731
    for r in rows:
        lines.append(f"| {r['task']} | {r['metric']} | {pct(r['native'])} | {pct(r['mapped'])} |"
                     + (f" {pct(r['source'])} |" if has_source else "")
                     + f" {pct(r['floor'])} | {pct(r['raw_retention'])} | {pct(r['floor_normalized_retention'])} |")
    finite = [r for r in rows if r["native"] > r["floor"]]
    if finite:
        raw = sum(r["raw_retention"] for r in finite) / len(finite)
        norm = sum(r["floor_normalized_retention"] for r in finite) / len(finite)
        lines.append("| **Mean** | | | |" + (" |" if has_source else "") + f" | {pct(raw)} | {pct(norm)} |")
    return "\n".join(lines)
