"""Closed-form fit: layer selection and affine ridge solve from :mod:`kvbridge.fit.stats`.

Letters: Fs / Ft features of one source / target layer (H·D), S the selected source layers.

Ridge scaling (recorded in ``mapper.json`` as ``ridge_scaling``): for target layer ``l`` with
selected features ``S``::

    λ_eff = ridge · mean(diag(G_SS))          G = Σ (x − x̄)(x − x̄)ᵀ   (sums, not averages)
    W     = (G_SS + λ_eff I)⁻¹ C_S,l           C = Σ (x − x̄)(y − ȳ)ᵀ
    b     = ȳ_l − x̄_S W

so ``ridge`` is relative to the average feature variance and independent of the number of
observations. The solve is a float64 Cholesky; when G_SS + λ_eff I is not positive definite or
numerically singular (e.g. ridge 0 with collinear features: squared pivot ratio below 1e-12),
λ_eff is raised tenfold (from at least 1e-10 · mean diagonal) until it is, and the ridge actually
used is recorded per layer.

R² of a layer pools its features: ``1 − SSE / SST`` with ``SST = Σ (y − ȳ)²`` over all of its
features, ``SSE`` the residual sum of squares, computed from the same statistics (fit data).
"""

from __future__ import annotations

import time

import torch

from ..core.mapper import Mapper, layer_features
from ..core.mapper_config import KINDS, Lever, MapperConfig, RuntimeOptions
from ..core.models import LoadedModel, prefill_content, source_hidden_size
from ..errors import InputError
from ..measure.plan import check_geometry, fit_phases, model_shape
from .config import FitConfig, recorded_settings
from .stats import (
    CalibrationStats,
    KVStats,
    collect_statistics,
    iter_batches,
    ridge_factor,
)
from .texts import calibration_sequences, repeat_spans, split_heldout_documents

RIDGE_SCALING = "lambda_eff = ridge * mean(diag(G_SS)) on centered sums; W = (G_SS + lambda_eff I)^-1 C_S,l"


def _layer_slice(layer: int, features: int) -> slice:
    return slice(layer * features, (layer + 1) * features)


def _feature_index(layers: tuple[int, ...], features: int, device) -> torch.Tensor:
    return torch.cat([torch.arange(l * features, (l + 1) * features, device=device) for l in layers])


def single_layer_r2(stats: KVStats, fs: int, ls: int, ft: int, lt: int, ridge: float,
                    device: str | torch.device | None = None) -> torch.Tensor:
    """(Ls, Lt) in-sample ridge R² of predicting each target layer from each single source layer."""
    scores = torch.empty(ls, lt, dtype=torch.float64)
    for s in range(ls):
        rows = _layer_slice(s, fs)
        f = ridge_factor(stats.gram[rows, rows], ridge, device)
        for l in range(lt):
            cols = _layer_slice(l, ft)
            c = stats.cross[rows, cols]
            scores[s, l] = f.r2(f.solve(c), c, stats.ssq_y[cols].sum())
    return scores


def select_layers(scores: torch.Tensor, top_k: int, depth: int | None = None) -> tuple[tuple[int, ...], ...]:
    """Per target layer, the ``top_k`` source layers with the best single-layer R² (sorted by id), among the
    first ``depth`` (None: all)."""
    scores = scores[:depth]
    ls, lt = scores.shape
    k = min(top_k, ls)
    return tuple(tuple(sorted(torch.topk(scores[:, l], k).indices.tolist())) for l in range(lt))


