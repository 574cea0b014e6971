"""Capacity where the plain map loses quality: lagged features, both caches as inputs, a residual MLP.

Letters: N observations, F_in features of one lever, Ft features of one target layer, H hidden units.

A :class:`~kvbridge.core.mapper_config.Lever` on (kind, target layer) replaces that layer's plain features by
its selected source layers' keys and/or values at tokens t, t − 1, … (see
:func:`kvbridge.core.mapper.build_features`). Its linear part is solved in closed form like every other
layer, from statistics of a second pass over the calibration sequences (the first pass's Gram
covers only lag 0); its optional residual MLP is then trained on what the linear part leaves::

    y ≈ x W + b + GELU(x W1 + b1) W2 + b2

with AdamW on mean squared error of the standardised residual, seeded, with a fixed budget of
steps (``mlp_steps`` batches of ``mlp_batch`` observations). Inputs and outputs are standardised
while training and the scales are folded into W1, b1, W2, b2, so the runtime formula stays the
one above.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F

from ..core.mapper import build_features, kv_features
from ..core.mapper_config import Features, Lever
from ..core.models import LoadedModel, prefill_content
from ..errors import FitError
from .stats import KVStats, iter_batches


@dataclass(frozen=True)
class MLPBudget:
    """How a residual MLP is trained: a fixed, stated budget, seeded."""

    steps: int = 1500
    batch: int = 1024
    lr: float = 1e-3
    weight_decay: float = 1e-4
    seed: int = 0
    max_observations: int = 262_144  # observations kept in host memory for training (a seeded sample beyond)


MAX_WEIGHT = 10.0  # attention weighting: no token counts more than this many average tokens


@torch.no_grad()
def attention_received(model, hidden: torch.Tensor, layer: int, keys: torch.Tensor, positions) -> torch.Tensor:
    """(B, T) attention mass each token's key receives in ``layer`` (summed over later queries, mean over
    heads), divided by its mean over the row: 1 = an average token."""
    from ..core.models import attention_queries
    from ..core.rope import apply_rope, rotary_factors

    cos, sin = rotary_factors(model, positions)
    q = attention_queries(model, hidden, layer, cos, sin, positions)  # (B, H, T, D), RoPE and query scaling applied
    k = apply_rope(keys.float(), cos, sin).repeat_interleave(q.shape[1] // keys.shape[1], 1)  # (B, H, T, D)
    t = q.shape[2]
    scores = (q @ k.transpose(-1, -2)) / q.shape[-1] ** 0.5  # (B, H, T, T)
    scores = scores.masked_fill(torch.ones(t, t, dtype=torch.bool, device=q.device).triu(1), float("-inf"))
    mass = scores.softmax(-1).sum(2).mean(1)  # (B, T): received by each key
    return mass / mass.mean(-1, keepdim=True)


@torch.no_grad()
def source_features(source: LoadedModel, ids: torch.Tensor, specs: dict) -> dict:
    """(B, T, F_in) features of each lever key (kind, layer) → :class:`~kvbridge.core.mapper_config.Features` for
    unpadded sequences ``ids`` (B, T): the source's prefill, read as the mapper reads it."""
    reads_state = any("state" in spec.inputs for spec in specs.values())
    sk, sv, _, *state = prefill_content(source.model, ids, torch.ones_like(ids), state=reads_state)
    kv = kv_features(sk, sv, dtype=torch.promote_types(sk[0].dtype, sv[0].dtype))  # (T, B, 2, Ls, Hs, Ds)
    hidden_state = state[0].float().transpose(0, 1) if reads_state else None  # (T, B, Hs)
    out = {}
    for key, spec in specs.items():
        sources = torch.tensor(spec.sources, device=kv.device)
        x = build_features(kv, hidden_state, spec, sources, None, 0)  # (T·B, F_in), token-major
        out[key] = x.view(*kv.shape[:2], -1).transpose(0, 1)  # (B, T, F_in)
    return out


