"""Runtime handoff: the source prefills, the mapper builds the target's cache, the target continues.

Letters: B batch, T prompt tokens (left-padded), m held-back tokens, K continuation tokens.

For a left-padded batch of prompts (B, T), the source prefills columns ``[0, T − m)``; the mapper
turns its content KV into the target's content KV; the target's own RoPE is applied at the same
positions (``cumsum(mask) − 1``, as ``generate`` computes them), and the result becomes a
transformers ``DynamicCache``. The target then consumes the last ``m`` prompt tokens natively —
through ``generate`` (which feeds only the columns the cache does not cover) or through a scoring
forward pass — so its first output always comes from its own computation on real tokens.

A :class:`Bridge` builds caches and the first token's logits; prompt batches come from
:mod:`kvbridge.core.prompts`, generation from :mod:`kvbridge.core.generation`, scoring from
:mod:`kvbridge.core.scoring`, selective recompute from :mod:`kvbridge.core.recompute`.
"""

from __future__ import annotations

import math
from typing import Literal

import torch

from ..errors import CompatibilityError, InputError, NumericalError
from .generation import Generation, generate_ids, generate_texts
from .graphs import assumed_unpadded, capturing
from .mapper import Mapper, kv_features
from .mapper_config import KINDS
from .models import (
    LoadedModel,
    cache_kv,
    cache_of,
    make_cache,
    position_limit,
    positions_from_mask,
    prefill,
    source_hidden_size,
    with_cache,
)
from .prompts import PromptBatches, check_batch
from .recompute import Stored, reading, selective_recompute
from .rope import plain_positions, rope_factors, rotate_, rotate_cast_
from .scoring import Score, score_ids, score_texts

Mode = Literal["mapped", "native", "source"]
MODES = ("mapped", "native", "source")


@torch.no_grad()
def held_back_tokens(hold_back: int, shortest: int) -> int:
    """Prompt tokens the target reads itself when the shortest prompt of a batch has ``shortest`` tokens:
    ``hold_back``, or all but the first (the source prefills at least one token of each)."""
    return max(1, min(hold_back, shortest - 1))


