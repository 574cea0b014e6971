"""Selective token recompute: the target recomputes the K/V of a few prefix tokens over the mapped cache.

Letters: B batch, T prefix columns (left-padded), n recomputed tokens per row, H kv heads, D head dim.

In the spirit of CacheBlend (Yao et al., 2024): after the mapper has built the target's cache, the
target runs one forward pass over ``n`` chosen prefix tokens, at their own positions, attending to
the mapped K/V of every other earlier token and to the fresh K/V of the chosen earlier tokens. Their
fresh K/V, layer by layer, then replace the mapped ones. The cost is that of a target forward over
``n`` tokens (a fraction of a native prefill); with every token chosen the result is the native cache
exactly.

Which tokens: the least predictable ones — spans that only the context can explain, such as names,
numbers or a sequence to be recalled later, are where a mapped key that is slightly off costs most.

* ``surprisal``: −log p of each token under the *source* model's next-token distribution. Exact, but
  it costs the source a vocabulary projection per prefix token (a large share of a small model's
  prefill).
* ``logit``: minus the source's logit of each token — its surprisal without the vocabulary-wide
  normalisation: one dot product of the source's last hidden state with the token's output embedding,
  instead of a projection onto the whole vocabulary.
* ``bigram``: −log p of each token given the previous one under bigram counts of the calibration
  tokens (Dirichlet-smoothed toward the unigram distribution, ``BIGRAM_PRIOR``), stored in the
  artifact. A table lookup per token: no FLOPs.

The row's first token (the attention sink) is always kept when ``sink`` is set.
"""

from __future__ import annotations

import math

import torch

from .models import cache_kv, cache_of, logits_from_hidden, make_cache, with_cache

CRITERIA = ("surprisal", "logit", "bigram")
BIGRAM_PRIOR = 1.0  # pseudo-counts of the unigram distribution in every bigram context


def bigram_tables(sequences: torch.Tensor, vocab: int) -> dict[str, torch.Tensor]:
    """Bigram and unigram counts of token ids ``sequences`` (N, T), as artifact tensors.

    ``recompute.bigram.keys`` (P,) int64: previous · vocab + token, sorted, one per seen pair;
    ``recompute.bigram.counts`` (P,) float32; ``recompute.unigram.counts`` (vocab,) float32.
    """
    ids = sequences.to(torch.int64)
    pairs = (ids[:, :-1] * vocab + ids[:, 1:]).flatten()
    keys, counts = torch.unique(pairs, return_counts=True)  # sorted
    unigram = torch.bincount(ids.flatten(), minlength=vocab)[:vocab]
    return {"recompute.bigram.keys": keys, "recompute.bigram.counts": counts.float(),
            "recompute.unigram.counts": unigram.float()}


def bigram_surprisal(ids: torch.Tensor, tables: dict[str, torch.Tensor]) -> torch.Tensor:
    """(B, T) −log p(token t | token t − 1) under the smoothed bigram counts; column 0 gets 0."""
    keys, counts = tables["recompute.bigram.keys"], tables["recompute.bigram.counts"]
    unigram = tables["recompute.unigram.counts"]
    vocab = unigram.numel()
    ids = ids.to(keys.device).clamp(0, vocab - 1)
    prev, tok = ids[:, :-1], ids[:, 1:]
    query = prev * vocab + tok
    at = torch.searchsorted(keys, query).clamp_max(keys.numel() - 1)
    pair = torch.where(keys[at] == query, counts[at], torch.zeros((), dtype=counts.dtype, device=counts.device))
    p_uni = (unigram[tok] + 1.0) / (unigram.sum() + vocab)  # add-one unigram, never zero
    # the counts of `prev` as a context equal its unigram counts up to sequence ends: close enough for ranking
    p = (pair + BIGRAM_PRIOR * p_uni) / (unigram[prev] + BIGRAM_PRIOR)
    out = torch.zeros(ids.shape, dtype=torch.float32, device=ids.device)
    out[:, 1:] = -torch.log(p.float())
    return out