@torch.no_grad()
def lever_observations(source: LoadedModel, target: LoadedModel, ids: torch.Tensor, specs: dict, positions,
                       weighted: bool = False):
    """(x, y, weight or None) per lever key for unpadded sequences ``ids`` (B, T) at token ``positions``."""
    from ..core.models import layer_inputs

    features = source_features(source, ids, specs)
    with layer_inputs(target.model, {layer for _, layer in specs} if weighted else ()) as hidden:
        tk, tv, pos = prefill_content(target.model, ids, torch.ones_like(ids))
    native = {"key": tk, "value": tv}
    out = {}
    for (kind, layer), x in features.items():
        y = native[kind][layer].transpose(1, 2).flatten(2)  # (B, T, Ft)
        w = None
        if weighted:
            w = attention_received(target.model, hidden[layer], layer, tk[layer], pos).clamp_max(MAX_WEIGHT)
            w = w[:, positions].flatten().cpu()
        out[(kind, layer)] = (x[:, positions].flatten(0, 1), y[:, positions].flatten(0, 1), w)
    return out


def fit_levers(source: LoadedModel, target: LoadedModel, sequences: torch.Tensor, selection: dict,
               levers: tuple[Lever, ...], ridge: float, stride: int, batch_size: int, budget: MLPBudget,
               progress: bool = True, weighting: str = "none") -> tuple[dict[str, torch.Tensor], dict]:
    """Closed-form linear part of every lever, then its residual MLP; returns (weights, report).

    ``weighting="attention"``: a weighted ridge, each observation weighted by the attention mass its
    native key receives in that target layer (capped at ``MAX_WEIGHT`` average tokens), so the fit
    spends its accuracy on the tokens the target actually reads.
    """
    from tqdm.auto import tqdm

    from .stats import ridge_factor

    fs, ft = source.info.kv_features, target.info.kv_features
    specs = {(v.kind, v.layer): Features(tuple(selection[v.kind][v.layer]), v.inputs, v.lags, v.state) for v in levers}
    device = target.device
    stats = {key: KVStats(spec.width(fs), ft) for key, spec in specs.items()}  # in host memory
    keep = {(v.kind, v.layer) for v in levers if v.hidden}
    kept: dict[tuple, list] = {key: [] for key in keep}
    positions = torch.arange(0, sequences.shape[1], stride)
    # the MLP's training rows live in host memory: a seeded sample when the fit observes more than the budget
    share = min(1.0, budget.max_observations / max(1, sequences.shape[0] * len(positions)))
    sampler = torch.Generator().manual_seed(budget.seed)
    with tqdm(total=sequences.shape[0], desc="lever statistics", unit="seq", disable=not progress) as bar:
        for batch in iter_batches(sequences, batch_size):
            observed = lever_observations(source, target, batch, specs, positions, weighting == "attention")
            for key, (x, y, w) in observed.items():
                stats[key].update(x, y, w)
                if key in keep:
                    rows = ((torch.rand(x.shape[0], generator=sampler) < share).to(x.device) if share < 1
                            else slice(None))
                    kept[key].append((x[rows].float().cpu(), y[rows].float().cpu()))
            bar.update(batch.shape[0])
    weights, report = {}, {}
    for lever in levers:
        key, name = (lever.kind, lever.layer), f"{lever.kind}.{lever.layer}"
        s = stats.pop(key)  # freed once solved (below), before the MLP trains
        factor = ridge_factor(s.gram, ridge, device)
        w = factor.solve(s.cross)  # (F_in, Ft) float64 on the target's device
        r2_linear, factor_ridge = factor.r2(w, s.cross, s.ssq_y.sum()), factor.relative
        del factor
        w = w.cpu()
        bias = s.mean_y - s.mean_x @ w
        weights[f"{name}.weight"] = w.float().cpu().contiguous()
        weights[f"{name}.bias"] = bias.float().cpu().contiguous()
        del s, w, bias
        report[name] = {"lever": lever.to_dict(), "features": specs[key].width(fs), "weighting": weighting,
                        "ridge_used": factor_ridge, "r2_fit_linear": r2_linear}
        if lever.hidden:
            x = torch.cat([a for a, _ in kept[key]])  # (N, F_in)
            residual = torch.cat([b for _, b in kept.pop(key)])  # (N, Ft): the native target features ...
            residual -= torch.addmm(weights[f"{name}.bias"], x, weights[f"{name}.weight"])  # ... minus the linear map
            observations = int(x.shape[0])
            mlp, r2 = train_residual_mlp(x, residual, lever.hidden, budget, progress, desc=f"MLP {name}")
            del x, residual
            for part, tensor in zip(("in.weight", "in.bias", "out.weight", "out.bias"), mlp):
                weights[f"{name}.mlp.{part}"] = tensor.contiguous()
            report[name] |= {"mlp_observations": observations, "mlp_budget": asdict(budget),
                             "r2_fit_residual_explained": r2}
    return weights, report


