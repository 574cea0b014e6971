"""Selective token recompute: the target recomputes the K/V of a few prefix tokens over the mapped cache.

Letters: B batch, T prefix columns (left-padded), n recomputed tokens per row, H kv heads, D head dim.

In the spirit of CacheBlend (Yao et al., 2024): after the mapper has built the target's cache, the
target runs one forward pass over ``n`` chosen prefix tokens, at their own positions, attending to
the mapped K/V of every other earlier token and to the fresh K/V of the chosen earlier tokens. Their
fresh K/V, layer by layer, replace the mapped ones (written in place in a copy of the cache, so the
chosen tokens attend over T columns, not T + n). The cost is that of a target forward over ``n``
tokens without the last layer's attention and MLP, whose output nothing reads (a fraction of a native
prefill); with every token chosen the result is the native cache exactly.

That pass need not run on its own: the target reads the held-back prompt tokens (and, when scoring, the
continuation) in a forward pass over the cache anyway, and the chosen tokens can ride along in it —
one pass over the target's weights instead of two. :func:`owing_cache` leaves the recompute owed by the
cache; under :func:`reading`, the next forward pass over it puts the chosen tokens before its own
(each row attending as above; the new tokens to every real prefix column, the chosen ones fresh) and
runs the last layer's attention and MLP for its own tokens only. ``generate``, ``score`` and
``first_token_logits`` go that way; :func:`recompute_columns` is the pass on its own (a complete cache).

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
* ``random``: a control, not a criterion — uniform random scores, seeded by the prompt's tokens (the same
  prompt gets the same choice), so a frontier can measure what a criterion adds over spending the same
  recompute budget on tokens chosen blindly.

Then, over a ``window`` of w tokens centred on each one (w odd, default 9 in ``kvbridge fit``), the scores are
averaged: a token ranks high when the text around it is unpredictable, not only the token itself. That
recomputes unpredictable *spans* whole (a name of several tokens, a number, a sequence to be recalled),
where a single surprising word in ordinary text ranks lower; with the same number of recomputed tokens it
keeps far more of the target's quality on the embedded family (see docs/levers.md). w = 1 is the token's own
score (artifacts fitted before the window existed).

The row's first token (the attention sink) is always kept when ``sink`` is set.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import math
from dataclasses import dataclass

import torch

from .models import cache_kv, logits_from_hidden, make_cache, positions_from_mask, with_cache

CRITERIA = ("surprisal", "logit", "bigram", "random")
BIGRAM_PRIOR = 1.0  # pseudo-counts of the unigram distribution in every bigram context


def reads_source_state(recompute_by: str) -> bool:
    """Whether a recompute criterion scores tokens from the source's final hidden states (so the source prefill must
    run its whole decoder, not stop at its cache): the source's surprisal and logit do; a bigram table and the
    random control do not."""
    return recompute_by not in ("bigram", "random")


def is_window(window) -> bool:
    """Whether ``window`` is a valid ``recompute_window``: an odd integer >= 1 (centred on each token)."""
    return isinstance(window, int) and not isinstance(window, bool) and window >= 1 and window % 2 == 1


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


def window_mean(scores: torch.Tensor, valid: torch.Tensor, window: int) -> torch.Tensor:
    """(B, T) mean of ``scores`` over the ``valid`` columns among the ``window`` (odd) columns centred on each
    one; 0 where none is valid. Pad columns and columns without a score (``valid`` False) count for nothing, so a
    left-padded row ranks its tokens as it would alone."""
    if window == 1:
        return scores.float().masked_fill(~valid, 0.0)
    # a window wider than 2T − 1 covers the whole row from every column: the same mean, and a kernel torch can take
    window = min(window, 2 * scores.shape[-1] - 1)
    w = valid.float()[:, None]
    pool = functools.partial(torch.nn.functional.avg_pool1d, kernel_size=window, stride=1, padding=window // 2)
    # (filled, not multiplied: a pad's score may be anything, even NaN, and must not reach its neighbours)
    total, count = pool(scores.float().masked_fill(~valid, 0.0)[:, None])[:, 0], pool(w)[:, 0]
    return torch.where(count > 0, total / count.clamp_min(1e-12), 0.0)


def recompute_counts(fraction: float, real: torch.Tensor, sink: bool) -> torch.Tensor:
    """How many tokens each row recomputes: ceil(``fraction`` × its ``real`` tokens) (float64, so the FLOP count and
    the runtime agree), at least its sink when ``sink`` is set, at most all of them."""
    return torch.clamp(torch.ceil(fraction * real.double()).long(), min=int(sink)).minimum(real)


def choose_columns(scores: torch.Tensor, mask: torch.Tensor, fraction: float, sink: bool) -> torch.Tensor:
    """(B, n) sorted columns to recompute: the top ``fraction`` of each row's real tokens by ``scores``.

    Each row gets ceil(fraction × its own real tokens) real picks (at least its sink when ``sink`` is set),
    as it would alone; ``n`` is the widest row's count, and a row with fewer fills its surplus with pad
    columns, which nothing attends to (a shorter row has at least as many pads as it needs).
    """
    from .graphs import assumed_unpadded

    mask = mask.to(scores.device)
    if assumed_unpadded():  # every row is whole: its count from the length, on the host (nothing read back)
        b, t = mask.shape
        n = min(t, max(int(sink), math.ceil(fraction * t)))  # recompute_counts' float64 arithmetic, in Python
        counts = torch.full((b,), n, dtype=torch.long, device=mask.device)
    else:
        counts = recompute_counts(fraction, mask.sum(-1), sink)  # (B,)
        n = int(counts.max())
    n = min(n, mask.shape[1])
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
    """Raised by the last layer's cache once it holds the chosen tokens' fresh K/V: their rest of the forward is
    not needed."""


class _Pending:
    """The recompute a cache still owes: the chosen tokens ``ids`` (B, n) at ``positions`` (B, n), each allowed
    to attend to ``allowed`` (B, n, T) of the T prefix columns (at ``prefix_positions``, within the model's sliding
    ``window`` if it has one). ``armed`` once a forward pass carries them."""

    def __init__(self, ids: torch.Tensor, positions: torch.Tensor, allowed: torch.Tensor,
                 prefix_positions: torch.Tensor, window: int | None):
        self.ids, self.positions, self.allowed = ids, positions, allowed
        self.prefix_positions, self.window = prefix_positions, window  # (B, T); the model's sliding window
        self.armed = False  # the chosen rows are in the forward pass now running (or have been)
        self.last_done = False  # the last layer holds their K/V
        self.failed = False  # that pass stopped before the end: some layers hold fresh K/V, others do not


@functools.cache
def _scatter_layer_class():
    """A transformers cache layer over a copy of the mapped K/V (B, H, T, D) that owes the recompute of the
    tokens at ``index`` (B, 1, n, 1). Its first update receives the chosen tokens' fresh K/V first (n rows),
    writes them over their columns, and appends any rows after them (tokens read after the prefix, as a
    ``DynamicLayer`` does); from then on it is a plain ``DynamicLayer``. On the ``last`` layer the first update
    carries the chosen rows only and stops their forward once written. Built once, on first use."""
    from transformers.cache_utils import DynamicLayer

    class ScatterLayer(DynamicLayer):
        def __init__(self, keys: torch.Tensor, values: torch.Tensor, index: torch.Tensor, last: bool,
                     pending: _Pending):
            super().__init__()
            self.lazy_initialization(keys, values)
            self.keys, self.values, self.index, self.last, self.pending = keys.clone(), values.clone(), index, last, \
                pending
            self.owes = True

        def update(self, key_states, value_states, *args, **kwargs):
            if not self.owes:
                return super().update(key_states, value_states, *args, **kwargs)
            if self.pending.failed:
                raise RuntimeError("the forward pass that carried this kvbridge cache's selective recompute failed "
                                   "part-way; the cache is half recomputed. Build a new one.")
            if not self.pending.armed:  # read by a forward that does not carry the chosen tokens: refuse
                raise RuntimeError("a kvbridge cache that owes a selective recompute was read outside "
                                   "kvbridge.core.recompute.reading(model); use Bridge.prefix_cache(...) for a "
                                   "complete cache.")
            n = self.index.shape[2]
            at = self.index.expand(-1, self.keys.shape[1], -1, self.keys.shape[3])
            self.keys.scatter_(2, at, key_states[:, :, :n].to(self.keys.dtype))
            self.values.scatter_(2, at, value_states[:, :, :n].to(self.values.dtype))
            self.owes = False
            if self.last:
                raise _LastLayerDone
            if key_states.shape[2] == n:
                return self.keys, self.values
            return super().update(key_states[:, :, n:], value_states[:, :, n:], *args, **kwargs)

    return ScatterLayer


def _bias(allowed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Additive (B, 1, q, K) mask from a boolean (B, q, K) one: eager attention adds it, SDPA takes it as is."""
    return torch.zeros(allowed[:, None].shape, dtype=dtype, device=allowed.device).masked_fill_(
        ~allowed[:, None], torch.finfo(dtype).min)


