"""Reduced-rank maps: a target layer's ridge map factored through rank r, the rank chosen from held-out error.

Letters: N observations, F features of the layer's input (its selected source layers), Ft target features, r rank.

A plain map ``y = x W + b`` costs F·Ft multiply-adds per token; factored as ``y = (x D) U + b_r`` with ``D = W V_r``
(F, r) and ``U = V_rᵀ`` (r, Ft) it costs r·(F + Ft). ``V_r`` are the top r eigenvectors of ``Wᵀ C`` (Ft, Ft), with
``C = Σ (x − x̄)(y − ȳ)ᵀ`` the fit's cross statistics: since ``(G + λI) W = C`` that is ``Wᵀ (G + λI) W``, so this is
the reduced-rank ridge solution (the ridge fit's predictions projected on their r strongest directions; exact at
r = Ft). The bias follows the projection: ``b_r = ȳ − (ȳ − b) V_r V_rᵀ``.

Which r: one pass over held-out sequences measures, per layer, the error of every rank at once — in the eigenbasis
``V`` the residual of rank r is ``Σ_{i≤r} (e_i − z_i)² + Σ_{i>r} e_i²`` with ``e = (y − ȳ) V`` and ``z = (x W + b −
ȳ) V``, so two sums per component give the whole curve. ``--rank r`` gives every factorable layer rank r;
``--rank-flops f`` spends f × the plain maps' full-rank FLOPs where held-out R² gains most per FLOP (greedy, in
steps of ``Ft / 32`` ranks). A layer whose factored map would cost as much as its full map keeps the full map
(rank 0 in ``mapper.json``), and lever layers are never factored.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..core.mapper import layer_features
from ..core.mapper_config import KINDS
from ..core.models import prefill_content
from .stats import iter_batches


@dataclass
class Basis:
    """One factorable (kind, layer): the eigenvectors ``vectors`` (Ft, Ft, columns by descending eigenvalue) of
    ``Wᵀ C``, the fit's target mean, and held-out sums per component (filled by :func:`heldout_curves`)."""

    vectors: torch.Tensor
    values: torch.Tensor
    mean_y: torch.Tensor
    features: int  # F: the layer's input width
    sst_fit: float = 1.0  # the fit's Σ (y − ȳ)²
    fit: torch.Tensor | None = None  # (Ft,) Σ (e_i − z_i)²
    rest: torch.Tensor | None = None  # (Ft,) Σ e_i²
    sst: float = 0.0  # held-out Σ (y − ȳ_held)²

    def sse(self) -> torch.Tensor:
        """(Ft + 1,) held-out squared error of ranks 0 … Ft."""
        fit = torch.cat([self.fit.new_zeros(1), self.fit.cumsum(0)])
        rest = self.rest.sum() - torch.cat([self.rest.new_zeros(1), self.rest.cumsum(0)])
        return fit + rest


def factorable(config_levers, target_layers: int) -> list[tuple[str, int]]:
    """The (kind, layer) pairs a reduced-rank fit may factor: every plain layer of a target layer without levers
    (the output tuning trains the plain map of a lever layer's other kind in full)."""
    lever_layers = {v.layer for v in config_levers}
    return [(kind, l) for kind in KINDS for l in range(target_layers) if l not in lever_layers]


def bases(stats, weights: dict[str, torch.Tensor], selection, pairs, source_features: int, target_features: int,
          device=None) -> dict[tuple[str, int], Basis]:
    """The eigenbasis of every factorable layer's fitted values, from the fit's statistics (float64)."""
    out = {}
    for kind, l in pairs:
        s = getattr(stats, kind)
        idx = torch.cat([torch.arange(j * source_features, (j + 1) * source_features) for j in selection[kind][l]])
        cols = slice(l * target_features, (l + 1) * target_features)
        c = s.cross[:, cols].index_select(0, idx).to(device=device, dtype=torch.float64)
        w = weights[f"{kind}.{l}.weight"].to(device=device, dtype=torch.float64)
        m = w.T @ c
        values, vectors = torch.linalg.eigh((m + m.T) / 2)  # ascending
        out[(kind, l)] = Basis(vectors.flip(1).cpu(), values.flip(0).cpu(), s.mean_y[cols].double().cpu(),
                               int(idx.numel()), float(s.ssq_y[cols].sum()))
    return out


@torch.no_grad()
def heldout_curves(source, target, sequences: torch.Tensor, selection, found: dict[tuple[str, int], Basis],
                   weights: dict[str, torch.Tensor], batch_size: int = 4) -> None:
    """Fill each basis' held-out sums: one prefill of both models per batch, every rank of every layer at once."""
    sums = {key: (torch.zeros(b.vectors.shape[0], dtype=torch.float64),) * 2 for key, b in found.items()}
    moments = {key: [torch.zeros(b.vectors.shape[0], dtype=torch.float64) for _ in range(2)]
               for key, b in found.items()}
    n = 0
    for batch in iter_batches(sequences, batch_size):
        mask = torch.ones_like(batch)
        sk, sv, _ = prefill_content(source.model, batch, mask)
        tk, tv, _ = prefill_content(target.model, batch, mask)
        device = tk[0].device  # the products on the fit's device, the sums on the host, in float64
        xs = {"key": layer_features(sk).to(device, torch.float64),
              "value": layer_features(sv).to(device, torch.float64)}  # (B, T, Ls, F)
        ys = {"key": layer_features(tk).double(), "value": layer_features(tv).double()}
        n += batch.numel()
        for (kind, l), b in found.items():
            x = xs[kind][:, :, list(selection[kind][l])].flatten(2).flatten(0, 1)  # (N, F)
            y = ys[kind][:, :, l].flatten(0, 1)  # (N, Ft)
            w, bias = (weights[f"{kind}.{l}.{p}"].to(device, torch.float64) for p in ("weight", "bias"))
            v, mean = b.vectors.to(device), b.mean_y.to(device)
            e = ((y - mean) @ v).cpu()
            z = ((x @ w + bias - mean) @ v).cpu()
            y = y.cpu()
            fit, rest = sums[(kind, l)]
            sums[(kind, l)] = (fit + ((e - z) ** 2).sum(0), rest + (e ** 2).sum(0))
            moments[(kind, l)][0] += y.sum(0)
            moments[(kind, l)][1] += (y * y).sum(0)
    for key, b in found.items():
        b.fit, b.rest = sums[key]
        sy, syy = moments[key]
        b.sst = float((syy - sy * sy / n).sum())