def map_source_cache(source_model, target_model, mapper: Mapper, source_cache, positions: torch.Tensor,
                     chunk_tokens: int = 1024, state: torch.Tensor | None = None,
                     premapped: tuple[list[torch.Tensor], list[torch.Tensor]] | None = None):
    """Source cache → target ``DynamicCache``: remove source RoPE, map, apply target RoPE at ``positions``.

    Tokens are mapped in chunks of ``chunk_tokens``; each chunk's GEMMs write straight into one
    preallocated buffer that becomes the cache (:meth:`Mapper.map_features`' layout; the cache's layers
    are views of it), so the transient memory beyond the output cache is one chunk's features, not a copy
    of the whole source cache. cos/sin are computed once for all positions (dynamic RoPE depends on the
    full length; on CPU once per length, :func:`~kvbridge.core.rope.rope_factors`); each RoPE is one in-place
    pass over every layer of a chunk. ``state`` (B, T, Hs): the source's final hidden states, for a mapper
    whose levers read them (``mapper.config.reads_state``). ``premapped``: the target's post-RoPE keys and values
    of a one-row batch's first M tokens, Lt × (1, Ht, M, Dt) each, mapped earlier (:func:`map_block`): copied,
    and the map runs over the tokens after them only.
    """
    if not isinstance(chunk_tokens, int) or chunk_tokens < 1:
        raise InputError(f"chunk_tokens must be an integer >= 1, not {chunk_tokens!r}.")
    src_k, src_v = cache_kv(source_cache)
    read = mapper.config.read_layers  # the features hold the source layers the maps read, no others
    src_k, src_v = [src_k[s] for s in read], [src_v[s] for s in read]
    batch, _, tokens, _ = src_k[0].shape
    t_cfg = mapper.config.target
    param = next(target_model.parameters())
    out = torch.empty((2, tokens, batch, t_cfg.num_layers, t_cfg.num_kv_heads, t_cfg.head_dim), device=param.device,
                      dtype=param.dtype)  # keys, values: the target's cache, in the map's layout
    direct = (mapper.device, mapper.dtype) == (param.device, param.dtype)  # the GEMMs can write into ``out``
    unrotate = token_major(rope_factors(source_model, positions, inverse=True))  # (T, B, 1, 1, Ds) each
    rotate = token_major(rope_factors(target_model, positions))  # (T, B, 1, 1, Dt) each
    m_dev, lag = mapper.device, mapper.max_lag
    masked = lag > 0 and not plain_positions(positions)  # lags need positions only where some row is padded
    first = 0
    if premapped is not None:
        first = premapped[0][0].shape[2]
        if batch != 1 or first > tokens or len(premapped[0]) != t_cfg.num_layers:
            raise InputError(f"premapped K/V cover the first tokens of one row: got {first} tokens of "
                             f"{len(premapped[0])} layers for a batch of {batch} rows of {tokens} tokens.")
        for i, (kind, layers) in enumerate(zip(KINDS, premapped)):
            for view, kv in zip(mapper.layer_views(kind, out[i]), layers):
                view[:, :, :first].copy_(kv)
    for t0 in range(first, tokens, chunk_tokens):
        sl = slice(t0, min(t0 + chunk_tokens, tokens))
        src = slice(max(0, t0 - lag), sl.stop)  # the chunk plus the tokens its lagged features read
        kv = content_features(src_k, src_v, src, [f[src] for f in unrotate], mapper.dtype, m_dev)  # (P+T, B, 2, R, …)
        rows = dict(zip(KINDS, out[:, sl]))
        # float32 keys are rotated in place; lower precision ones on their way from a chunk's buffer into the
        # cache (one read and one write each, rotate_cast_'s fused kernel taking no aliased operands)
        into = dict(rows, key=torch.empty_like(rows["key"])) if out.dtype != torch.float32 else rows
        mapped = mapper.map_features(kv, positions[:, src].to(m_dev) if masked else None,
                                     t0 - src.start, None if state is None else state[:, src].to(m_dev).transpose(0, 1),
                                     out=into if direct else None)
        del kv  # a chunk's transient memory is its features or its keys' rotation, not both
        rotate_cast_(rows["key"], mapped["key"], *(f[sl].to(out.device) for f in rotate))
        if not direct:
            rows["value"].copy_(mapped["value"])
    # one sum and one sync for the whole cache (NaN and Inf survive a sum; a finite cache whose sum
    # overflows float32 is garbage too): garbage in a cache decodes as plausible-looking garbage. While a CUDA
    # graph records, the sum is kept on the device for the caller to read after the replay (:attr:`finite`).
    total = out.sum(dtype=torch.float32)
    if not capturing() and not math.isfinite(total):
        raise NumericalError(NONFINITE)
    cache = make_cache(target_model, mapper.layer_views("key", out[0]), mapper.layer_views("value", out[1]))
    cache.kvbridge_total = total
    return cache


NONFINITE = ("the mapped cache holds NaN or Inf values; the mapper's weights or the source's outputs are not finite. "
             "Run `kvbridge verify` on the mapper, or use float32.")


