"""``kvbridge frontier``: what each lever buys in retention and costs in time to first token, measured.

Fits a few mappers (the plain map and maps with levers, see :mod:`kvbridge.fit.levers`), crosses them
with runtime options (selective recompute, a native sink token, a blind recompute as a control), and
measures every point on the family tasks at each context length (native, source and floors once, then
only the mapped mode per point) and its time to first token against the native target **at the same
length**, side by side in one run. Writes ``frontier.json``, ``frontier.md`` and ``frontier.png``
(retention against TTFT speed-up at the chosen length, Pareto front marked).

The headline of a point is one length's: its held-out retention there, each task's cell capped at
100 % (the uncapped mean stays in the JSON), with a 95 % paired bootstrap interval over documents, next
to its TTFT speed-up there. Settings are chosen on validation data and reported on held-out data: the
``validation_items`` shortest calibration documents of at least ``VALIDATION_TOKENS`` tokens are kept out
of every fit and measured at every length as the held-out set is (packed end to end at a length longer
than they are). ``recommended`` (:func:`recommend`), at the chosen length (default the longest):

* a point is fast enough when the median of its interleaved rounds' speed-ups, less their median absolute
  deviation (its own timing noise), is at least ``MIN_SPEEDUP``;
* among those, the best validation retention, and every point whose paired bootstrap interval of validation
  retention minus the best one's reaches zero, tie; the fastest of them is recommended.

A task's mapped score is called below the source's only when the paired interval of mapped − source lies
wholly below zero.
"""

from __future__ import annotations

import json
import statistics
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import torch

from ..core.outputs import check_output_dir, write_text
from ..core.transfer import Bridge
from ..errors import InputError
from ..fit.closed_form import fit_mapper
from ..fit.config import MAX_RIDGE, FitConfig
from .bench import device_name, map_flops, mapped_ttft_flops, prefill_flops, time_ms
from .evaluate import (
    bootstrap_interval,
    capped_mean_retention,
    counted,
    document_rows,
    family_tasks,
    gap_interval,
    gap_recovered,
    mapped_minus_source,
    mean_retention,
    paired_replicates,
    percentile_interval,
)
from .freegen import continuation_results
from .frontier_report import cell_name, frontier_table, plot_frontier

MIN_SPEEDUP = 1.5
GENERATED = 48  # greedy tokens per continuation in the free-generation measure (at the headline length)
VALIDATION_TOKENS = 1024  # validation documents are at least this long (or the longest length, if shorter)


@dataclass(frozen=True)
class Point:
    """One setting: how the mapper is fitted (``fit``: FitConfig overrides) and used (``runtime``)."""

    name: str
    fit: dict = field(default_factory=dict)
    runtime: dict = field(default_factory=dict)  # Bridge options: recompute, sink, hold_back


@dataclass(frozen=True)
class FrontierConfig:
    fit: FitConfig  # shared settings of every fit (calibration size, ridge, MLP budget)
    points: tuple[Point, ...]
    lengths: tuple[int, ...] = (256, 1024, 2048)
    items: int = 48
    validation_items: int = 64  # documents
    ttft_trials: int = 7
    ttft_warmup: int = 2
    ttft_rounds: int = 5
    choose_at: int | None = None  # the length the recommendation is made and headlined at (default the longest)
    predictable: bool = True  # the fifth task, recall of the document's own early text

    @property
    def headline_length(self) -> int:
        return self.choose_at or max(self.lengths)


LAGS = dict(lags=(0, 1, 2), lever_inputs="kv")
MLP128 = dict(LAGS, mlp_hidden=128)
MLP256 = dict(LAGS, mlp_hidden=256)
STATE128 = dict(LAGS, lever_inputs="kvs", mlp_hidden=128)  # + the source's final hidden state at each lag
# lags + MLP 128, calibrated with repeated spans and tuned on the target's next-token distribution (kvbridge.fit.tune)
TUNED = dict(MLP128, repeat_spans=0.5, lever_objective="output")
# every point starts from the plain map: its levers are spelled out, whatever kvbridge fit's defaults are
PLAIN = dict(top_k=None, lags=(0,), lever_inputs="same", lever_kinds=("key",), lever_layers=None, lever_count=1,
             lever_top_k=4, lever_weighting="none", mlp_hidden=0, repeat_spans=0.0, lever_objective="kv",
             tune_plain=False, recompute=0.0, recompute_by="logit", recompute_window=1, sink=False, hold_back=1)