def solve(stats: CalibrationStats, source_info, target_info, top_k: int | None, ridge: float,
          device: str | torch.device | None = None, depth: int | None = None):
    """Select layers (among the source's first ``depth``; None: all) and solve the affine ridge maps for K and V.

    Target layers that read the same source layers share one Cholesky factor; each layer's weights are
    then solved from its own columns of C, so the solve ``device`` holds one copy of G_SS, its factor and
    one layer's C and W (the statistics stay where they are, in host memory for a fit).
    Returns ``(weights, selection, report)`` with float32 weights named as in the artifact.
    """
    fs, ls = source_info.kv_features, source_info.num_layers
    ft, lt = target_info.kv_features, target_info.num_layers
    usable = ls if depth is None else min(depth, ls)
    k = usable if top_k is None else min(top_k, usable)
    weights: dict[str, torch.Tensor] = {}
    selection: dict[str, tuple[tuple[int, ...], ...]] = {}
    report: dict[str, dict] = {}
    for kind in KINDS:
        s: KVStats = getattr(stats, kind)
        if k == usable:
            chosen = tuple(tuple(range(usable)) for _ in range(lt))
            scores = None
        else:
            scores = single_layer_r2(s, fs, ls, ft, lt, ridge, device)
            chosen = select_layers(scores, k, usable)
        selection[kind] = chosen
        r2 = [0.0] * lt
        used_ridge = [ridge] * lt
        by_selection: dict[tuple[int, ...], list[int]] = {}
        for l, layers in enumerate(chosen):
            by_selection.setdefault(layers, []).append(l)
        for layers, targets in by_selection.items():
            every = layers == tuple(range(ls))  # the whole Gram: no index copy
            idx = _feature_index(layers, fs, s.gram.device)
            g = s.gram if every else s.gram.index_select(0, idx).index_select(1, idx)
            factor = ridge_factor(g, ridge, device)
            del g
            mean_x = s.mean_x if every else s.mean_x.index_select(0, idx)
            for l in targets:
                cols = _layer_slice(l, ft)
                c = (s.cross[:, cols] if every else s.cross[:, cols].index_select(0, idx)).to(factor.factor.device)
                w = factor.solve(c)  # (S·Fs, Ft) float64 on the solve device
                r2[l] = factor.r2(w, c, s.ssq_y[cols].sum())
                used_ridge[l] = factor.relative
                bias = s.mean_y[cols].to(w.device) - mean_x.to(w.device) @ w
                weights[f"{kind}.{l}.weight"] = w.float().cpu().contiguous()
                weights[f"{kind}.{l}.bias"] = bias.float().cpu().contiguous()
            del factor
        report[kind] = {
            "r2_fit": r2,
            "r2_fit_mean": sum(r2) / lt,
            "ridge_used": used_ridge,
            "single_layer_r2": None if scores is None else [[round(float(v), 6) for v in row] for row in scores],
        }
    return weights, selection, report


def solve_heads(stats: CalibrationStats, source_info, target_info, selection, layers, blocks: int, ridge: float,
                weights: dict[str, torch.Tensor], report: dict, device: str | torch.device | None = None) -> None:
    """Head-blocked ridge maps for ``layers`` ((kind, target layer) pairs), in place of their full ones: block g
    of the target layer's KV heads from block g of each selected source layer's heads, each block its own ridge
    solve on its rows and columns of the fit's statistics (layers reading the same source layers share each
    block's factor). Updates ``weights`` (``(n, F_in / n, Ft / n)``) and the in-sample R² and ridge in ``report``."""
    fs, ft = source_info.kv_features, target_info.kv_features
    width_s, width_t = fs // blocks, ft // blocks  # one block's features in one source layer / the target layer
    for kind in KINDS:
        s: KVStats = getattr(stats, kind)
        by_selection: dict[tuple[int, ...], list[int]] = {}  # layers reading the same source layers share factors
        for k, l in layers:
            if k == kind:
                by_selection.setdefault(selection[kind][l], []).append(l)
        for chosen, targets in by_selection.items():
            parts = {l: ([], torch.empty(ft, dtype=torch.float64), [0.0, 0.0], []) for l in targets}
            for g in range(blocks):  # one factor per block, solved for every target layer of this selection
                idx = torch.cat([torch.arange(src * fs + g * width_s, src * fs + (g + 1) * width_s)
                                 for src in chosen]).to(s.gram.device)
                factor = ridge_factor(s.gram.index_select(0, idx).index_select(1, idx), ridge, device)
                mean_x = s.mean_x.index_select(0, idx)
                for l in targets:
                    ws, bias, errors, ridges = parts[l]
                    cols = slice(l * ft + g * width_t, l * ft + (g + 1) * width_t)
                    c = s.cross[:, cols].index_select(0, idx).to(factor.factor.device)
                    w = factor.solve(c)
                    block_sst = float(s.ssq_y[cols].sum())
                    errors[0] += (1.0 - factor.r2(w, c, block_sst)) * block_sst
                    errors[1] += block_sst
                    ridges.append(factor.relative)
                    bias[g * width_t : (g + 1) * width_t] = (s.mean_y[cols].to(w.device)
                                                            - mean_x.to(w.device) @ w).cpu()
                    ws.append(w.float().cpu())
                del factor
            for l, (ws, bias, (sse, sst), ridges) in parts.items():
                weights[f"{kind}.{l}.weight"] = torch.stack(ws).contiguous()
                weights[f"{kind}.{l}.bias"] = bias.float().contiguous()
                report[kind]["r2_fit"][l] = 1.0 - sse / sst if sst > 0 else float("nan")
                report[kind]["ridge_used"][l] = max(ridges)
        report[kind]["r2_fit_mean"] = sum(report[kind]["r2_fit"]) / len(report[kind]["r2_fit"])


