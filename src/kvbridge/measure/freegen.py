"""Free generation: what a user reads, measured against native and against the source alone.

Perplexity and cloze score given text; a mapped cache that scores well can still generate badly (a loop of
"the string of the string of …"). Here every mode writes its own text, greedily, after the same held-out context:
the target from its own prefill (``native``), the target from the mapped cache (``mapped``) and the source from its
own prefill (``source``: the baseline a transfer must beat — a user who keeps the small model gets that).

* ``continuation``: ``new_tokens`` greedy tokens (end-of-text suppressed, so every continuation has them all);
  *agreement* is the share of positions whose token equals native's, *first divergence* the first position that
  differs (``new_tokens`` when none does), *repetition* the share of the continuation's 4-grams that already
  occurred earlier in it (0: no loop).
* ``recall, written``: a generative exact-match task. A 16-token span of another document is stated early in the
  context and begins again near its end (:func:`kvbridge.measure.evaluate.recall_items`); after its first token the
  model writes the other 15 greedily, and is right only if all 15 are the span's: a value stated far back, which only
  reading the context gives. (An exact next line of third-party code is beyond the embedded family's models: native
  wrote none of 16 right.)

Each figure is kept per item with its document, so :mod:`kvbridge.measure.evaluate`'s paired bootstrap gives intervals
and gap recovered ((mapped − source) ÷ (native − source)) as for the scoring tasks.
"""

from __future__ import annotations

import torch

from ..errors import InputError
from .evaluate import SPAN, TaskResult, recall_items

MODES = ("native", "mapped", "source")
NGRAM = 4


def repetition(tokens: list[int], n: int = NGRAM) -> float:
    """Share of the n-grams of ``tokens`` that already occurred earlier in it (0 for no repeat)."""
    grams = [tuple(tokens[i : i + n]) for i in range(len(tokens) - n + 1)]
    seen, repeats = set(), 0
    for gram in grams:
        repeats += gram in seen
        seen.add(gram)
    return repeats / len(grams) if grams else 0.0


def first_divergence(tokens: list[int], reference: list[int]) -> int:
    """The first position where ``tokens`` differs from ``reference`` (their common length when none does)."""
    for i, (a, b) in enumerate(zip(tokens, reference)):
        if a != b:
            return i
    return min(len(tokens), len(reference))


def agreement(tokens: list[int], reference: list[int]) -> float:
    """Share of the reference's positions where ``tokens`` holds the same token."""
    return sum(a == b for a, b in zip(tokens, reference)) / len(reference) if reference else float("nan")


@torch.no_grad()
def greedy(bridge, contexts: list[list[int]], mode: str, new_tokens: int, batch_size: int = 8,
           stop_eos: bool = False) -> list[list[int]]:
    """Greedy continuations of ``new_tokens`` tokens after each context (end-of-text suppressed unless ``stop_eos``)."""
    eos = bridge.tokenizer.eos_token_id
    extra = {} if stop_eos or eos is None else {"suppress_tokens": [eos]}
    out = []
    for i in range(0, len(contexts), batch_size):
        ids, mask = bridge.pad(contexts[i : i + batch_size])
        new = bridge.generate_ids(ids, mask, mode, max_new_tokens=new_tokens, **extra)
        out += new.tolist()
    return out


def _result(task: str, metric: str, values: dict, keys: list, higher_is_better: bool = True) -> TaskResult:
    means = {m: sum(v) / len(v) for m, v in values.items()}
    return TaskResult(task, metric, means["native"], means["mapped"], means["source"], 0.0, len(keys),
                      higher_is_better, per_item=values, keys=keys)


def continuation_results(bridge, contexts: list[list[int]], keys: list, new_tokens: int = 48,
                         batch_size: int = 8, known: dict | None = None) -> list[TaskResult]:
    """Agreement with native, first divergence and repetition of each mode's greedy continuation (one result each;
    repetition is kept as 1 − repetition, *distinct 4-grams*, so that higher is better for all three). ``known``:
    continuations already written for these contexts (mode → lists), filled in with the ones written here — a
    sweep over mappers writes native's and the source's once."""
    if not contexts:
        raise InputError("no contexts to continue.")
    texts = known if known is not None else {}
    for mode in MODES:
        if mode not in texts or mode == "mapped":
            texts[mode] = greedy(bridge, contexts, mode, new_tokens, batch_size)
    native = texts["native"]
    agree = {m: [agreement(t, r) for t, r in zip(texts[m], native)] for m in MODES}
    diverge = {m: [float(first_divergence(t, r)) for t, r in zip(texts[m], native)] for m in MODES}
    distinct = {m: [1.0 - repetition(t) for t in texts[m]] for m in MODES}
    return [_result("agreement", f"token agreement with native ({new_tokens} greedy tokens)", agree, keys),
            _result("first divergence", f"first position differing from native (of {new_tokens})", diverge, keys),
            _result("distinct 4-grams", f"1 − repeated {NGRAM}-grams of the continuation", distinct, keys)]


def written_recall_result(bridge, rows: torch.Tensor, keys: list, batch_size: int = 8) -> TaskResult:
    """Exact match of a span stated far back, *written* (see the module's docstring)."""
    contexts, _, spans = recall_items(rows, alphabet=None)
    hits = {}
    for mode in MODES:
        new = greedy(bridge, contexts, mode, SPAN - 1, batch_size)
        hits[mode] = [float(list(w[: len(span)]) == list(span)) for w, span in zip(new, spans)]
    distance = rows.shape[1] - 64 - 40
    return _result("recall, written", f"exact match of a {SPAN}-token span written greedily, stated ≥{distance} "
                   "tokens back", hits, keys)