# each plain map and the lever read the one source layer that predicts them best (kvbridge fit's default, chosen on
# the embedded families: on the default family's two-layer source every layer costs twice the FLOPs for no measured
# gain, on the deep family's four-layer source it loses retention with the levers, on deep-pruned's it ties at four
# times the FLOPs; see docs/levers.md, docs/family.md)
FAMILY = dict(top_k=1, lever_top_k=1)
# 150 windows of 1,024 tokens: what the family's calibration split holds once 64 validation documents are out
# (kvbridge fit's default, and the shipped mapper, read 160)
FIT = FitConfig(num_texts=150, seq_len=1024, stride=2, heldout_texts=4, batch_size=4, mlp_steps=4000, mlp_batch=1024,
                **PLAIN)
# the tuned map with a lever on layer 3's values as well as its keys
TUNED_KV = dict(TUNED, lever_kinds=("key", "value"))
# tuning also trains layer 3's plain value map (no runtime cost), every map reads one source layer
LEAN = dict(TUNED, tune_plain=True, **FAMILY)
# selective recompute by each token's own score (the previous releases' rule) ...
RECOMPUTE = {r: dict(recompute=r, recompute_by="logit", recompute_window=1) for r in (0.03, 0.05, 0.07, 0.1, 0.15, 0.2)}
# ... and by its score averaged over the 9 tokens centred on it (kvbridge fit's default): unpredictable spans whole
SPANS = {r: dict(recompute=r, recompute_by="logit", recompute_window=9) for r in (0.03, 0.04, 0.05, 0.07, 0.08, 0.15)}
# the control: the same budget on tokens chosen blindly (seeded by the prompt), what the criterion adds is the rest
BLIND = {r: dict(recompute=r, recompute_by="random", recompute_window=1) for r in (0.04,)}
# the target reads the last 256 prompt tokens itself, none recomputed (kvbridge fit's default: docs/levers.md)
HOLD_BACK = dict(hold_back=256, recompute=0.0, recompute_by="logit", recompute_window=9)
FULL = FrontierConfig(  # about 40 minutes on 2 CPU cores
    fit=FIT,
    points=(
        Point("plain"),
        Point("lean", fit=LEAN),
        Point("lean + recompute 4% at random (control)", fit=LEAN, runtime=BLIND[0.04]),
        Point("lean + recompute 3% by span", fit=LEAN, runtime=SPANS[0.03]),
        Point("lean + recompute 4% by span", fit=LEAN, runtime=SPANS[0.04]),
        Point("lean + recompute 5% by span", fit=LEAN, runtime=SPANS[0.05]),
        Point("lean + hold-back 256", fit=LEAN, runtime=HOLD_BACK),
    ),
)
ABLATION = (
    Point("lags + MLP 128, repeated spans only", fit=dict(MLP128, repeat_spans=0.5)),
    Point("lags + MLP 128, tuned without repeated spans", fit=dict(MLP128, lever_objective="output")),
)
VALUES = (
    Point("tuned, keys and values", fit=TUNED_KV),
    Point("tuned, keys and values + recompute 5%", fit=TUNED_KV, runtime=RECOMPUTE[0.05]),
)
EXTENDED = FrontierConfig(  # FULL plus the levers that did not make it, for the record (about 2 hours)
    fit=FIT,
    points=FULL.points + (
        Point("lean + recompute 5% by token", fit=LEAN, runtime=RECOMPUTE[0.05]),
        Point("lean + recompute 7% by span", fit=LEAN, runtime=SPANS[0.07]),
        Point("tuned", fit=TUNED),
        Point("tuned + recompute 7%", fit=TUNED, runtime=RECOMPUTE[0.07]),
        Point("lean + recompute 7% by token", fit=LEAN, runtime=RECOMPUTE[0.07]),
        Point("lean + recompute 10% by token", fit=LEAN, runtime=RECOMPUTE[0.1]),
        Point("lean + recompute 5%, window 5", fit=LEAN, runtime=dict(SPANS[0.05], recompute_window=5)),
        Point("lean + recompute 5%, window 13", fit=LEAN, runtime=dict(SPANS[0.05], recompute_window=13)),
        Point("lags + MLP 128", fit=MLP128),
        Point("tuned + recompute 3%", fit=TUNED, runtime=RECOMPUTE[0.03]),
        Point("tuned + recompute 5%", fit=TUNED, runtime=RECOMPUTE[0.05]),
        Point("tuned + recompute 10%", fit=TUNED, runtime=RECOMPUTE[0.1]),
        Point("tuned, plain value map tuned too", fit=dict(TUNED, tune_plain=True)),
        Point("tuned, one source layer a map", fit=dict(TUNED, **FAMILY)),
        Point("lags", fit=LAGS),
        Point("plain + recompute 10%", runtime=RECOMPUTE[0.1]),
        Point("lags + MLP 128 + recompute 10%", fit=MLP128, runtime=RECOMPUTE[0.1]),
        Point("lags + MLP 128 + recompute 5%", fit=MLP128, runtime=RECOMPUTE[0.05]),
        Point("lags + MLP 128 + recompute 20%", fit=MLP128, runtime=RECOMPUTE[0.2]),
        Point("tuned + recompute 15%", fit=TUNED, runtime=RECOMPUTE[0.15]),
        Point("lags + MLP 256", fit=MLP256),
        Point("lags + MLP 128 + hold-back 32", fit=MLP128, runtime=dict(hold_back=32)),
        Point("lags + MLP 128 + hold-back 64", fit=MLP128, runtime=dict(hold_back=64)),
        Point("tuned + hold-back 64", fit=TUNED, runtime=dict(hold_back=64)),
        Point("lags, attention-weighted ridge", fit=dict(LAGS, lever_weighting="attention")),
        Point("lags + MLP 128 + native sink", fit=MLP128, runtime=dict(sink=True, recompute_by="logit")),
        Point("lags + MLP 128 + recompute 10% by bigram", fit=MLP128,
              runtime=dict(recompute=0.1, recompute_by="bigram")),
        Point("lags + MLP 128 + recompute 10% by surprisal", fit=MLP128,
              runtime=dict(recompute=0.1, recompute_by="surprisal")),
        Point("lags + state + MLP 128", fit=STATE128),
        Point("lags + state + MLP 128 + hold-back 64", fit=STATE128, runtime=dict(hold_back=64)),
    ) + ABLATION + VALUES,
)
TUNING = FrontierConfig(  # what tuning and the repeated spans each buy (about 12 minutes)
    fit=FIT,
    points=(Point("lags + MLP 128", fit=MLP128),) + ABLATION + (Point("tuned", fit=TUNED),),
)
VALUE_LEVER = FrontierConfig(  # what a lever on the values of the same layer buys, alone and beside recompute
    fit=FIT,  # (about 11 minutes)
    points=(Point("tuned", fit=TUNED), Point("tuned + recompute 5%", fit=TUNED, runtime=RECOMPUTE[0.05])) + VALUES,
)
QUICK = FrontierConfig(
    fit=FitConfig(num_texts=8, seq_len=256, stride=2, heldout_texts=2, batch_size=8, mlp_steps=20, mlp_batch=256,
                  **PLAIN),
    points=(Point("plain"), Point("lags + MLP", fit=dict(LAGS, mlp_hidden=16)),
            Point("lags + MLP, tuned", fit=dict(LAGS, mlp_hidden=16, repeat_spans=0.5, lever_objective="output",
                                                tune_steps=10)),
            Point("plain + recompute 10%", runtime=RECOMPUTE[0.1]),
            Point("plain + recompute 10% at random (control)", runtime=dict(RECOMPUTE[0.1], recompute_by="random"))),
    lengths=(128, 256), items=8, validation_items=6, ttft_trials=3, ttft_warmup=1, ttft_rounds=3,
)