@torch.no_grad()
def heldout_r2(mapper: Mapper, source: LoadedModel, target: LoadedModel, sequences: torch.Tensor,
               batch_size: int = 4) -> dict[str, list[float]]:
    """Per target layer pooled R² of the mapper on held-out sequences, measured by running its hot path."""
    lt, ft = target.info.num_layers, target.info.kv_features
    zeros = lambda *shape: torch.zeros(*shape, dtype=torch.float64)  # noqa: E731
    sums = {kind: {"sse": zeros(lt), "sy": zeros(lt, ft), "syy": zeros(lt, ft)} for kind in KINDS}
    for batch in iter_batches(sequences, batch_size):
        mask = torch.ones_like(batch)
        sk, sv, _, *state = prefill_content(source.model, batch, mask, state=mapper.config.reads_state)
        tk, tv, _ = prefill_content(target.model, batch, mask)
        mk, mv = mapper.map([k.to(mapper.device) for k in sk], [v.to(mapper.device) for v in sv],
                            state=state[0].to(mapper.device) if state else None)
        for kind, mapped, native in (("key", mk, tk), ("value", mv, tv)):
            y = layer_features(native).double().cpu()  # (B, T, Lt, Ft)
            err = y - layer_features(mapped).double().cpu()
            sums[kind]["sse"] += (err * err).sum(dim=(0, 1, 3))
            sums[kind]["sy"] += y.sum(dim=(0, 1))
            sums[kind]["syy"] += (y * y).sum(dim=(0, 1))
    n = sequences.numel()
    result = {}
    for kind in KINDS:
        sy, syy = sums[kind]["sy"], sums[kind]["syy"]
        sst = (syy - sy * sy / n).sum(1)
        result[kind] = [float(v) for v in 1.0 - sums[kind]["sse"] / sst]
    return result


def plan_levers(config: FitConfig, report: dict, target_layers: int, state: int = 0) -> tuple[Lever, ...]:
    """The levers a fit adds: on ``lever_layers``, or on the ``lever_count`` layers of each lever kind with
    the lowest fit R² of the plain map (where it loses most) among those the target does not compute itself
    (``native_layers``). ``state``: the source's hidden size."""
    if not config.has_levers:
        return ()
    levers = []
    for kind in config.lever_kinds:
        if config.lever_layers is not None:  # in range: fit_mapper checked before its first pass
            layers = config.lever_layers
        else:  # among the mapped layers: a native one needs no lever
            r2 = report[kind]["r2_fit"]
            mapped = range(config.native_layers, target_layers)
            layers = tuple(sorted(sorted(mapped, key=lambda j: r2[j])[: config.lever_count]))
        levers += [config.lever(kind, j, state) for j in layers]
    return tuple(levers)


def _peak_memory_bytes(device) -> int:
    if torch.device(device).type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    import resource

    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024  # Linux reports KiB


def working_memory(source: LoadedModel, target: LoadedModel, config: FitConfig) -> int:
    """Device bytes the capture and the solve need beside statistics kept on the device (from the plan of this
    fit: :func:`kvbridge.measure.plan.fit_phases`), for :func:`kvbridge.fit.stats.totals_device`'s "auto"."""
    from .stats import statistics_bytes

    itemsize = next(target.model.parameters()).element_size()
    s, t = model_shape(source.model.config), model_shape(target.model.config)
    phases = fit_phases(s, t, config, itemsize, "device")
    stats = statistics_bytes(s.layers * s.kv_features, t.layers * t.kv_features)
    return max(p.device for p in phases if p.name in ("capture", "solve")) - stats