def surprisal(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """(B, T) −log p(token t | tokens < t) under ``logits`` (B, T, V); column 0 gets 0."""
    logprobs = torch.log_softmax(logits[:, :-1].float(), dim=-1)  # (B, T−1, V): column t predicts t + 1
    out = torch.zeros(ids.shape, dtype=torch.float32, device=logits.device)
    out[:, 1:] = -logprobs.gather(-1, ids[:, 1:, None].to(logits.device))[..., 0]
    return out


def negative_logit(model, hidden: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """(B, T) minus ``model``'s logit of token t from its final hidden state at t − 1 (column 0 gets 0)."""
    head = model.get_output_embeddings()
    rows = head.weight[ids[:, 1:].to(head.weight.device)]  # (B, T−1, hidden): output embedding of each next token
    logit = (hidden[:, :-1].to(rows.dtype) * rows).sum(-1).float()
    if getattr(head, "bias", None) is not None:
        logit = logit + head.bias[ids[:, 1:].to(head.bias.device)].float()
    out = torch.zeros(ids.shape, dtype=torch.float32, device=logit.device)
    out[:, 1:] = -logit
    return out


def choose_columns(scores: torch.Tensor, mask: torch.Tensor, fraction: float, sink: bool) -> torch.Tensor:
    """(B, n) sorted columns to recompute: the top ``fraction`` of each row's real tokens by ``scores``.

    ``n`` is the same for every row (ceil of the fraction of the widest row); a shorter row fills its
    surplus with pad columns, which nothing attends to.
    """
    mask = mask.to(scores.device)
    real = mask.sum(-1)  # (B,)
    n = min(max(int(math.ceil(fraction * int(real.max()))), int(sink)), mask.shape[1])
    ranked = scores.float().masked_fill(mask == 0, float("-inf"))
    if sink:  # each row's first real token: the column where the mask turns on
        first = (mask.cumsum(-1) == 1) & (mask == 1)
        ranked = ranked.masked_fill(first, float("inf"))
    return torch.topk(ranked, n, dim=-1).indices.sort(dim=-1).values


@torch.no_grad()
def recompute_columns(model, cache, ids: torch.Tensor, mask: torch.Tensor, positions: torch.Tensor,
                      columns: torch.Tensor):
    """A new cache equal to ``cache`` except at ``columns`` (B, n), whose K/V ``model`` recomputes over it."""
    device = next(model.parameters()).device
    b, t = ids.shape
    n = columns.shape[1]
    ids, mask, positions, columns = (x.to(device) for x in (ids, mask, positions, columns))
    keys, values = cache_kv(cache)
    chosen = torch.zeros(b, t, dtype=torch.bool, device=device).scatter_(1, columns, True)  # (B, T)
    q_pos = positions.gather(1, columns)  # (B, n)
    q_real = mask.gather(1, columns).bool()  # (B, n): surplus picks of short rows are pads
    # a chosen token attends to earlier mapped tokens that are not being replaced ...
    old = (mask.bool() & ~chosen)[:, None, :] & (positions[:, None, :] <= q_pos[:, :, None])  # (B, n, T)
    # ... and to the fresh K/V of chosen tokens at or before its position (itself included)
    new = (q_real[:, None, :] & (q_pos[:, None, :] <= q_pos[:, :, None])) | torch.eye(n, dtype=torch.bool,
                                                                                       device=device)[None]
    allowed = torch.cat([old & q_real[:, :, None], new], dim=-1)[:, None]  # (B, 1, n, T + n)
    dtype = next(model.parameters()).dtype  # an additive mask: eager attention adds it, SDPA takes it as is
    bias = torch.zeros(allowed.shape, dtype=dtype, device=device).masked_fill_(~allowed, torch.finfo(dtype).min)
    work = make_cache(model, keys, values)  # updating it concatenates: the mapped tensors stay as they are
    out = model.get_decoder()(input_ids=ids.gather(1, columns), attention_mask=bias, position_ids=q_pos,
                              **with_cache(work), use_cache=True)
    fresh_k, fresh_v = cache_kv(cache_of(out))
    index = columns[:, None, :, None]  # (B, 1, n, 1) → broadcast over heads and head dim
    new_k, new_v = [], []
    for k, v, fk, fv in zip(keys, values, fresh_k, fresh_v):
        idx = index.expand(-1, k.shape[1], -1, k.shape[3])
        new_k.append(k.scatter(2, idx, fk[:, :, t:].to(k.dtype)))  # (B, H, T, D)
        new_v.append(v.scatter(2, idx, fv[:, :, t:].to(v.dtype)))
    return make_cache(model, new_k, new_v)


@torch.no_grad()
def selective_recompute(bridge, ids: torch.Tensor, mask: torch.Tensor):
    """The mapped cache of a left-padded batch with ``bridge.recompute`` of its prefix tokens (and the sink)
    recomputed by the target: source prefill (with what the criterion needs), map, choose, recompute."""
    from .models import positions_from_mask, prefill

    source = bridge.source.model
    positions = positions_from_mask(mask)
    reads_state = bridge.mapper.config.reads_state
    if bridge.recompute_by == "surprisal" and not reads_state:
        source_cache, logits = prefill(source, ids, mask, positions, logits="all")
        scores, hidden = surprisal(logits, ids), None
    else:
        wants = bridge.recompute_by != "bigram" or reads_state
        source_cache, hidden = prefill(source, ids, mask, positions, logits="hidden" if wants else "none")
        if bridge.recompute_by == "surprisal":  # the same logits, from the hidden states the mapper reads too
            scores = surprisal(logits_from_hidden(source, hidden), ids)
        elif bridge.recompute_by == "logit":
            scores = negative_logit(source, hidden, ids)
        else:
            scores = bigram_surprisal(ids, bridge.mapper.weights)
    cache = bridge.map_cache(source_cache, positions, hidden if reads_state else None)
    after_pad = torch.nn.functional.pad(mask[:, :-1], (1, 0)).to(scores.device) == 0  # first token: no score
    columns = choose_columns(scores.masked_fill(after_pad, 0.0), mask, bridge.recompute, bridge.sink)
    return recompute_columns(bridge.target.model, cache, ids, mask, positions, columns)