# the deep family (8-layer target, 4-layer source trained on its own): fast maps — fewer source layers a map, or
# reduced-rank maps at a quarter of the FLOPs — against every source layer, plain and with the recommended levers
LEAN_DEEP = dict(TUNED, tune_plain=True)
DEEP = FrontierConfig(
    fit=FIT,
    points=(
        Point("plain"),
        Point("plain, top-k 1", fit=dict(top_k=1, lever_top_k=1)),
        Point("plain, rank at 25% FLOPs", fit=dict(rank_flops=0.25)),
        Point("lean", fit=LEAN_DEEP),
        Point("lean + recompute 4% by span", fit=LEAN_DEEP, runtime=SPANS[0.04]),
        Point("lean, top-k 1 + recompute 4% by span", fit=LEAN, runtime=SPANS[0.04]),
        Point("lean, rank at 25% FLOPs + recompute 4% by span", fit=dict(LEAN_DEEP, rank_flops=0.25),
              runtime=SPANS[0.04]),
        Point("plain, head-matched", fit=dict(head_blocks=4)),
        Point("lean, head-matched + recompute 4% by span", fit=dict(LEAN_DEEP, head_blocks=4), runtime=SPANS[0.04]),
    ),
)
# the deep family's lever points once more (run it with another --seed: the plain maps are closed-form ridge fits, the
# same under any seed, so only the fits with residual MLPs and tuning are here), beside what might buy more retention
# there: larger recompute shares, two source layers a map, and a lever that also reads the source's hidden state
DEEP_LEVERS = FrontierConfig(
    fit=FIT,
    points=(
        Point("lean + recompute 4% by span", fit=LEAN_DEEP, runtime=SPANS[0.04]),
        Point("lean, top-k 1 + recompute 4% by span", fit=LEAN, runtime=SPANS[0.04]),
        Point("lean, top-k 1 + recompute 8% by span", fit=LEAN, runtime=SPANS[0.08]),
        Point("lean, top-k 1 + recompute 15% by span", fit=LEAN, runtime=SPANS[0.15]),
        Point("lean, top-k 2 + recompute 4% by span", fit=dict(LEAN_DEEP, top_k=2, lever_top_k=2),
              runtime=SPANS[0.04]),
        Point("lean + state, top-k 1 + recompute 4% by span", fit=dict(LEAN, lever_inputs="kvs"),
              runtime=SPANS[0.04]),
    ),
    lengths=(256, 1024),  # 55 minutes on 2 CPU cores; the deep grid's headline length is 1,024
)
# the deep family's bottleneck: `kvbridge diagnose --family deep --oracle` finds one target layer (3) whose native K/V
# alone lift retention from about a quarter to nearly all; levers on its values as well as its keys, and with a wider
# MLP, against kvbridge fit's defaults (a lever on the keys of the worst layer). (The run in docs/results/frontier/deep/
# bottleneck also had "levers read every source layer", lever_top_k None: fit caps it at top_k, one layer, so it was
# the second point's fit again — identical retention; dropped.)
LEAN_KV = dict(LEAN, lever_kinds=("key", "value"))
DEEP_BOTTLENECK = FrontierConfig(
    fit=FIT,
    points=(
        Point("lean, top-k 1 + recompute 4% by span", fit=LEAN, runtime=SPANS[0.04]),
        Point("lean, keys and values, top-k 1 + recompute 4% by span", fit=LEAN_KV, runtime=SPANS[0.04]),
        Point("lean, keys and values, MLP 256, top-k 1 + recompute 4% by span", fit=dict(LEAN_KV, mlp_hidden=256),
              runtime=SPANS[0.04]),
    ),
    lengths=(256, 1024),  # about 35 minutes on 2 CPU cores
)
# the deep family's bottleneck computed, not mapped: the target's own first four layers (layers 0-3: the lost layer 3
# needs the three below it) with the map filling the other four from the source's first D layers only (its prefill
# stops there); against every source layer, and a control whose upper layers carry no information at all (the
# largest ridge leaves each map its mean: what those layers are worth on these tasks)
NATIVE4 = dict(FAMILY, native_layers=4)
DEEP_NATIVE = FrontierConfig(
    fit=FIT,
    points=(
        Point("lean, top-k 1 + recompute 4% by span", fit=LEAN, runtime=SPANS[0.04]),
        Point("plain, every source layer + 4 native layers", fit=dict(native_layers=4)),
        Point("plain, top-k 1 + 4 native layers", fit=NATIVE4),
        Point("plain, top-k 1 of the first 2 source layers + 4 native layers", fit=dict(NATIVE4, source_depth=2)),
        Point("plain, top-k 1 of the first source layer + 4 native layers", fit=dict(NATIVE4, source_depth=1)),
        Point("4 native layers, the maps' means above them (control)", fit=dict(NATIVE4, source_depth=1,
                                                                               ridge=MAX_RIDGE)),
    ),
    lengths=(256, 1024),
)
# the default family's side of the choice of kvbridge fit's source layers a map: one (the default) against every
# source layer, plain and with the levers, at the deep-levers grid's lengths
LAYERS = FrontierConfig(
    fit=FIT,
    points=(
        Point("plain"),
        Point("plain, top-k 1", fit=FAMILY),
        Point("lean + recompute 4% by span", fit=LEAN, runtime=SPANS[0.04]),
        Point("lean + recompute 4% by span, every source layer", fit=dict(LEAN, top_k=None, lever_top_k=None),
              runtime=SPANS[0.04]),
    ),
    lengths=(256, 1024),
)
GRIDS = {"full": FULL, "extended": EXTENDED, "tuning": TUNING, "values": VALUE_LEVER, "deep": DEEP,
         "deep-levers": DEEP_LEVERS, "deep-bottleneck": DEEP_BOTTLENECK, "deep-native": DEEP_NATIVE, "layers": LAYERS,
         "quick": QUICK}