def _window(model) -> int | None:
    """The decoder's sliding attention window (None: full attention), as its own mask function reads it."""
    return getattr(model.get_decoder().config, "sliding_window", None)


def _in_window(allowed: torch.Tensor, q_pos: torch.Tensor, k_pos: torch.Tensor, window: int | None) -> torch.Tensor:
    """``allowed`` (B, q, K) restricted to keys less than ``window`` positions before each query (as transformers'
    sliding-window mask does); unchanged without a window."""
    return allowed if window is None else allowed & (q_pos[:, :, None] - k_pos[:, None, :] < window)


def owing_cache(model, cache, ids: torch.Tensor, mask: torch.Tensor, positions: torch.Tensor,
                columns: torch.Tensor):
    """A copy of ``cache`` (T columns) that owes the recompute of ``columns`` (B, n) of the prefix ``ids``:
    the next forward pass over it under :func:`reading` recomputes them along with its own tokens, in one
    pass. Each chosen token attends to every real column at or before its position; the forward's own
    tokens attend to every real prefix column (chosen ones fresh) and causally to each other."""
    from transformers import DynamicCache

    device = next(model.parameters()).device
    ids, mask, positions, columns = (x.to(device) for x in (ids, mask, positions, columns))
    keys, values = cache_kv(cache)
    if any(k.shape[2] != ids.shape[1] for k in keys):
        from ..errors import UnsupportedModelError

        raise UnsupportedModelError(
            f"selective recompute needs every prefix column in the cache, but this target's sliding-window layers "
            f"keep only the last {min(k.shape[2] for k in keys)} of the prompt's {ids.shape[1]}. Turn recompute off "
            "(Bridge(..., recompute=0), or kvbridge fit --recompute 0) or use prompts shorter than the window.")
    q_pos = positions.gather(1, columns)  # (B, n)
    q_real = mask.gather(1, columns).bool()  # (B, n): surplus picks of short rows are pads
    allowed = mask.bool()[:, None, :] & (positions[:, None, :] <= q_pos[:, :, None]) & q_real[:, :, None]  # (B, n, T)
    window = _window(model)
    allowed = _in_window(allowed, q_pos, positions, window)
    allowed.scatter_(2, columns[:, :, None], True)  # a pad pick attends to itself: no row is all masked
    pending = _Pending(ids.gather(1, columns), q_pos, allowed, positions, window)
    work = DynamicCache(config=model.config)
    index = columns[:, None, :, None]  # (B, 1, n, 1) → broadcast over heads and head dim
    layer = _scatter_layer_class()
    work.layers = [layer(k, v, index, i == len(keys) - 1, pending) for i, (k, v) in enumerate(zip(keys, values))]
    work.kvbridge_pending = pending
    work.kvbridge_total = getattr(cache, "kvbridge_total", None)  # the map's finiteness sum, read after a graph
    return work


