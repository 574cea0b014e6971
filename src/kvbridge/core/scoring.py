"""Scoring: the log-likelihood of a continuation, from a mapped, native or source prefix.

Letters: B batch, T context tokens (left-padded), m held-back tokens, K continuation tokens, V vocabulary.

:func:`score_ids` is what :meth:`kvbridge.Bridge.score_ids` runs: the bridge builds the prefix cache
over all but the last ``m`` context tokens, and the continuing model reads those ``m`` tokens and the
continuation in one forward pass. :func:`score_plain` is the reference without any cache. Both turn
log-probabilities into a :class:`Score` the same way (:func:`score_row`), refusing non-finite values.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from ..errors import InputError, NumericalError
from .models import positions_from_mask, with_cache
from .prompts import check_ids, check_text
from .recompute import reading


class Score(NamedTuple):
    """Log-likelihood of a continuation, whether it is the greedy one, and top-1 hits among its tokens."""

    logprob: float
    is_greedy: bool
    correct: int
    tokens: int


def log_probs(logits: torch.Tensor, what: str) -> torch.Tensor:
    """float32 log-softmax of ``logits``; refuses non-finite values (NaN would otherwise score as a tie or a win)."""
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    if not bool(torch.isfinite(logprobs).all()):
        raise NumericalError(f"the {what} produced NaN or Inf log-probabilities; nothing was scored. Check the mapper "
                             "(`kvbridge verify`) and the model dtype (float16 can overflow: try bfloat16 or float32).")
    return logprobs


def score_row(logprobs: torch.Tensor, continuation: list[int]) -> Score:
    """Score of one continuation from the (K, V) log-probs of the positions that predict its K tokens."""
    target = torch.tensor(continuation, device=logprobs.device)
    hits = logprobs.argmax(-1) == target
    return Score(float(logprobs.gather(1, target[:, None]).sum()), bool(hits.all()), int(hits.sum()), len(target))


@torch.no_grad()
def score_plain(model, context: list[int], continuation: list[int]) -> Score:
    """``model`` scores ``continuation`` after ``context`` in one forward pass, no cache and no transfer."""
    device = next(model.parameters()).device
    ids = torch.tensor([context + continuation], device=device)
    return score_row(log_probs(model(input_ids=ids).logits[0, len(context) - 1 : -1], "model"), continuation)


def check_per_context(contexts: list, continuations: list, per_context: int) -> None:
    """``per_context`` continuations follow each context (:func:`score_ids`), or one InputError says what is off."""
    if not isinstance(per_context, int) or per_context < 1:
        raise InputError(f"per_context must be a positive integer, not {per_context!r}.")
    if len(contexts) * per_context != len(continuations):
        raise InputError(f"{len(contexts)} contexts need {len(contexts) * per_context} continuations "
                         f"({per_context} each), not {len(continuations)}.")


@torch.no_grad()
def score_ids(bridge, contexts: list[list[int]], continuations: list[list[int]], mode: str = "mapped",
              per_context: int = 1) -> list[Score]:
    """Log-likelihood of each continuation given its context, and whether it is the greedy one.

    The continuing model (target for ``mapped``/``native``) reads the held-back context tokens
    and the continuation in one forward pass over the prefix cache. ``per_context``: each context is
    followed by that many consecutive continuations (``continuations[i * k : (i + 1) * k]`` after
    ``contexts[i]``, as multiple-choice items are); its prefix cache is built once and shared by them.
    """
    check_per_context(contexts, continuations, per_context)
    if not contexts:
        raise InputError("no contexts given; nothing to score.")
    if any(len(c) == 0 for c in continuations):
        raise InputError("a continuation is empty; nothing to score.")
    check_ids(continuations, "continuation", bridge.vocab)
    for i, cont in enumerate(continuations):
        ctx = contexts[i // per_context]
        if len(ctx) + len(cont) > bridge.max_positions:
            raise InputError(f"context {i // per_context} plus its continuation has {len(ctx) + len(cont)} tokens, "
                             f"more than the {bridge.max_positions} positions these models support. Truncate the "
                             "context.")
    longest = max(len(c) for c in continuations)
    ids, mask = bridge.pad(contexts)
    # a shared prefix is completed (any selective recompute run) before it is copied to its continuations
    model, cache = bridge.prefix_cache(mode, ids, mask, owing=per_context == 1)
    if per_context > 1:
        cache.batch_repeat_interleave(per_context)
        ids, mask = ids.repeat_interleave(per_context, 0), mask.repeat_interleave(per_context, 0)
    b, m = ids.shape[0], bridge.held_back(mask)
    tail = torch.full((b, m + longest), int(ids[0, -1]), dtype=torch.long)
    tail_mask = torch.zeros((b, m + longest), dtype=torch.long)
    tail[:, :m], tail_mask[:, :m] = ids[:, -m:], 1
    for i, cont in enumerate(continuations):
        tail[i, m : m + len(cont)] = torch.tensor(cont, dtype=torch.long)
        tail_mask[i, m : m + len(cont)] = 1  # right padding after a continuation is causal-safe
    full_mask = torch.cat([mask, tail_mask[:, m:]], dim=1)  # (B, T + K): context, then continuation
    positions = positions_from_mask(full_mask)[:, ids.shape[1] - m:]  # (B, m + K) of the tail
    device = next(model.parameters()).device
    with reading(model):  # a selective recompute rides along with the tail
        out = model(input_ids=tail.to(device), attention_mask=full_mask.to(device),
                    position_ids=positions.to(device), **with_cache(cache), use_cache=True)
    logprobs = log_probs(out.logits, f"{'target' if mode != 'source' else 'source'} ({mode})")  # (B, m + K, V)
    # position m − 1 + j predicts continuation token j
    return [score_row(logprobs[i, m - 1 : m - 1 + len(cont)], cont) for i, cont in enumerate(continuations)]


def score_texts(bridge, contexts: list[str], continuations: list[str], mode: str = "mapped") -> list[Score]:
    """Text version of :func:`score_ids`: the context is encoded with special tokens, the continuation without."""
    for what, texts in (("contexts", contexts), ("continuations", continuations)):
        if not isinstance(texts, (list, tuple)):  # a string would be scored as one-character texts
            raise InputError(f"{what} must be a list of strings, not {type(texts).__name__}; for one pair, pass "
                             f"[context], [continuation].")
        for i, text in enumerate(texts):
            check_text(text, f"{what[:-1]} {i}")
    tok = bridge.tokenizer
    ctx = [tok(c, verbose=False)["input_ids"] for c in contexts]
    cont = [tok(c, add_special_tokens=False, verbose=False)["input_ids"] for c in continuations]
    return score_ids(bridge, ctx, cont, mode)