FAMILY_GRIDS = {"deep": "deep", "deep-pruned": "layers"}  # kvbridge frontier's grid per embedded family (else full)
# the point kvbridge fit's defaults reproduce (FAMILY's source-layer counts included). Chosen by `kvbridge gap` on
# third-party validation code — the share of the target's lead over the source kept, and free generation — not by
# this frontier's rule, whose floor-normalized retention rewards a recompute that lands on the planted recall spans
# ("lean + recompute 4% by span", the previous default): docs/levers.md
RECOMMENDED = "lean + hold-back 256"


def split_validation(tokenizer, texts: list[str], items: int, length: int) -> tuple[list[str], list[str]]:
    """(fit texts, validation texts): the ``items`` shortest documents with at least ``length`` tokens are kept for
    validation (whole documents, and as little text as that many documents allow taken from the fit)."""
    sizes = [(len(tokenizer(t, add_special_tokens=False, verbose=False)["input_ids"]), i) for i, t in enumerate(texts)]
    chosen = sorted((n, i) for n, i in sizes if n >= length)[:items]
    if len(chosen) < items:
        raise InputError(f"the calibration texts hold only {len(chosen)} documents of {length}+ tokens; the frontier "
                         f"keeps {items} of them out of the fit for validation. Pass more texts.")
    keep = {i for _, i in chosen}
    return [t for i, t in enumerate(texts) if i not in keep], [texts[i] for i in sorted(keep)]


