"""Calibration: capture source and target KV on the same tokens and accumulate mergeable statistics.

Letters: N observations (tokens), Fx source features (all source layers, Ls·Hs·Ds), Fy target
features (all target layers, Lt·Ht·Dt).

For keys and for values separately we keep, in float64::

    n                      observations
    mean_x (Fx,)  mean_y (Fy,)
    gram   (Fx, Fx)  Σ (x − x̄)(x − x̄)ᵀ     shared by every target layer and every selection
    cross  (Fx, Fy)  Σ (x − x̄)(y − ȳ)ᵀ
    ssq_y  (Fy,)     Σ (y − ȳ)²              per target feature (for R²)

Each batch is centered on its own mean, then merged with the running totals by the pairwise
update of Chan, Golub & LeVeque; the same :meth:`KVStats.merge` combines shards from other
processes exactly (to float64 rounding). Memory is fixed by the geometry, not by the data size.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch

from .errors import FitError, InputError
from .mapper import layer_features
from .models import LoadedModel, prefill_content


# -- statistics --------------------------------------------------------------------------------
class KVStats:
    """Centered, mergeable second-order statistics of (source features x, target features y)."""

    def __init__(self, fx: int, fy: int, device: str | torch.device = "cpu"):
        f64 = dict(dtype=torch.float64, device=device)
        self.n = 0
        self.mean_x = torch.zeros(fx, **f64)
        self.mean_y = torch.zeros(fy, **f64)
        self.gram = torch.zeros(fx, fx, **f64)
        self.cross = torch.zeros(fx, fy, **f64)
        self.ssq_y = torch.zeros(fy, **f64)

    def _absorb(self, n, mean_x, mean_y, gram, cross, ssq_y) -> None:
        """Pairwise merge of another block's centered totals into these (in place)."""
        if n == 0:
            return
        total = self.n + n
        dx, dy = mean_x - self.mean_x, mean_y - self.mean_y
        w = self.n * n / total  # weight of the between-block term
        self.gram += gram
        self.gram.addr_(dx, dx, alpha=w)
        self.cross += cross
        self.cross.addr_(dx, dy, alpha=w)
        self.ssq_y += ssq_y + w * dy * dy
        self.mean_x += dx * (n / total)
        self.mean_y += dy * (n / total)
        self.n = total

    def update(self, x: torch.Tensor, y: torch.Tensor, weight: torch.Tensor | None = None) -> None:
        """Add observations x (N, Fx), y (N, Fy), optionally weighted (N,): then ``n`` sums the weights."""
        x = x.to(self.gram.device, torch.float64)
        y = y.to(self.gram.device, torch.float64)
        if weight is None:
            mx, my = x.mean(0), y.mean(0)
            xc, yc = x - mx, y - my
            self._absorb(x.shape[0], mx, my, xc.T @ xc, xc.T @ yc, (yc * yc).sum(0))
            return
        w = weight.to(self.gram.device, torch.float64)[:, None]  # (N, 1)
        total = float(w.sum())
        mx, my = (w * x).sum(0) / total, (w * y).sum(0) / total
        xc, yc = x - mx, y - my
        self._absorb(total, mx, my, (w * xc).T @ xc, (w * xc).T @ yc, (w * yc * yc).sum(0))

    def merge(self, other: KVStats) -> KVStats:
        """A new statistics object equal to one pass over both data sets."""
        merged = KVStats(self.mean_x.numel(), self.mean_y.numel(), self.gram.device)
        merged._absorb(self.n, self.mean_x, self.mean_y, self.gram, self.cross, self.ssq_y)
        merged._absorb(other.n, other.mean_x.to(merged.gram.device), other.mean_y.to(merged.gram.device),
                       other.gram.to(merged.gram.device), other.cross.to(merged.gram.device),
                       other.ssq_y.to(merged.gram.device))
        return merged


@dataclass
class CalibrationStats:
    """Key and value statistics of one calibration pass, plus what it cost."""

    key: KVStats
    value: KVStats
    sequences: int = 0
    tokens: int = 0
    seconds: float = 0.0

    @property
    def observations(self) -> int:
        return self.key.n

    def merge(self, other: CalibrationStats) -> CalibrationStats:
        return CalibrationStats(
            key=self.key.merge(other.key),
            value=self.value.merge(other.value),
            sequences=self.sequences + other.sequences,
            tokens=self.tokens + other.tokens,
            seconds=self.seconds + other.seconds,
        )

    def update_flops(self) -> float:
        """Floating-point work of the Gram and cross products accumulated so far (K and V)."""
        total = 0.0
        for s in (self.key, self.value):
            fx, fy = s.mean_x.numel(), s.mean_y.numel()
            total += 2.0 * s.n * fx * (fx + fy)
        return total


