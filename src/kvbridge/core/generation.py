"""Generation: the continuing model decodes after a mapped, native or source prefix cache.

Letters: B batch, T prompt tokens (left-padded), m held-back tokens.

The bridge builds the prefix cache over all but the last ``m`` prompt tokens
(:meth:`kvbridge.Bridge.prefix_cache`); transformers' ``generate`` then feeds exactly the columns the
cache does not cover — the held-back tokens — and decodes, so every sampling and stopping option of
``generate`` works unchanged.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from ..errors import InputError
from .models import with_cache
from .prompts import check_generation, pad_token_id
from .recompute import reading


@dataclass
class Generation:
    """New text and token ids per prompt. ``prefilled``: per prompt, the tokens its prefix cache covered — in
    ``mapped`` mode the ones the source prefilled and the mapper mapped, the target reading the rest itself
    (``held_back`` per batch: fewer than the bridge's ``hold_back`` when the shortest prompt is shorter)."""

    texts: list[str]
    token_ids: list[list[int]]
    seconds: float
    prefilled: list[int] | None = None
    held_back: int | None = None


@torch.no_grad()
def generate_ids(bridge, ids: torch.Tensor, mask: torch.Tensor, mode: str = "mapped", max_new_tokens: int = 32,
                 **generate_kwargs) -> torch.Tensor:
    """New token ids (B, ≤ max_new_tokens) after a left-padded batch (B, T), greedy unless ``do_sample=True``.

    ``generate_kwargs`` go to transformers ``generate`` (do_sample, temperature, top_p, top_k,
    stop_strings with tokenizer, …).
    """
    check_generation(max_new_tokens, generate_kwargs)
    model, cache = bridge.prefix_cache(mode, ids, mask, owing=True)
    device = next(model.parameters()).device
    generate_kwargs.setdefault("do_sample", False)
    # one sequence per prompt and prefix cache (check_generation refuses more), whatever the checkpoint's
    # generation_config.json asks for
    generate_kwargs.setdefault("num_beams", 1)
    generate_kwargs.setdefault("num_return_sequences", 1)
    generate_kwargs.setdefault("pad_token_id", pad_token_id(bridge.tokenizer))
    try:
        with reading(model):  # a selective recompute rides along with generate's first step
            out = model.generate(input_ids=ids.to(device), attention_mask=mask.to(device), **with_cache(cache),
                                 max_new_tokens=max_new_tokens, **generate_kwargs)
    except ValueError as exc:  # transformers validates generation options only here
        raise InputError(f"transformers' generate refused the call (usually a generation option): "
                         f"{str(exc).splitlines()[0]}") from None
    return out[:, ids.shape[1]:]


def generate_texts(bridge, prompts: list[str] | str, mode: str = "mapped", max_new_tokens: int = 32,
                   **generate_kwargs) -> Generation:
    """Continue each prompt (text in, text out), timed from the encoded prompts to the last new token."""
    check_generation(max_new_tokens, generate_kwargs)
    ids, mask = bridge.encode(prompts, max_new_tokens)
    start = time.perf_counter()
    new = generate_ids(bridge, ids, mask, mode, max_new_tokens, **generate_kwargs)
    if new.device.type == "cuda":
        torch.cuda.synchronize(new.device)
    seconds = time.perf_counter() - start
    texts = bridge.tokenizer.batch_decode(new.tolist(), skip_special_tokens=True)
    held = bridge.held_back(mask)
    return Generation(texts=texts, token_ids=new.tolist(), seconds=seconds,
                      prefilled=[int(n) - held for n in mask.sum(-1)], held_back=held)