def rows_available(tokenizer, texts: list[str], length: int) -> int:
    """How many rows of ``length`` tokens the texts give packed end to end (what a packed task can have)."""
    bos, eos = tokenizer.bos_token_id is not None, tokenizer.eos_token_id is not None
    tokens = sum(len(tokenizer(t, add_special_tokens=False, verbose=False)["input_ids"]) + eos for t in texts)
    return tokens // (length - bos)


def ttft(bridge: Bridge, tokens: int, warmup: int, trials: int, rounds: int = 5) -> dict:
    """Native and mapped time to first token at ``tokens`` (batch 1), measured side by side.

    ``rounds`` interleaved rounds, each timing native then mapped (medians of ``trials``): the speed-up is
    the median of the rounds' ratios, so drift on a shared machine between rounds cancels out of it."""
    g = torch.Generator().manual_seed(0)
    low = max(bridge.tokenizer.all_special_ids) + 1
    ids = torch.randint(low, len(bridge.tokenizer), (1, tokens), generator=g)
    mask = torch.ones_like(ids)
    device = bridge.target.device
    native, mapped = [], []
    for _ in range(rounds):
        native.append(time_ms(lambda: bridge.first_token_logits(ids, mask, "native"), device, warmup, trials)[0])
        mapped.append(time_ms(lambda: bridge.first_token_logits(ids, mask, "mapped"), device, warmup, trials)[0])
    ratios = [n / m for n, m in zip(native, mapped)]
    speedup = statistics.median(ratios)
    return {"native_ttft_ms": statistics.median(native), "mapped_ttft_ms": statistics.median(mapped),
            "ttft_speedup": speedup, "round_speedups": ratios,
            "speedup_noise": statistics.median(abs(r - speedup) for r in ratios)}


def flop_limit(bridge: Bridge, tokens: int) -> float:
    """FLOPs of a native prefill ÷ FLOPs of the mapped path (source prefill, map, recompute, held-back tokens)."""
    return prefill_flops(bridge.target.model.config, tokens, 1) / mapped_ttft_flops(bridge, tokens)


