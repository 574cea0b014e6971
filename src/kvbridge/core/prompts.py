"""Prompts and batches: text checked, encoded and left-padded; token ids and generation settings refused
in one line before they reach a model.

Letters: B batch, T columns (left-padded).
"""

from __future__ import annotations

import numbers
from typing import Any

import torch

from ..errors import InputError


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
    for name in ("num_beams", "num_return_sequences"):  # generate expands the prompts but not a given cache
        if kwargs.get(name) not in (None, 1):
            raise InputError(f"{name}={kwargs[name]!r}: generation continues one prefix cache per prompt, so it "
                             "returns one greedy or sampled sequence per prompt. For several samples, repeat the "
                             "prompt in the batch.")
    if kwargs.get("do_sample"):
        temperature, top_p, top_k = kwargs.get("temperature"), kwargs.get("top_p"), kwargs.get("top_k")
        if temperature is not None and not (isinstance(temperature, (int, float)) and 0 < temperature < float("inf")):
            raise InputError(f"temperature must be a number > 0 when sampling, not {temperature!r} "
                             "(for greedy decoding, do not sample).")
        if top_p is not None and not (isinstance(top_p, (int, float)) and 0 < top_p <= 1):
            raise InputError(f"top_p must be in (0, 1], not {top_p!r}.")
        if top_k is not None and not (isinstance(top_k, int) and top_k >= 0):
            raise InputError(f"top_k must be an integer >= 0, not {top_k!r}.")


def pad_token_id(tokenizer) -> int:
    """The id a batch is padded with: the tokenizer's pad token, else its EOS, else 0 (masked out anyway)."""
    if tokenizer.pad_token_id is not None:
        return tokenizer.pad_token_id
    return tokenizer.eos_token_id if tokenizer.eos_token_id is not None else 0


def check_ids(rows: Any, what: str, vocab: int) -> None:
    """Each row a list of integer token ids in [0, vocab)."""
    for i, row in enumerate(rows):
        if not isinstance(row, (list, tuple)) or not all(isinstance(t, numbers.Integral) and not isinstance(t, bool)
                                                         for t in row):
            raise InputError(f"{what} {i} must be a list of integer token ids.")
        if row and (min(row) < 0 or max(row) >= vocab):
            raise InputError(f"{what} {i} holds token ids outside the vocabulary [0, {vocab}); "
                             "encode text with the models' own tokenizer.")


def check_batch(ids: Any, mask: Any, vocab: int) -> None:
    """A left-padded batch as :func:`pad_rows` makes it: (B, T) integer ids in the vocabulary, a 0/1 mask alike."""
    if not isinstance(ids, torch.Tensor) or not isinstance(mask, torch.Tensor):
        raise InputError("ids and mask must be tensors (B, T); Bridge.encode or Bridge.pad makes them.")
    if ids.dim() != 2 or ids.shape != mask.shape or ids.is_floating_point() or ids.shape[1] < 2:
        raise InputError(f"ids {tuple(ids.shape)} and mask {tuple(mask.shape)} must be integer tensors of one "
                         "shape (B, T) with T >= 2; Bridge.encode or Bridge.pad makes them.")
    from .graphs import capturing

    # (the values cannot be read while a CUDA graph records: its caller checked them on the host)
    if ids.numel() and not capturing() and (int(ids.min()) < 0 or int(ids.max()) >= vocab):
        raise InputError(f"ids hold token ids outside the vocabulary [0, {vocab}).")


def pad_rows(rows: list[list[int]], pad_id: int, vocab: int, limit: int, max_new_tokens: int = 0
             ) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-padded ids and mask (B, T) of token-id rows; each row needs 2+ tokens and room for
    ``max_new_tokens`` within ``limit`` positions."""
    check_ids(rows, "prompt", vocab)
    for i, row in enumerate(rows):
        if len(row) < 2:
            raise InputError(f"prompt {i} has {len(row)} token; a transfer needs at least 2 (the source prefills the "
                             "first, the target reads the last). Give a longer prompt.")
        if len(row) + max_new_tokens > limit:
            raise InputError(f"prompt {i} has {len(row)} tokens (+{max_new_tokens} to generate), more than the "
                             f"{limit} positions these models support. Shorten the prompt or generate fewer tokens.")
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, row in enumerate(rows):
        ids[i, width - len(row):] = torch.tensor(row, dtype=torch.long)
        mask[i, width - len(row):] = 1
    return ids, mask


def encode_prompts(tokenizer, prompts: Any, vocab: int, limit: int, max_new_tokens: int = 0
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """Text prompts → left-padded ids and mask (B, T); refuses empty, non-text, too short and over-long ones."""
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
        rows.append(tokenizer(prompt, verbose=False)["input_ids"])  # the length is checked in pad_rows, in one line
    return pad_rows(rows, pad_token_id(tokenizer), vocab, limit, max_new_tokens)


class PromptBatches:
    """Prompt handling of a :class:`kvbridge.Bridge`: checked, encoded, left-padded batches that both models
    can read (needs ``source``, ``target`` and ``tokenizer`` attributes)."""

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
