"""Calibration: capture source and target KV on the same tokens and accumulate mergeable statistics.

Letters: N observations (tokens), Fx source features (all source layers, Ls·Hs·Ds), Fy target
features (all target layers, Lt·Ht·Dt).

For keys and for values separately we keep, in float64::

    n                      observations
    mean_x (Fx,)  mean_y (Fy,)
    gram   (Fx, Fx)  Σ (x − x̄)(x − x̄)ᵀ     shared by every target layer and every selection
    cross  (Fx, Fy)  Σ (x − x̄)(y − ȳ)ᵀ
    ssq_y  (Fy,)     Σ (y − ȳ)²              per target feature (for R²)

Each update is centered on its own mean, then merged with the running totals by the pairwise
update of Chan, Golub & LeVeque; the same :meth:`KVStats.merge` combines shards exactly (to float64
rounding), and :meth:`KVStats.all_reduce` does it across torch.distributed processes.

Where the memory goes: observations are gathered on the models' device in their dtype
(:class:`ObservationBuffer`) and added ``block`` × ``block`` features at a time. The float64 totals live on
the models' device when it is an accelerator with room for them (``totals="auto"``: the products then never
leave it, and the fit runs at the device's float64 speed), else in host memory, where the device never holds a
Gram-sized tensor. Memory is fixed by the geometry, not by the data size; ``kvbridge plan`` predicts it.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch

from ..core.mapper import layer_features
from ..core.models import LoadedModel, prefill_content
from ..errors import FitError, InputError

# -- statistics --------------------------------------------------------------------------------
BLOCK = 4096  # features per side of one product block: its float64 transient is BLOCK² × 8 bytes (128 MiB)


class KVStats:
    """Centered, mergeable second-order statistics of (source features x, target features y).

    The totals live on ``device`` (the fit keeps them in host memory); :meth:`update` computes the products
    on the device its observations are on, ``block`` × ``block`` features at a time, and adds each block into
    the totals, so the accelerator never holds a Gram-sized tensor.
    """

    def __init__(self, fx: int, fy: int, device: str | torch.device = "cpu", block: int = BLOCK):
        f64 = dict(dtype=torch.float64, device=device)
        self.n = 0
        self.block = block
        self.mean_x = torch.zeros(fx, **f64)
        self.mean_y = torch.zeros(fy, **f64)
        self.gram = torch.zeros(fx, fx, **f64)
        self.cross = torch.zeros(fx, fy, **f64)
        self.ssq_y = torch.zeros(fy, **f64)

    def _shift(self, n, mean_x, mean_y) -> float:
        """Chan, Golub & LeVeque: add the between-block terms of merging ``n`` observations with these means,
        move the means and count; returns 0 when there is nothing to merge. The caller adds the block's own
        centered totals."""
        if n == 0:
            return 0
        total = self.n + n
        dx, dy = mean_x.to(self.gram.device) - self.mean_x, mean_y.to(self.gram.device) - self.mean_y
        w = self.n * n / total  # weight of the between-block term
        self.gram.addr_(dx, dx, alpha=w)
        self.cross.addr_(dx, dy, alpha=w)
        self.ssq_y.add_(dy * dy, alpha=w)
        self.mean_x += dx * (n / total)
        self.mean_y += dy * (n / total)
        self.n = total
        return n

    def _absorb(self, n, mean_x, mean_y, gram, cross, ssq_y) -> None:
        """Pairwise merge of another block's centered totals into these (in place)."""
        if self._shift(n, mean_x, mean_y):
            self.gram += gram.to(self.gram.device)
            self.cross += cross.to(self.gram.device)
            self.ssq_y += ssq_y.to(self.gram.device)

    def update(self, x: torch.Tensor, y: torch.Tensor, weight: torch.Tensor | None = None) -> None:
        """Add observations x (N, Fx), y (N, Fy), optionally weighted (N,): then ``n`` sums the weights.

        Means and products are computed in float64 on x's device (y and the weights join it there), one
        block of features at a time: the device holds two (N, block) float64 operands and one block × block
        product beside the observations. The Gram is symmetric: blocks above its diagonal are computed once
        and added twice.
        """
        b, dev = self.block, x.device
        y = y.to(dev)
        w = None if weight is None else weight.to(dev, torch.float64)[:, None]  # (N, 1)
        n = x.shape[0] if w is None else float(w.sum())

        def centered(t, m, s, weighted=False):  # (N, ≤b) float64 block of t − m (one new tensor)
            block = t[:, s : s + b].to(torch.float64, copy=True).sub_(m[s : s + b])
            return block.mul_(w) if weighted and w is not None else block

        def block_sums(t):  # Σ over observations (weighted), (≤b,) per block
            return torch.cat([(t[:, s : s + b].double() * w if w is not None else t[:, s : s + b].double()).sum(0)
                              for s in range(0, t.shape[1], b)])

        mx, my = block_sums(x) / n, block_sums(y) / n
        if not self._shift(n, mx, my):
            return
        host = self.gram.device
        for r in range(0, x.shape[1], b):
            left = centered(x, mx, r, weighted=True)
            for s in range(r, x.shape[1], b):
                right = left if s == r and w is None else centered(x, mx, s)
                product = (left.T @ right).to(host)
                self.gram[r : r + b, s : s + b] += product
                if s != r:
                    self.gram[s : s + b, r : r + b] += product.T
                del right
            for s in range(0, y.shape[1], b):
                self.cross[r : r + b, s : s + b] += (left.T @ centered(y, my, s)).to(host)
            del left
        for s in range(0, y.shape[1], b):
            self.ssq_y[s : s + b] += centered(y, my, s).square_().mul_(1 if w is None else w).sum(0).to(host)

    def merge(self, other: KVStats) -> KVStats:
        """A new statistics object equal to one pass over both data sets."""
        merged = KVStats(self.mean_x.numel(), self.mean_y.numel(), self.gram.device, self.block)
        merged._absorb(self.n, self.mean_x, self.mean_y, self.gram, self.cross, self.ssq_y)
        merged._absorb(other.n, other.mean_x, other.mean_y, other.gram, other.cross, other.ssq_y)
        return merged

    def all_reduce(self, group=None) -> None:
        """Turn every process's statistics into those of all processes' observations together (in place).

        torch.distributed must be initialised. Exact to float64 rounding: with the global mean μ, each
        process's totals re-centered on μ (its own plus n·(m − μ)(m − μ)ᵀ) sum to the pooled totals.
        """
        import torch.distributed as dist

        comm = _comm_device(group)
        counts = torch.tensor([float(self.n)], dtype=torch.float64, device=comm)
        sums = torch.cat([self.mean_x, self.mean_y]).to(comm) * float(self.n)
        dist.all_reduce(counts, group=group)
        dist.all_reduce(sums, group=group)
        total = float(counts)
        if total == 0:
            return
        mu = sums / total
        fx = self.mean_x.numel()
        dx, dy = self.mean_x - mu[:fx].to(self.gram.device), self.mean_y - mu[fx:].to(self.gram.device)
        self.gram.addr_(dx, dx, alpha=float(self.n))
        self.cross.addr_(dx, dy, alpha=float(self.n))
        self.ssq_y.add_(dy * dy, alpha=float(self.n))
        for t in (self.gram, self.cross, self.ssq_y):  # one block at a time through the communication device
            flat = t.view(-1)
            step = self.block * self.block
            for s in range(0, flat.numel(), step):
                part = flat[s : s + step].to(comm)
                dist.all_reduce(part, group=group)
                flat[s : s + step] = part.to(flat.device)
        self.mean_x.copy_(mu[:fx])
        self.mean_y.copy_(mu[fx:])
        self.n = int(total) if total == int(total) else total


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