def _cache_argument(kwargs: dict):
    return kwargs.get("cache", kwargs.get("past_key_values"))  # the keyword changed name in transformers 5


def _carry_chosen(module, args, kwargs):
    """Decoder pre-hook: when the cache owes a recompute, put the chosen tokens before the forward's own."""
    pending = getattr(_cache_argument(kwargs), "kvbridge_pending", None)
    if pending is None or pending.armed:
        return None
    ids = kwargs.get("input_ids")
    if args or ids is None:
        raise RuntimeError("a kvbridge cache that owes a selective recompute must be read with input_ids passed "
                           "by keyword (the bridge's generate, score and first_token_logits do).")
    b, q = ids.shape
    n, t = pending.ids.shape[1], pending.allowed.shape[2]
    mask = kwargs.get("attention_mask")
    mask = torch.ones((b, t + q), dtype=torch.long, device=ids.device) if mask is None else mask
    if mask.dim() != 2 or mask.shape != (b, t + q) or pending.ids.shape[0] != b:
        raise RuntimeError(f"a kvbridge cache that owes a selective recompute over {pending.ids.shape[0]} rows of "
                           f"{t} columns was read with input_ids {tuple(ids.shape)} and attention_mask "
                           f"{tuple(mask.shape)}; expected a 2-D mask over the prefix and the new tokens.")
    positions = kwargs.get("position_ids")
    positions = positions_from_mask(mask)[:, t:] if positions is None else positions
    col = torch.arange(t + q, device=ids.device)
    row = torch.arange(q, device=ids.device)
    own = mask.bool()[:, None, :] & ((col[None, :] < t) | (col[None, :] - t <= row[:, None]))[None]  # (B, q, T+q)
    own = _in_window(own, positions, torch.cat([pending.prefix_positions, positions], 1), pending.window)
    chosen = torch.cat([pending.allowed, pending.allowed.new_zeros((b, n, q))], dim=2)  # never the new tokens
    dtype = next(module.parameters()).dtype
    kwargs.update(input_ids=torch.cat([pending.ids, ids], 1), position_ids=torch.cat([pending.positions, positions], 1),
                  attention_mask=_bias(torch.cat([chosen, own], 1), dtype))
    pending.armed = True
    return args, kwargs


