"""Prune and distil a source from the deep family's target (run once, resumable; tests and CI never retrain).

    python -m kvbridge.family.training.train_pruned --work pruned-work       # resumes from pruned-work/ when run again

The ``deep-pruned`` family: the deep family's 8-layer target with a 4-layer source *built from it* the way
Ministral 3's sizes are built from one parent (pruned, then distilled: "Cascade Distillation"), where the
``deep`` family's source was trained on its own. Same geometry as the deep source (4 layers, 192 wide, MLP 512,
its own RoPE: θ = 5e4, YaRN ×2), so the two families differ only in how the source came to be.

1. ``prune``: the 4 of the target's 8 layers whose depth-pruned model has the lowest loss (Minitron's depth probe
   over all 70 choices), then its 192 most active hidden channels and 512 most active MLP neurons per layer
   (:func:`kvbridge.family.training.train.prune`).
2. ``distil``: forward KL to the target's logits + 0.5·CE on 256-token rows of the first family's distillation mix,
   their position ids skipping ahead at a random cut up to 2,048
   (:func:`~kvbridge.family.training.train.skip_positions`; the teacher reads the same positions), so the new RoPE
   is learned at every position cheaply.
3. ``long``: the same loss on rows of 512, then 1,024, then 1,024 and 2,048 tokens in turn
   (:func:`kvbridge.family.training.train_long.shapes_for`), the long stage's mix.

Training runs under bfloat16 autocast; every ``--save-every`` steps the stage's loop state is written to
``--work`` (atomically). The end measures the source on held-out data (the family instrument checks) and writes
``--out``: the source (bfloat16 weights), the tokenizer and ``family.json`` (the target's figures copied from the
deep family's: it is the same checkpoint). Run again after it finished, it only writes ``--out`` again.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

from .. import DEEP, PRUNED
from .train import (
    DISTILL_MIX,
    PAD,
    Rows,
    best_layers,
    frequent_tokens,
    log,
    prune,
    recall_rows,
    skip_positions,
    train,
)
from .train_deep import POSITIONS, SHAPES, _atomic_save, _write_json, first_family_data, work_state
from .train_long import LONG_MIX, measure, shapes_for

STAGES = ("distil", "long")
SEED = 30


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--work", default="pruned-work", help="resumable state: loop checkpoints, finished stages")
    parser.add_argument("--out", default=str(PRUNED), help="where the source and family.json go")
    parser.add_argument("--distil-steps", type=int, default=600)
    parser.add_argument("--long-steps", type=int, default=250)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--long-lr", type=float, default=5e-4)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--log-every", type=int, default=50)
    parser.add_argument("--save-every", type=int, default=50)
    return parser


def _pruned_source(target, train_stream, frequent, work: Path, progress: dict, progress_path):
    """The source pruned from ``target`` (its best layers, narrowed), or the one an earlier run of this folder
    pruned: (source, kept target layers)."""
    from transformers import Ministral3ForCausalLM

    layers, hidden, mlp, _ = SHAPES["source"]  # prune gives the source its RoPE (the deep source's)
    if "prune" in progress and (work / "source").exists():
        return Ministral3ForCausalLM.from_pretrained(work / "source"), progress["prune"]["layers"]
    torch.manual_seed(SEED)
    calib = Rows(train_stream, frequent, SEED, alphabet=len(frequent)).batch(32, DISTILL_MIX)[0]
    started = time.time()
    keep = best_layers(target, layers, calib)
    source = prune(target, keep, hidden, mlp, calib)
    progress["prune"] = {"layers": list(keep), "hidden": hidden, "mlp": mlp,
                         "rope": dict(source.config.rope_parameters), "seconds": round(time.time() - started)}
    source.save_pretrained(work / "source")
    _write_json(progress, progress_path)
    return source, keep


def main(argv=None) -> None:
    from transformers import Ministral3ForCausalLM

    args = _parser().parse_args(argv)
    torch.set_num_threads(args.threads)
    work, progress_path, progress = work_state(args.work)

    tokenizer, splits, train_stream, held_stream, recorded = first_family_data()
    frequent = frequent_tokens(train_stream)
    spans = frequent_tokens(train_stream, 3072)
    probe = recall_rows(held_stream, frequent, 16, seq=1024)

    target = Ministral3ForCausalLM.from_pretrained(DEEP / "target").float().eval()
    for p in target.parameters():
        p.requires_grad_(False)
    layers, hidden, mlp, _ = SHAPES["source"]  # prune gives the source its RoPE (the deep source's)
    source, keep = _pruned_source(target, train_stream, frequent, work, progress, progress_path)
    for i, stage in enumerate(STAGES):
        if stage in progress:
            continue
        seed = SEED + 1 + i
        ckpt = work / f"source-{stage}.pt"
        resume = torch.load(ckpt, weights_only=False) if ckpt.exists() else None
        common = dict(teacher=target, tag=f"source/{stage}", log_every=args.log_every, autocast=torch.bfloat16,
                      resume=resume, save=lambda state, ckpt=ckpt: _atomic_save(state, ckpt),
                      save_every=args.save_every)
        if stage == "distil":
            rows = Rows(train_stream, frequent, seed, alphabet=len(frequent))
            steps, lr = args.distil_steps, args.lr
            seconds = train(source, rows, steps, lr, args.batch, lambda p: DISTILL_MIX, probe,
                            positions=skip_positions(POSITIONS), **common)
        else:
            rows = Rows(train_stream, spans, seed, alphabet=len(frequent), early=512)
            steps, lr = args.long_steps, args.long_lr
            seconds = train(source, rows, steps, lr, 4, lambda p: LONG_MIX, probe, shapes=shapes_for(steps),
                            **common)
        progress[stage] = {"steps": steps, "lr": lr, "seed": seed, "seconds": round(seconds)}
        source.save_pretrained(work / "source")
        _write_json(progress, progress_path)
        ckpt.unlink(missing_ok=True)

    out = Path(args.out)
    source = source.cpu().float().eval()
    source.generation_config.pad_token_id = PAD
    source.to(torch.bfloat16).save_pretrained(out / "source")
    tokenizer.save_pretrained(out / "source")
    source = source.float()
    started = time.time()
    deep = json.loads((DEEP / "family.json").read_text())
    report = {
        "corpus": deep["corpus"], "splits": deep["splits"], "tokenizer": deep["tokenizer"],
        "train_stream_sha256": recorded,
        "target": {"checkpoint": "the deep family's target (kvbridge/family/deep/target), figures from its "
                                 "family.json"} | deep["target"],
        "pruned": f"the source is the target's layers {list(keep)} pruned to {hidden} channels and {mlp} MLP neurons, "
                  "then distilled from the target (forward KL + 0.5·CE)",
        "command": ("python -m kvbridge.family.training.train_pruned "
                    + " ".join(sys.argv[1:] if argv is None else argv)),
        "autocast": "bfloat16", "threads": args.threads,
        "weights": "bfloat16 (the figures below are measured on them, in float32 arithmetic)",
        "stages": progress,
        "train_seconds": sum(record["seconds"] for record in progress.values()),
        "source": {"layers": layers, "hidden": hidden, "mlp": mlp, "rope": dict(source.config.rope_parameters),
                   "parameters": sum(p.numel() for p in source.parameters())}
        | measure(source, tokenizer, splits["heldout"], held_stream, frequent),
    }
    report["measure_seconds"] = round(time.time() - started)
    (out / "family.json").write_text(json.dumps(report, indent=2) + "\n")
    log(json.dumps(report["source"], indent=2))


if __name__ == "__main__":
    main()