def observation_tokens(seq_len: int, stride: int) -> torch.Tensor:
    """Token positions observed in every calibration sequence: 0, stride, 2·stride, …"""
    if stride < 1:
        raise InputError("--stride must be at least 1.")
    return torch.arange(0, seq_len, stride)


def iter_batches(sequences: torch.Tensor, batch_size: int) -> Iterator[torch.Tensor]:
    for start in range(0, sequences.shape[0], batch_size):
        yield sequences[start : start + batch_size]


@torch.no_grad()
def paired_features(source: LoadedModel, target: LoadedModel, ids: torch.Tensor, positions: torch.Tensor):
    """Source and target content features at ``positions`` of unpadded sequences ``ids`` (B, T).

    Returns ``{"key": (x, y), "value": (x, y)}`` with x (B·P, Ls·Fs) and y (B·P, Lt·Ft).
    """
    mask = torch.ones_like(ids)
    out = {}
    sk, sv, _ = prefill_content(source.model, ids, mask)
    tk, tv, _ = prefill_content(target.model, ids, mask)
    for kind, src, tgt in (("key", sk, tk), ("value", sv, tv)):
        x = layer_features(src)[:, positions.to(src[0].device)]  # (B, P, Ls, Fs)
        y = layer_features(tgt)[:, positions.to(tgt[0].device)]  # (B, P, Lt, Ft)
        out[kind] = (x.flatten(0, 1).flatten(1), y.flatten(0, 1).flatten(1))
    return out


def collect_statistics(
    source: LoadedModel,
    target: LoadedModel,
    sequences: torch.Tensor,
    stride: int,
    batch_size: int = 4,
    device: str | torch.device | None = None,
    progress: bool = True,
) -> CalibrationStats:
    """One pass over ``sequences`` (N, T): capture both caches, accumulate K and V statistics."""
    import time

    from tqdm.auto import tqdm

    device = device or target.device
    fx = source.info.num_layers * source.info.kv_features
    fy = target.info.num_layers * target.info.kv_features
    stats = CalibrationStats(key=KVStats(fx, fy, device), value=KVStats(fx, fy, device))
    positions = observation_tokens(sequences.shape[1], stride)
    start = time.perf_counter()
    with tqdm(total=sequences.shape[0], desc="calibration", unit="seq", disable=not progress) as bar:
        for batch in iter_batches(sequences, batch_size):
            feats = paired_features(source, target, batch, positions)
            stats.key.update(*feats["key"])
            stats.value.update(*feats["value"])
            stats.sequences += batch.shape[0]
            stats.tokens += batch.numel()
            bar.update(batch.shape[0])
    stats.seconds = time.perf_counter() - start
    return stats


# -- the closed-form solve on these statistics (fit and levers) -----------------------------------
_MAX_RIDGE_RAISES = 12
_MIN_RCOND = 1e-12  # below this a float64 solve loses all significant digits


def ridge_solve(a: torch.Tensor, rhs: torch.Tensor, ridge: float) -> tuple[torch.Tensor, float]:
    """Solve (A + λ I) W = rhs with λ = ridge · mean(diag A), raising λ if A + λI is not PD."""
    scale = float(torch.diagonal(a).mean())
    if not torch.isfinite(a).all() or not torch.isfinite(rhs).all():
        raise FitError("the calibration statistics contain NaN or Inf; check the models' outputs in this dtype "
                       "(try --dtype float32).")
    if scale <= 0:
        raise FitError("the selected source features have zero variance on the calibration data; "
                       "use more varied texts.")
    lam = ridge * scale
    eye = torch.eye(a.shape[0], dtype=a.dtype, device=a.device)
    for _ in range(_MAX_RIDGE_RAISES):
        factor, info = torch.linalg.cholesky_ex(a + lam * eye)
        if int(info) == 0:
            # A factorisation can "succeed" on a numerically singular matrix and return huge weights;
            # the squared pivot ratio estimates the reciprocal condition number cheaply.
            pivots = torch.diagonal(factor)
            if float((pivots.min() / pivots.max()) ** 2) > _MIN_RCOND:
                w = torch.cholesky_solve(rhs, factor)
                if torch.isfinite(w).all():
                    return w, lam / scale
        lam = max(lam * 10.0, 1e-10 * scale)
    raise FitError(f"the Gram matrix stays singular even with ridge {lam / scale:.1e}; pass a larger --ridge.")


def pooled_r2(w: torch.Tensor, c: torch.Tensor, gw: torch.Tensor, sst: torch.Tensor) -> float:
    """In-sample R² of ŷ = (x − x̄)W for one target layer from statistics: w, c, gw = G·w (F, Ft)."""
    sse = sst - 2 * (w * c).sum() + (w * gw).sum()
    return float(1.0 - sse / sst) if sst > 0 else float("nan")