def fit_mapper(source: LoadedModel, target: LoadedModel, texts: list[str], config: FitConfig,
               progress: bool = True, distributed: bool = False, totals: str = "auto") -> Mapper | None:
    """Fit a mapper from ``source`` to ``target`` on ``texts``.

    ``distributed``: every process of an initialised torch.distributed group calls it (see
    :mod:`kvbridge.fit.distributed`); each reads its share of the calibration sequences, the statistics are
    all-reduced, rank 0 solves and returns the mapper and the other processes return None. Without it the
    fit is one process's, whatever process group the caller runs in.

    The last documents, enough for ``heldout_texts`` sequences, are held out whole for the held-out
    R²; the fit reads the first ``num_texts`` sequences of the others. ``calibration_sha256`` in
    ``mapper.json`` is :func:`kvbridge.core.hashing.sha256_texts` of all of ``texts`` as given. ``totals``: where the
    float64 statistics live ("auto": the models' GPU when they and the capture's and solve's working memory fit
    there, else host memory; "device"; "host"), see :func:`kvbridge.fit.stats.totals_device`.
    """
    _check_inputs(source, target, texts, config)
    device = target.device
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    fit_texts, held_texts = split_heldout_documents(target.tokenizer, texts, config.heldout_texts, config.seq_len)
    fit_seqs = calibration_sequences(target.tokenizer, fit_texts, config.num_texts, config.seq_len)
    held_seqs = (calibration_sequences(target.tokenizer, held_texts, config.heldout_texts, config.seq_len)
                 if held_texts else fit_seqs[:0])
    start = time.perf_counter()
    from .distributed import is_main

    main_process = not distributed or is_main()
    stats = collect_statistics(source, target, fit_seqs, config.stride, config.batch_size,
                               progress and main_process, distributed=distributed, totals=totals,
                               transient=working_memory(source, target, config) if totals == "auto" else 0)
    if not main_process:  # this process's share is in rank 0's statistics now
        return None
    solve_start = time.perf_counter()
    weights, selection, report = solve(stats, source.info, target.info, config.top_k, config.ridge, device,
                                       config.source_depth)
    solve_seconds = time.perf_counter() - solve_start
    levers = plan_levers(config, report, target.info.num_layers, source_hidden_size(source.model))
    if levers and config.lever_top_k is not None:  # levers read fewer source layers: their own selection
        selection = _lever_selection(stats, config, levers, selection, source.info, target.info, device)
    heads = _head_blocks(stats, config, levers, selection, weights, report, source.info, target.info, device)
    found = None
    if config.rank is not None or config.rank_flops is not None:  # the eigenbases need the fit's statistics
        from . import rank as reduced

        found = reduced.bases(stats, weights, selection, reduced.factorable(levers, target.info.num_layers),
                              source.info.kv_features, target.info.kv_features, device)
    seen = {"observations": stats.observations, "tokens": stats.tokens, "seconds": stats.seconds,
            "flops": stats.update_flops()}
    del stats  # the levers gather their own statistics: host memory holds one set at a time
    lever_report, tune_report, tune_seconds = {}, None, None
    if levers:
        lever_weights, lever_report, tune_report, tune_seconds = _fit_levers(source, target, fit_seqs, selection,
                                                                             levers, weights, config, progress)
        weights.update(lever_weights)
    ranks, rank_report = {}, None
    if found is not None:
        weights, ranks, rank_report = _reduce_ranks(source, target, held_seqs, selection, found, weights, config)
        del found
    run_report = _run_report(time.perf_counter() - start, solve_seconds, tune_seconds, seen, device)
    fit_info = _fit_info(config, source, target, texts, fit_seqs, seen, report, lever_report, tune_report,
                         rank_report if ranks else None)
    mapper = _assemble(source, target, config, fit_seqs, selection, fit_info, levers, ranks, heads, weights,
                       run_report)
    del weights  # the mapper holds them once (group operands); the per-layer originals can go
    if held_seqs.shape[0]:
        held = heldout_r2(mapper, source, target, held_seqs, config.batch_size)
        for kind in KINDS:
            fit_info[f"{kind}_r2_heldout"] = held[kind]
            fit_info[f"{kind}_r2_heldout_mean"] = sum(held[kind]) / len(held[kind])
        fit_info["heldout_sequences"] = int(held_seqs.shape[0])
    return mapper


