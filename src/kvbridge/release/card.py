"""Release files for a mapper artifact: a Hub model card, a machine-readable manifest and a runnable example.

``kvbridge card ARTIFACT`` adds three files to an artifact folder::

    README.md               Hub model card (YAML front matter by huggingface_hub's ModelCardData): the pair
                            with revisions and fingerprints, how it was fitted, the retention and latency
                            tables rendered from result files, usage, limitations
    artifact_manifest.json  provenance and evaluation summary: versions, models, fit, file hashes, results
    example.py              a minimal cache handoff that runs as is against the artifact

Every figure comes from a file a kvbridge command wrote (mapper.json, fit_report.json, ``kvbridge eval
--out``, ``kvbridge bench --json``, ``kvbridge frontier --out``, ``kvbridge demo --out``); what was not
measured is said to be missing, never filled in. The three files describe the mapper and stay outside
``checksums.sha256`` on purpose: a card can be regenerated when new results arrive without changing
the mapper's identity, and the manifest records the SHA-256 of every file it describes.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from ..core.artifact import (
    CARD_FILES,
    CHECKSUMS_FILE,
    CONFIG_FILE,
    RUN_REPORT_FILE,
    WEIGHTS_FILE,
    read_run_report,
)
from ..core.hashing import sha256_file
from ..core.hub import is_hub_id
from ..core.mapper import require_verified
from ..core.mapper_config import MapperConfig, read_config
from ..core.outputs import write_text
from ..errors import InputError, KVBridgeError
from ..version import __version__

CARD_FILE, MANIFEST_FILE, EXAMPLE_FILE = CARD_FILES
MANIFEST_FORMAT = "kvbridge-artifact-manifest"


# -- reading result files -------------------------------------------------------------------------
def _read_json(path: str | Path, what: str) -> Any:
    path = Path(path)
    if not path.is_file():
        raise InputError(f"{what} {path} does not exist; give the file a kvbridge command wrote.")
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError, RecursionError) as exc:
        raise InputError(f"{what} {path} is not readable JSON ({exc}).") from None


def read_eval(folder: str | Path) -> dict:
    """``kvbridge eval --out`` results: protocol, per-metric rows, device."""
    data = _read_json(Path(folder) / "results.json", "--eval")
    if not isinstance(data, dict) or not isinstance(data.get("rows"), list):
        raise InputError(f"--eval {folder}: results.json has no 'rows'; give the folder `kvbridge eval --out` wrote.")
    return data


def read_bench(path: str | Path) -> dict:
    """``kvbridge bench --json`` rows (or bench_real's)."""
    from ..measure.bench import BenchRow

    data = _read_json(path, "--bench")
    try:
        rows = [BenchRow(**row) for row in data["rows"]]
    except (KeyError, TypeError) as exc:
        raise InputError(f"--bench {path} is not a `kvbridge bench --json` file ({exc!r}).") from None
    if not rows:
        raise InputError(f"--bench {path} holds no rows.")
    return {"device": str(data.get("device", "not recorded")), "rows": rows}


def read_frontier(folder: str | Path) -> dict:
    data = _read_json(Path(folder) / "frontier.json", "--frontier")
    if not isinstance(data, dict) or not isinstance(data.get("points"), list):
        raise InputError(f"--frontier {folder}: frontier.json has no 'points'; give the folder `kvbridge frontier "
                         "--out` wrote.")
    if "headline_tokens" not in data or not all(isinstance(p, dict) and "by_length" in p for p in data["points"]):
        raise InputError(f"--frontier {folder}: frontier.json was written by an older kvbridge (no retention and "
                         "speed-up at each length); run `kvbridge frontier --out DIR` again.")
    return data


def read_demo(path: str | Path) -> dict:
    data = _read_json(path, "--demo")
    if not isinstance(data, dict) or not isinstance(data.get("retention"), dict) or not data["retention"] \
            or not isinstance(data.get("latency"), list) or not data["latency"]:
        raise InputError(f"--demo {path} is not the demo.json `kvbridge demo --out` wrote (it needs retention and "
                         "latency figures).")
    return data


# -- rendering ------------------------------------------------------------------------------------
def _family_role(name: str) -> str | None:
    """'source'/'target' when ``name`` is the embedded family's checkpoint, else None."""
    from .. import family

    try:
        resolved = Path(name).resolve()
        for role, path in (("source", family.source_path()), ("target", family.target_path())):
            if resolved == Path(path).resolve():
                return role
    except (OSError, KVBridgeError):  # no embedded family installed: then it is not the family
        return None
    return None


def _pct(value: Any) -> str:
    return f"{100 * value:.1f}%" if isinstance(value, (int, float)) else "n/a"


def _pair_table(config: MapperConfig) -> str:
    lines = ["| Role | Model | Revision | Weights fingerprint | Layers × KV heads × head dim | RoPE |",
             "|---|---|---|---|---|---|"]
    for role, label in (("source", "Source (prefill)"), ("target", "Target (decode)")):
        m = getattr(config, role)
        rope = {k: v for k, v in m.rope.parameters.items() if k not in ("rope_type", "type")}
        lines.append(f"| {label} | `{m.name_or_path}` | {('`' + m.revision + '`') if m.revision else 'local folder'} "
                     f"| {('`' + m.weights_sha256[:16] + '…`') if m.weights_sha256 else 'not recorded'} "
                     f"| {m.num_layers} × {m.num_kv_heads} × {m.head_dim} | {m.rope.rope_type} {rope} |")
    return "\n".join(lines)


def _fit_section(config: MapperConfig, run: dict) -> str:
    f = config.fit
    s = f.get("settings") if isinstance(f.get("settings"), dict) else {}
    number = lambda v: isinstance(v, (int, float)) and not isinstance(v, bool)  # noqa: E731
    lines = ["| Setting | Value |", "|---|---|"]
    for key, label in (("num_texts", "calibration sequences"), ("seq_len", "tokens per sequence"),
                       ("stride", "observation stride"), ("top_k", "source layers per target layer"),
                       ("ridge", "ridge (relative)")):
        if key in s:
            lines.append(f"| {label} | {s[key]} |")
    if number(f.get("observations")):
        lines.append(f"| observations | {f['observations']:,} |")
    if "calibration_sha256" in f:
        lines.append(f"| calibration texts SHA-256 | `{f['calibration_sha256']}` |")
    levers = "; ".join(f"{v.kind}s of layer {v.layer}: lags {list(v.lags)} of {'+'.join(v.inputs)}"
                       + (f", residual MLP {v.hidden}" if v.hidden else "")
                       for v in config.levers) or "none (plain map)"
    lines.append(f"| levers | {levers} |")
    tune = f.get("tune")
    if isinstance(tune, dict) and number(tune.get("validation_kl_before")) and number(tune.get("validation_kl_after")):
        budget = tune.get("budget") if isinstance(tune.get("budget"), dict) else {}
        lines.append(f"| levers tuned on the target's output | {budget.get('steps', '?')} steps on "
                     f"{tune.get('rows', '?')} rows (a share of {s.get('repeat_spans', 0):g} with a repeated span); "
                     f"validation KL {tune['validation_kl_before']:.4f} → {tune['validation_kl_after']:.4f}, "
                     f"{'kept' if tune.get('kept') else 'not kept'} |")
    r = config.runtime
    window = f", averaged over {r.recompute_window} tokens" if r.recompute_window > 1 and r.recompute > 0 else ""
    lines.append(f"| runtime | hold-back {r.hold_back} tokens, recompute {r.recompute:g} "
                 f"(by {r.recompute_by}{window}), sink {'on' if r.sink else 'off'} |")
    for kind in ("key", "value"):
        fit_r2, held = f.get(f"{kind}_r2_fit_mean"), f.get(f"{kind}_r2_heldout_mean")
        if number(fit_r2):
            lines.append(f"| {kind} R² (mean over target layers) | fit {fit_r2:.4f}"
                         + (f", held-out {held:.4f} |" if number(held) else " |"))
    if run.get("fit_seconds") is not None:
        lines.append(f"| fit time | {run['fit_seconds']:.1f} s on {f.get('device', 'an unrecorded device')} "
                     f"({run.get('torch_threads', '?')} torch threads) |")
        lines.append(f"| fit peak memory | {run.get('peak_memory_bytes', 0) / 2**30:.2f} GiB "
                     f"({run.get('peak_memory_kind', 'kind not recorded')}) |")
    else:
        lines.append(f"| fit time and memory | not recorded ({RUN_REPORT_FILE} is absent or unreadable) |")
    return "\n".join(lines)


def _retention_section(eval_data: dict | None, demo: dict | None) -> tuple[str, dict]:
    """Markdown and the manifest's summary of every retention result given."""
    parts, summary = [], {}
    if eval_data is not None:
        from ..measure.lm_eval_tasks import eval_table, in_mean

        protocol = eval_data.get("protocol", {})
        name = protocol.get("name", "default") if isinstance(protocol, dict) else str(protocol)
        rows = eval_data["rows"]
        counted = [r for r in rows if in_mean(r)]
        mean = sum(r["floor_normalized_retention"] for r in counted) / len(counted) if counted else None
        parts.append(f"### lm-evaluation-harness ({eval_data.get('device', 'device not recorded')})\n\n"
                     + eval_table(rows, name))
        summary["lm_eval"] = {"protocol": protocol, "device": eval_data.get("device"),
                              "mean_floor_normalized_retention": mean,
                              "rows": [{k: r.get(k) for k in ("task", "metric", "num_fewshot", "native", "mapped",
                                                              "source", "floor", "floor_normalized_retention")}
                                       for r in rows if r.get("primary")]}
    if demo is not None:
        from dataclasses import fields

        from ..measure.evaluate import TaskResult, mean_retention

        names = {f.name for f in fields(TaskResult)} - {"per_item"}
        as_results = lambda rows: [TaskResult(**{k: r[k] for k in names if k in r}) for r in rows]  # noqa: E731
        family = {}
        for length, both in demo["retention"].items():
            rows = both["recommended"]
            plain = {r["task"]: r for r in both.get("plain", [])}
            lines = [f"### Embedded family tasks, {length}-token contexts ({demo.get('device', 'cpu')})", "",
                     "| Task | Metric | Native | Source alone | Floor | This mapper | Floor-normalized retention | "
                     "Plain linear map, for reference |", "|---|---|---:|---:|---:|---:|---:|---:|"]
            fmt = lambda r, v: f"{100 * v:.1f}%" if r.get("higher_is_better", True) else f"{v:.2f}"  # noqa: E731
            for r in rows:
                p = plain.get(r["task"])
                lines.append(f"| {r['task']} | {r['metric']} | {fmt(r, r['native'])} | {fmt(r, r['source'])} | "
                             f"{fmt(r, r['floor'])} | {fmt(r, r['mapped'])} | "
                             f"{_pct(r['floor_normalized_retention'])} | "
                             + (f"{_pct(p['floor_normalized_retention'])} |" if p else "n/a |"))
            mean = mean_retention(as_results(rows))
            lines.append(f"| **Mean** | | | | | | **{_pct(mean)}** | "
                         f"{_pct(mean_retention(as_results(both['plain']))) if both.get('plain') else 'n/a'} |")
            parts.append("\n".join(lines))
            family[length] = {"mean_floor_normalized_retention": mean, "rows": rows}
        summary["family_tasks"] = {"device": demo.get("device"), "threads": demo.get("threads"), "lengths": family}
        if demo.get("third_party"):  # the lead figure: what the target adds over the source, kept by the map
            from ..measure.gap import gap_table

            parts.append(f"### What the map keeps of the target's lead over the source: "
                         f"{demo['third_party'].get('texts', 'third-party text')} ({demo.get('device', 'cpu')})\n\n"
                         "Gap recovered = (mapped − source) ÷ (native − source), perplexity in log space, with a "
                         "paired bootstrap interval over documents; n/s where the target does not beat the source "
                         "beyond noise. Agreement, first divergence and distinct 4-grams: greedy continuations "
                         "compared with native's.\n\n" + gap_table(demo["third_party"]))
            summary["third_party"] = demo["third_party"]
    if not parts:
        return ("Not measured. Run `kvbridge eval --source S --target T --mapper THIS_FOLDER --out EVAL` and then "
                "`kvbridge card THIS_FOLDER --eval EVAL`.", {})
    return "\n\n".join(parts), summary


def _latency_section(bench: dict | None, demo: dict | None) -> tuple[str, dict | None]:
    from ..measure.bench import BenchRow, bench_table

    if bench is None and demo is not None:
        bench = {"device": f"CPU ({demo.get('threads', '?')} threads)",
                 "rows": [BenchRow(**r) for r in demo["latency"]]}
    if bench is None:
        return ("Not measured. Run `kvbridge bench --source S --target T --mapper THIS_FOLDER --json BENCH.json` "
                "and then `kvbridge card THIS_FOLDER --bench BENCH.json`.", None)
    text = (f"Measured on {bench['device']}, batch 1, medians; time to first token (TTFT) = everything up to the "
            "first token's logits (native: the target's prefill; mapped: source prefill, map, the target's "
            "held-back tokens).\n\n" + bench_table(bench["rows"]))
    return text, {"device": bench["device"], "rows": [r.to_dict() for r in bench["rows"]]}


def _frontier_section(frontier: dict | None) -> tuple[str, dict | None]:
    if frontier is None:
        return "", None
    from ..measure.frontier import frontier_table

    summary = {"recommended": frontier.get("recommended"),
               "headline_tokens": frontier.get("headline_tokens"),
               "points": [{k: p.get(k) for k in ("name", "retention", "interval_95", "ttft_speedup", "context_tokens",
                                                 "mean_floor_normalized_retention")} for p in frontier["points"]]}
    return "## Retention against speed (kvbridge frontier)\n\n" + frontier_table(frontier) + "\n\n", summary


def _usage(config: MapperConfig, mapper_ref: str) -> str:
    import shlex

    s, t = config.source, config.target
    rev = lambda m, flag: f" --{flag}-revision {m.revision}" if m.revision else ""  # noqa: E731
    q = shlex.quote
    return f"""```bash
pip install kvbridge
kvbridge generate --source {q(s.name_or_path)}{rev(s, 'source')} --target {q(t.name_or_path)}{rev(t, 'target')} \\
    --mapper {q(mapper_ref)} --prompt "..." --compare
```

```python
import torch
from kvbridge import Bridge

bridge = Bridge.from_pretrained({s.name_or_path!r}, {t.name_or_path!r}, {mapper_ref!r},
                                source_revision={s.revision!r}, target_revision={t.revision!r},
                                device="cuda" if torch.cuda.is_available() else "cpu")
print(bridge.generate(["..."], max_new_tokens=32).texts[0])
```

`Mapper.from_pretrained(..., dtype=torch.bfloat16)` halves its memory (residual MLPs stay float32).
See `{EXAMPLE_FILE}` for a complete handoff."""


def card_text(config: MapperConfig, run: dict, files: list[dict], retention: str, latency: str, frontier: str,
              mapper_ref: str, license_id: str) -> str:
    from huggingface_hub import ModelCardData

    base = [m.name_or_path for m in (config.source, config.target) if is_hub_id(m.name_or_path)]
    data = ModelCardData(library_name="kvbridge", license=license_id, base_model=base or None,
                         tags=["kvbridge", "kv-cache", "kv-cache-transfer", "prefill-reuse"])
    s, t = config.source.name_or_path, config.target.name_or_path
    file_rows = "\n".join(f"| `{f['name']}` | {f['bytes']:,} B | {'yes' if f['in_checksums'] else 'no'} |"
                          for f in files)
    hold = config.runtime.hold_back
    return f"""---
{data.to_yaml()}
---

# kvbridge mapper: {s} → {t}

A fitted cross-model KV-cache mapper, written by kvbridge {__version__}: `{s}` prefills a context, this
mapper turns its KV cache into `{t}`'s, and `{t}` continues without prefilling the context itself.
It is not a language model: both base models are needed, under their own licenses.

## The pair

{_pair_table(config)}

Tokenizer fingerprint (both models): `{config.source.tokenizer_sha256[:16]}…`. kvbridge refuses other
geometries, RoPE settings and tokenizers, and — unless told `--allow-revision-mismatch` — other
revisions or weights: do not assume the mapper fits other checkpoints or quantized variants without
refitting.

## Files

| File | Size | In `{CHECKSUMS_FILE}` |
|---|---:|---|
{file_rows}
| `{MANIFEST_FILE}` | — | no |

The checksummed files are the mapper's identity (`kvbridge verify` checks them). The fit report, this
card, the example and the manifest describe it and stay outside, so that they can be regenerated
(`kvbridge card`) without changing the mapper; `{MANIFEST_FILE}` records the SHA-256 of each.

## How it was fitted

{_fit_section(config, run)}

## Retention

Floor-normalized retention = (mapped − floor) / (native − floor): 100 % is the target's own quality,
0 % the floor (chance, or the source alone where stated). Native = the target prefills the context itself.

{retention}

## Latency

{latency}

{frontier}## Usage

{_usage(config, mapper_ref)}

## Limitations

- Only for the exact pair above; any other checkpoint needs a refit (`kvbridge fit`).
- The mapped cache is an approximation: retention below 100 % above means answers that differ from the
  target's own. Check the tables on your own tasks (`kvbridge eval`, `kvbridge diagnose --oracle`).
- The target reads the last {hold} prompt token(s) itself (hold-back); shorter prompts gain nothing.
- Latency depends on hardware, dtype and batch: the figures above hold for the device named with them.
- Figures that are missing above were not measured for this artifact.
"""


def example_text(config: MapperConfig) -> str:
    def ref(role: str) -> str:
        m = getattr(config, role)
        family_role = _family_role(m.name_or_path)
        if family_role:
            return f"str(family.{family_role}_path())"
        return repr(m.name_or_path)

    uses_family = any(_family_role(getattr(config, r).name_or_path) for r in ("source", "target"))
    prompt = "def read_config(path):\n    with open(path) as" if uses_family else "The three primary colours are"
    return f'''"""Minimal cache handoff with this mapper (written by `kvbridge card`).

    python example.py [MAPPER]     # MAPPER: this folder (default) or the hub id it was pushed to

The source model prefills the prompt, the mapper turns its KV cache into the target's, and the
target generates from the mapped cache; the target's own prefill runs beside it for comparison.
"""

import sys
from pathlib import Path

import torch

from kvbridge import Bridge{", family" if uses_family else ""}

MAPPER = sys.argv[1] if len(sys.argv) > 1 else str(Path(__file__).resolve().parent)
SOURCE, SOURCE_REVISION = {ref("source")}, {config.source.revision!r}
TARGET, TARGET_REVISION = {ref("target")}, {config.target.revision!r}
PROMPT = {prompt!r}

bridge = Bridge.from_pretrained(SOURCE, TARGET, MAPPER, source_revision=SOURCE_REVISION,
                                target_revision=TARGET_REVISION,
                                device="cuda" if torch.cuda.is_available() else "cpu")
for mode in ("native", "mapped"):
    out = bridge.generate([PROMPT], mode=mode, max_new_tokens=24)
    print(f"{{mode:>6}}: {{out.texts[0]!r}}  ({{out.seconds * 1000:.0f}} ms)")
'''


def _text_entry(name: str, text: str) -> dict:
    from ..core.hashing import sha256_bytes

    data = text.encode("utf-8")
    return {"name": name, "bytes": len(data), "sha256": sha256_bytes(data), "in_checksums": False}


def _file_entry(folder: Path, name: str, in_checksums: bool) -> dict:
    path = folder / name
    return {"name": name, "bytes": path.stat().st_size, "sha256": sha256_file(path), "in_checksums": in_checksums}


def foreign_card_files(folder: Path) -> list[str]:
    """The card files in ``folder`` that an earlier ``kvbridge card`` did not write as they are now (a user's own
    README.md, an edited example.py, a manifest of something else): a card must not overwrite them unasked. A file
    is the card's when the folder's kvbridge manifest lists it with its current SHA-256 (the manifest: when it is a
    kvbridge manifest at all)."""
    try:
        manifest = json.loads((folder / MANIFEST_FILE).read_text(encoding="utf-8"))
        ours = manifest.get("format") == MANIFEST_FORMAT
        recorded = {f["name"]: f["sha256"] for f in manifest.get("files", []) if isinstance(f, dict)} if ours else {}
    except (OSError, ValueError, AttributeError, TypeError, KeyError, RecursionError):
        ours, recorded = False, {}
    foreign = []
    for name in CARD_FILES:
        path = folder / name
        if not path.exists():
            continue
        if name == MANIFEST_FILE:
            mine = ours
        else:
            try:
                mine = path.is_file() and recorded.get(name) == sha256_file(path)
            except OSError:
                mine = False
        if not mine:
            foreign.append(name)
    return foreign


def write_card(artifact: str | Path, eval_dir: str | Path | None = None, bench_json: str | Path | None = None,
               frontier_dir: str | Path | None = None, demo_json: str | Path | None = None,
               demo: dict | None = None, repo_id: str | None = None, license_id: str = "mit",
               force: bool = False) -> list[Path]:
    """Write README.md, artifact_manifest.json and example.py into ``artifact``; returns their paths.

    Results come from the folders/files kvbridge commands wrote (``demo``: the figures ``run_demo``
    returns, in place of ``demo_json``). The artifact must verify first: a card never describes a
    corrupted mapper. Card files that an earlier card did not write (:func:`foreign_card_files`) are
    replaced only with ``force``.
    """
    if not isinstance(license_id, str) or not license_id.strip() or any(c in license_id for c in "\n\r"):
        raise InputError("--license must name a license on one line (e.g. mit, apache-2.0, other).")
    if repo_id is not None:
        from ..core.hub import check_repo_id

        check_repo_id(repo_id, "--repo-id")
    folder = require_verified(artifact, "written")
    foreign = [] if force else foreign_card_files(folder)
    if foreign:
        raise InputError(f"{folder} holds {', '.join(foreign)} that kvbridge card did not write (or that were edited "
                         "since); the card would replace them. Move them away, or pass --force (force=True) to "
                         "overwrite. Nothing was written.")
    config, run = read_config(folder), read_run_report(folder)
    eval_data = read_eval(eval_dir) if eval_dir else None
    bench = read_bench(bench_json) if bench_json else None
    frontier = read_frontier(frontier_dir) if frontier_dir else None
    demo = demo if demo is not None else (read_demo(demo_json) if demo_json else None)

    run = {k: v for k, v in run.items() if isinstance(v, (int, float, str))}  # unverified file: numbers or text
    if not isinstance(run.get("fit_seconds"), (int, float)) or not isinstance(run.get("peak_memory_bytes", 0),
                                                                               (int, float)):
        run = {}
    sections = []
    for what, render in (("--eval/--demo", lambda: _retention_section(eval_data, demo)),
                         ("--bench/--demo", lambda: _latency_section(bench, demo)),
                         ("--frontier", lambda: _frontier_section(frontier))):
        try:
            sections.append(render())
        except (KeyError, TypeError, AttributeError, ValueError, IndexError) as exc:
            raise InputError(f"{what}: a result file lacks what the card needs ({type(exc).__name__}: {exc}); give "
                             "files written by this kvbridge's commands. Nothing was written.") from None
    (retention, retention_summary), (latency, latency_summary), (frontier_md, frontier_summary) = sections
    files = [_file_entry(folder, n, True) for n in (WEIGHTS_FILE, CONFIG_FILE, CHECKSUMS_FILE)]
    if (folder / RUN_REPORT_FILE).is_file():
        files.append(_file_entry(folder, RUN_REPORT_FILE, False))
    # everything is rendered before anything is written: a failure leaves the folder as it was
    example = example_text(config)
    files.append(_text_entry(EXAMPLE_FILE, example))
    card = card_text(config, run, files, retention, latency, frontier_md, repo_id or str(folder), license_id)
    files.append(_text_entry(CARD_FILE, card))
    meta = json.loads((folder / CONFIG_FILE).read_text(encoding="utf-8"))
    manifest = {
        "format": MANIFEST_FORMAT,
        "format_version": 1,
        "kvbridge_version": __version__,
        "mapper_format_version": meta.get("format_version"),
        "models": {"source": config.source.to_dict(), "target": config.target.to_dict()},
        "fit": {"settings": config.fit.get("settings"), "calibration_sha256": config.fit.get("calibration_sha256"),
                "observations": config.fit.get("observations"),
                "r2": {k: v for k, v in config.fit.items() if "_r2_" in k and k.endswith("_mean")},
                "run": run or None},
        "levers": [v.to_dict() for v in config.levers],
        "runtime": config.runtime.to_dict(),
        "files": files,
        "identity": {"covered_by_checksums": [WEIGHTS_FILE, CONFIG_FILE],
                     "outside_checksums": [RUN_REPORT_FILE, *CARD_FILES]},
        "evaluation": retention_summary or None,
        "latency": latency_summary,
        "frontier": frontier_summary,
    }
    manifest_text = json.dumps(manifest, indent=2) + "\n"
    for name, text in ((EXAMPLE_FILE, example), (CARD_FILE, card), (MANIFEST_FILE, manifest_text)):
        write_text(folder / name, text)
    return [folder / name for name in CARD_FILES]
