"""``kvbridge demo``: the whole job on the embedded family, with no network.

The recommended mapper (``kvbridge fit``'s defaults) and the plain linear map it is
compared with ship with the package as verified artifacts, as published ones would — the demo loads them
(``refit``: fits both again on the calibration split, about four minutes on 2 cores, to the same bytes) → saves and
verifies the artifact → retention on the family tasks at 256 and 1,024 tokens, plain and recommended side by
side → latency table with time to first token → native vs mapped continuations of held-out prompts.
"""

from __future__ import annotations

import json
import tempfile
import time
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from .. import family
from ..core.artifact import check_writable_artifact_dir
from ..core.mapper import Mapper, check_mapper
from ..core.outputs import check_output_dir, write_text
from ..core.transfer import Bridge
from ..errors import KVBridgeError
from ..fit.closed_form import fit_mapper
from ..fit.config import FitConfig
from ..release.card import write_card
from .bench import bench_table, run_bench
from .evaluate import bootstrap_interval, capped_mean_retention, family_tasks, gap_cell, mean_retention
from .frontier import ttft
from .gap import GapConfig, gap_table, run_gap


@dataclass(frozen=True)
class DemoConfig:
    fit: FitConfig  # the recommended levers (kvbridge fit's defaults) at the demo's calibration size
    task_items: int
    task_lengths: tuple[int, ...]
    contexts: tuple[int, ...]
    warmup: int
    trials: int
    prompts: int = 2
    new_tokens: int = 24
    gap: GapConfig = GapConfig(lengths=(1024,), items=48)  # third-party held-out code: gap recovered, generation
    headline_trials: int = 5  # per round of the headline's interleaved TTFT timing
    headline_rounds: int = 5


FULL = DemoConfig(fit=FitConfig(),  # kvbridge fit's defaults: the frontier's recommended point
                  task_items=48, task_lengths=(256, 1024), contexts=(64, 256, 1024), warmup=2, trials=7)
QUICK = DemoConfig(fit=FitConfig(num_texts=8, seq_len=128, stride=4, heldout_texts=2, batch_size=8, mlp_steps=20,
                                 mlp_batch=256, tune_steps=10),
                   task_items=8, task_lengths=(128,), contexts=(32, 64), warmup=1, trials=3, new_tokens=8,
                   headline_trials=2, headline_rounds=3,
                   gap=GapConfig(lengths=(128,), items=8, new_tokens=8, trials=2, rounds=2))
PLAIN = dict(lags=(0,), lever_inputs="same", mlp_hidden=0, top_k=None, recompute=0.0, sink=False,
             hold_back=1)  # the published card's map: every source layer, no levers


def _say(message: str = "") -> None:
    print(message, flush=True)