@torch.no_grad()
def map_block(source_model, target_model, mapper: Mapper, keys: torch.Tensor, values: torch.Tensor,
              hidden: torch.Tensor | None, start: int, past: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """The target's post-RoPE keys and values (Lt, T, Ht, Dt) of one prompt's tokens [start, start + T), mapped
    from the source's post-RoPE ``keys``/``values`` (Ls, P+T, Hs, Ds) and final hidden states ``hidden`` (P+T, S;
    read when the mapper's levers do) of tokens [start − P, start + T), ``past`` = P (at least the mapper's
    :attr:`~Mapper.max_lag`, or ``start``): what :func:`map_source_cache` gives these tokens of the whole prompt,
    since the map reads no token after the one it maps. Map-ahead: a source engine maps each block it stores, so
    that the target's connector only reads it (``premapped``). The models need only their config and rotary
    module (:func:`kvbridge.core.models.load_rope_model`); the target's RoPE must not depend on the prompt's length."""
    if past < min(mapper.max_lag, start) or past > start or keys.shape != values.shape or keys.dim() != 4:
        raise InputError(f"map_block needs the {min(mapper.max_lag, start)} tokens before the block for its lags "
                         f"and K/V of one shape; got past={past} at start={start}, keys {tuple(keys.shape)}.")
    positions = torch.arange(start - past, start + keys.shape[1] - past, device=keys.device)[None]
    cache = make_cache(source_model, [k.transpose(0, 1)[None] for k in keys], [v.transpose(0, 1)[None] for v in values])
    state = hidden[None] if mapper.config.reads_state else None
    mapped_k, mapped_v = cache_kv(map_source_cache(source_model, target_model, mapper, cache, positions, state=state))
    return (torch.stack([k[0, :, past:].transpose(0, 1) for k in mapped_k]),
            torch.stack([v[0, :, past:].transpose(0, 1) for v in mapped_v]))


def token_major(factors: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """RoPE factors (B, T, D) as (T, B, 1, 1, D) views: broadcast over a buffer's layers and heads."""
    return tuple(f.transpose(0, 1)[:, :, None, None] for f in factors)


def content_features(keys: list[torch.Tensor], values: list[torch.Tensor], rows: slice, unrotate, dtype: torch.dtype,
                     device: torch.device) -> torch.Tensor:
    """:func:`~kvbridge.core.mapper.kv_features` of the source's K/V columns ``rows`` with RoPE removed from the keys
    (factors ``unrotate`` (T, B, 1, 1, D), already cut to ``rows``), in ``dtype`` on ``device``: the map's input.

    In float32 the keys are gathered, then un-rotated in place, every layer at once. In lower precision each
    layer's keys go straight from the cache to the buffer through one float32 rotation
    (:func:`~kvbridge.core.rope.rotate_cast_`): no float32 copy of the whole buffer, and one pass on a GPU."""
    if dtype == torch.float32:
        kv = kv_features(keys, values, rows, torch.float32)  # (P+T, B, 2, R, Hs, Ds), on the source's device
        rotate_(kv[:, :, 0], *unrotate)  # content keys, every layer at once
        return kv.to(device)
    b, h, _, d = keys[0].shape
    t = keys[0][:, :, rows].shape[2]
    kv = torch.empty((t, b, 2, len(keys), h, d), dtype=dtype, device=device)
    c, s = (f.to(device) for f in unrotate)
    for i, (k, v) in enumerate(zip(keys, values)):
        rotate_cast_(kv[:, :, 0, i], k[:, :, rows].permute(2, 0, 1, 3).to(device), c[:, :, 0], s[:, :, 0])
        kv[:, :, 1, i].copy_(v[:, :, rows].permute(2, 0, 1, 3))
    return kv


def check_parts(source: LoadedModel, target: LoadedModel, mapper: Mapper) -> None:
    """Refuse what is not a loaded model or a mapper, naming the loader to use."""
    for role, model in (("source", source), ("target", target)):
        if not isinstance(model, LoadedModel):
            raise InputError(f"{role} must be a model from kvbridge.load_model, not {type(model).__name__}; "
                             "or use Bridge.from_pretrained(source_id, target_id, mapper_id).")
    if not isinstance(mapper, Mapper):
        raise InputError(f"mapper must be a kvbridge.Mapper (Mapper.from_pretrained), not {type(mapper).__name__}.")
    width, hidden = mapper.config.state_width, source_hidden_size(source.model)
    if width and width != hidden:
        raise CompatibilityError(f"the mapper reads a source hidden state of {width} features; this source's is "
                                 f"{hidden}. Load the source model it was fitted for.")


def check_options(constructor, options: dict) -> None:
    """Refuse a misspelled Bridge option before any model loads (from_pretrained forwards them): the options
    are the constructor's keyword parameters, read from its signature."""
    import inspect

    known = [p for p in inspect.signature(constructor).parameters if p not in ("self", "source", "target", "mapper")]
    unknown = sorted(set(options) - set(known))
    if unknown:
        raise InputError(f"unknown Bridge option(s) {', '.join(unknown)}; the options are {', '.join(known)}.")


class Bridge(PromptBatches):
    """A source model, a target model and a mapper between them, checked to belong together."""

    def __init__(self, source: LoadedModel, target: LoadedModel, mapper: Mapper, hold_back: int | None = None,
                 allow_revision_mismatch: bool = False, chunk_tokens: int = 1024, recompute: float | None = None,
                 sink: bool | None = None, recompute_by: str | None = None, recompute_window: int | None = None,
                 native_layers: int | None = None, cuda_graphs: bool = False):
        """``hold_back``, ``recompute``, ``recompute_by``, ``recompute_window``, ``sink`` and ``native_layers``
        default to the mapper's runtime options. ``cuda_graphs``: :meth:`first_token_logits` of an unpadded batch
        on a CUDA device replays a CUDA graph recorded for its shape (:mod:`kvbridge.core.graphs`) instead of launching
        every kernel from Python; its cache is then the graph's, refilled by the next call of that shape."""
        check_parts(source, target, mapper)
        if not isinstance(chunk_tokens, int) or isinstance(chunk_tokens, bool) or chunk_tokens < 1:
            raise InputError(f"chunk_tokens must be an integer >= 1, not {chunk_tokens!r}.")
        options = mapper.config.runtime.override(hold_back, recompute, recompute_by, sink, recompute_window,
                                                 native_layers)
        if options.native_layers >= mapper.config.target.num_layers:
            raise InputError(f"native_layers={options.native_layers}: the target has {mapper.config.target.num_layers} "
                             "layers and at least one must be mapped; pass fewer (or mode='native').")
        limit = position_limit(source.info.max_positions, target.info.max_positions)
        for name in ("hold_back", "recompute_window"):
            if getattr(options, name) > limit:
                raise InputError(f"{name}={getattr(options, name)} exceeds the {limit} positions these models "
                                 f"support; pass at most {limit}.")
        self.recompute, self.recompute_by, self.sink = options.recompute, options.recompute_by, options.sink
        self.recompute_window, self.native_layers = options.recompute_window, options.native_layers
        self.chunk_tokens = chunk_tokens
        if not isinstance(cuda_graphs, bool):
            raise InputError(f"cuda_graphs must be True or False, not {cuda_graphs!r}.")
        self.cuda_graphs, self._graphs = cuda_graphs, {}
        mapper.check_models(source.info, target.info, allow_revision_mismatch)
        self.source, self.target, self.mapper, self.hold_back = source, target, mapper, options.hold_back
        self.tokenizer = target.tokenizer

    @classmethod
    def from_pretrained(cls, source: str, target: str, mapper: str, *, source_revision: str | None = None,
                        target_revision: str | None = None, mapper_revision: str | None = None, device: str = "cpu",
                        dtype: str | torch.dtype | None = None, mapper_device: str | None = None,
                        target_device: str | None = None, **options) -> Bridge:
        """Load the three from hub ids or folders; ``options`` are the constructor's (hold_back, recompute, …)."""
        from .models import check_device, load_model, resolve_dtype

        check_options(cls.__init__, options)
        for flag, dev in (("--device", device), ("--mapper-device", mapper_device), ("--target-device", target_device)):
            if dev is not None:
                check_device(dev, flag)
        torch_dtype = resolve_dtype(dtype, device)
        m = Mapper.from_pretrained(mapper, revision=mapper_revision, device=mapper_device or device, dtype=torch_dtype)
        s = load_model(source, source_revision, device, torch_dtype)
        return cls(s, load_model(target, target_revision, target_device or device, torch_dtype), m, **options)

    # -- caches ------------------------------------------------------------------------------
    def held_back(self, mask: torch.Tensor) -> int:
        """Prompt tokens the target reads itself: ``hold_back``, or fewer when the batch's shortest prompt is
        not longer (the source prefills at least one token of each). One count per batch: a short prompt lowers
        it for its batch-mates, whose results then differ slightly from the same prompts run alone."""
        shortest = mask.shape[1] if assumed_unpadded() else int(mask.sum(-1).min())
        return held_back_tokens(self.hold_back, shortest)

    @property
    def selects_tokens(self) -> bool:
        """Whether the target recomputes chosen prefix tokens (selective recompute or a native sink)."""
        return self.recompute > 0 or self.sink

    @property
    def needs_source_state(self) -> bool:
        """Whether building the cache reads the source's final hidden states (a lever that reads them, or a
        recompute criterion scored from them): stored source K/V without them (LMCache's) cannot serve it."""
        from .recompute import reads_source_state

        return self.mapper.config.reads_state or (self.selects_tokens and reads_source_state(self.recompute_by))

    @property
    def runs_target(self) -> bool:
        """Whether building the cache runs the target's weights (chosen tokens recomputed, or its first layers)."""
        return self.selects_tokens or self.native_layers > 0

    @torch.no_grad()
    def source_prefill(self, ids: torch.Tensor, mask: torch.Tensor, stored: Stored | None = None,
                       state: bool | None = None):
        """``(cache, positions, state)``: the source's own cache over a left-padded batch (decoder only, no
        logits), its positions, and its final hidden states when the mapper reads them or ``state`` asks (else
        None). ``stored``: the source's own K/V and hidden states of the first tokens of a one-row batch, kept by
        the engine that served them (warm transfer); the source then runs over the remaining tokens only."""
        positions = positions_from_mask(mask)
        state = self.mapper.config.reads_state if state is None else state
        depth = None if state else self.source_depth  # a state needs every layer; a cache only what the maps read
        if stored is None or stored.tokens == 0:
            if state:
                cache, hidden = prefill(self.source.model, ids, mask, positions, logits="hidden")
                return cache, positions, hidden
            return prefill(self.source.model, ids, mask, positions, logits="none", depth=depth)[0], positions, None
        n = stored.tokens
        if ids.shape[0] != 1 or not bool(mask.all()) or n > ids.shape[1]:
            raise InputError(f"stored source K/V cover the first tokens of one unpadded prompt; got a batch of "
                             f"{tuple(ids.shape)} with {n} stored tokens.")
        model = self.source.model
        param = next(model.parameters())
        keys, values = ([t.to(param.device, param.dtype) for t in kv] for kv in (stored.keys, stored.values))
        if len(keys) != self.mapper.config.source.num_layers or any(k.shape[2] != n for k in keys + values) or \
                (stored.hidden is not None and stored.hidden.shape[:2] != (1, n)):
            raise InputError("the stored source K/V do not match the source model's layers or the stored length.")
        if stored.hidden is None and state:
            raise InputError("the stored source K/V come without the source's hidden states, which this map reads.")
        cache = make_cache(model, keys[:depth], values[:depth])
        hidden = stored.hidden.to(param.device, param.dtype) if stored.hidden is not None else None
        if n < ids.shape[1]:  # the source computes the rest over its own stored K/V
            cache, rest = prefill(model, ids[:, n:], mask, positions[:, n:], "hidden" if state else "none", cache,
                                  depth)
            hidden = torch.cat([hidden, rest], dim=1) if state else None
        return cache, positions, hidden if state else None

    @property
    def source_depth(self) -> int | None:
        """The source layers a transfer's source prefill runs (None: all): the deepest one the maps read."""
        depth = self.mapper.config.source_depth
        return None if depth >= self.mapper.config.source.num_layers else depth

    def native_lower(self, cache, ids: torch.Tensor, mask: torch.Tensor, positions: torch.Tensor):
        """``cache`` (mapped, over the same columns) with its first :attr:`native_layers` layers replaced by the
        target's own K/V: the target's prefill over those columns, stopped after that many layers."""
        if not self.native_layers:
            return cache
        device = next(self.target.model.parameters()).device
        own, _ = prefill(self.target.model, ids.to(device), mask.to(device), positions.to(device), logits="none",
                         depth=self.native_layers)
        for layer, mine in zip(cache.layers[: self.native_layers], own.layers):
            layer.keys, layer.values = mine.keys, mine.values
        return cache

    def map_cache(self, source_cache, positions: torch.Tensor, state: torch.Tensor | None = None,
                  premapped: tuple[list[torch.Tensor], list[torch.Tensor]] | None = None):
        """Source cache (and final hidden states, if the mapper reads them) → target ``DynamicCache``;
        ``premapped``: the target K/V of the first tokens, mapped ahead (:func:`map_source_cache`)."""
        return map_source_cache(self.source.model, self.target.model, self.mapper, source_cache, positions,
                                self.chunk_tokens, state, premapped)

    def mapped_cache(self, ids: torch.Tensor, mask: torch.Tensor, owing: bool = False, stored: Stored | None = None):
        """Target cache for columns [0, T) of a left-padded batch, built from the source's prefill (and, with
        ``recompute``/``sink``, the target's recompute of the chosen tokens). ``owing``: the recompute is left
        to the next forward pass over the cache, which must run under :func:`kvbridge.core.recompute.reading`.
        ``stored``: the source's own K/V of the prompt's first tokens (warm transfer, :meth:`source_prefill`)."""
        if not self.selects_tokens:
            source_cache, positions, state = self.source_prefill(ids, mask, stored)
            cache = self.map_cache(source_cache, positions, state, stored.mapped if stored else None)
            return self.native_lower(cache, ids, mask, positions)
        return selective_recompute(self, ids, mask, owing, stored)

    def prefix_cache(self, mode: Mode, ids: torch.Tensor, mask: torch.Tensor, owing: bool = False):
        """The model that continues and its cache over all but the last :meth:`held_back` columns.

        ``owing`` (mapped mode): a selective recompute is not run on its own but carried by the continuing
        model's next forward pass over the cache, with the held-back tokens (one target pass instead of two);
        that pass must run under :func:`kvbridge.core.recompute.reading` (generate, score and
        :meth:`first_token_logits` do)."""
        if mode not in MODES:
            raise InputError(f"mode must be one of {', '.join(MODES)}, not {mode!r}.")
        check_batch(ids, mask, self.vocab)
        cut = ids.shape[1] - self.held_back(mask)
        prefix_ids, prefix_mask = ids[:, :cut], mask[:, :cut]
        if mode == "mapped":
            return self.target.model, self.mapped_cache(prefix_ids, prefix_mask, owing)
        model = self.target.model if mode == "native" else self.source.model
        return model, prefill(model, prefix_ids, prefix_mask, logits="none")[0]

    @torch.no_grad()
    def first_token_logits(self, ids: torch.Tensor, mask: torch.Tensor, mode: Mode = "mapped"):
        """Everything up to the first output token's logits: ``(cache over all T columns, logits (B, V))``.

        This is what time to first token (TTFT) measures. ``native``: the target prefills all T tokens
        and projects the last one to the vocabulary, in one pass. ``mapped``: the source prefills the
        first T − m, the mapper builds the target's cache, and the target reads the m held-back tokens
        to the last one's logits (with selective recompute, in the same forward pass as the recomputed
        tokens). ``source``: the same as native with the source model.
        """
        if self.cuda_graphs and not assumed_unpadded():
            graphed = self._graphed_first_token(ids, mask, mode)
            if graphed is not None:
                return graphed
        if mode != "mapped":
            model = self.target.model if mode == "native" else self.source.model
            cache, logits = prefill(model, ids, mask, logits="last")
            return cache, logits[:, -1]
        model, cache = self.prefix_cache(mode, ids, mask, owing=True)
        device = next(model.parameters()).device
        m = self.held_back(mask)
        with reading(model):
            whole = None if assumed_unpadded() else mask.to(device)  # (an unpadded batch: no mask to inspect)
            out = model(input_ids=ids[:, -m:].to(device), attention_mask=whole,
                        position_ids=positions_from_mask(mask)[:, -m:].to(device), **with_cache(cache), use_cache=True,
                        logits_to_keep=1)
        return cache_of(out), out.logits[:, -1]

    def _graphed_first_token(self, ids: torch.Tensor, mask: torch.Tensor, mode: Mode):
        """:meth:`first_token_logits` through a CUDA graph of this batch's shape, or None where none can run (a
        padded batch, or not a CUDA device): ids are checked here, on the host, since the graph cannot."""
        from .graphs import GraphCache

        device = (self.source if mode == "source" else self.target).device
        if device.type != "cuda" or mode not in MODES or not bool(mask.all()):
            return None
        check_batch(ids, mask, self.vocab)
        if mode not in self._graphs:
            self._graphs[mode] = GraphCache(lambda i: self.first_token_logits(i, torch.ones_like(i), mode), device)
        cache, logits = self._graphs[mode](ids.to(device))
        total = getattr(cache, "kvbridge_total", None)
        if total is not None and not math.isfinite(total):
            raise NumericalError(NONFINITE)
        return cache, logits

    # -- generation (kvbridge.core.generation) ----------------------------------------------------------
    def generate_ids(self, ids: torch.Tensor, mask: torch.Tensor, mode: Mode = "mapped", max_new_tokens: int = 32,
                     **generate_kwargs) -> torch.Tensor:
        """New token ids (B, ≤ max_new_tokens) after a left-padded batch
        (:func:`kvbridge.core.generation.generate_ids`)."""
        return generate_ids(self, ids, mask, mode, max_new_tokens, **generate_kwargs)

    def generate(self, prompts: list[str] | str, mode: Mode = "mapped", max_new_tokens: int = 32,
                 **generate_kwargs) -> Generation:
        """Continue each prompt; ``generate_kwargs`` go to transformers ``generate`` (do_sample, top_p, …)."""
        return generate_texts(self, prompts, mode, max_new_tokens, **generate_kwargs)

    # -- scoring (kvbridge.core.scoring) --------------------------------------------------------------
    def score_ids(self, contexts: list[list[int]], continuations: list[list[int]], mode: Mode = "mapped",
                  per_context: int = 1) -> list[Score]:
        """Log-likelihood of each continuation given its context (see :func:`kvbridge.core.scoring.score_ids`;
        ``per_context``: that many consecutive continuations share each context's prefix)."""
        return score_ids(self, contexts, continuations, mode, per_context)

    def score(self, contexts: list[str], continuations: list[str], mode: Mode = "mapped") -> list[Score]:
        """Text version of :meth:`score_ids`: the context is encoded with special tokens, the continuation without."""
        return score_texts(self, contexts, continuations, mode)