def _check_inputs(source: LoadedModel, target: LoadedModel, texts, config: FitConfig) -> None:
    """One InputError naming what a Python caller passed wrong, before any model runs."""
    from ..core.models import check_same_tokenizer

    for role, model in (("source", source), ("target", target)):
        if not isinstance(model, LoadedModel):
            raise InputError(f"{role} must be a model from kvbridge.load_model (or family.load_family), not "
                             f"{type(model).__name__}.")
    if not isinstance(config, FitConfig):
        raise InputError(f"config must be a kvbridge.fit.FitConfig, not {type(config).__name__}.")
    if isinstance(texts, str) or not isinstance(texts, (list, tuple)) or not all(isinstance(t, str) for t in texts):
        raise InputError("texts must be a list of strings (read a file with kvbridge.fit.texts.read_texts).")
    check_same_tokenizer(source.info, target.info)
    check_geometry(config, source.info.num_layers, target.info.num_layers,
                   (source.info.max_positions, target.info.max_positions),
                   (source.info.num_kv_heads, target.info.num_kv_heads))


def _head_blocks(stats, config: FitConfig, levers, selection, weights, report, source_info, target_info,
                 device) -> dict[str, tuple[int, ...]]:
    """Head-blocked plain maps (in place in ``weights``) on every layer a rank could factor (no lever on its target
    layer): the block count per kind and target layer, {} without ``head_blocks``."""
    if config.head_blocks is None:
        return {}
    from .rank import factorable

    blocked = factorable(levers, target_info.num_layers)
    solve_heads(stats, source_info, target_info, selection, blocked, config.head_blocks, config.ridge, weights,
                report, device)
    return {kind: tuple(config.head_blocks if (kind, l) in blocked else 1 for l in range(target_info.num_layers))
            for kind in KINDS}


def _fit_info(config: FitConfig, source, target, texts, fit_seqs, seen: dict, report: dict, lever_report,
              tune_report, rank_report) -> dict:
    """What mapper.json records of the fit: its settings, the calibration's fingerprints, per-layer R² and ridge."""
    from ..core.hashing import sha256_texts

    fit_info = {
        "settings": recorded_settings(config, source.info.num_layers),
        "levers": lever_report,
        "tune": tune_report,
        "ridge_scaling": RIDGE_SCALING,
        "observations": seen["observations"],
        "tokens": seen["tokens"],
        "calibration_sha256": sha256_texts(texts),
        "calibration_token_ids_sha256": _ids_sha(fit_seqs),
        **({"rank_choice": rank_report} if rank_report is not None else {}),
        "device": str(target.device),
        "model_dtype": str(next(target.model.parameters()).dtype).replace("torch.", ""),
    }
    for kind in KINDS:
        fit_info[f"{kind}_r2_fit"] = report[kind]["r2_fit"]
        fit_info[f"{kind}_r2_fit_mean"] = report[kind]["r2_fit_mean"]
        fit_info[f"{kind}_ridge_used"] = report[kind]["ridge_used"]
        if report[kind]["single_layer_r2"] is not None:
            fit_info[f"{kind}_single_layer_r2"] = report[kind]["single_layer_r2"]
    return fit_info


def _lever_selection(stats: CalibrationStats, config: FitConfig, levers, selection, source_info, target_info,
                     device) -> dict:
    """The selection with each lever layer reading its own best ``lever_top_k`` source layers (by single-layer R²)."""
    selection = dict(selection)
    for kind in {v.kind for v in levers}:
        scores = single_layer_r2(getattr(stats, kind), source_info.kv_features, source_info.num_layers,
                                 target_info.kv_features, target_info.num_layers, config.ridge, device)
        best = select_layers(scores, min(config.lever_top_k, config.top_k or config.lever_top_k), config.source_depth)
        chosen = list(selection[kind])
        for v in levers:
            if v.kind == kind:
                chosen[v.layer] = best[v.layer]
        selection[kind] = tuple(chosen)
    return selection


