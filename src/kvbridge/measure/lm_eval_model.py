"""lm-evaluation-harness model ``kvbridge``: one class, three modes, so one command yields every column.

* ``mapped``: the source prefills the context, the mapper builds the target's cache, the target reads
  the held-back context token(s) and scores or generates the continuation;
* ``native``: the target alone;
* ``source``: the source alone.

A one-token context has nothing to transfer; ``mapped`` scores it natively (the target reads the whole
context itself) and counts it: ``native_fallbacks`` (task →
requests scored natively in mapped mode) and ``request_counts`` (task → requests) end up in
``kvbridge eval``'s results.json and table. Over-long requests keep their last ``max_length``
tokens, as lm-eval's Hugging Face backend does. Chat templates are off (completion mode, as the
published figures).

Rolling log-likelihood (perplexity tasks such as wikitext) is scored in chunks of ``rolling_chunk``
tokens, each conditioned on the text before it (up to ``max_length`` tokens in all), in every mode:
lm-eval's default windows give every window a one-token context, which would leave nothing to
transfer and report 100 % retention for any mapper. In ``mapped`` mode each chunk's preceding text
is prefilled by the source and mapped; only a text's first chunk (its context is BOS alone) is
scored natively, and counted as a fallback.

Generation follows lm-eval's Hugging Face backend: ``until`` and ``max_gen_toks`` are lm-eval's,
``do_sample`` decides sampling (a temperature alone does not), ``do_sample`` without a temperature
samples at 1.0, and every other key (top_p, top_k, repetition_penalty, …) goes to transformers'
``generate``; a key transformers does not know is refused rather than ignored.

Registered on import (``import kvbridge.measure.lm_eval_model``); needs ``pip install "kvbridge[eval]"``.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

from lm_eval.api.model import TemplateLM
from lm_eval.api.registry import register_model
from tqdm.auto import tqdm

from ..core.scoring import score_plain
from ..core.transfer import MODES, Bridge
from ..errors import InputError

DEFAULT_MAX_GEN_TOKS = 256


def _device(device: str | None) -> str:
    """lm-eval's CLI passes cuda:0 unless --device is given; like its Hugging Face backend, use the CPU when
    there is no CUDA (and say so)."""
    import sys

    import torch

    if not device:
        return "cpu"
    if str(device).startswith("cuda") and not torch.cuda.is_available():
        print(f"kvbridge: device {device!r} asked for but CUDA is not available; using the CPU.", file=sys.stderr)
        return "cpu"
    return str(device)


def _int(value: Any, name: str) -> int:
    try:
        return int(value)
    except (TypeError, ValueError):
        raise InputError(f"model_args {name}={value!r} must be an integer.") from None


def _flag(value: Any) -> bool:
    return value if isinstance(value, bool) else str(value).strip().lower() in ("1", "true", "yes", "on")


LM_EVAL_EXTRAS = {"max_batch_size"}  # what lm-eval's evaluator passes every model beside batch_size and device


@register_model("kvbridge")
class KVBridgeLM(TemplateLM):
    """``lm_eval --model kvbridge --model_args source=…,target=…,mapper=…,mode=mapped``."""

    def __init__(self, source: str | None = None, target: str | None = None, mapper: str | None = None,
                 mode: str = "mapped", device: str = "cpu", dtype: str = "auto", batch_size: int | str = 8,
                 hold_back: int | str | None = None, max_length: int | str | None = None,
                 source_revision: str | None = None, target_revision: str | None = None,
                 mapper_revision: str | None = None,
                 allow_revision_mismatch: bool | str = False, rolling_chunk: int | str = 256,
                 bridge: Bridge | None = None, **extra):
        super().__init__()
        unknown = sorted(set(extra) - LM_EVAL_EXTRAS)  # lm-eval adds max_batch_size itself; anything else is a typo
        if unknown:
            import inspect

            known = [p for p in inspect.signature(KVBridgeLM.__init__).parameters if p not in ("self", "extra")]
            raise InputError(f"unknown model_args {', '.join(unknown)}; the kvbridge model takes "
                             f"{', '.join(known)}.")
        self.rolling_chunk = _int(rolling_chunk, "rolling_chunk")
        if self.rolling_chunk < 1:
            raise InputError("rolling_chunk must be at least 1 token.")
        if mode not in MODES:
            raise InputError(f"mode must be one of {', '.join(MODES)}, not {mode!r}.")
        if bridge is None:
            if not (source and target and mapper):
                raise InputError("model_args need source=…, target=… and mapper=… (folders or hub ids).")
            bridge = Bridge.from_pretrained(
                source, target, mapper, source_revision=source_revision, target_revision=target_revision,
                mapper_revision=mapper_revision, device=_device(device), dtype=dtype or "auto",
                hold_back=None if hold_back in (None, "") else _int(hold_back, "hold_back"),
                allow_revision_mismatch=_flag(allow_revision_mismatch))
        self.bridge, self.mode = bridge, mode
        self.tokenizer = bridge.tokenizer
        self.batch_size = _int(batch_size, "batch_size") if str(batch_size) != "auto" else 8
        self.max_length = _int(max_length, "max_length") if max_length else bridge.max_positions
        if self.rolling_chunk >= self.max_length:
            raise InputError(f"rolling_chunk ({self.rolling_chunk}) must be below max_length ({self.max_length}).")
        self.request_counts: Counter[str] = Counter()  # task → requests answered
        self.native_fallbacks: Counter[str] = Counter()  # task → of those, scored natively in mapped mode
        self._tasks: list[str] = []  # task of each request of the current loglikelihood call

    @classmethod
    def from_bridge(cls, bridge: Bridge, mode: str = "mapped", batch_size: int = 8,
                    rolling_chunk: int = 256) -> KVBridgeLM:
        return cls(bridge=bridge, mode=mode, batch_size=batch_size, rolling_chunk=rolling_chunk)

    def _count(self, task: str | None, fallback: bool) -> None:
        task = task or "?"
        self.request_counts[task] += 1
        if fallback:
            self.native_fallbacks[task] += 1

    # -- TemplateLM plumbing ------------------------------------------------------------------
    @property
    def eot_token_id(self) -> int:
        return self.tokenizer.eos_token_id

    @property
    def prefix_token_id(self) -> int:
        bos = self.tokenizer.bos_token_id
        return bos if bos is not None else self.eot_token_id

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs) -> list[int]:
        special = True if add_special_tokens is None else add_special_tokens
        return self.tokenizer(string, add_special_tokens=special)["input_ids"]

    def tok_decode(self, tokens: list[int]) -> str:
        return self.tokenizer.decode(tokens, skip_special_tokens=True)

    # -- scoring ------------------------------------------------------------------------------
    def loglikelihood(self, requests, disable_tqdm: bool = False) -> list[tuple[float, bool]]:
        self._tasks = [getattr(req, "task_name", None) for req in requests]
        try:
            return super().loglikelihood(requests, disable_tqdm=disable_tqdm)
        finally:
            self._tasks = []

    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, owners: list | None = None,
                              **kwargs) -> list[tuple[float, bool]]:
        """Score (key, context ids, continuation ids) requests; ``owners[i]`` names request i's task."""
        owners = owners if owners is not None else (self._tasks if len(self._tasks) == len(requests) else None)
        items = []
        for i, (_, ctx, cont) in enumerate(requests):
            whole = (ctx + cont)[-self.max_length:]  # keep the last max_length positions
            cut = max(len(whole) - len(cont), 1)
            items.append((i, whole[:cut], whole[cut:]))
        # long first: similar lengths share a batch, and the first batch shows the peak memory
        items.sort(key=lambda it: -(len(it[1]) + len(it[2])))
        results: list[tuple[float, bool] | None] = [None] * len(items)
        hold = 1  # a context of one token has nothing to transfer (Bridge.held_back adapts to the rest)
        with tqdm(total=len(items), desc=f"kvbridge {self.mode} loglikelihood", disable=disable_tqdm) as bar:
            for start in range(0, len(items), self.batch_size):
                chunk = items[start : start + self.batch_size]
                if self.mode == "mapped":  # mapped contexts must be longer than the held-back tokens
                    groups = {"mapped": [it for it in chunk if len(it[1]) > hold],
                              "native": [it for it in chunk if len(it[1]) <= hold]}
                else:
                    groups = {self.mode: chunk}
                for mode, part in groups.items():
                    for (i, _, _), s in zip(part, self._score(part, mode) if part else []):
                        results[i] = (s.logprob, s.is_greedy)
                        self._count(owners[i] if owners else None, self.mode == "mapped" and mode == "native")
                bar.update(len(chunk))
        return results  # type: ignore[return-value]

    def _score(self, part, mode):
        contexts, continuations = [ctx for _, ctx, _ in part], [cont for _, _, cont in part]
        if min(len(c) for c in contexts) > 1:
            return self.bridge.score_ids(contexts, continuations, mode)
        # a context too short to hold back anything: score the whole sequence in one native pass
        model = self.bridge.source.model if mode == "source" else self.bridge.target.model
        return [score_plain(model, c, k) for c, k in zip(contexts, continuations)]

    def rolling_windows(self, tokens: list[int]) -> list[tuple[list[int], list[int]]]:
        """(context, chunk) pairs covering ``tokens``: each chunk of ``rolling_chunk`` tokens after the text
        before it, BOS first, at most ``max_length`` tokens in all. Every token is scored exactly once."""
        k = self.rolling_chunk
        text = [self.prefix_token_id] + tokens
        return [(text[max(0, start + 1 - (self.max_length - len(chunk))) : start + 1], chunk)
                for start in range(0, len(tokens), k) for chunk in [tokens[start : start + k]]]

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        windows, owners, tasks = [], [], []
        for i, req in enumerate(requests):
            (text,) = req.args
            for ctx, cont in self.rolling_windows(self.tok_encode(text, add_special_tokens=False)):
                windows.append(((text, ""), ctx, cont))
                owners.append(i)
                tasks.append(getattr(req, "task_name", None))
        scores = self._loglikelihood_tokens(windows, disable_tqdm=disable_tqdm, owners=tasks)
        totals = [0.0] * len(requests)
        for owner, (logprob, _) in zip(owners, scores):
            totals[owner] += logprob
        return totals

    # -- generation ---------------------------------------------------------------------------
    def generation_kwargs(self, gen_kwargs: dict | None) -> tuple[list[str], int, dict]:
        """lm-eval's generation kwargs → (stop strings, max new tokens, kwargs for transformers ``generate``)."""
        from transformers import GenerationConfig

        kwargs = dict(gen_kwargs or {})
        until = kwargs.pop("until", None) or [self.tok_decode([self.eot_token_id])]
        until = [until] if isinstance(until, str) else [u for u in until if u]
        max_new = int(kwargs.pop("max_gen_toks", DEFAULT_MAX_GEN_TOKS))
        do_sample = _flag(kwargs.pop("do_sample", False))
        temperature = kwargs.pop("temperature", None)
        out: dict[str, Any] = {"do_sample": do_sample}
        if do_sample:
            temperature = 1.0 if temperature is None else float(temperature)
            if temperature <= 0:
                raise InputError(f"do_sample with temperature {temperature}: sampling needs a temperature > 0 "
                                 "(or drop do_sample for greedy decoding).")
            out["temperature"] = temperature
        known = GenerationConfig()
        for key, value in kwargs.items():
            if not hasattr(known, key):
                raise InputError(f"generation option {key!r} is not one transformers' generate knows; "
                                 "remove it from the task's generation_kwargs.")
            out[key] = value
        return until, max_new, out

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        outputs: list[str] = []
        bridge = self.bridge
        for req in tqdm(requests, desc=f"kvbridge {self.mode} generate", disable=disable_tqdm):
            context, gen_kwargs = req.args
            until, max_new, kwargs = self.generation_kwargs(gen_kwargs)
            ids = self.tok_encode(context)[-(self.max_length - max_new):]
            mode = self.mode
            if len(ids) < 2 and mode == "mapped":
                mode = "native"  # nothing to transfer: the target reads the whole context itself
            self._count(getattr(req, "task_name", None), mode != self.mode)
            if len(ids) < 2:  # a cache needs at least one token before the held-back one
                ids = [self.prefix_token_id] + ids
            input_ids, mask = bridge.pad([ids], max_new)
            new = bridge.generate_ids(input_ids, mask, mode, max_new, stop_strings=until or None,
                                      tokenizer=self.tokenizer, **kwargs)
            text = self.tok_decode(new[0].tolist())
            for stop in until:
                if stop in text:
                    text = text[: text.index(stop)]
            outputs.append(text)
        return outputs