def in_sample_curves(found: dict[tuple[str, int], Basis]) -> None:
    """Without held-out data: the fit's own curve — rank r loses the fitted signal of the directions it drops (the
    eigenvalues), on top of the full map's error; against the fit's total variance."""
    for b in found.values():
        signal = b.values.clamp_min(0)
        b.fit = torch.zeros_like(signal)
        b.rest = signal
        b.fit[0] = max(b.sst_fit - float(signal.sum()), 0.0)  # the full map's own error, counted at every rank
        b.sst = b.sst_fit or 1.0


def choose_ranks(found: dict[tuple[str, int], Basis], target_features: int, rank: int | None = None,
                 flops: float | None = None) -> dict[tuple[str, int], int]:
    """Each factorable layer's rank (0: keep the full map): ``rank`` for all, or the held-out-best allocation of
    ``flops`` × their full-rank FLOPs."""
    ft = target_features
    full = {key: b.features * ft for key, b in found.items()}
    # from this rank on a factored map costs as much as the full one: keep the full map (rank 0)
    widest = {key: (b.features * ft) // (b.features + ft) for key, b in found.items()}
    if rank is not None:
        return {key: rank if rank < widest[key] else 0 for key in found}
    budget = flops * sum(full.values())
    step = max(1, ft // 32)
    floor = sum(min(step, widest[key]) * (b.features + ft) for key, b in found.items())
    if floor > budget:  # the smallest start is one rank a layer
        step = 1
        floor = sum(b.features + ft for b in found.values())
    if floor > budget:
        from ..errors import InputError

        raise InputError(f"--rank-flops {flops:g} is below what rank 1 in every factorable layer costs "
                         f"({floor / sum(full.values()):.3f} of their full FLOPs); pass at least that.")
    chosen = {key: min(step, widest[key]) for key in found}
    spent = floor
    curves = {key: b.sse() / max(b.sst, 1e-30) for key, b in found.items()}  # 1 − R² by rank
    while True:
        best, best_gain = None, 0.0
        for key, r in chosen.items():
            if r >= widest[key]:
                continue
            nxt = min(r + step, widest[key])
            cost = (nxt - r) * (found[key].features + ft)
            if spent + cost > budget:
                continue
            gain = float(curves[key][r] - curves[key][nxt]) / cost
            if gain > best_gain:
                best, best_gain = key, gain
        if best is None:
            break
        nxt = min(chosen[best] + step, widest[best])
        spent += (nxt - chosen[best]) * (found[best].features + ft)
        chosen[best] = nxt
    return {key: 0 if r >= widest[key] else r for key, r in chosen.items()}


def factor(weights: dict[str, torch.Tensor], found: dict[tuple[str, int], Basis], ranks: dict[tuple[str, int], int]
           ) -> dict[str, torch.Tensor]:
    """``weights`` with each layer of rank r > 0 factored: ``down`` (F, r), ``up`` (r, Ft), its bias projected."""
    out = dict(weights)
    for key, r in ranks.items():
        if not r:
            continue
        kind, l = key
        b = found[key]
        v = b.vectors[:, :r]  # (Ft, r)
        w = out.pop(f"{kind}.{l}.weight").double()
        bias = out[f"{kind}.{l}.bias"].double()
        out[f"{kind}.{l}.down.weight"] = (w @ v).float().contiguous()
        out[f"{kind}.{l}.up.weight"] = v.T.float().contiguous()
        out[f"{kind}.{l}.bias"] = (b.mean_y - (b.mean_y - bias) @ v @ v.T).float().contiguous()
    return out


def report(found: dict[tuple[str, int], Basis], ranks: dict[tuple[str, int], int], target_features: int,
           heldout: bool) -> dict:
    """What mapper.json's fit records of the choice: each layer's rank and R² (chosen rank, full rank), and the
    share of the factorable layers' full-rank FLOPs spent."""
    ft = target_features
    full = sum(b.features * ft for b in found.values())
    spent = sum(ranks[key] * (b.features + ft) if ranks[key] else b.features * ft for key, b in found.items())
    r2 = {}
    for key, b in found.items():
        curve = 1.0 - b.sse() / max(b.sst, 1e-30)
        r = ranks[key] or b.vectors.shape[0]
        r2[f"{key[0]}.{key[1]}"] = {"rank": ranks[key], "r2": round(float(curve[r]), 6),
                                    "r2_full": round(float(curve[-1]), 6)}
    return {"criterion": "held-out" if heldout else "in-sample", "flops_share": round(spent / full, 4), "layers": r2}
