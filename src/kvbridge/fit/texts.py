"""Texts: reading calibration and held-out files, and cutting them into calibration windows.

``read_texts`` takes ``.txt`` (one text per non-empty line) or ``.jsonl`` (a ``text`` field per line),
UTF-8, and names the file and line of anything it cannot read. ``calibration_sequences`` packs texts
end to end into (N, T) windows that start with BOS; ``split_heldout_documents`` keeps whole documents
out of the fit for the held-out R²; ``repeat_spans`` writes a span into some windows twice, so that the
levers also calibrate on text the target can only predict by reading its context.
"""

from __future__ import annotations

import io
import json
import random
from collections.abc import Iterable
from pathlib import Path

import torch

from ..errors import InputError


def read_texts(path: str | Path) -> list[str]:
    """Texts from a ``.txt`` file (one per non-empty line) or ``.jsonl`` (a ``text`` field per line)."""
    if not str(path).strip():
        raise InputError("no texts file given: pass a .txt or .jsonl file.")
    path = Path(path)
    if path.is_dir():
        raise InputError(f"{path} is a folder; pass a .txt or .jsonl file.")
    if not path.is_file():
        raise InputError(f"text file {str(path)!r} does not exist.")
    texts: list[str] = []
    try:
        raw = path.read_bytes().decode("utf-8")
    except UnicodeDecodeError as exc:
        line = path.read_bytes()[: exc.start].count(b"\n") + 1
        raise InputError(f"{path}:{line} is not UTF-8 (byte {exc.start}); save the texts as UTF-8.") from None
    with io.StringIO(raw, newline=None) as handle:  # universal newlines, as open() would
        if path.suffix == ".jsonl":
            for number, line in enumerate(handle, 1):
                if not line.strip():
                    continue
                try:
                    record = json.loads(line)
                except json.JSONDecodeError as exc:
                    raise InputError(f"{path}:{number} is not valid JSON ({exc.msg}).") from None
                except RecursionError:
                    raise InputError(f"{path}:{number} is nested too deeply to be a text record.") from None
                if not isinstance(record, dict) or not isinstance(record.get("text"), str):
                    raise InputError(f"{path}:{number} has no string field 'text'; "
                                     "each line must be {\"text\": ...}.")
                try:  # JSON can spell a lone surrogate ("\\ud800"), which no tokenizer reads
                    record["text"].encode("utf-8")
                except UnicodeEncodeError as exc:
                    raise InputError(f"{path}:{number}: its text holds an unpaired surrogate (character "
                                     f"{exc.start}), not valid Unicode text.") from None
                texts.append(record["text"])
        elif path.suffix in (".txt", ""):
            texts = [line.rstrip("\n") for line in handle if line.strip()]
        else:
            raise InputError(f"{path} must be a .txt file (one text per line) or .jsonl (a 'text' field per line).")
    texts = [t for t in texts if t.strip()]
    if not texts:
        raise InputError(f"{path} contains no text.")
    return texts


def calibration_sequences(tokenizer, texts: Iterable[str], num_sequences: int, seq_len: int) -> torch.Tensor:
    """(N, T) token ids: BOS, then the texts' tokens packed end to end and cut into windows.

    Every sequence starts like a real prompt (with the BOS token when the tokenizer has one), and
    no token is wasted on padding. Raises when the texts do not fill ``num_sequences`` windows.
    """
    if num_sequences < 1 or seq_len < 2:
        raise InputError("need at least one calibration sequence of at least 2 tokens.")
    bos = [tokenizer.bos_token_id] if tokenizer.bos_token_id is not None else []
    body = seq_len - len(bos)
    needed = num_sequences * body
    stream: list[int] = []
    for text in texts:
        stream.extend(tokenizer(text, add_special_tokens=False, verbose=False)["input_ids"])
        if tokenizer.eos_token_id is not None:
            stream.append(tokenizer.eos_token_id)
        if len(stream) >= needed:
            break
    if len(stream) < needed:
        have = len(stream) // body
        raise InputError(
            f"the texts hold {len(stream):,} tokens: enough for {have} sequences of {seq_len} tokens, not "
            f"{num_sequences}. Pass more text, or lower --num-texts / --seq-len."
        )
    rows = [bos + stream[i * body : (i + 1) * body] for i in range(num_sequences)]
    return torch.tensor(rows, dtype=torch.long)


