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
from typing import Any, Literal, NamedTuple

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
from .recompute import CRITERIA
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


def check_text(text: Any, what: str) -> None:
    """Refuse what is not text a tokenizer can read: non-strings, and strings with undecodable bytes (a
    command line or file read with ``surrogateescape`` keeps a non-UTF-8 byte as a lone surrogate)."""
    if not isinstance(text, str):
        raise InputError(f"{what} must be a string, not {type(text).__name__}.")
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise InputError(f"{what} is not valid UTF-8 text (an undecodable byte at character {exc.start}); "
                         "pass UTF-8 text.") from None


def check_generation(max_new_tokens: Any, kwargs: dict[str, Any]) -> None:
    """Refuse generation settings transformers would reject deep inside ``generate`` (or silently misuse)."""
    if not isinstance(max_new_tokens, int) or isinstance(max_new_tokens, bool) or max_new_tokens < 1:
        raise InputError(f"max_new_tokens must be an integer >= 1, not {max_new_tokens!r}.")
    if kwargs.get("do_sample"):
        temperature, top_p, top_k = kwargs.get("temperature"), kwargs.get("top_p"), kwargs.get("top_k")
        if temperature is not None and not (isinstance(temperature, (int, float)) and 0 < temperature < float("inf")):
            raise InputError(f"temperature must be a number > 0 when sampling, not {temperature!r} "
                             "(for greedy decoding, do not sample).")
        if top_p is not None and not (isinstance(top_p, (int, float)) and 0 < top_p <= 1):
            raise InputError(f"top_p must be in (0, 1], not {top_p!r}.")
        if top_k is not None and not (isinstance(top_k, int) and top_k >= 0):
            raise InputError(f"top_k must be an integer >= 0, not {top_k!r}.")


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

    # -- inputs ------------------------------------------------------------------------------
    def encode(self, prompts: list[str] | str, max_new_tokens: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """Left-padded ids and mask (B, T); refuses empty, too short and over-long prompts."""
        if not isinstance(max_new_tokens, int) or isinstance(max_new_tokens, bool) or max_new_tokens < 0:
            raise InputError(f"max_new_tokens must be an integer >= 0, not {max_new_tokens!r}.")
        if isinstance(prompts, str):
            prompts = [prompts]
        if not isinstance(prompts, (list, tuple)):
            raise InputError(f"prompts must be a string or a list of strings, not {type(prompts).__name__}.")
        if not prompts:
            raise InputError("no prompt given.")
        rows = []
        for i, prompt in enumerate(prompts):
            check_text(prompt, f"prompt {i}")
            if not prompt.strip():
                raise InputError(f"prompt {i} is empty; give the context to prefill.")
            rows.append(self.tokenizer(prompt, verbose=False)["input_ids"])  # length is checked below, in one line
        return self.pad(rows, max_new_tokens)

    @property
    def max_positions(self) -> int:
        """Positions both models support (prompt plus generated or scored tokens)."""
        return min(self.source.info.max_positions or 10**12, self.target.info.max_positions or 10**12)

    def _check_ids(self, rows: list[list[int]], what: str) -> None:
        vocab = min(self.source.model.config.vocab_size, self.target.model.config.vocab_size)
        for i, row in enumerate(rows):
            if not isinstance(row, (list, tuple)) or not all(isinstance(t, int) and not isinstance(t, bool)
                                                             for t in row):
                raise InputError(f"{what} {i} must be a list of integer token ids.")
            if row and (min(row) < 0 or max(row) >= vocab):
                raise InputError(f"{what} {i} holds token ids outside the vocabulary [0, {vocab}); "
                                 "encode text with the models' own tokenizer.")

    def _check_batch(self, ids: torch.Tensor, mask: torch.Tensor) -> None:
        """A left-padded batch as :meth:`pad` makes it: (B, T) integer ids in the vocabulary, a 0/1 mask alike."""
        if not isinstance(ids, torch.Tensor) or not isinstance(mask, torch.Tensor):
            raise InputError("ids and mask must be tensors (B, T); Bridge.encode or Bridge.pad makes them.")
        if ids.dim() != 2 or ids.shape != mask.shape or ids.is_floating_point() or ids.shape[1] < 2:
            raise InputError(f"ids {tuple(ids.shape)} and mask {tuple(mask.shape)} must be integer tensors of one "
                             "shape (B, T) with T >= 2; Bridge.encode or Bridge.pad makes them.")
        vocab = min(self.source.model.config.vocab_size, self.target.model.config.vocab_size)
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= vocab):
            raise InputError(f"ids hold token ids outside the vocabulary [0, {vocab}).")

    def pad(self, rows: list[list[int]], max_new_tokens: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        limit = self.max_positions
        self._check_ids(rows, "prompt")
        for i, row in enumerate(rows):
            if len(row) < 2:
                raise InputError(
                    f"prompt {i} has {len(row)} token; a transfer needs at least 2 (the source prefills the first, "
                    "the target reads the last). Give a longer prompt."
                )
            if len(row) + max_new_tokens > limit:
                raise InputError(
                    f"prompt {i} has {len(row)} tokens (+{max_new_tokens} to generate), more than the {limit} "
                    "positions these models support. Shorten the prompt or generate fewer tokens."
                )
        pad_id = self.tokenizer.pad_token_id
        if pad_id is None:
            pad_id = self.tokenizer.eos_token_id if self.tokenizer.eos_token_id is not None else 0
        width = max(len(r) for r in rows)
        ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
        mask = torch.zeros((len(rows), width), dtype=torch.long)
        for i, row in enumerate(rows):
            ids[i, width - len(row):] = torch.tensor(row, dtype=torch.long)
            mask[i, width - len(row):] = 1
        return ids, mask

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

    @torch.no_grad()
    def map_cache(self, source_cache, positions: torch.Tensor):
        """Source cache → target ``DynamicCache``: remove source RoPE, map, apply target RoPE at ``positions``.

        Tokens are mapped in chunks of ``self.chunk_tokens`` straight into preallocated target
        tensors, so the transient memory beyond the output cache is one chunk's features, not a
        copy of the whole source cache. cos/sin are computed once for all positions (dynamic RoPE
        depends on the full length).
        """
        src_k, src_v = cache_kv(source_cache)
        batch, _, tokens, _ = src_k[0].shape
        t_info, device = self.target.info, self.target.device
        dtype = next(self.target.model.parameters()).dtype
        shape = (batch, t_info.num_kv_heads, tokens, t_info.head_dim)
        out_k = [torch.empty(shape, device=device, dtype=dtype) for _ in range(t_info.num_layers)]
        out_v = [torch.empty(shape, device=device, dtype=dtype) for _ in range(t_info.num_layers)]
        s_cos, s_sin = rotary_factors(self.source.model, positions.to(src_k[0].device))  # (B, T, Ds)
        t_cos, t_sin = rotary_factors(self.target.model, positions.to(device))  # (B, T, Dt)
        m_dev, lag = self.mapper.device, self.mapper.max_lag
        for t0 in range(0, tokens, self.chunk_tokens):
            sl = slice(t0, min(t0 + self.chunk_tokens, tokens))
            src = slice(max(0, t0 - lag), sl.stop)  # the chunk plus the tokens its lagged features read
            keys = [remove_rope(k[:, :, src].float(), s_cos[:, src], s_sin[:, src]).to(m_dev) for k in src_k]
            mk, mv = self.mapper.map(keys, [v[:, :, src].to(m_dev) for v in src_v],
                                     positions[:, src].to(m_dev) if lag else None, past=t0 - src.start)
            for layer in range(t_info.num_layers):
                out_k[layer][:, :, sl] = apply_rope(mk[layer].to(device, torch.float32), t_cos[:, sl], t_sin[:, sl])
                out_v[layer][:, :, sl] = mv[layer]
        # one sum per tensor and one sync for the whole cache (NaN and Inf survive a sum; a finite cache whose
        # sum overflows float32 is garbage too): garbage in a cache decodes as plausible-looking garbage
        if not bool(torch.isfinite(torch.stack([t.sum(dtype=torch.float32) for t in out_k + out_v])).all()):
            raise NumericalError("the mapped cache holds NaN or Inf values; the mapper's weights or the source's "
                                 "outputs are not finite. Run `kvbridge verify` on the mapper, or use float32.")
        return make_cache(self.target.model, out_k, out_v)

    def mapped_cache(self, ids: torch.Tensor, mask: torch.Tensor):
        """Target cache for columns [0, T) of a left-padded batch, built from the source's prefill (and, with
        ``recompute``/``sink``, the target's recompute of the chosen tokens)."""
        if not self.selects_tokens:
            return self.map_cache(*self.source_prefill(ids, mask))
        from .recompute import bigram_surprisal, choose_columns, negative_logit, recompute_columns, surprisal

        positions = positions_from_mask(mask)
        if self.recompute_by == "surprisal":
            source_cache, logits = prefill(self.source.model, ids, mask, positions, logits="all")
            scores = surprisal(logits, ids)
        elif self.recompute_by == "logit":
            source_cache, hidden = prefill(self.source.model, ids, mask, positions, logits="hidden")
            scores = negative_logit(self.source.model, hidden, ids)
        else:
            source_cache = self.source_prefill(ids, mask)[0]
            scores = bigram_surprisal(ids, self.mapper.weights)
        cache = self.map_cache(source_cache, positions)
        after_pad = torch.nn.functional.pad(mask[:, :-1], (1, 0)).to(scores.device) == 0  # first token: no score
        columns = choose_columns(scores.masked_fill(after_pad, 0.0), mask, self.recompute, self.sink)
        return recompute_columns(self.target.model, cache, ids, mask, positions, columns)

    def prefix_cache(self, mode: Mode, ids: torch.Tensor, mask: torch.Tensor):
        """The model that continues and its cache over all but the last :meth:`held_back` columns."""
        if mode not in MODES:
            raise InputError(f"mode must be one of {', '.join(MODES)}, not {mode!r}.")
        self._check_batch(ids, mask)
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
        pad_id = self.tokenizer.pad_token_id
        generate_kwargs.setdefault("pad_token_id", self.tokenizer.eos_token_id if pad_id is None else pad_id)
        try:
            out = model.generate(input_ids=ids.to(device), attention_mask=mask.to(device), cache=cache,
                                 max_new_tokens=max_new_tokens, **generate_kwargs)
        except ValueError as exc:  # transformers validates generation options only here
            raise InputError(f"transformers refused the generation options: {str(exc).splitlines()[0]}") from None
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
        self._check_ids(continuations, "continuation")
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