def train_residual_mlp(x: torch.Tensor, residual: torch.Tensor, hidden: int, budget: MLPBudget,
                       progress: bool = True, desc: str = "MLP") -> tuple[tuple[torch.Tensor, ...], float]:
    """Fit GELU(x W1 + b1) W2 + b2 ≈ residual; returns the folded (W1, b1, W2, b2) and the share of the
    residual's variance it explains on the last 5 % of observations (kept out of training)."""
    from tqdm.auto import tqdm

    n = x.shape[0]
    if n < 20:
        raise FitError(f"a residual MLP needs more calibration observations than {n}; pass more texts.")
    g = torch.Generator().manual_seed(budget.seed)
    order = torch.randperm(n, generator=g)
    xs, rs = x[order], residual[order]  # shuffled copies, standardised in place below: the first 5 % validate
    del x, residual
    n_val = max(1, n // 20)
    mu, sigma = xs[n_val:].mean(0), xs[n_val:].std(0)
    sigma = sigma.clamp_min(1e-3 * float(sigma.median()) + 1e-12)  # a near-constant feature must not blow up W1
    r_mu, r_sigma = rs[n_val:].mean(0), rs[n_val:].std(0).clamp_min(1e-6)
    xs.sub_(mu).div_(sigma)
    rs.sub_(r_mu).div_(r_sigma)
    val, train = torch.arange(n_val), torch.arange(n_val, n)
    torch.manual_seed(budget.seed)
    net = torch.nn.Sequential(torch.nn.Linear(xs.shape[1], hidden), torch.nn.GELU(),
                              torch.nn.Linear(hidden, rs.shape[1]))
    torch.nn.init.zeros_(net[2].weight)  # start at the linear map: the MLP only adds what helps
    torch.nn.init.zeros_(net[2].bias)
    opt = torch.optim.AdamW(net.parameters(), lr=budget.lr, weight_decay=budget.weight_decay)
    schedule = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / 50) * 0.5 * (1 + math.cos(math.pi * s / budget.steps)))
    with torch.enable_grad(), tqdm(total=budget.steps, desc=desc, unit="step", disable=not progress) as bar:
        for _ in range(budget.steps):
            idx = train[torch.randint(len(train), (min(budget.batch, len(train)),), generator=g)]
            loss = F.mse_loss(net(xs[idx]), rs[idx])
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            schedule.step()
            bar.update(1)
    with torch.no_grad():
        explained = 1.0 - float(((net(xs[val]) - rs[val]) ** 2).sum() / (rs[val] ** 2).sum().clamp_min(1e-12))
        w1 = net[0].weight.T / sigma[:, None]  # (F_in, H): x̃ = (x − μ)/σ folded in
        b1 = net[0].bias - (mu / sigma) @ net[0].weight.T
        w2 = net[2].weight.T * r_sigma  # (H, Ft): output scale folded in
        b2 = net[2].bias * r_sigma + r_mu
    return (w1.float(), b1.float(), w2.float(), b2.float()), explained
