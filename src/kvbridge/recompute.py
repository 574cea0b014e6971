"""Selective token recompute: the target recomputes the K/V of a few prefix tokens over the mapped cache.

Letters: B batch, T prefix columns (left-padded), n recomputed tokens per row, H kv heads, D head dim.

In the spirit of CacheBlend (Yao et al., 2024): after the mapper has built the target's cache, the
target runs one forward pass over ``n`` chosen prefix tokens, at their own positions, attending to
the mapped K/V of every other earlier token and to the fresh K/V of the chosen earlier tokens. Their
fresh K/V, layer by layer, replace the mapped ones (written in place in a copy of the cache, so the
chosen tokens attend over T columns, not T + n). The cost is that of a target forward over ``n``
tokens without the last layer's attention and MLP, whose output nothing reads (a fraction of a native
prefill); with every token chosen the result is the native cache exactly.

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

import functools

import torch

from .models import cache_kv, logits_from_hidden, make_cache, with_cache

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

    Each row gets ceil(fraction × its own real tokens) real picks (at least its sink when ``sink`` is set),
    as it would alone; ``n`` is the widest row's count, and a row with fewer fills its surplus with pad
    columns, which nothing attends to (a shorter row has at least as many pads as it needs).
    """
    mask = mask.to(scores.device)
    real = mask.sum(-1)  # (B,)
    counts = torch.clamp(torch.ceil(fraction * real.double()).long(), min=int(sink)).minimum(real)  # (B,)
    n = min(int(counts.max()), mask.shape[1])
    ranked = scores.float().masked_fill(mask == 0, float("-inf"))
    if sink:  # each row's first real token: the column where the mask turns on
        first = (mask.cumsum(-1) == 1) & (mask == 1)
        ranked = ranked.masked_fill(first, float("inf"))
    order = ranked.argsort(dim=-1, descending=True, stable=True)
    places = torch.arange(order.shape[1], device=order.device).expand_as(order)
    rank = torch.empty_like(order).scatter_(1, order, places)  # each column's place in its row's ranking
    picked = (rank < counts[:, None]) & (mask == 1)
    # picked real tokens first, then pad columns, never a real token beyond the row's own count
    priority = torch.where(picked, 2, torch.where(mask == 0, 1, 0))
    return torch.topk(priority, n, dim=-1, sorted=True).indices.sort(dim=-1).values


class _LastLayerDone(Exception):
    """Raised by the last layer's cache once it holds its fresh K/V: the rest of the forward is not needed."""


@functools.cache
def _scatter_layer_class():
    """A transformers cache layer over a copy of the mapped K/V (B, H, T, D) whose update writes the fresh K/V
    of the recomputed tokens at their columns (``index`` (B, 1, n, 1)) instead of appending them, and returns
    the whole layer; on the ``last`` layer it then stops the forward. Built once, on first use."""
    from transformers.cache_utils import DynamicLayer

    class ScatterLayer(DynamicLayer):
        def __init__(self, keys: torch.Tensor, values: torch.Tensor, index: torch.Tensor, last: bool):
            super().__init__()
            self.lazy_initialization(keys, values)
            self.keys, self.values, self.index, self.last = keys.clone(), values.clone(), index, last

        def update(self, key_states, value_states, *args, **kwargs):
            at = self.index.expand(-1, self.keys.shape[1], -1, self.keys.shape[3])
            self.keys.scatter_(2, at, key_states.to(self.keys.dtype))
            self.values.scatter_(2, at, value_states.to(self.values.dtype))
            if self.last:
                raise _LastLayerDone
            return self.keys, self.values

    return ScatterLayer


@torch.no_grad()
def recompute_columns(model, cache, ids: torch.Tensor, mask: torch.Tensor, positions: torch.Tensor,
                      columns: torch.Tensor):
    """A new cache equal to ``cache`` except at ``columns`` (B, n), whose K/V ``model`` recomputes over it.

    Layer by layer, the fresh K/V of the chosen tokens are written over their mapped ones in a copy of the
    cache before the chosen tokens attend: each attends to every real column at or before its position,
    which then holds the mapped K/V of the other tokens and the fresh K/V of the chosen ones (itself
    included). The last layer stops once its K/V are written: its attention and MLP feed nothing.
    """
    from transformers import DynamicCache

    device = next(model.parameters()).device
    ids, mask, positions, columns = (x.to(device) for x in (ids, mask, positions, columns))
    keys, values = cache_kv(cache)
    q_pos = positions.gather(1, columns)  # (B, n)
    q_real = mask.gather(1, columns).bool()  # (B, n): surplus picks of short rows are pads
    allowed = mask.bool()[:, None, :] & (positions[:, None, :] <= q_pos[:, :, None]) & q_real[:, :, None]  # (B, n, T)
    allowed.scatter_(2, columns[:, :, None], True)  # a pad pick attends to itself: no row is all masked
    dtype = next(model.parameters()).dtype  # an additive mask: eager attention adds it, SDPA takes it as is
    bias = torch.zeros(allowed[:, None].shape, dtype=dtype, device=device).masked_fill_(~allowed[:, None],
                                                                                        torch.finfo(dtype).min)
    work = DynamicCache(config=model.config)
    index = columns[:, None, :, None]  # (B, 1, n, 1) → broadcast over heads and head dim
    layer = _scatter_layer_class()
    work.layers = [layer(k, v, index, last=i == len(keys) - 1) for i, (k, v) in enumerate(zip(keys, values))]
    try:
        model.get_decoder()(input_ids=ids.gather(1, columns), attention_mask=bias, position_ids=q_pos,
                            **with_cache(work), use_cache=True)
    except _LastLayerDone:
        pass
    return make_cache(model, [layer.keys for layer in work.layers], [layer.values for layer in work.layers])


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