def _rows(kwargs: dict, part: slice) -> dict:
    """Decoder-layer keyword arguments restricted to the query rows ``part``."""
    out = dict(kwargs)
    out["attention_mask"] = kwargs["attention_mask"][:, :, part]
    out["position_ids"] = kwargs["position_ids"][:, part]
    out["position_embeddings"] = tuple(x[:, part] for x in kwargs["position_embeddings"])
    return out


def _finish_chosen(module, args, kwargs):
    """Last decoder layer pre-hook: the chosen tokens need only its K/V (written, then their pass stops); the
    layer then runs on the forward's own tokens alone."""
    pending = getattr(_cache_argument(kwargs), "kvbridge_pending", None)
    if pending is None or not pending.armed or pending.last_done or pending.failed:
        return None  # (a failed cache's own layers refuse the read)
    n = pending.ids.shape[1]
    hidden = args[0] if args else kwargs.pop("hidden_states")
    try:
        module.forward(hidden[:, :n], **_rows(kwargs, slice(0, n)))
    except _LastLayerDone:
        pass
    pending.last_done = True
    return (hidden[:, n:], *args[1:]), _rows(kwargs, slice(n, None))


@contextlib.contextmanager
def reading(model):
    """Inside, a forward pass of ``model`` over a cache from :func:`owing_cache` carries the chosen tokens along
    with its own: one pass recomputes them and reads the new tokens (e.g. the held-back prompt tokens in
    ``generate``'s first step), instead of a recompute pass and then a reading pass. A cache whose carrying
    pass did not finish (an exception inside) refuses any later read."""
    carried: list[_Pending] = []

    def carry(module, args, kwargs):
        out = _carry_chosen(module, args, kwargs)
        if out is not None:
            carried.append(_cache_argument(kwargs).kvbridge_pending)
        return out

    decoder = model.get_decoder()
    hooks = [decoder.register_forward_pre_hook(carry, with_kwargs=True),
             decoder.layers[-1].register_forward_pre_hook(_finish_chosen, with_kwargs=True)]
    try:
        yield
    finally:
        for hook in hooks:
            hook.remove()
        for pending in carried:
            pending.failed = not pending.last_done


@torch.no_grad()
def recompute_columns(model, cache, ids: torch.Tensor, mask: torch.Tensor, positions: torch.Tensor,
                      columns: torch.Tensor):
    """A new cache equal to ``cache`` except at ``columns`` (B, n), whose K/V ``model`` recomputes over it.

    Layer by layer, the fresh K/V of the chosen tokens are written over their mapped ones in a copy of the
    cache before the chosen tokens attend: each attends to every real column at or before its position,
    which then holds the mapped K/V of the other tokens and the fresh K/V of the chosen ones (itself
    included). The last layer stops once its K/V are written: its attention and MLP feed nothing.
    """
    work = owing_cache(model, cache, ids, mask, positions, columns)
    pending = work.kvbridge_pending
    pending.armed = True
    try:
        bias = _bias(pending.allowed, next(model.parameters()).dtype)
        model.get_decoder()(input_ids=pending.ids, attention_mask=bias, position_ids=pending.positions,
                            **with_cache(work), use_cache=True)
    except _LastLayerDone:
        pass
    return make_cache(model, [layer.keys for layer in work.layers], [layer.values for layer in work.layers])