def real_flop_limit(bridge: Bridge, tokens: int) -> float | None:
    """The TTFT FLOP limit this point's kind of map would have at the Ministral-3 3B→8B geometry (plan arithmetic,
    :func:`kvbridge.measure.bench_real.published_config`): its plain maps reading the same share of the source's layers
    and spending the same share of their full-rank FLOPs (head-matched maps: matched there too, one block per KV head),
    its levers if it has the fit's default ones, its runtime options; the same share of the source's layers run (a map
    reading only the first ones) and of the target's layers computed natively. None for a point with other levers (their
    cost at that geometry is not planned here)."""
    from ..fit.config import FitConfig
    from .bench import path_flops
    from .bench_real import _published_infos, published_config

    config = bridge.mapper.config
    default = FitConfig()
    expected = {(v.lags, v.inputs, v.hidden) for v in config.levers}
    if config.levers and (expected != {(default.lags, default.lever_input_kinds or (v.kind,), default.mlp_hidden)
                                       for v in config.levers} or {v.kind for v in config.levers}
                          != set(default.lever_kinds)):
        return None
    lever_layers = {v.layer for v in config.levers}
    plain = [(kind, l) for kind in config.selection for l in range(config.target.num_layers) if l not in lever_layers]
    ft, fs = config.target.kv_features, config.source.kv_features
    share = statistics.mean(len(config.selection[kind][l]) for kind, l in plain) / config.source.num_layers
    widths = {(kind, l): len(config.selection[kind][l]) * fs for kind, l in plain}
    spent = sum(config.rank(kind, l) * (widths[(kind, l)] + ft) if config.rank(kind, l) else widths[(kind, l)] * ft
                for kind, l in plain)
    fraction = spent / sum(w * ft for w in widths.values()) if config.ranks else None
    infos, configs = _published_infos()
    source, target = infos["ministral3-3b-text"], infos["ministral3-8b-text"]
    top_k = max(1, round(share * source.num_layers)) if share < 1 else None
    blocks = {config.blocks(kind, l) for kind, l in plain}
    if len(blocks) > 1:
        return None  # partly blocked: not planned here
    blocks = blocks.pop() if blocks else 1
    matched = blocks == config.source.num_kv_heads == config.target.num_kv_heads
    heads = None if blocks == 1 else source.num_kv_heads if matched else blocks
    if heads is not None and (source.num_kv_heads % heads or target.num_kv_heads % heads):
        return None
    depth = config.source_depth  # the same shares of the source's layers read and the target's computed natively
    real_depth = None if depth >= config.source.num_layers else max(1, round(depth / config.source.num_layers
                                                                             * source.num_layers))
    native = round(bridge.native_layers / config.target.num_layers * target.num_layers)
    real = published_config(source, target, bool(config.levers), configs["ministral3-3b-text"].hidden_size,
                            top_k=top_k, rank_fraction=fraction, head_blocks=heads, source_depth=real_depth)
    src, tgt = configs["ministral3-3b-text"], configs["ministral3-8b-text"]
    return prefill_flops(tgt, tokens, 1) / path_flops(src, tgt, real, tokens, bridge.hold_back, bridge.recompute,
                                                      bridge.sink, bridge.recompute_by, native)


def fast_enough(p: dict) -> bool:
    """The speed-up clears ``MIN_SPEEDUP`` by the point's own timing noise (median absolute deviation of its
    interleaved rounds' speed-ups)."""
    return p["ttft_speedup"] - p["speedup_noise"] >= MIN_SPEEDUP


def is_control(p: dict) -> bool:
    """A control (its name ends "(control)") measures what a lever's choice adds; it is never recommended."""
    return p["name"].endswith("(control)")


def recommend(points: list[dict], validation: dict[str, list] | None = None) -> str | None:
    """Among points fast enough (:func:`fast_enough`) at the headline length, controls left out
    (:func:`is_control`), the fastest that ties the best one's validation retention: the paired bootstrap interval
    of its validation retention minus the best's reaches zero (``validation``: name → the point's validation runs at
    that length; without it, exact equality). None when none is fast enough."""
    eligible = [p for p in points if fast_enough(p) and p["validation_retention"] == p["validation_retention"]
                and not is_control(p)]
    if not eligible:
        return None
    if validation is not None and any(p["name"] not in validation for p in eligible):
        raise ValueError("recommend: every eligible point needs its validation runs")
    best = max(eligible, key=lambda p: p["validation_retention"])

    def ties(p):
        if p is best:
            return True
        if validation is None:
            return p["validation_retention"] >= best["validation_retention"]
        p["validation_minus_best_95"] = paired_difference(validation[p["name"]], validation[best["name"]])
        return p["validation_minus_best_95"][1] >= 0

    return max((p for p in eligible if ties(p)), key=lambda p: p["ttft_speedup"])["name"]


def paired_difference(runs: list, best: list) -> tuple[float, float]:
    """95 % paired bootstrap interval of capped retention of ``runs`` minus that of ``best`` (the same rows)."""
    split = len(runs)

    def difference(drawn):
        ours, theirs = [r for run in drawn[:split] for r in run], [r for run in drawn[split:] for r in run]
        return capped_mean_retention(ours) - capped_mean_retention(theirs)

    return percentile_interval(paired_replicates(runs + best, difference, grouped=True))


def pareto(points: list[dict]) -> list[str]:
    """Names of the points no other point beats on both retention and TTFT speed-up (at the headline length)."""
    front = []
    for p in points:
        if not any(q is not p and q["retention"] >= p["retention"] and q["ttft_speedup"] >= p["ttft_speedup"]
                   and (q["retention"], q["ttft_speedup"]) != (p["retention"], p["ttft_speedup"]) for q in points):
            front.append(p["name"])
    return front


