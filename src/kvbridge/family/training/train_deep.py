"""Train the deep embedded family (run once, resumable; tests and CI never retrain).

    python -m kvbridge.family.training.train_deep --work deep-work          # resumes from deep-work/ when run again

A second family, the hard case for a map: an 8-layer target and a 4-layer source, each trained **from its own
random initialization** (no pruning, no distillation: their caches are related only by the data they read),
with the first family's tokenizer, corpus split, Ministral3 architecture, RoPE settings, copy curriculum and
length curriculum. Each model runs seven stages, seeded:

1. ``copy``: whole rows of a repeated random sequence over the 16 most frequent tokens, growing only once copied
   well (:class:`~kvbridge.family.training.train.Rows`).
2. ``main``: 256-token rows of real code with a steady share of pure repeats and of random and real spans over the
   1,024 most frequent tokens that recur later (``CONTINUE_MIX``, the whole alphabet at once, as the first
   family's second stage; for the deep target this alone did not bring copying: 1.6 % after 1,400 steps).
3. ``induce``: pure repeats only, spans of 8–32 distinct tokens over the 256 most frequent (more than a span
   holds: over 16 tokens a span is nearly a permutation of the alphabet, and the copy stage's 76 % was that
   shortcut, gone at 32), growing to 1,024 once copied.
4. ``recall``: ``CONTINUE_MIX`` again at 256 tokens over the 1,024 most frequent tokens, now that the model copies
   (after ``induce`` the deep target copied pure repeats but recalled a random span inside real text 11 % of the
   time; a ``long`` stage started from there stayed at 1-2 % recall and lost copying, 54 % -> 9 %, in 400 steps).
5. ``stretch``: the ``recall`` stage's rows again, with position ids that skip ahead at a random cut
   (:func:`~kvbridge.family.training.train.skip_positions`, up to 2,048): after ``recall`` the deep target recalled a
   span 200 tokens back in 256-token rows (64 %) but not in 512-token rows (0.4 %; :func:`position_probe`, ``--probe``)
   — it had never seen a position past 256 — and the ``long`` stage started from there lost copying again (16 % -> 10 %
   in 150 steps, recall at 1,024 tokens 3 %). Short rows that reach every position teach the positions cheaply; after
   ``stretch`` and ``long`` the target recalled 72 % at 512 tokens, 71 / 53 / 25 % at 1,024 tokens 200 / 450 / 950 back
   (the source 65 %, 70 / 29 / 3 %).
6. ``long``: the length curriculum of :mod:`kvbridge.family.training.train_long` (512-token rows, then 1,024, then 1,024
   and 2,048 in turn), spans drawn from the 1,024 most frequent tokens growing to 3,072 as pure repeats are copied,
   recurring anywhere later in the row, pure repeats at the recall stage's 35 %.
7. ``polish``: language at length (the first family's long-stage mix, mostly plain text, 1,024- and 2,048-token
   rows in turn, lr 3e-4), for the target only by default: after ``long`` the 8-layer target read held-out code
   worse than the 4-layer source (perplexity 52.1 vs 40.6; the first family's target 18.2) — more layers learn
   language more slowly per step, and the earlier stages spent their steps on copying.

Training runs under bfloat16 autocast (``--autocast``; about 1.4× faster on this CPU; weights and optimizer state
stay float32). Every ``--save-every`` steps the stage's whole loop state is written to ``--work`` (atomically),
and each finished stage is recorded in ``progress.json``: a killed run loses at most that many steps. The end
measures both models on held-out data (the first family's instrument checks) and writes ``--out``: both
checkpoints (bfloat16 weights, about 22 MB together; loaded in float32 on CPU, and measured that way), the
tokenizer and ``family.json`` with the settings, commands and times of every stage.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch

from ...core.hashing import sha256_bytes
from .. import CHECKPOINTS, DEEP
from ..corpus import documents
from .train import (
    CONTINUE_MIX,
    PAD,
    PURE_ONLY,
    SOURCE_ROPE,
    TARGET_ROPE,
    Rows,
    frequent_tokens,
    log,
    ministral3,
    recall_accuracy,
    recall_rows,
    skip_positions,
    token_stream,
    train,
)
from .train_long import LONG_MIX, measure, shapes_for

# (layers, hidden, MLP, RoPE): the target has twice the source's depth and a third more width
SHAPES = {"target": (8, 256, 640, TARGET_ROPE), "source": (4, 192, 512, SOURCE_ROPE)}
STAGES = ("copy", "main", "induce", "recall", "stretch", "long", "polish")
SEEDS = {"target": 10, "source": 20}  # each model's own initialization and data order
COPY_GROW_AFTER = 400
POSITIONS = 2048  # both models' max_position_embeddings


def _atomic_save(obj, path: Path) -> None:
    tmp = path.with_name(path.name + ".tmp")
    torch.save(obj, tmp)
    os.replace(tmp, path)


def _write_json(data: dict, path: Path) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=2) + "\n")
    os.replace(tmp, path)


PROBES = ((256, 200), (512, 200), (1024, 200), (1024, 450), (1024, 950))  # (row length, span distance)


def work_state(folder: str | Path) -> tuple[Path, Path, dict]:
    """``(work folder, its progress.json, the stages it records as finished)``; the folder is created if new."""
    work = Path(folder)
    work.mkdir(parents=True, exist_ok=True)
    progress_path = work / "progress.json"
    return work, progress_path, json.loads(progress_path.read_text()) if progress_path.exists() else {}


def first_family_data():
    """``(tokenizer, splits, train stream, held-out stream, the stream's recorded SHA-256)``: the first family's
    tokenizer and corpus, one vocabulary for every family, checked against the stream it was trained on."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(CHECKPOINTS / "target")
    splits = documents()
    train_stream = token_stream(tokenizer, splits["train"])
    recorded = json.loads((CHECKPOINTS / "family.json").read_text())["train_stream_sha256"]
    if sha256_bytes(train_stream.numpy().tobytes()) != recorded:
        raise SystemExit("the local standard library gives another training stream than the first family's "
                         "(another Python version?); this family would not read the same corpus.")
    return tokenizer, splits, train_stream, token_stream(tokenizer, splits["heldout"]), recorded


def position_probe(model, held_stream: torch.Tensor, frequent: list[int], rows: int = 16, seed: int = 0) -> dict:
    """Recall of a 16-token random span ``distance`` tokens back, the repeat ending 24 tokens before the row's end,
    per (row length, distance) of :data:`PROBES`: a model that never saw a position past 256 fails at 512 even
    at the same distance."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for seq, distance in PROBES:
        ids, starts = [], []
        for _ in range(rows):
            start = int(torch.randint(0, len(held_stream) - seq, (1,), generator=g))
            row = torch.cat([torch.tensor([1]), held_stream[start : start + seq - 1]])
            span = torch.tensor(frequent)[torch.randperm(len(frequent), generator=g)[:16]]
            b = seq - 40
            row[b - distance : b - distance + 16], row[b : b + 16] = span, span
            ids.append(row)
            starts.append(b)
        out[f"{seq} tokens, {distance} back"] = round(recall_accuracy(model, torch.stack(ids), starts), 4)
    return out


def polish_shapes(step: int) -> tuple[int, int]:
    """(row length, batch) of the polish stage: 1,024 and 2,048 tokens in turn, 4,096 tokens a step."""
    seq = 1024 if step % 2 == 0 else 2048
    return seq, 4096 // seq


def run_stage(role: str, stage: str, model, args, streams, work: Path, progress: dict) -> dict:
    """One stage of one model, resumed from its loop checkpoint when one exists; returns its record."""
    train_stream, frequent, spans, probe_short, probe_long = streams
    seed = SEEDS[role] + STAGES.index(stage) + 100 * args.seed
    ckpt = work / f"{role}-{stage}.pt"
    resume = torch.load(ckpt, weights_only=False) if ckpt.exists() else None
    common = dict(tag=f"{role}/{stage}", log_every=args.log_every, autocast=torch.bfloat16 if args.autocast else None,
                  resume=resume, save=lambda state: _atomic_save(state, ckpt), save_every=args.save_every)
    if stage == "copy":
        rows = Rows(train_stream, frequent, seed)
        steps, lr = args.copy_steps, 1e-3
        # grows only once copying is learned (or after a long wait): a timer that grows the alphabet before the
        # induction phase change (here after 100-300 steps) restarts it, and the first run stalled that way
        seconds = train(model, rows, steps, lr, args.batch, lambda p: PURE_ONLY, probe_short, until_alphabet=256,
                        grow_after=COPY_GROW_AFTER, **common)
    elif stage == "main":  # the whole alphabet at once, as the first family's second stage (recall 3 % -> 93 %)
        rows = Rows(train_stream, frequent, seed, alphabet=len(frequent))
        steps, lr = args.main_steps, 1e-3
        seconds = train(model, rows, steps, lr, args.batch, lambda p: CONTINUE_MIX, probe_short, **common)
    elif stage == "induce":  # pure repeats only, over the 256 most frequent tokens growing to 1,024 when copied
        rows = Rows(train_stream, frequent, seed, alphabet=256)
        steps, lr = args.induce_steps, 1e-3
        seconds = train(model, rows, steps, lr, args.batch, lambda p: PURE_ONLY, probe_short,
                        grow_after=COPY_GROW_AFTER, **common)
    elif stage == "recall":  # copying inside real text, at the short length where it is cheap to learn
        rows = Rows(train_stream, frequent, seed, alphabet=len(frequent))
        steps, lr = args.recall_steps, args.long_lr
        seconds = train(model, rows, steps, lr, args.batch, lambda p: CONTINUE_MIX, probe_short, **common)
    elif stage == "stretch":  # the same rows, their positions spread over the whole 2,048
        rows = Rows(train_stream, frequent, seed, alphabet=len(frequent))
        steps, lr = args.stretch_steps, args.long_lr
        seconds = train(model, rows, steps, lr, args.batch, lambda p: CONTINUE_MIX, probe_long,
                        positions=skip_positions(POSITIONS), **common)
    elif stage == "polish":  # language at length: the target, larger, needs more of it than the source
        steps, lr = (args.polish_steps if role == "target" else args.source_polish_steps), args.polish_lr
        rows = Rows(train_stream, spans, seed, alphabet=len(spans), early=512)
        if not steps:
            return {"steps": 0, "lr": lr, "seed": seed, "seconds": 0, "alphabet": rows.alphabet}
        seconds = train(model, rows, steps, lr, 4, lambda p: LONG_MIX, probe_long, shapes=polish_shapes, **common)
    else:  # the copy curriculum again at length: the alphabet starts at the 1,024 it knows and grows to 3,072 as
        # pure repeats are copied; pure rows keep the recall stage's share (at the first family's 10 %, a long stage
        # from the recall stage's model lost copying: 16 % -> 10 % in 150 steps)
        rows = Rows(train_stream, spans, seed, alphabet=len(frequent), early=512)
        mix = dict(LONG_MIX, pure=CONTINUE_MIX["pure"], random=0.35)
        steps, lr = args.long_steps, args.long_lr
        seconds = train(model, rows, steps, lr, 4, lambda p: mix, probe_long, shapes=shapes_for(steps),
                        grow_after=COPY_GROW_AFTER, **common)
    return {"steps": steps, "lr": lr, "seed": seed, "seconds": round(seconds), "alphabet": rows.alphabet}


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--work", default="deep-work", help="resumable state: loop checkpoints, finished stages")
    parser.add_argument("--out", default=str(DEEP), help="where the finished family goes")
    parser.add_argument("--copy-steps", type=int, default=400, help="steps of the copy stage")
    parser.add_argument("--main-steps", type=int, default=1400)
    parser.add_argument("--induce-steps", type=int, default=600)
    parser.add_argument("--recall-steps", type=int, default=500)
    parser.add_argument("--stretch-steps", type=int, default=400)
    parser.add_argument("--long-steps", type=int, default=600)
    parser.add_argument("--long-lr", type=float, default=5e-4)
    parser.add_argument("--polish-steps", type=int, default=2000, help="steps of the target's polish stage")
    parser.add_argument("--source-polish-steps", type=int, default=0)
    parser.add_argument("--polish-lr", type=float, default=3e-4)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--no-autocast", dest="autocast", action="store_false", help="train in plain float32")
    parser.add_argument("--log-every", type=int, default=50)
    parser.add_argument("--save-every", type=int, default=50)
    parser.add_argument("--probe", nargs="+", metavar="MODEL",
                        help="print each checkpoint folder's recall by position (position_probe) and exit")
    return parser


def main(argv=None) -> None:
    from transformers import Ministral3ForCausalLM

    args = _parser().parse_args(argv)
    torch.set_num_threads(args.threads)
    work, progress_path, progress = work_state(args.work)

    tokenizer, splits, train_stream, held_stream, recorded = first_family_data()
    frequent = frequent_tokens(train_stream)
    if args.probe:
        for folder in args.probe:
            probe = position_probe(Ministral3ForCausalLM.from_pretrained(folder).float().eval(), held_stream, frequent)
            print(folder, json.dumps(probe))
        return
    spans = frequent_tokens(train_stream, 3072)
    streams = (train_stream, frequent, spans, recall_rows(held_stream, frequent, 32),
               recall_rows(held_stream, frequent, 16, seq=1024))

    models = {}
    for role in ("target", "source"):
        torch.manual_seed(SEEDS[role] + 100 * args.seed)
        model = ministral3(*SHAPES[role][:3], SHAPES[role][3])
        if (work / role).exists():  # the last finished stage of this model
            model = Ministral3ForCausalLM.from_pretrained(work / role)
        model.to(args.device)
        for i, stage in enumerate(STAGES):
            key = f"{role}/{stage}"
            if key in progress or any(f"{role}/{later}" in progress for later in STAGES[i + 1 :]):
                continue  # done, or a work folder from before this stage existed: never run a stage out of order
            progress[key] = run_stage(role, stage, model, args, streams, work, progress)
            model.save_pretrained(work / role)  # before progress.json says the stage is done
            _write_json(progress, progress_path)
            (work / f"{role}-{stage}.pt").unlink(missing_ok=True)
        models[role] = model.cpu().float().eval()

    out = Path(args.out)
    for role, model in models.items():  # shipped in bfloat16 (half the bytes), measured as shipped
        model.generation_config.pad_token_id = PAD
        model.to(torch.bfloat16).save_pretrained(out / role)
        tokenizer.save_pretrained(out / role)
        models[role] = model.float()
    started = time.time()
    report = {
        "corpus": json.loads((CHECKPOINTS / "family.json").read_text())["corpus"],
        "splits": "the first family's (kvbridge/family/data: calibration and held-out)",
        "tokenizer": "the first family's (4,096-token byte-level BPE)",
        "train_stream_sha256": recorded,
        "independent": "source and target trained from their own random initializations; no pruning, no "
                       "distillation",
        "command": "python -m kvbridge.family.training.train_deep " + " ".join(sys.argv[1:] if argv is None else argv),
        "autocast": "bfloat16" if args.autocast else None, "threads": args.threads, "device": args.device,
        "weights": "bfloat16 (the figures below are measured on them, in float32 arithmetic)",
        "stages": progress,
        "train_seconds": sum(record["seconds"] for record in progress.values()),
    }
    for role, model in models.items():
        layers, hidden, mlp, rope = SHAPES[role]
        report[role] = {"layers": layers, "hidden": hidden, "mlp": mlp, "rope": rope,
                        "parameters": sum(p.numel() for p in model.parameters())} | measure(
            model, tokenizer, splits["heldout"], held_stream, frequent)
    report["measure_seconds"] = round(time.time() - started)
    (out / "family.json").write_text(json.dumps(report, indent=2) + "\n")
    log(json.dumps({k: report[k] for k in ("target", "source")}, indent=2))


if __name__ == "__main__":
    main()
