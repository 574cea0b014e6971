"""lm-evaluation-harness model ``kvbridge``: one class, three modes, so one command yields every column.

* ``mapped``: the source prefills the context, the mapper builds the target's cache, the target reads
  the held-back context token(s) and scores or generates the continuation;
* ``native``: the target alone;
* ``source``: the source alone.

Contexts no longer than ``hold_back`` tokens have nothing to transfer; ``mapped`` scores them
natively (the target reads the whole context itself). Over-long requests keep their last
``max_length`` tokens, as lm-eval's Hugging Face backend does. Chat templates are off (completion
mode, as the published figures).

Registered on import (``import kvbridge.lm_eval_model``); needs ``pip install "kvbridge[eval]"``.
"""

from __future__ import annotations

from typing import Any

from lm_eval.api.model import TemplateLM
from lm_eval.api.registry import register_model
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window
from tqdm.auto import tqdm

from .errors import InputError
from .transfer import MODES, Bridge, score_plain


def _flag(value: Any) -> bool:
    return value if isinstance(value, bool) else str(value).strip().lower() in ("1", "true", "yes", "on")


@register_model("kvbridge")
class KVBridgeLM(TemplateLM):
    """``lm_eval --model kvbridge --model_args source=…,target=…,mapper=…,mode=mapped``."""

    def __init__(self, source: str | None = None, target: str | None = None, mapper: str | None = None,
                 mode: str = "mapped", device: str = "cpu", dtype: str = "auto", batch_size: int | str = 8,
                 hold_back: int | str = 1, max_length: int | str | None = None, source_revision: str | None = None,
                 target_revision: str | None = None, mapper_revision: str | None = None,
                 allow_revision_mismatch: bool | str = False, bridge: Bridge | None = None, **_ignored):
        super().__init__()
        if mode not in MODES:
            raise InputError(f"mode must be one of {', '.join(MODES)}, not {mode!r}.")
        if bridge is None:
            if not (source and target and mapper):
                raise InputError("model_args need source=…, target=… and mapper=… (folders or hub ids).")
            bridge = Bridge.from_pretrained(
                source, target, mapper, source_revision=source_revision, target_revision=target_revision,
                mapper_revision=mapper_revision, device=device, dtype=dtype, hold_back=int(hold_back),
                allow_revision_mismatch=_flag(allow_revision_mismatch))
        self.bridge, self.mode = bridge, mode
        self.tokenizer = bridge.tokenizer
        self.batch_size = int(batch_size) if str(batch_size) != "auto" else 8
        self.max_length = int(max_length) if max_length else bridge.max_positions

    @classmethod
    def from_bridge(cls, bridge: Bridge, mode: str = "mapped", batch_size: int = 8) -> "KVBridgeLM":
        return cls(bridge=bridge, mode=mode, batch_size=batch_size)

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
    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kwargs) -> list[tuple[float, bool]]:
        items = []
        for i, (_, ctx, cont) in enumerate(requests):
            whole = (ctx + cont)[-self.max_length:]  # keep the last max_length positions
            cut = max(len(whole) - len(cont), 1)
            items.append((i, whole[:cut], whole[cut:]))
        # long first: similar lengths share a batch, and the first batch shows the peak memory
        items.sort(key=lambda it: -(len(it[1]) + len(it[2])))
        results: list[tuple[float, bool] | None] = [None] * len(items)
        hold = self.bridge.hold_back
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
                bar.update(len(chunk))
        return results  # type: ignore[return-value]

    def _score(self, part, mode):
        contexts, continuations = [ctx for _, ctx, _ in part], [cont for _, _, cont in part]
        if min(len(c) for c in contexts) > self.bridge.hold_back:
            return self.bridge.score_ids(contexts, continuations, mode)
        # a context too short to hold back anything: score the whole sequence in one native pass
        model = self.bridge.source.model if mode == "source" else self.bridge.target.model
        return [score_plain(model, c, k) for c, k in zip(contexts, continuations)]

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        windows, owners = [], []
        for i, (text,) in enumerate(req.args for req in requests):
            for ctx, cont in map(make_disjoint_window, get_rolling_token_windows(
                    self.tok_encode(text, add_special_tokens=False), self.prefix_token_id, self.max_length, 1)):
                windows.append(((text, ""), ctx, cont))
                owners.append(i)
        scores = self._loglikelihood_tokens(windows, disable_tqdm=disable_tqdm)
        totals = [0.0] * len(requests)
        for owner, (logprob, _) in zip(owners, scores):
            totals[owner] += logprob
        return totals

    # -- generation ---------------------------------------------------------------------------
    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        outputs: list[str] = []
        for req in tqdm(requests, desc=f"kvbridge {self.mode} generate", disable=disable_tqdm):
            context, gen_kwargs = req.args
            kwargs = dict(gen_kwargs or {})
            until = kwargs.pop("until", None) or [self.tok_decode([self.eot_token_id])]
            until = [until] if isinstance(until, str) else list(until)
            max_new = int(kwargs.pop("max_gen_toks", 256))
            do_sample = _flag(kwargs.pop("do_sample", False))
            temperature = float(kwargs.pop("temperature", 0.0) or 0.0)
            extra = {"do_sample": True, "temperature": temperature} if do_sample and temperature > 0 else {}
            ids = self.tok_encode(context)[-(self.max_length - max_new):]
            if len(ids) <= self.bridge.hold_back:
                raise InputError("a generation context is too short to prefill; kvbridge needs at least 2 tokens.")
            text = self._generate_ids(ids, max_new, until, extra)
            for stop in until:
                if stop and stop in text:
                    text = text[: text.index(stop)]
            outputs.append(text)
        return outputs

    def _generate_ids(self, ids: list[int], max_new: int, until: list[str], extra: dict) -> str:
        bridge = self.bridge
        input_ids, mask = bridge.pad([ids], max_new)
        model, cache = bridge.prefix_cache(self.mode, input_ids, mask)
        device = next(model.parameters()).device
        pad = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else self.eot_token_id
        out = model.generate(input_ids=input_ids.to(device), attention_mask=mask.to(device), cache=cache,
                             max_new_tokens=max_new, stop_strings=[u for u in until if u], tokenizer=self.tokenizer,
                             pad_token_id=pad, **({"do_sample": False} | extra))
        return self.tok_decode(out[0, input_ids.shape[1]:].tolist())