FLUSH_OBSERVATIONS = 8192  # observations gathered on the models' device before one blocked update


class ObservationBuffer:
    """Observations gathered where the models run (their dtype) and added to ``stats`` ``rows`` at a time:
    each update adds every block of the totals once, so fewer, larger updates move less to host memory."""

    def __init__(self, stats: KVStats, rows: int = FLUSH_OBSERVATIONS):
        self.stats, self.rows, self.held = stats, rows, 0
        self.x: torch.Tensor | None = None
        self.y: torch.Tensor | None = None

    def add(self, x: torch.Tensor, y: torch.Tensor) -> None:
        if self.x is None:
            self.x = x.new_empty(self.rows, x.shape[1])
            self.y = y.new_empty(self.rows, y.shape[1])
        start = 0
        while start < x.shape[0]:
            take = min(self.rows - self.held, x.shape[0] - start)
            self.x[self.held : self.held + take] = x[start : start + take]
            self.y[self.held : self.held + take] = y[start : start + take]
            self.held += take
            start += take
            if self.held == self.rows:
                self.flush()

    def flush(self) -> None:
        if self.held:
            self.stats.update(self.x[: self.held], self.y[: self.held])
            self.held = 0

    def close(self) -> None:
        self.flush()
        self.x = self.y = None