def run_frontier(source, target, calibration: list[str], heldout: list[str], config: FrontierConfig,
                 out: str | Path, progress: bool = True) -> dict:
    """Measure every point; write DIR/frontier.json, frontier.md, frontier.png; return the JSON."""
    out = check_output_dir(out)
    start = time.perf_counter()
    lengths, headline = tuple(config.lengths), config.headline_length
    if headline not in lengths:
        raise InputError(f"the headline length {headline} is not one of the measured lengths {list(lengths)}.")
    tok = target.tokenizer
    _check_rows(tok, heldout, config)
    fit_texts, validation = split_validation(tok, calibration, config.validation_items,
                                             min(VALIDATION_TOKENS, max(lengths)))
    out.mkdir(parents=True, exist_ok=True)
    # rows per length: one per document while enough are that long, else documents packed end to end
    val_rows = {n: min(config.validation_items, rows_available(tok, validation, n)) for n in lengths}
    mappers: dict[tuple, object] = {}
    references: dict[str, list] = {}
    kept_validation: dict[str, list] = {}
    kept_heldout: dict[str, list] = {}
    leads: dict[tuple, list] = {}
    points = []

    def tasks_of(bridge, texts, items, length, tag):
        options = dict(predictable=config.predictable, pack=True)
        if tag not in references:  # the first point runs every mode; the others only the mapped one
            references[tag] = family_tasks(bridge, texts, items, length, **options)
            return references[tag]
        return family_tasks(bridge, texts, items, length, reference=references[tag], **options)

    written: dict = {}  # greedy continuations per mode at the headline length (native's and the source's shared)
    for point in config.points:
        key = tuple(sorted(point.fit.items()))
        if key not in mappers:
            t0 = time.perf_counter()
            mappers[key] = fit_mapper(source, target, fit_texts, replace(config.fit, **point.fit), progress=progress)
            _say(f"[{time.perf_counter() - start:5.0f} s] fitted {point.name!r} in {time.perf_counter() - t0:.0f} s",
                 progress)
        bridge = Bridge(source, target, mappers[key], **point.runtime)
        runs, val = {}, {}
        for n in lengths:  # the first point runs every mode: minutes a length at 2,048 tokens on 2 CPU cores
            runs[n] = tasks_of(bridge, heldout, config.items, n, f"heldout@{n}")
            val[n] = tasks_of(bridge, validation, val_rows[n], n, f"validation@{n}")
            _say(f"[{time.perf_counter() - start:5.0f} s] {point.name}: tasks at {n} tokens done", progress)
        kept_validation[point.name], kept_heldout[point.name] = [val[headline]], [runs[headline]]
        # free generation at the headline length: native's and the source's continuations written once for all points
        rows, keys = document_rows(bridge.tokenizer, heldout, config.items, headline, pack=True)
        generation = {r.task: r for r in continuation_results(
            bridge, [r[: min(headline, bridge.max_positions - GENERATED)].tolist() for r in rows], keys, GENERATED,
            known=written)}
        by_length = {}
        for n in lengths:
            timing = ttft(bridge, n, config.ttft_warmup, config.ttft_trials, config.ttft_rounds)
            by_length[str(n)] = {
                "retention": capped_mean_retention(runs[n]), "uncapped_retention": mean_retention(runs[n]),
                "interval_95": bootstrap_interval([runs[n]], statistic=capped_mean_retention),
                "validation_retention": capped_mean_retention(val[n]), "validation_rows": val_rows[n], **timing,
                "ttft_flop_limit": flop_limit(bridge, n)}
        points.append(_point(point, bridge, _task_cells(runs, leads), runs, by_length, generation, headline))
        here = by_length[str(headline)]
        _say(f"[{time.perf_counter() - start:5.0f} s] {point.name}: held-out retention (capped) "
             + ", ".join(f"{100 * v['retention']:.1f}% at {v['ttft_speedup']:.2f}× @{n}" for n, v in by_length.items())
             + f"; validation {100 * here['validation_retention']:.1f}% @{headline}", progress)
    chosen = recommend(points, kept_validation)
    for p in points:  # what the recommended point keeps beyond each control, paired by document
        if chosen and is_control(p):
            p["recommended_minus_control_95"] = {
                "heldout": paired_difference(kept_heldout[chosen], kept_heldout[p["name"]]),
                "validation": paired_difference(kept_validation[chosen], kept_validation[p["name"]])}
    report = {"points": points, "recommended": chosen, "pareto": pareto(points),
              "min_ttft_speedup": MIN_SPEEDUP, "headline_tokens": headline, "lengths": list(lengths),
              "items": config.items, "validation_documents": config.validation_items,
              "validation_rows": {str(n): v for n, v in val_rows.items()}, "predictable_recall": config.predictable,
              "fit": asdict(config.fit), "device": device_name(target.device), "threads": torch.get_num_threads(),
              "ttft_rounds": config.ttft_rounds, "seconds": round(time.perf_counter() - start, 1)}
    write_text(out / "frontier.json", json.dumps(report, indent=2) + "\n")
    write_text(out / "frontier.md", frontier_table(report) + "\n")
    plot_frontier(report, out / "frontier.png")
    return report



