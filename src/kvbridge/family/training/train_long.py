"""Long-context stages of the embedded family (run once; tests and CI never retrain).

The shipped checkpoints come from two runs of this module after the two stages of
:mod:`kvbridge.family.training.train`, each continuing the checkpoints in place (2 CPU cores)::

    python -m kvbridge.family.training.train_long --target-steps 1000 --source-steps 600 --seed 2     # 1,789 s
    python -m kvbridge.family.training.train_long --target-steps 500 --source-steps 400 --alphabet 3072 \
        --random-share 0.35 --seed 3                                                         # 1,271 s

The second run widens the random spans' alphabet from the 1,024 to the 3,072 most frequent tokens:
after the first, the target copied spans of its training alphabet over ~950 tokens (78 % in the
probe) but spans of the held-out rows' frequent tokens, as the family tasks draw them, far less
(40 %); after the second, 53 %.

The first two stages (:mod:`kvbridge.family.training.train`) trained both models on 256-token rows; past
position 256 they fell apart (held-out target perplexity 113 at positions 384–512 and 541 at
768–1,024, against 29 at 128–256), although their configs claim 2,048 positions. This stage
continues both checkpoints with a length curriculum and keeps what makes the family an instrument:

1. Target: AdamW on rows of 512 tokens (first 15 % of steps), then 1,024, then 1,024 and 2,048 in
   turn (always 4,096 tokens a step), mixing real code with the copy rows of :class:`Rows`: a random
   or real span that recurs anywhere later in the row (so in-context recall now spans up to 2,000
   tokens), and a few pure repeats.
2. Source: the same rows, distilled from the new target (forward KL + 0.5·CE), its own RoPE kept.
3. Both RoPE configurations are kept as they were (target YaRN θ=1e5 ×4 from 512, source YaRN
   θ=5e4 ×2 from 1,024, both 2,048 positions; Ministral3's query scaling from the original length).
4. Measured and written to ``family.json`` under ``long_context``: perplexity by position band on
   held-out documents at 1,024 and 2,048 tokens, no-context perplexity, and recall of a random span
   stated ~950 tokens earlier, for both models, with the stage's settings and times.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

from ...core.hashing import sha256_bytes
from ...core.scoring import score_plain
from ...measure.evaluate import band_perplexity, frequent_ids, heldout_rows, recall_items
from ..corpus import documents
from .train import PAD, Rows, frequent_tokens, heldout_ppl, log, recall_accuracy, recall_rows, token_stream, train

LONG_MIX = {"pure": 0.1, "random": 0.3, "real": 0.15}
TOKENS_PER_STEP = 4096


def shapes_for(steps: int):
    """(row length, batch) per step: 512 first, then 1,024, then 1,024 and 2,048 in turn."""
    def shape(step: int) -> tuple[int, int]:
        progress = step / steps
        seq = 512 if progress < 0.15 else 1024 if progress < 0.55 or step % 2 == 0 else 2048
        return seq, TOKENS_PER_STEP // seq
    return shape


def measure(model, tokenizer, held_texts, held_stream, frequent) -> dict:
    """Every figure the stage records for one model, on held-out data only."""
    rows_1k = heldout_rows(tokenizer, held_texts, 48, 1024)
    rows_2k = heldout_rows(tokenizer, held_texts, 23, 2048)
    short = torch.stack([torch.cat([torch.tensor([1]), held_stream[i : i + 255].long()])
                         for i in range(0, 64 * 256, 256)])
    ppl, bare = heldout_ppl(model, short)
    far, far_starts = recall_rows(held_stream, frequent, 32, seq=1024)
    task_recall = {}  # the family task's recall (random): distinct tokens of the held-out rows' frequent ones
    for length, rows in ((256, heldout_rows(tokenizer, held_texts, 48, 256)), (1024, rows_1k)):
        ctx, _, cont = recall_items(rows, frequent_ids(rows, set(tokenizer.all_special_ids), 1024))
        scores = [score_plain(model, c, k) for c, k in zip(ctx, cont)]
        task_recall[f"task_recall_random_{length}"] = round(sum(x.correct for x in scores)
                                                            / sum(x.tokens for x in scores), 4)
    return task_recall | {
        "heldout_ppl": round(ppl, 3), "heldout_ppl_no_context": round(bare, 3),
        "recall_accuracy": round(recall_accuracy(model, *recall_rows(held_stream, frequent, 32)), 4),
        "recall_accuracy_1024": round(recall_accuracy(model, far, far_starts), 4),
        "band_ppl_1024": band_perplexity(model, rows_1k),
        "band_ppl_2048": band_perplexity(model, rows_2k),
    }


def main(argv=None) -> None:
    from transformers import AutoTokenizer, Ministral3ForCausalLM

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--from", dest="source_dir", default=str(Path(__file__).parents[1] / "checkpoints"),
                        help="checkpoints of the previous stage (target/, source/, family.json)")
    parser.add_argument("--out", default=None, help="where to write (default: --from, replaced in place)")
    parser.add_argument("--target-steps", type=int, default=1000)
    parser.add_argument("--source-steps", type=int, default=600)
    parser.add_argument("--lr", type=float, default=3e-4)
    parser.add_argument("--source-lr", type=float, default=5e-4)
    parser.add_argument("--alphabet", type=int, default=1024,
                        help="random spans draw from this many of the training stream's most frequent tokens")
    parser.add_argument("--random-share", type=float, default=LONG_MIX["random"],
                        help="share of rows where a random span recurs later in real text")
    parser.add_argument("--seed", type=int, default=2)
    parser.add_argument("--log-every", type=int, default=50)
    args = parser.parse_args(argv)
    torch.manual_seed(args.seed)
    torch.set_num_threads(2)
    t0 = time.time()
    src_dir = Path(args.source_dir)
    out = Path(args.out or src_dir)
    previous = json.loads((src_dir / "family.json").read_text())
    tokenizer = AutoTokenizer.from_pretrained(src_dir / "target")
    splits = documents()
    train_stream = token_stream(tokenizer, splits["train"])
    if sha256_bytes(train_stream.numpy().tobytes()) != previous["train_stream_sha256"]:
        raise SystemExit("the local standard library gives another training stream than the recorded one "
                         "(another Python version?); the stage would not continue the same corpus.")
    held_stream = token_stream(tokenizer, splits["heldout"])
    frequent = frequent_tokens(train_stream)  # the probes' alphabet, the same in every stage
    spans = frequent_tokens(train_stream, args.alphabet)  # what the training rows' random spans draw from
    mix = dict(LONG_MIX, random=args.random_share)
    probe = recall_rows(held_stream, frequent, 16, seq=1024)
    target = Ministral3ForCausalLM.from_pretrained(src_dir / "target")
    source = Ministral3ForCausalLM.from_pretrained(src_dir / "source")
    before = {name: measure(m, tokenizer, splits["heldout"], held_stream, frequent)
              for name, m in (("target", target), ("source", source))}
    log(f"before: {json.dumps(before)}")

    rows = Rows(train_stream, spans, args.seed, alphabet=len(spans), early=512)
    target_seconds = train(target, rows, args.target_steps, args.lr, 4, lambda p: mix, probe, tag="target",
                           log_every=args.log_every, shapes=shapes_for(args.target_steps))
    rows = Rows(train_stream, spans, args.seed + 1, alphabet=len(spans), early=512)
    source_seconds = train(source, rows, args.source_steps, args.source_lr, 4, lambda p: mix, probe, teacher=target,
                           tag="source", log_every=args.log_every, shapes=shapes_for(args.source_steps))

    for name, model in (("target", target), ("source", source)):
        model.generation_config.pad_token_id = PAD
        model.save_pretrained(out / name)
        tokenizer.save_pretrained(out / name)
    after = {name: measure(m, tokenizer, splits["heldout"], held_stream, frequent)
             for name, m in (("target", target), ("source", source))}
    report = {k: v for k, v in previous.items() if k not in ("target", "source", "long_context")}
    report["continued_from"] = previous
    report["long_context"] = {
        "command": "python -m kvbridge.family.training.train_long " + " ".join(sys.argv[1:] if argv is None else argv),
        "seed": args.seed, "target_steps": args.target_steps, "source_steps": args.source_steps, "lr": args.lr,
        "tokens_per_step": TOKENS_PER_STEP, "mix": mix, "alphabet": args.alphabet,
        "row_lengths": "512 for the first 15% of steps, then 1024, then 1024 and 2048 in turn (from 55%)",
        "target_train_seconds": round(target_seconds), "source_train_seconds": round(source_seconds),
        "train_seconds": round(time.time() - t0), "threads": torch.get_num_threads(),
        "before": before,
    }
    for name, model in (("target", target), ("source", source)):
        report[name] = {"parameters": sum(p.numel() for p in model.parameters())} | after[name]
    (out / "family.json").write_text(json.dumps(report, indent=2) + "\n")
    log(json.dumps({k: report[k] for k in ("target", "source")}, indent=2))


if __name__ == "__main__":
    main()