def split_heldout_documents(tokenizer, texts: list[str], num_sequences: int, seq_len: int
                            ) -> tuple[list[str], list[str]]:
    """``(fit texts, held-out texts)``: the last documents that fill ``num_sequences`` windows are held out whole.

    Held-out windows cut from the same documents as the fit windows (the next window of the same
    file) would flatter the held-out R²; whole documents keep the two apart.
    """
    if num_sequences == 0:
        return list(texts), []
    needed = num_sequences * (seq_len - (tokenizer.bos_token_id is not None))
    have, cut = 0, len(texts)
    while cut > 0 and have < needed:
        cut -= 1
        have += len(tokenizer(texts[cut], add_special_tokens=False, verbose=False)["input_ids"]) + (
            tokenizer.eos_token_id is not None)
    if have < needed or cut == 0:
        raise InputError(f"the texts are too few to hold out {num_sequences} sequences of {seq_len} tokens in "
                         "documents of their own; pass more texts, or lower --heldout-texts (0 skips held-out R²).")
    return list(texts[:cut]), list(texts[cut:])


SPAN_TOKENS = (8, 32)  # shortest and longest repeated span
MAX_SPANS = 16  # repeated spans a row, on average, at most


def repeat_spans(sequences: torch.Tensor, per_row: float, seed: int = 0, special: Iterable[int] = ()) -> torch.Tensor:
    """A copy of ``sequences`` (N, T) in which rows hold spans written twice, ``per_row`` spans a row on average.

    A row gets ⌊per_row⌋ spans, and one more with probability per_row − ⌊per_row⌋ (seeded). A span of 8 to 32
    tokens overwrites a stretch of the row's first half and again a stretch of its second half (never the
    first column, which holds BOS). Half of the spans are a stretch of another row; half are tokens drawn one
    by one from the rows' own token distribution (``special`` ids excluded), text no model could predict.
    Either way the second occurrence is what only the first one explains, as in a document that repeats a
    name, a number or a line. Calibration text rarely does this, yet in-context recall lives in exactly these
    tokens' keys (the previous-token keys an induction head matches). ``per_row`` 0 returns the rows unchanged.

    Not the evaluation's recipe (:mod:`kvbridge.measure.evaluate`'s recall tasks): the lengths differ (8-32 tokens
    against always 16), the sources differ (random spans here are drawn from the rows' own token distribution,
    repeats allowed, against distinct tokens of the 1,024 most frequent; real spans from any position of another
    calibration row against the same position of another held-out row), and the positions differ (anywhere in
    the first half, then anywhere in the second, against 8-39 tokens in and again in the last 64).
    """
    if not 0.0 <= per_row <= MAX_SPANS:
        raise InputError(f"repeated spans per row must be a number from 0 to {MAX_SPANS}, not {per_row}.")
    n, t = sequences.shape
    if per_row == 0 or t < 2 * SPAN_TOKENS[0] + 2:
        return sequences
    rng = random.Random(seed)
    skip = torch.tensor(sorted(set(int(i) for i in special)), dtype=sequences.dtype)
    pool = sequences[:, 1:].flatten()
    pool = pool[~torch.isin(pool, skip)] if skip.numel() else pool
    if pool.numel() == 0:
        pool = sequences.flatten()
    out = sequences.clone()
    half = t // 2
    whole, part = int(per_row), per_row - int(per_row)
    for i in range(n):
        for _ in range(whole + (rng.random() < part)):
            length = rng.randint(SPAN_TOKENS[0], min(SPAN_TOKENS[1], half - 1))
            if n > 1 and rng.random() < 0.5:
                j = (i + 1 + rng.randrange(n - 1)) % n
                at = rng.randrange(1, t - length + 1)
                span = sequences[j, at : at + length]
            else:
                span = pool[torch.tensor([rng.randrange(pool.numel()) for _ in range(length)])]
            first, second = rng.randrange(1, half - length + 1), rng.randrange(half, t - length + 1)
            out[i, first : first + length] = span
            out[i, second : second + length] = span
    return out