def _check_rows(tok, heldout: list[str], config: FrontierConfig) -> None:
    """Enough held-out rows at every length, before minutes of fitting."""
    if config.items < 4:
        raise InputError(f"{config.items} held-out rows: the cloze task needs at least 4.")
    for n in config.lengths:
        available = rows_available(tok, heldout, n)
        if available < config.items:
            raise InputError(f"the held-out texts give {available} rows of {n} tokens, packed end to end; "
                             f"{config.items} were asked for. Ask for fewer items or pass more texts.")


def _task_cells(runs: dict, leads: dict) -> list[dict]:
    """One record per task and length: the three modes, the floor, mapped − source and the share of the target's
    lead kept. ``leads`` caches the target's own lead over the source, the same for every point."""
    tasks = []
    for n, run in runs.items():
        for r in run:
            lo, hi = mapped_minus_source(r)
            if (n, r.task) not in leads:
                leads[n, r.task] = list(mapped_minus_source(r, mode="native"))
            tasks.append({"task": r.task, "context_tokens": n, "native": r.native, "mapped": r.mapped,
                          "source": r.source, "floor": r.floor, "higher_is_better": r.higher_is_better,
                          "floor_normalized_retention": r.floor_normalized_retention,
                          "counted": counted(r),
                          "mapped_minus_source_95": [lo, hi], "below_source": hi < 0,
                          "native_minus_source_95": leads[n, r.task],
                          # share of the target's lead over the source kept: only where there is a lead
                          **({"gap_recovered": gap_recovered(r), "gap_interval_95": list(gap_interval(r))}
                             if leads[n, r.task][0] > 0 else {"gap_recovered": None})})
    return tasks


def _point(point: Point, bridge: Bridge, tasks: list[dict], runs: dict, by_length: dict, generation: dict,
           headline: int) -> dict:
    """A point's record in frontier.json: its levers, every cell, the headline length's figures beside each
    length's, free generation, FLOPs and what beats what."""
    mapper = bridge.mapper
    here = by_length[str(headline)]
    return {
        "name": point.name, "levers": {"fit": point.fit, "runtime": point.runtime,
                                       "mapper": [v.to_dict() for v in mapper.config.levers]},
        "tasks": tasks, "context_tokens": headline,
        # the headline: one length, capped cells, paired interval, next to the speed-up there
        "retention": here["retention"], "interval_95": here["interval_95"],
        "validation_retention": here["validation_retention"],
        **{k: here[k] for k in ("native_ttft_ms", "mapped_ttft_ms", "ttft_speedup", "round_speedups",
                                "speedup_noise", "ttft_flop_limit")},
        "by_length": by_length,
        "mean_floor_normalized_retention": mean_retention([r for run in runs.values() for r in run]),
        "capped_retention_all_lengths": capped_mean_retention([r for run in runs.values() for r in run]),
        "interval_95_all_lengths": bootstrap_interval(list(runs.values()), statistic=capped_mean_retention),
        "generation": {task: {"native": r.native, "mapped": r.mapped, "source": r.source,
                              "mapped_minus_source_95": list(mapped_minus_source(r))}
                       for task, r in generation.items()},
        "real_geometry_ttft_flop_limit": real_flop_limit(bridge, 1024),
        "map_mflop_per_token": map_flops(mapper, 1) / 1e6,
        "mapper_parameters": mapper.config.num_parameters(),
        "key_r2_heldout": mapper.config.fit.get("key_r2_heldout"),
        "source_beats_mapped": [cell_name(t) for t in tasks if t["below_source"]],
        "mapped_beats_source": [cell_name(t) for t in tasks if t["mapped_minus_source_95"][0] > 0],
    }


def _say(message: str, progress: bool) -> None:
    if progress:
        print(message, flush=True)