@dataclass
class Stored:
    """The source's own K/V of a prompt's first ``tokens`` tokens (per layer (1, H, tokens, D), keys with RoPE) and
    its final hidden states there (1, tokens, S; None where the engine kept K/V only — LMCache — and the map reads no
    state): what an engine that served the source kept (warm transfer).
    ``mapped``: the target's post-RoPE keys and values of the first M ≤ ``tokens`` of them, mapped ahead by that
    engine (per target layer (1, Ht, M, Dt)); the map then runs over the tokens after them only."""

    tokens: int
    keys: list[torch.Tensor]
    values: list[torch.Tensor]
    hidden: torch.Tensor | None
    mapped: tuple[list[torch.Tensor], list[torch.Tensor]] | None = None


def source_scores(bridge, ids: torch.Tensor, mask: torch.Tensor, positions: torch.Tensor,
                  stored: Stored | None = None):
    """``(source cache, final hidden states or None, scores (B, T))``: the source's prefill (over what ``stored``
    does not cover) with what the criterion needs, and each token's score (higher: recompute first)."""
    from .models import prefill

    source = bridge.source.model
    reads_state = bridge.mapper.config.reads_state
    if stored is None and bridge.recompute_by == "surprisal" and not reads_state:
        source_cache, logits = prefill(source, ids, mask, positions, logits="all")
        return source_cache, None, surprisal(logits, ids)
    wants = reads_source_state(bridge.recompute_by) or reads_state
    source_cache, _, hidden = bridge.source_prefill(ids, mask, stored, state=wants)
    if bridge.recompute_by == "surprisal":  # the same logits, from the hidden states the mapper reads too
        scores = surprisal(logits_from_hidden(source, hidden), ids)
    elif bridge.recompute_by == "logit":
        scores = negative_logit(source, hidden, ids)
    elif bridge.recompute_by == "random":
        scores = random_scores(ids, mask)
    else:
        scores = bigram_surprisal(ids, bridge.mapper.weights)
    return source_cache, hidden, scores


def random_scores(ids: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
    """(B, T) uniform scores in [0, 1), each row's seeded by its real tokens (``mask``: 1 on them; left padding
    gets zeros): the ``random`` control's blind choice, the same for a prompt whatever batch it is in."""
    out = torch.zeros(ids.shape, dtype=torch.float32)
    real = torch.ones_like(ids, dtype=torch.bool) if mask is None else mask.to(ids.device) == 1
    for b, (row, keep) in enumerate(zip(ids.cpu(), real.cpu())):
        tokens = row[keep]
        seed = int.from_bytes(hashlib.sha256(tokens.numpy().tobytes()).digest()[:8], "little")
        out[b, keep] = torch.rand(tokens.shape[0], generator=torch.Generator().manual_seed(seed))
    return out.to(ids.device)


@torch.no_grad()
def selective_recompute(bridge, ids: torch.Tensor, mask: torch.Tensor, owing: bool = False,
                        stored: Stored | None = None):
    """The mapped cache of a left-padded batch with ``bridge.recompute`` of its prefix tokens (and the sink)
    recomputed by the target: source prefill (with what the criterion needs; ``stored``: the source's own K/V and
    hidden states of the first tokens, the prefill runs over the rest only), map, choose, recompute.
    ``owing``: return the cache before the recompute, owing it to the next forward pass over it
    (:func:`owing_cache`)."""
    positions = positions_from_mask(mask)
    source_cache, hidden, scores = source_scores(bridge, ids, mask, positions, stored)
    cache = bridge.map_cache(source_cache, positions, hidden if bridge.mapper.config.reads_state else None,
                             stored.mapped if stored else None)
    cache = bridge.native_lower(cache, ids, mask, positions)
    mask = mask.to(scores.device)
    scored = (mask == 1) & (torch.nn.functional.pad(mask[:, :-1], (1, 0)) == 1)  # a row's first token has no score
    scores = window_mean(scores, scored, bridge.recompute_window)
    columns = choose_columns(scores, mask, bridge.recompute, bridge.sink)
    finish = owing_cache if owing else recompute_columns
    return finish(bridge.target.model, cache, ids, mask, positions, columns)
