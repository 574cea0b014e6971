"""``kvbridge demo``: the whole job on the embedded family, with no network.

Fit a mapper on the calibration split → save and verify the artifact → map held-out prompts and
show native vs mapped continuations → retention table on the family tasks → latency table.
"""

from __future__ import annotations

import json
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from . import family
from .artifact import check_artifact
from .bench import bench_table, run_bench
from .errors import KVBridgeError
from .evaluate import family_tasks, retention_table
from .fit import FitConfig, fit_mapper
from .mapper import Mapper
from .transfer import Bridge


@dataclass(frozen=True)
class DemoConfig:
    fit: FitConfig
    task_items: int
    task_seq_len: int
    contexts: tuple[int, ...]
    warmup: int
    trials: int
    prompts: int = 2
    new_tokens: int = 24


FULL = DemoConfig(fit=FitConfig(num_texts=64, seq_len=256, stride=2, heldout_texts=4, batch_size=8),
                  task_items=48, task_seq_len=256, contexts=(64, 256, 1024), warmup=2, trials=7)
QUICK = DemoConfig(fit=FitConfig(num_texts=8, seq_len=128, stride=4, heldout_texts=2, batch_size=8),
                   task_items=8, task_seq_len=128, contexts=(32, 64), warmup=1, trials=3, new_tokens=8)


def _say(message: str = "") -> None:
    print(message, flush=True)


def run_demo(out: str | None = None, quick: bool = False, progress: bool = True) -> dict:
    """Run the demo; returns every figure (also written to ``OUT/demo.json`` when ``out`` is given)."""
    cfg = QUICK if quick else FULL
    torch.manual_seed(0)
    start = time.perf_counter()
    source, target = family.load_family()
    fam = family.report()
    _say(f"embedded family: source {fam['source']['parameters']:,} params (2 layers), "
         f"target {fam['target']['parameters']:,} params (4 layers), trained on the CPython standard library")

    # 1. fit on the calibration split
    mapper = fit_mapper(source, target, family.calibration_texts(), cfg.fit, progress=progress)
    f = mapper.config.fit
    _say(f"fit: {f['observations']:,} observations in {f['fit_seconds']:.1f} s "
         f"({f['observations_per_second']:,.0f} obs/s); R² keys {f['key_r2_fit_mean']:.3f} "
         f"(held-out {f.get('key_r2_heldout_mean', float('nan')):.3f}), values {f['value_r2_fit_mean']:.3f} "
         f"(held-out {f.get('value_r2_heldout_mean', float('nan')):.3f})")

    # 2. save, verify, reload exactly as a user would
    tmp = None if out else tempfile.TemporaryDirectory(prefix="kvbridge-demo-")
    root = Path(out or tmp.name)
    artifact = root / "mapper"
    mapper.save_pretrained(artifact)
    problems = check_artifact(artifact)
    if problems:
        raise KVBridgeError(f"demo artifact does not verify: {problems}")
    bridge = Bridge(source, target, Mapper.from_pretrained(str(artifact)))
    _say(f"artifact saved and verified: {artifact}")

    # 3. native vs mapped on held-out prompts
    held = family.heldout_texts()
    prompts = [bridge.tokenizer.decode(bridge.tokenizer(t, add_special_tokens=False)["input_ids"][:96])
               for t in held[: cfg.prompts]]
    gens = {m: bridge.generate(prompts, mode=m, max_new_tokens=cfg.new_tokens) for m in ("native", "mapped")}
    samples = []
    for i, prompt in enumerate(prompts):
        a, b = gens["native"].token_ids[i], gens["mapped"].token_ids[i]
        same = sum(x == y for x, y in zip(a, b))
        samples.append({"prompt_tail": prompt[-120:], "native": gens["native"].texts[i],
                        "mapped": gens["mapped"].texts[i], "agreeing_tokens": same, "tokens": len(a)})
        _say(f"\n=== held-out prompt {i} (…{prompt[-60:]!r})")
        _say(f"--- native ({gens['native'].seconds * 1000:.0f} ms): {gens['native'].texts[i]!r}")
        _say(f"--- mapped ({gens['mapped'].seconds * 1000:.0f} ms): {gens['mapped'].texts[i]!r}")
        _say(f"--- {same}/{len(a)} tokens agree")

    # 4. retention on the family tasks
    results = family_tasks(bridge, held, items=cfg.task_items, seq_len=cfg.task_seq_len)
    _say(f"\nRetention on held-out text ({cfg.task_items} documents × {cfg.task_seq_len} tokens, CPU):\n")
    _say(retention_table(results))

    # 5. latency
    rows = run_bench(bridge, list(cfg.contexts), cfg.warmup, cfg.trials, progress=progress)
    _say(f"\nLatency (batch 1, float32, {torch.get_num_threads()} CPU threads, median of {cfg.trials}):\n")
    _say(bench_table(rows))
    figures = {
        "mode": "quick" if quick else "full",
        "device": "cpu",
        "threads": torch.get_num_threads(),
        "family": fam,
        "fit": {k: v for k, v in f.items() if not k.endswith("single_layer_r2")},
        "samples": samples,
        "retention": [r.to_dict() for r in results],
        "latency": [r.to_dict() for r in rows],
        "seconds": round(time.perf_counter() - start, 1),
    }
    if out:
        (root / "demo.json").write_text(json.dumps(figures, indent=2) + "\n", encoding="utf-8")
        _say(f"\nall figures: {root / 'demo.json'}")
    else:
        tmp.cleanup()
    _say(f"demo finished in {figures['seconds']:.0f} s")
    return figures
