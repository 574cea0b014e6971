"""Retention through the engine: the family tasks scored by vLLM from prefixes the connector mapped, beside Bridge.

Every family task is a log-likelihood (teacher-forced) task, so one scoring path serves them all: a request's prompt
is the context and the continuation, the connector maps all of it but the last ``hold_back + len(continuation)``
tokens (``kvbridge_hold_back``), and vLLM's ``prompt_logprobs`` give the target's log-probability and rank of each
continuation token over the mapped context. Native, source and floors come from Bridge on the same rows (one
reference run), so the engine's column differs from Bridge's mapped column only by the engine.

Each scoring request is isolated: a cache_salt of its own (in the mapper's namespace), so no block of it is ever a
prefix-cache hit — neither one the target computed for another request (the held-back continuation of an earlier
document with the same context, say) nor one mapped for another — and the connector must report its whole prefix
mapped, or the score is refused.
"""

from __future__ import annotations

import itertools
import math
import os
import time

from ...core.scoring import Score, check_per_context
from ...core.transfer import held_back_tokens
from ..engine.config import HOLD_BACK, PARAM, ServeConfig


class EngineScorer:
    """``score_ids`` (as :meth:`kvbridge.Bridge.score_ids`) through a vLLM engine that has the kvbridge connector."""

    def __init__(self, llm, config: ServeConfig, tokenizer, hold_back: int, batch: int = 64):
        self.llm, self.config, self.tokenizer, self.hold_back, self.batch = llm, config, tokenizer, hold_back, batch
        self._run = os.urandom(6).hex()  # this scorer's requests' salts: apart from any other scorer's
        self._count = itertools.count()

    def held_back(self, context: list[int]) -> int:
        """The context tokens the engine computes itself: Bridge's rule
        (:func:`kvbridge.core.transfer.held_back_tokens`), applied to a call's shortest context as Bridge applies it
        to a batch's."""
        return held_back_tokens(self.hold_back, len(context))

    def salt(self) -> str:
        """A scoring request's own cache_salt (its blocks never shared with another request's)."""
        return f"score-{self._run}-{next(self._count)}"

    def score_ids(self, contexts: list[list[int]], continuations: list[list[int]], mode: str = "mapped",
                  per_context: int = 1) -> list[Score]:
        from vllm import SamplingParams

        from .. import mapped_request

        check_per_context(contexts, continuations, per_context)
        held = self.held_back(min(contexts, key=len))  # one count per call, as Bridge holds back per batch
        contexts = [c for c in contexts for _ in range(per_context)]  # one request per continuation, as before
        out = []
        for i in range(0, len(contexts), self.batch):
            items, params = [], []
            for ctx, cont in zip(contexts[i:i + self.batch], continuations[i:i + self.batch]):
                item, extra = mapped_request(list(ctx) + list(cont), self.config, mode, cache_salt=self.salt())
                extra["kv_transfer_params"][HOLD_BACK] = held + len(cont)
                items.append(item)
                # prompt_logprobs would make vLLM skip the prefix cache, and with it the connector's load; vLLM
                # 0.32 also fails detokenizing the entries of positions it did not compute (no text is needed here)
                params.append(SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=1, extra_args=extra,
                                             skip_reading_prefix_cache=mode == "native", detokenize=False))
            for o, ctx, cont in zip(self.llm.generate(items, params, use_tqdm=False), contexts[i:], continuations[i:]):
                if mode != "native":
                    params = o.kv_transfer_params or {}
                    if params.get(PARAM) != "mapped":
                        raise RuntimeError(f"the engine did not map a scoring request: {params}")
                    mapped = params.get("kvbridge_mapped_tokens", 0)
                    if mapped != len(ctx) - held:
                        raise RuntimeError(f"a scoring request read {len(ctx) - held - mapped} prefix tokens from the "
                                           "prefix cache instead of mapping them")
                entries = o.prompt_logprobs[len(ctx):len(ctx) + len(cont)]
                logprob = sum(e[t].logprob for e, t in zip(entries, cont))
                correct = sum(int(e[t].rank == 1) for e, t in zip(entries, cont))
                if not math.isfinite(logprob):
                    raise RuntimeError("the engine returned a non-finite log-probability")
                out.append(Score(logprob, correct == len(cont), correct, len(cont)))
        return out


def engine_retention(llm, config: ServeConfig, bridge, texts: list[str], items: int, lengths: list[int],
                     progress=print) -> dict:
    """Per length: the family tasks with Bridge (native, source, mapped) and the engine's mapped column."""
    from ...measure.evaluate import capped_mean_retention as capped_mean
    from ...measure.evaluate import family_tasks, gap_cell, mean_retention

    scorer = EngineScorer(llm, config, bridge.tokenizer, bridge.hold_back)
    report = {"items": items, "lengths": {}}
    for length in lengths:
        started = time.perf_counter()
        ref = family_tasks(bridge, texts, items, length)
        progress(f"{length} tokens: Bridge done ({time.perf_counter() - started:.0f} s)")
        eng = family_tasks(scorer, texts, items, length, reference=ref)
        progress(f"{length} tokens: engine done ({time.perf_counter() - started:.0f} s)")
        report["lengths"][str(length)] = {
            "bridge": [r.to_dict() for r in ref], "engine": [r.to_dict() for r in eng],
            # gap recovered over the source alone, with its paired interval (n/s: the target does not lead)
            "bridge_gap": [gap_cell(r) for r in ref], "engine_gap": [gap_cell(r) for r in eng],
            "bridge_mean_retention": mean_retention(ref), "engine_mean_retention": mean_retention(eng),
            "bridge_capped_mean_retention": capped_mean(ref), "engine_capped_mean_retention": capped_mean(eng)}
    return report


def retention_rows(report: dict) -> str:
    lines = ["| Tokens | Task | Native | Source alone | Bridge mapped | vLLM mapped | Bridge gap recovered | "
             "vLLM gap recovered | Bridge retention | vLLM retention |", "|---:|---|" + "---:|" * 8]
    for length, block in report["lengths"].items():
        gaps = zip(block.get("bridge_gap", ["—"] * len(block["bridge"])),  # (reports written before the figure)
                   block.get("engine_gap", ["—"] * len(block["engine"])))
        for b, e, (bg, eg) in zip(block["bridge"], block["engine"], gaps):
            fmt = (lambda v: f"{100 * v:.1f}%") if b["higher_is_better"] else (lambda v: f"{v:.2f}")  # noqa: E731
            lines.append(f"| {int(length):,} | {b['task']} | {fmt(b['native'])} | {fmt(b['source'])} | "
                         f"{fmt(b['mapped'])} | {fmt(e['mapped'])} | {bg} | {eg} | "
                         f"{100 * b['floor_normalized_retention']:.1f}% | "
                         f"{100 * e['floor_normalized_retention']:.1f}% |")
        for what, key in (("mean floor-normalized retention", "mean_retention"),
                          ("mean, each cell capped at 100 %", "capped_mean_retention")):
            bridge, engine = block[f"bridge_{key}"], block[f"engine_{key}"]
            lines.append(f"| {int(length):,} | **{what}** | | | | | | | **{100 * bridge:.1f}%** | "
                         f"**{100 * engine:.1f}%** |")
    return "\n".join(lines)