def statistics_bytes(fx: int, fy: int) -> int:
    """Bytes of the K and V totals of :class:`KVStats` (float64): means, Gram, cross and ssq for both kinds."""
    return 2 * 8 * (fx * fx + fx * fy + fx + 2 * fy)


def totals_device(choice, models_device: torch.device, fx: int, fy: int, transient: int = 0) -> torch.device:
    """Where :func:`collect_statistics` keeps its float64 totals: ``choice`` "cpu" (host memory), "device" (the
    models' device), or "auto": the models' device when it is a CUDA device whose free memory holds the totals and
    ``transient`` bytes more (the rest of the capture and the solve, :mod:`kvbridge.measure.plan`), else host memory."""
    if choice not in ("auto", "cpu", "device"):
        raise InputError(f"statistics totals go to 'auto', 'cpu' or 'device', not {choice!r}.")
    models_device = torch.device(models_device)
    if choice == "cpu" or models_device.type == "cpu":
        return torch.device("cpu")
    if choice == "device":
        return models_device
    if models_device.type != "cuda":
        return torch.device("cpu")
    free, _ = torch.cuda.mem_get_info(models_device)
    return models_device if free >= statistics_bytes(fx, fy) + transient else torch.device("cpu")


def shard(sequences: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    """This process's share of the calibration sequences: every ``world``-th one from ``rank``."""
    return sequences[rank::world]


def collect_statistics(
    source: LoadedModel,
    target: LoadedModel,
    sequences: torch.Tensor,
    stride: int,
    batch_size: int = 4,
    progress: bool = True,
    buffer_rows: int = FLUSH_OBSERVATIONS,
    block: int = BLOCK,
    distributed: bool = False,
    totals: str = "cpu",
    transient: int = 0,
) -> CalibrationStats:
    """One pass over ``sequences`` (N, T): capture both caches, accumulate K and V statistics.

    The totals (float64) live where ``totals`` says (:func:`totals_device`: "cpu", "device", or "auto" with
    ``transient`` bytes of headroom on the device); observations are gathered on the models' device in their
    dtype, ``buffer_rows`` at a time, and added block by block (``block`` features a side). Under
    torch.distributed each process reads its :func:`shard` of the sequences and the totals are
    all-reduced: every process ends with the statistics of all of them (``distributed``: the caller has
    joined the process group, see :mod:`kvbridge.fit.distributed`).
    """
    import time

    import torch.distributed as dist
    from tqdm.auto import tqdm

    fx = source.info.num_layers * source.info.kv_features
    fy = target.info.num_layers * target.info.kv_features
    where = totals_device(totals, target.device, fx, fy, transient)
    stats = CalibrationStats(key=KVStats(fx, fy, where, block), value=KVStats(fx, fy, where, block))
    if distributed and not (dist.is_available() and dist.is_initialized()):
        raise InputError("distributed=True needs an initialised torch.distributed process group "
                         "(kvbridge.fit.distributed.start, or run under torchrun).")
    if distributed:
        sequences = shard(sequences, dist.get_rank(), dist.get_world_size())
    positions = observation_tokens(sequences.shape[1], stride)
    rows = max(1, min(buffer_rows, sequences.shape[0] * len(positions)))  # never more than the pass observes
    buffers = {kind: ObservationBuffer(getattr(stats, kind), rows) for kind in ("key", "value")}
    start = time.perf_counter()
    with tqdm(total=sequences.shape[0], desc="calibration", unit="seq", disable=not progress) as bar:
        for batch in iter_batches(sequences, batch_size):
            feats = paired_features(source, target, batch, positions)
            for kind, buffer in buffers.items():
                buffer.add(*feats[kind])
            del feats
            stats.sequences += batch.shape[0]
            stats.tokens += batch.numel()
            bar.update(batch.shape[0])
    for buffer in buffers.values():
        buffer.close()
    if distributed:
        for kind in ("key", "value"):
            getattr(stats, kind).all_reduce()
        counts = torch.tensor([stats.sequences, stats.tokens], dtype=torch.int64, device=_comm_device())
        dist.all_reduce(counts)
        stats.sequences, stats.tokens = (int(v) for v in counts.cpu())
    stats.seconds = time.perf_counter() - start
    return stats


def _comm_device(group=None) -> torch.device:
    """Where collectives run: NCCL needs CUDA tensors, gloo takes host ones."""
    import torch.distributed as dist

    nccl = dist.get_backend(group) == "nccl"
    return torch.device("cuda", torch.cuda.current_device()) if nccl else torch.device("cpu")


# -- the closed-form solve on these statistics (fit and levers) -----------------------------------
_MAX_RIDGE_RAISES = 12
_MIN_RCOND = 1e-12  # below this a float64 solve loses all significant digits


@dataclass
class RidgeFactor:
    """Cholesky factor L of A + λI (lower), λ absolute and relative to mean(diag A)."""

    factor: torch.Tensor
    lam: float
    relative: float

    def solve(self, rhs: torch.Tensor) -> torch.Tensor:
        """W = (A + λI)⁻¹ rhs, on the factor's device."""
        w = torch.cholesky_solve(rhs.to(self.factor.device, torch.float64), self.factor)
        if not torch.isfinite(w).all():
            raise FitError("the ridge solve produced NaN or Inf weights; pass a larger --ridge.")
        return w

    def r2(self, w: torch.Tensor, rhs: torch.Tensor, sst) -> float:
        """In-sample R² of ŷ = (x − x̄)W for the columns of ``rhs`` (= C of those columns, W solved from it).

        SSE = SST − 2 wᵀc + wᵀGw, and (G + λI)W = C gives wᵀGw = wᵀc − λ‖w‖²: no Gram needed.
        """
        sst = float(sst)
        sse = sst - float((w * rhs.to(w.device, w.dtype)).sum()) - self.lam * float((w * w).sum())
        return 1.0 - sse / sst if sst > 0 else float("nan")


def ridge_factor(a: torch.Tensor, ridge: float, device: str | torch.device | None = None) -> RidgeFactor:
    """Factor A + λI with λ = ridge · mean(diag A) on ``device`` (default: A's), raising λ while the
    factorisation fails or is numerically singular. A is not changed; the device holds one copy of A and
    the factor, and while solving the factor and the column-major copy LAPACK/cuSOLVER take of it."""
    device = a.device if device is None else torch.device(device)
    scale = float(torch.diagonal(a).mean())
    rows = max(1, BLOCK * BLOCK // max(a.shape[1], 1))  # rows per check: a block-sized mask at a time
    if not all(bool(torch.isfinite(a[i : i + rows]).all()) for i in range(0, a.shape[0], rows)):
        raise FitError("the calibration statistics contain NaN or Inf; check the models' outputs in this dtype "
                       "(try --dtype float32).")
    if scale <= 0:
        raise FitError("the selected source features have zero variance on the calibration data; "
                       "use more varied texts.")
    work = a.to(device, torch.float64, copy=True)
    lam, added = ridge * scale, 0.0
    for _ in range(_MAX_RIDGE_RAISES):
        torch.diagonal(work).add_(lam - added)
        added = lam
        factor, info = torch.linalg.cholesky_ex(work)
        if int(info) == 0:
            # A factorisation can "succeed" on a numerically singular matrix and return huge weights;
            # the squared pivot ratio estimates the reciprocal condition number cheaply.
            pivots = torch.diagonal(factor)
            if float((pivots.min() / pivots.max()) ** 2) > _MIN_RCOND:
                return RidgeFactor(factor, lam, lam / scale)
        del factor
        lam = max(lam * 10.0, 1e-10 * scale)
    raise FitError(f"the Gram matrix stays singular even with ridge {lam / scale:.1e}; pass a larger --ridge.")