def _side_by_side(plain: list, recommended: list) -> str:
    """One table: native, source, floor once; mapped and retention for the plain map and the recommended one."""
    lines = ["| Task | Native | Source alone | Floor | Plain map | Retention | Gap recovered | Recommended | "
             "Retention | "
             "Gap recovered |", "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    fmt = lambda r, v: f"{v:.2f}" if not r.higher_is_better else f"{100 * v:.1f}%"  # noqa: E731
    for a, b in zip(plain, recommended):
        lines.append(f"| {a.task} | {fmt(a, a.native)} | {fmt(a, a.source)} | {fmt(a, a.floor)} | {fmt(a, a.mapped)} | "
                     f"{100 * a.floor_normalized_retention:.1f}% | {gap_cell(a)} | {fmt(b, b.mapped)} | "
                     f"{100 * b.floor_normalized_retention:.1f}% | {gap_cell(b)} |")
    lines.append(f"| **Mean floor-normalized retention** | | | | | **{100 * mean_retention(plain):.1f}%** | | | "
                 f"**{100 * mean_retention(recommended):.1f}%** | |")
    return "\n".join(lines)


def shipped_mapper(cfg: DemoConfig, plain: bool = False) -> Mapper | None:
    """The family's shipped recommended (``plain``: plain) mapper, when it is what ``cfg`` would fit (its recorded fit
    settings equal ``cfg.fit``'s, with :data:`PLAIN` for the plain one); None otherwise (then the demo fits it)."""
    from ..fit.config import recorded_settings

    try:
        mapper = Mapper.from_pretrained(family.mapper_path(plain))
    except KVBridgeError:
        return None
    fit = replace(cfg.fit, **PLAIN) if plain else cfg.fit
    settings = dict(mapper.config.fit.get("settings") or {})
    expected = recorded_settings(fit, mapper.config.source.num_layers)
    same = all(settings.get(k) == (list(v) if isinstance(v, tuple) else v) for k, v in expected.items()) and all(
        k in expected for k in settings)  # and nothing recorded that this config would not record (native layers)
    return mapper if same else None


def run_demo(out: str | None = None, quick: bool = False, progress: bool = True, refit: bool = False,
             name: str = "default") -> dict:
    """Run the demo; returns every figure (also written to ``OUT/demo.json`` when ``out`` is given). The shipped
    recommended mapper is used unless ``refit`` (or ``quick``, whose reduced fit is its own). ``name``: the embedded
    family (only ``default`` ships a mapper: the others' are fitted)."""
    cfg = QUICK if quick else FULL
    if out:  # before minutes of work, not after
        check_output_dir(out)
        check_writable_artifact_dir(Path(out) / "mapper")
    torch.manual_seed(0)
    start = time.perf_counter()
    source, target = family.load_family(name=name)
    fam = family.report(name)
    _say(f"embedded family {name!r}: source {fam['source']['parameters']:,} params "
         f"({source.info.num_layers} layers), target {fam['target']['parameters']:,} params "
         f"({target.info.num_layers} layers), trained on the CPython standard library")

    # 1. fit the recommended mapper (kvbridge fit's defaults) and the plain linear map, on the calibration split
    mapper, plain = _mappers(cfg, source, target, not (quick or refit or name != "default"), progress)
    # 2. save, verify, reload exactly as a user would
    tmp = None if out else tempfile.TemporaryDirectory(prefix="kvbridge-demo-")
    root = Path(out or tmp.name)
    artifact = root / "mapper"
    bridge = Bridge(source, target, _saved_and_verified(mapper, artifact))
    # 3. native vs mapped on held-out prompts
    held = family.heldout_texts()
    samples = _samples(bridge, held, cfg)
    # 4. retention on the family tasks, plain map and recommended levers side by side, at each length
    retention = _retention(bridge, Bridge(source, target, plain), held, cfg)
    # 5. what the mapped target keeps of the target's lead over the source on third-party code, generation included
    from ..family.external import external_texts

    third_party = run_gap(bridge, external_texts("heldout"), cfg.gap, progress=lambda message: None,
                          label="third-party code, held-out packages")
    _say(f"\nWhat the target adds over the source, kept by the map: third-party Python (held-out packages, "
         f"{cfg.gap.items} documents), CPU:\n")
    _say(gap_table(third_party))

    # 6. latency, time to first token included
    rows = run_bench(bridge, list(cfg.contexts), cfg.warmup, cfg.trials, progress=False)
    _say(f"\nLatency of the recommended mapper (batch 1, float32, {torch.get_num_threads()} CPU threads, "
         f"median of {cfg.trials}):\n")
    _say(bench_table(rows))
    longest = max(cfg.task_lengths)
    # the headline's speed-up: native and mapped timed side by side in interleaved rounds, as the frontier does
    timing = ttft(bridge, longest, cfg.warmup, cfg.headline_trials, cfg.headline_rounds)
    headline = _headline(retention[str(longest)], timing, third_party, cfg.headline_rounds, longest)
    _say(f"\nHeadline: {headline}")
    _say_samples(samples)
    figures = {
        "mode": "quick" if quick else "full",
        "device": "cpu",
        "threads": torch.get_num_threads(),
        "family": fam,
        "fit": {k: v for k, v in mapper.config.fit.items() if not k.endswith("single_layer_r2")},
        "fit_run": mapper.run_report,
        "levers": [v.to_dict() for v in mapper.config.levers],
        "runtime": mapper.config.runtime.to_dict(),
        "samples": samples,
        "retention": retention,
        "third_party": third_party,
        "latency": [r.to_dict() for r in rows],
        "headline_ttft": timing,
        "headline": headline,
        "seconds": round(time.perf_counter() - start, 1),
    }
    if out:
        write_text(root / "demo.json", json.dumps(figures, indent=2) + "\n")
        written = write_card(artifact, demo=figures)  # the artifact leaves as a release would: carded
        _say(f"\nall figures: {root / 'demo.json'}; model card, manifest and example: "
             + ", ".join(p.name for p in written) + f" in {artifact}")
    else:
        tmp.cleanup()
    _say(f"demo finished in {figures['seconds']:.0f} s")
    return figures


def _mappers(cfg: DemoConfig, source, target, shipped: bool, progress: bool) -> tuple[Mapper, Mapper]:
    """(recommended, plain): the shipped artifacts when ``shipped`` (and they verify), else fitted on the
    calibration split; says which, and what the fit found."""
    calibration = family.calibration_texts()
    mapper = shipped_mapper(cfg) if shipped else None
    if mapper is None:
        _say("fitting the recommended mapper (kvbridge fit's defaults)" + (" — about three minutes on 2 cores"
                                                                           if cfg is FULL else ""))
        mapper = fit_mapper(source, target, calibration, cfg.fit, progress=progress)
    else:
        _say(f"recommended mapper: the shipped, verified artifact {family.mapper_path()} (fitted with these settings "
             f"in {mapper.run_report.get('fit_seconds', float('nan')):.0f} s; --refit fits it again)")
    plain = shipped_mapper(cfg, plain=True) if shipped else None
    if plain is None:
        plain = fit_mapper(source, target, calibration, replace(cfg.fit, **PLAIN), progress=False)
    else:
        _say(f"plain map (the published card's kind): the shipped artifact {family.mapper_path(plain=True)} (fitted "
             f"in {plain.run_report.get('fit_seconds', float('nan')):.0f} s)")
    f = mapper.config.fit
    levers = ", ".join(f"{v.kind}s of layer {v.layer}: lags {list(v.lags)} of {'+'.join(v.inputs)}"
                       + (f", MLP {v.hidden}" if v.hidden else "") for v in mapper.config.levers) or "none"
    _say(f"fit: {f['observations']:,} observations in {mapper.run_report['fit_seconds']:.1f} s; "
         f"levers: {levers}; runtime "
         f"{mapper.config.runtime.to_dict()}; held-out R² keys {f.get('key_r2_heldout_mean', float('nan')):.3f} "
         f"(plain {plain.config.fit.get('key_r2_heldout_mean', float('nan')):.3f}), values "
         f"{f.get('value_r2_heldout_mean', float('nan')):.3f}")
    return mapper, plain


def _saved_and_verified(mapper: Mapper, artifact: Path) -> Mapper:
    """The mapper saved, verified and read back exactly as a user would."""
    mapper.save_pretrained(artifact)
    problems = check_mapper(artifact)
    if problems:
        raise KVBridgeError(f"demo artifact does not verify: {problems}")
    _say(f"artifact saved and verified: {artifact}")
    return Mapper.from_pretrained(str(artifact))


def _samples(bridge: Bridge, held: list[str], cfg: DemoConfig) -> list[dict]:
    """Native, mapped and source-alone continuations of held-out prompts, with their token agreement."""
    prompts = [bridge.tokenizer.decode(bridge.tokenizer(t, add_special_tokens=False)["input_ids"][:96])
               for t in held[: cfg.prompts]]
    gens = {m: bridge.generate(prompts, mode=m, max_new_tokens=cfg.new_tokens) for m in ("native", "mapped", "source")}
    samples = []
    for i, prompt in enumerate(prompts):
        a, b, c = (gens[m].token_ids[i] for m in ("native", "mapped", "source"))
        samples.append({"prompt_tail": prompt[-120:], "native": gens["native"].texts[i],
                        "mapped": gens["mapped"].texts[i], "source": gens["source"].texts[i],
                        "agreeing_tokens": sum(x == y for x, y in zip(a, b)),
                        "source_agreeing_tokens": sum(x == y for x, y in zip(a, c)), "tokens": len(a)})
    return samples


def _retention(bridge: Bridge, plain_bridge: Bridge, held: list[str], cfg: DemoConfig) -> dict:
    """Family-task retention at each length, the plain map and the recommended one side by side (printed)."""
    retention = {}
    for length in cfg.task_lengths:
        base = family_tasks(plain_bridge, held, items=cfg.task_items, seq_len=length)
        ours = family_tasks(bridge, held, items=cfg.task_items, seq_len=length, reference=base)
        retention[str(length)] = {"plain": [r.to_dict() for r in base], "recommended": [r.to_dict() for r in ours],
                                  "recommended_mean": mean_retention(ours),
                                  "recommended_capped_mean": capped_mean_retention(ours),
                                  "recommended_capped_interval_95": bootstrap_interval(
                                      [ours], statistic=capped_mean_retention)}
        _say(f"\nRetention on held-out text ({cfg.task_items} documents × {length} tokens, CPU):\n")
        _say(_side_by_side(base, ours))
    return retention


def _headline(longest: dict, timing: dict, third_party: dict, rounds: int, length: int) -> str:
    """One sentence: the gap kept on third-party code first, then family-task retention at ``length`` with its
    interleaved TTFT speed-up."""
    lo, hi = longest["recommended_capped_interval_95"]
    family_line = (f"{100 * longest['recommended_capped_mean']:.1f} % [{100 * lo:.1f}, {100 * hi:.1f}] of "
                   f"the target's above-floor quality (each task capped at 100 %, 95 % bootstrap interval over "
                   f"documents; uncapped {100 * longest['recommended_mean']:.1f} %) at "
                   f"{timing['ttft_speedup']:.2f} ± {timing['speedup_noise']:.2f}× time to first token (median of "
                   f"{rounds} interleaved rounds ± their median absolute deviation) at {length:,} tokens")
    first = third_party["lengths"][0]
    cells = {c["task"]: c for c in first["cells"]}
    ppl, agree = cells.get("perplexity"), cells.get("agreement")
    if ppl and ppl["target_leads"]:
        lo, hi = ppl["gap_interval"]
        gap_line = (f"on third-party code the mapped target keeps {100 * ppl['gap_recovered']:.0f} % [{100 * lo:.0f}, "
                    f"{100 * hi:.0f}] of the target's perplexity lead over the source")
    else:
        gap_line = "on third-party code the target's perplexity lead over the source is inside the noise"
    if agree:
        gap_line += (f"; its greedy continuations agree with native's on {100 * agree['mapped']:.0f} % of tokens "
                     f"(the source alone: {100 * agree['source']:.0f} %)")
    if "ttft" in first:
        gap_line += f", at {first['ttft']['ttft_speedup']:.2f}× time to first token"
    return f"{gap_line} at {first['length']:,} tokens; on the family's own tasks, {family_line}"


def _say_samples(samples: list[dict]) -> None:
    for i, sample in enumerate(samples):
        _say(f"\n=== held-out prompt {i} (…{sample['prompt_tail'][-60:]!r})")
        _say(f"--- native: {sample['native']!r}")
        _say(f"--- mapped: {sample['mapped']!r}")
        _say(f"--- source alone: {sample['source']!r}")
        _say(f"--- mapped agrees with native on {sample['agreeing_tokens']}/{sample['tokens']} tokens, the source "
             f"alone on {sample['source_agreeing_tokens']}")
