"""Runtime handoff: the source prefills, the mapper builds the target's cache, the target continues.

Letters: B batch, T prompt tokens (left-padded), m held-back tokens, K continuation tokens.

For a left-padded batch of prompts (B, T), the source prefills columns ``[0, T − m)``; the mapper
turns its content KV into the target's content KV; the target's own RoPE is applied at the same
positions (``cumsum(mask) − 1``, as ``generate`` computes them), and the result becomes a
transformers ``DynamicCache``. The target then consumes the last ``m`` prompt tokens natively —
through ``generate`` (which feeds only the columns the cache does not cover) or through a scoring
forward pass — so its first output always comes from its own computation on real tokens.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Literal, NamedTuple

import torch

from .errors import InputError, NumericalError
from .mapper import Mapper
from .models import (
    LoadedModel,
    cache_kv,
    make_cache,
    positions_from_mask,
    prefill,
)
from .prompts import (
    check_batch,
    check_generation,
    check_ids,
    check_text,
    encode_prompts,
    pad_rows,
    pad_token_id,
)
from .recompute import CRITERIA, selective_recompute
from .rope import apply_rope, remove_rope, rotary_factors

Mode = Literal["mapped", "native", "source"]
MODES = ("mapped", "native", "source")


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


def _score_row(logprobs: torch.Tensor, continuation: list[int]) -> Score:
    """Score of one continuation from the (K, V) log-probs of the positions that predict its K tokens."""
    target = torch.tensor(continuation, device=logprobs.device)
    hits = logprobs.argmax(-1) == target
    return Score(float(logprobs.gather(1, target[:, None]).sum()), bool(hits.all()), int(hits.sum()), len(target))


@torch.no_grad()
def score_plain(model, context: list[int], continuation: list[int]) -> Score:
    """``model`` scores ``continuation`` after ``context`` in one forward pass, no cache and no transfer."""
    device = next(model.parameters()).device
    ids = torch.tensor([context + continuation], device=device)
    return _score_row(log_probs(model(input_ids=ids).logits[0, len(context) - 1 : -1], "model"), continuation)


@dataclass
class Generation:
    texts: list[str]
    token_ids: list[list[int]]
    seconds: float


@torch.no_grad()
def map_source_cache(source_model, target_model, mapper: Mapper, source_cache, positions: torch.Tensor,
                     chunk_tokens: int = 1024):
    """Source cache → target ``DynamicCache``: remove source RoPE, map, apply target RoPE at ``positions``.

    Tokens are mapped in chunks of ``chunk_tokens`` straight into preallocated target
    tensors, so the transient memory beyond the output cache is one chunk's features, not a
    copy of the whole source cache. cos/sin are computed once for all positions (dynamic RoPE
    depends on the full length).
    """
    if not isinstance(chunk_tokens, int) or chunk_tokens < 1:
        raise InputError(f"chunk_tokens must be an integer >= 1, not {chunk_tokens!r}.")
    src_k, src_v = cache_kv(source_cache)
    batch, _, tokens, _ = src_k[0].shape
    t_cfg = mapper.config.target
    device = next(target_model.parameters()).device
    dtype = next(target_model.parameters()).dtype
    shape = (batch, t_cfg.num_kv_heads, tokens, t_cfg.head_dim)
    out_k = [torch.empty(shape, device=device, dtype=dtype) for _ in range(t_cfg.num_layers)]
    out_v = [torch.empty(shape, device=device, dtype=dtype) for _ in range(t_cfg.num_layers)]
    s_cos, s_sin = rotary_factors(source_model, positions.to(src_k[0].device))  # (B, T, Ds)
    t_cos, t_sin = rotary_factors(target_model, positions.to(device))  # (B, T, Dt)
    m_dev, lag = mapper.device, mapper.max_lag
    for t0 in range(0, tokens, chunk_tokens):
        sl = slice(t0, min(t0 + chunk_tokens, tokens))
        src = slice(max(0, t0 - lag), sl.stop)  # the chunk plus the tokens its lagged features read
        keys = [remove_rope(k[:, :, src].float(), s_cos[:, src], s_sin[:, src]).to(m_dev) for k in src_k]
        mk, mv = mapper.map(keys, [v[:, :, src].to(m_dev) for v in src_v],
                                 positions[:, src].to(m_dev) if lag else None, past=t0 - src.start)
        for layer in range(t_cfg.num_layers):
            out_k[layer][:, :, sl] = apply_rope(mk[layer].to(device, torch.float32), t_cos[:, sl], t_sin[:, sl])
            out_v[layer][:, :, sl] = mv[layer]
    # one sum per tensor and one sync for the whole cache (NaN and Inf survive a sum; a finite cache whose
    # sum overflows float32 is garbage too): garbage in a cache decodes as plausible-looking garbage
    if not bool(torch.isfinite(torch.stack([t.sum(dtype=torch.float32) for t in out_k + out_v])).all()):
        raise NumericalError("the mapped cache holds NaN or Inf values; the mapper's weights or the source's "
                             "outputs are not finite. Run `kvbridge verify` on the mapper, or use float32.")
    return make_cache(target_model, out_k, out_v)


class Bridge:
    """A source model, a target model and a mapper between them, checked to belong together."""

    def __init__(self, source: LoadedModel, target: LoadedModel, mapper: Mapper, hold_back: int | None = None,
                 allow_revision_mismatch: bool = False, chunk_tokens: int = 1024, recompute: float | None = None,
                 sink: bool | None = None, recompute_by: str | None = None):
        """``hold_back``, ``recompute``, ``recompute_by`` and ``sink`` default to the mapper's runtime options."""
        for role, model in (("source", source), ("target", target)):
            if not isinstance(model, LoadedModel):
                raise InputError(f"{role} must be a model from kvbridge.models.load_model, not {type(model).__name__}; "
                                 "or use Bridge.from_pretrained(source_id, target_id, mapper_id).")
        if not isinstance(mapper, Mapper):
            raise InputError(f"mapper must be a kvbridge.Mapper (Mapper.from_pretrained), not {type(mapper).__name__}.")
        for name, value in (("hold_back", hold_back), ("chunk_tokens", chunk_tokens)):
            if value is not None and (not isinstance(value, int) or isinstance(value, bool)):
                raise InputError(f"{name} must be an integer, not {value!r}.")
        if recompute is not None and (isinstance(recompute, bool) or not isinstance(recompute, (int, float))):
            raise InputError(f"recompute must be a fraction in [0, 1], not {recompute!r}.")
        if chunk_tokens < 1:
            raise InputError("chunk_tokens must be >= 1.")
        self.chunk_tokens = chunk_tokens
        runtime = mapper.config.runtime
        hold_back = runtime.hold_back if hold_back is None else hold_back
        if hold_back < 1:
            raise InputError("hold_back must be >= 1: the target must consume at least the last prompt token itself.")
        self.recompute = runtime.recompute if recompute is None else float(recompute)
        if not 0.0 <= self.recompute <= 1.0:
            raise InputError(f"recompute must be a fraction in [0, 1], not {recompute}.")
        if sink is not None and not isinstance(sink, bool):
            raise InputError(f"sink must be True or False, not {sink!r}.")
        self.sink = runtime.sink if sink is None else sink
        self.recompute_by = runtime.recompute_by if recompute_by is None else recompute_by
        if self.recompute_by not in CRITERIA:
            raise InputError(f"recompute_by must be 'surprisal', 'logit' or 'bigram', not {recompute_by!r}.")
        if self.recompute_by == "bigram" and not runtime.bigram_pairs:
            raise InputError("this mapper carries no bigram table (fitted by an older kvbridge): use "
                             "recompute_by='logit' or 'surprisal', or refit it.")
        mapper.check_models(source.info, target.info, allow_revision_mismatch)
        self.source, self.target, self.mapper, self.hold_back = source, target, mapper, hold_back
        self.tokenizer = target.tokenizer

    @classmethod
    def from_pretrained(cls, source: str, target: str, mapper: str, *, source_revision: str | None = None,
                        target_revision: str | None = None, mapper_revision: str | None = None,
                        device: str = "cpu", dtype: str | torch.dtype | None = None,
                        mapper_device: str | None = None, target_device: str | None = None,
                        hold_back: int | None = None, allow_revision_mismatch: bool = False,
                        recompute: float | None = None, sink: bool | None = None,
                        recompute_by: str | None = None) -> Bridge:
        from .models import check_device, load_model, resolve_dtype

        for flag, dev in (("--device", device), ("--mapper-device", mapper_device), ("--target-device", target_device)):
            if dev is not None:
                check_device(dev, flag)
        torch_dtype = resolve_dtype(dtype, device)
        m = Mapper.from_pretrained(mapper, revision=mapper_revision, device=mapper_device or device, dtype=torch_dtype)
        s = load_model(source, source_revision, device, torch_dtype)
        t = load_model(target, target_revision, target_device or device, torch_dtype)
        return cls(s, t, m, hold_back, allow_revision_mismatch, recompute=recompute, sink=sink,
                   recompute_by=recompute_by)

    # -- inputs (kvbridge.prompts) -------------------------------------------------------------
    @property
    def vocab(self) -> int:
        return min(self.source.model.config.vocab_size, self.target.model.config.vocab_size)

    @property
    def max_positions(self) -> int:
        """Positions both models support (prompt plus generated or scored tokens)."""
        return min(self.source.info.max_positions or 10**12, self.target.info.max_positions or 10**12)

    def encode(self, prompts: list[str] | str, max_new_tokens: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """Left-padded ids and mask (B, T); refuses empty, too short and over-long prompts."""
        return encode_prompts(self.tokenizer, prompts, self.vocab, self.max_positions, max_new_tokens)

    def pad(self, rows: list[list[int]], max_new_tokens: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """Left-padded ids and mask (B, T) of token-id rows."""
        return pad_rows(rows, pad_token_id(self.tokenizer), self.vocab, self.max_positions, max_new_tokens)

    # -- caches ------------------------------------------------------------------------------
    def held_back(self, mask: torch.Tensor) -> int:
        """Prompt tokens the target reads itself for this batch: ``hold_back``, or fewer when the shortest
        prompt is not longer (the source must prefill at least one token of every prompt).

        The count is one per batch: a prompt shorter than ``hold_back`` + 1 lowers it for its batch-mates,
        so their results then differ slightly from the same prompts run alone.
        """
        return max(1, min(self.hold_back, int(mask.sum(-1).min()) - 1))

    @property
    def selects_tokens(self) -> bool:
        """Whether the target recomputes chosen prefix tokens (selective recompute or a native sink)."""
        return self.recompute > 0 or self.sink

    @property
    def needs_source_logits(self) -> bool:
        return self.selects_tokens and self.recompute_by == "surprisal"

    @torch.no_grad()
    def source_prefill(self, ids: torch.Tensor, mask: torch.Tensor):
        """The source's own cache over a left-padded batch (decoder only, no logits) and its positions."""
        positions = positions_from_mask(mask)
        return prefill(self.source.model, ids, mask, positions, logits="none")[0], positions

    def map_cache(self, source_cache, positions: torch.Tensor):
        """Source cache → target ``DynamicCache`` (see :func:`map_source_cache`)."""
        return map_source_cache(self.source.model, self.target.model, self.mapper, source_cache, positions,
                                self.chunk_tokens)

    def mapped_cache(self, ids: torch.Tensor, mask: torch.Tensor):
        """Target cache for columns [0, T) of a left-padded batch, built from the source's prefill (and, with
        ``recompute``/``sink``, the target's recompute of the chosen tokens)."""
        if not self.selects_tokens:
            return self.map_cache(*self.source_prefill(ids, mask))
        return selective_recompute(self, ids, mask)

    def prefix_cache(self, mode: Mode, ids: torch.Tensor, mask: torch.Tensor):
        """The model that continues and its cache over all but the last :meth:`held_back` columns."""
        if mode not in MODES:
            raise InputError(f"mode must be one of {', '.join(MODES)}, not {mode!r}.")
        check_batch(ids, mask, self.vocab)
        cut = ids.shape[1] - self.held_back(mask)
        prefix_ids, prefix_mask = ids[:, :cut], mask[:, :cut]
        if mode == "mapped":
            return self.target.model, self.mapped_cache(prefix_ids, prefix_mask)
        model = self.target.model if mode == "native" else self.source.model
        return model, prefill(model, prefix_ids, prefix_mask, logits="none")[0]

    @torch.no_grad()
    def first_token_logits(self, ids: torch.Tensor, mask: torch.Tensor, mode: Mode = "mapped"):
        """Everything up to the first output token's logits: ``(cache over all T columns, logits (B, V))``.

        This is what time to first token (TTFT) measures. ``native``: the target prefills all T tokens
        and projects the last one to the vocabulary, in one pass. ``mapped``: the source prefills the
        first T − m, the mapper builds the target's cache, and the target reads the m held-back tokens
        to the last one's logits. ``source``: the same as native with the source model.
        """
        if mode != "mapped":
            model = self.target.model if mode == "native" else self.source.model
            cache, logits = prefill(model, ids, mask, logits="last")
            return cache, logits[:, -1]
        model, cache = self.prefix_cache(mode, ids, mask)
        device = next(model.parameters()).device
        m = self.held_back(mask)
        out = model(input_ids=ids[:, -m:].to(device), attention_mask=mask.to(device),
                    position_ids=positions_from_mask(mask)[:, -m:].to(device), cache=cache, use_cache=True,
                    logits_to_keep=1)
        return out.cache, out.logits[:, -1]

    # -- generation --------------------------------------------------------------------------
    @torch.no_grad()
    def generate_ids(self, ids: torch.Tensor, mask: torch.Tensor, mode: Mode = "mapped", max_new_tokens: int = 32,
                     **generate_kwargs) -> torch.Tensor:
        """New token ids (B, ≤ max_new_tokens) after a left-padded batch, greedy unless ``do_sample=True``.

        ``generate_kwargs`` go to transformers ``generate`` (do_sample, temperature, top_p, top_k,
        stop_strings with tokenizer, …). The prefix cache covers all but the held-back tokens, and
        ``generate`` feeds exactly the columns it does not cover.
        """
        check_generation(max_new_tokens, generate_kwargs)
        model, cache = self.prefix_cache(mode, ids, mask)
        device = next(model.parameters()).device
        generate_kwargs.setdefault("do_sample", False)
        generate_kwargs.setdefault("pad_token_id", pad_token_id(self.tokenizer))
        try:
            out = model.generate(input_ids=ids.to(device), attention_mask=mask.to(device), cache=cache,
                                 max_new_tokens=max_new_tokens, **generate_kwargs)
        except ValueError as exc:  # transformers validates generation options only here
            raise InputError(f"transformers' generate refused the call (usually a generation option): "
                             f"{str(exc).splitlines()[0]}") from None
        return out[:, ids.shape[1]:]

    def generate(self, prompts: list[str] | str, mode: Mode = "mapped", max_new_tokens: int = 32,
                 **generate_kwargs) -> Generation:
        """Continue each prompt; ``generate_kwargs`` go to transformers ``generate`` (do_sample, top_p, …)."""
        check_generation(max_new_tokens, generate_kwargs)
        ids, mask = self.encode(prompts, max_new_tokens)
        start = time.perf_counter()
        new = self.generate_ids(ids, mask, mode, max_new_tokens, **generate_kwargs)
        if new.device.type == "cuda":
            torch.cuda.synchronize(new.device)
        seconds = time.perf_counter() - start
        texts = self.tokenizer.batch_decode(new.tolist(), skip_special_tokens=True)
        return Generation(texts=texts, token_ids=new.tolist(), seconds=seconds)

    # -- scoring -----------------------------------------------------------------------------
    @torch.no_grad()
    def score_ids(self, contexts: list[list[int]], continuations: list[list[int]], mode: Mode = "mapped"
                  ) -> list[Score]:
        """Log-likelihood of each continuation given its context, and whether it is the greedy one.

        The continuing model (target for ``mapped``/``native``) reads the held-back context tokens
        and the continuation in one forward pass over the prefix cache.
        """
        if len(contexts) != len(continuations):
            raise InputError("contexts and continuations must have the same length.")
        if not contexts:
            raise InputError("no contexts given; nothing to score.")
        if any(len(c) == 0 for c in continuations):
            raise InputError("a continuation is empty; nothing to score.")
        check_ids(continuations, "continuation", self.vocab)
        for i, (ctx, cont) in enumerate(zip(contexts, continuations)):
            if len(ctx) + len(cont) > self.max_positions:
                raise InputError(f"context {i} plus its continuation has {len(ctx) + len(cont)} tokens, more than "
                                 f"the {self.max_positions} positions these models support. Truncate the context.")
        longest = max(len(c) for c in continuations)
        ids, mask = self.pad(contexts)
        model, cache = self.prefix_cache(mode, ids, mask)
        b, m = ids.shape[0], self.held_back(mask)
        tail = torch.full((b, m + longest), int(ids[0, -1]), dtype=torch.long)
        tail_mask = torch.zeros((b, m + longest), dtype=torch.long)
        tail[:, :m], tail_mask[:, :m] = ids[:, -m:], 1
        for i, cont in enumerate(continuations):
            tail[i, m : m + len(cont)] = torch.tensor(cont, dtype=torch.long)
            tail_mask[i, m : m + len(cont)] = 1  # right padding after a continuation is causal-safe
        full_mask = torch.cat([mask, tail_mask[:, m:]], dim=1)  # (B, T + K): context, then continuation
        positions = positions_from_mask(full_mask)[:, ids.shape[1] - m:]  # (B, m + K) of the tail
        device = next(model.parameters()).device
        out = model(input_ids=tail.to(device), attention_mask=full_mask.to(device),
                    position_ids=positions.to(device), cache=cache, use_cache=True)
        logprobs = log_probs(out.logits, f"{'target' if mode != 'source' else 'source'} ({mode})")  # (B, m + K, V)
        # position m − 1 + j predicts continuation token j
        return [_score_row(logprobs[i, m - 1 : m - 1 + len(cont)], cont) for i, cont in enumerate(continuations)]

    def score(self, contexts: list[str], continuations: list[str], mode: Mode = "mapped") -> list[Score]:
        """Text version of :meth:`score_ids`: the context is encoded with special tokens, the continuation without."""
        for what, texts in (("context", contexts), ("continuation", continuations)):
            for i, text in enumerate(texts):
                check_text(text, f"{what} {i}")
        ctx = [self.tokenizer(c, verbose=False)["input_ids"] for c in contexts]
        cont = [self.tokenizer(c, add_special_tokens=False, verbose=False)["input_ids"] for c in continuations]
        return self.score_ids(ctx, cont, mode)