def _fit_levers(source, target, fit_seqs, selection, levers, weights, config: FitConfig, progress: bool):
    """The levers' weights (their own statistics, then the residual MLPs), tuned on the target's next-token
    distribution when ``lever_objective`` is "output": (weights, lever report, tune report, tune seconds)."""
    from .levers import MLPBudget, fit_levers

    budget = MLPBudget(steps=config.mlp_steps, batch=config.mlp_batch, lr=config.mlp_lr, seed=config.seed,
                       max_observations=config.mlp_observations)
    lever_seqs = repeat_spans(fit_seqs, config.repeat_spans, config.seed, target.tokenizer.all_special_ids)
    lever_weights, lever_report = fit_levers(source, target, lever_seqs, selection, levers, config.ridge,
                                             config.lever_stride, config.batch_size, budget, progress,
                                             config.lever_weighting)
    if config.lever_objective != "output":
        return lever_weights, lever_report, None, None
    from .tune import TuneBudget, tune_levers

    tuning = TuneBudget(steps=config.tune_steps, batch=config.tune_batch, lr=config.tune_lr, rows=config.tune_rows,
                        seed=config.seed)
    tune_start = time.perf_counter()
    lever_keys = {(v.kind, v.layer) for v in levers}
    plain = tuple(sorted((kind, layer) for _, layer in lever_keys for kind in KINDS
                         if (kind, layer) not in lever_keys)) if config.tune_plain else ()
    start_weights = lever_weights | {f"{kind}.{layer}.{part}": weights[f"{kind}.{layer}.{part}"]
                                     for kind, layer in plain for part in ("weight", "bias")}
    lever_weights, tune_report = tune_levers(source, target, lever_seqs, selection, levers, start_weights, tuning,
                                             config.batch_size, progress, plain)
    return lever_weights, lever_report, tune_report, time.perf_counter() - tune_start


def _reduce_ranks(source, target, held_seqs, selection, found, weights, config: FitConfig):
    """Factor the plain maps at the ranks chosen on held-out R² curves (in-sample without held-out sequences):
    (weights, ranks per kind, the rank report)."""
    from . import rank as reduced

    if held_seqs.shape[0]:
        reduced.heldout_curves(source, target, held_seqs, selection, found, weights, config.batch_size)
    else:
        reduced.in_sample_curves(found)
    chosen = reduced.choose_ranks(found, target.info.kv_features, config.rank, config.rank_flops)
    weights = reduced.factor(weights, found, chosen)
    ranks = {kind: tuple(chosen.get((kind, l), 0) for l in range(target.info.num_layers)) for kind in KINDS}
    return weights, ranks, reduced.report(found, chosen, target.info.kv_features, bool(held_seqs.shape[0]))


def _run_report(fit_seconds: float, solve_seconds: float, tune_seconds, seen: dict, device) -> dict:
    """The fit's volatile figures: kept out of mapper.json so that identical fits give identical checksums."""
    return {
        "fit_seconds": round(fit_seconds, 3),
        "solve_seconds": round(solve_seconds, 3),
        "tune_seconds": None if tune_seconds is None else round(tune_seconds, 3),
        "observations_per_second": round(seen["observations"] / max(seen["seconds"], 1e-9), 1),
        "statistics_gflop_per_second": round(seen["flops"] / max(seen["seconds"], 1e-9) / 1e9, 3),
        "peak_memory_bytes": _peak_memory_bytes(device),
        "peak_memory_kind": "device allocator" if device.type == "cuda" else "process RSS (CPU)",
        "torch_threads": torch.get_num_threads(),
    }


def _assemble(source, target, config: FitConfig, fit_seqs, selection, fit_info, levers, ranks, heads, weights,
              run_report) -> Mapper:
    """The mapper: its weights with the recompute's bigram table (every artifact carries it, a few MB at most) and
    the runtime options the settings record."""
    from ..core.recompute import bigram_tables

    vocab = int(target.model.config.vocab_size)
    weights.update(bigram_tables(fit_seqs, vocab))
    runtime = RuntimeOptions(hold_back=config.hold_back, recompute=float(config.recompute), sink=bool(config.sink),
                             recompute_by=config.recompute_by, recompute_window=config.recompute_window,
                             native_layers=config.native_layers, bigram_vocab=vocab,
                             bigram_pairs=int(weights["recompute.bigram.keys"].numel()))
    return Mapper(MapperConfig(source=source.info, target=target.info, selection=selection, fit=fit_info,
                               levers=levers, runtime=runtime, ranks=ranks, heads=heads), weights, run_report)


def _ids_sha(ids: torch.Tensor) -> str:
    from ..core.hashing import sha256_bytes

    return sha256_bytes(ids.to(torch.int64).contiguous().numpy().tobytes())
