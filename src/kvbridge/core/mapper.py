"""The map itself: content-space source KV → content-space target KV. Hot path only.

Letters: B batch, T tokens, P past tokens (lag context only), Ls/Lt source/target layers, H kv heads,
D head dim, F features of one layer (H·D, heads concatenated head-major: feature ``h*D + d``),
S selected source layers, J lags, I input kinds, N hidden units of a residual MLP.

For every target layer ``l`` and for keys and values separately::

    x_l = concat over lags j, input kinds i, source layers s ∈ S_l of content_i,s(t − j)   # (B, T, J·I·S·Fs)
          [then, per lag, the source's final hidden state h(t − j), when a lever reads "state"]  # + (J·Hs)
    y_l = x_l @ W_l + b_l  [+ GELU(x_l @ W1_l + b1_l) @ W2_l + b2_l]                        # (B, T, Ft)

A plain layer (version-1 maps) reads lag 0 of its own kind only: ``x_l`` = the selected source layers' keys
(for keys) or values (for values) at the same token. A :class:`~kvbridge.core.mapper_config.Lever` widens one
target layer's features with neighbouring tokens (``lags``), with the other cache and the source's final
hidden state (``inputs``: the residual stream after its last layer, which no cache holds), and adds a residual
MLP (``hidden``). Lagged features before a sequence's first token are zeros.

Target layers that read the same features and have no MLP share one GEMM: their weights are
concatenated along the output dimension once, when the mapper is built, so the published artifact's top_k =
all-layers mapper is a single ``addmm`` per K and V. The runtime holds the source's K/V token-major in one
buffer (:func:`kv_features`): a plain group's ``x`` is a strided view of it, a lag is the same view shifted
by B rows (float32 GEMMs accumulate lag by lag, so lagged features are never copied), and every GEMM writes
its target layers' columns of one output buffer per kind, whose per-layer views are the cache. Nothing in
:meth:`Mapper.map` touches files, logs or syncs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from ..errors import ArtifactError
from . import artifact, schema
from .mapper_config import (
    INTEGER_TENSORS,
    KINDS,
    Features,
    MapperConfig,
    keeps_dtype,
    read_config,
)
from .models import ModelInfo, check_matches, check_same_tokenizer


@dataclass(frozen=True)
class GemmGroup:
    """Target layers reading the same features, mapped by one GEMM (and at most one residual MLP)."""

    features: Features
    sources: torch.Tensor | None  # (S,) indices into the read source layers (config.read_layers), None = all of them
    targets: tuple[int, ...]
    weight: torch.Tensor  # (F_in, n·Ft)
    bias: torch.Tensor  # (n·Ft,)
    mlp: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None = None  # W1, b1, W2, b2
    slot: int = 0  # where its n target layers start in the mapped buffer (:meth:`Mapper.map_features`)
    # a factored group: ``weight`` is [down_1 … down_n] (F_in, Σr), ``bias`` zeros (Σr,); per target layer
    # y = z_i @ up_i + bias_i with z_i its r_i columns of x @ weight
    ups: tuple[torch.Tensor, ...] | None = None  # (r_i, Ft) each
    biases: tuple[torch.Tensor, ...] | None = None  # (Ft,) each
    # a head-blocked layer (one target layer): ``weight`` (n, F_in / n, Ft / n), block g of the outputs from block g
    # of each selected source layer's heads
    blocks: int = 1


def _slots(groups: list[GemmGroup]) -> tuple[int, ...]:
    """Each target layer's slot in a mapped buffer whose slots follow ``groups``' target layers in order."""
    order = [layer for group in groups for layer in group.targets]
    return tuple(order.index(layer) for layer in range(len(order)))


def _adjacent(parts: list[torch.Tensor], dim: int) -> torch.Tensor | None:
    """The tensor ``torch.cat(parts, dim)`` would build, without a copy, when ``parts`` already are adjacent
    slices of one buffer in order (as :func:`assemble` lays them out); else None."""
    first = parts[0]
    step = first.shape[dim] * first.stride(dim)
    storage = first.untyped_storage().data_ptr()
    for i, p in enumerate(parts):
        if (p.untyped_storage().data_ptr() != storage or p.shape != first.shape or p.stride() != first.stride()
                or p.storage_offset() != first.storage_offset() + i * step or p.dtype != first.dtype):
            return None
    shape = list(first.shape)
    shape[dim] *= len(parts)
    whole = first.as_strided(shape, first.stride(), first.storage_offset())
    return whole if whole.is_contiguous() else None


def _concat(parts: list[torch.Tensor], dim: int) -> torch.Tensor:
    whole = _adjacent(parts, dim)
    return torch.cat(parts, dim=dim) if whole is None else whole


def assemble(config: MapperConfig, fetch, device: torch.device | str, dtype: torch.dtype | None
             ) -> dict[str, torch.Tensor]:
    """Every tensor of ``config``, ``fetch(name)`` one at a time, written into its group's GEMM operand
    preallocated on ``device`` (in ``dtype``; MLPs and tables keep theirs): the map is never held twice
    while it is built, only one layer beyond it."""
    weights: dict[str, torch.Tensor] = {}
    ft = config.target.kv_features
    for kind in KINDS:
        for _, targets, _, factored in config.groups(kind):
            if len(targets) == 1:
                continue
            if factored:  # the downs side by side: one GEMM's operand, fetched one at a time as below
                first = fetch(f"{kind}.{targets[0]}.down.weight")
                widths = [config.rank(kind, l) for l in targets]
                down = torch.empty((first.shape[0], sum(widths)), device=device, dtype=dtype or first.dtype)
                col = 0
                for i, (l, r) in enumerate(zip(targets, widths)):
                    down[:, col : col + r] = first if i == 0 else fetch(f"{kind}.{l}.down.weight")
                    weights[f"{kind}.{l}.down.weight"] = down[:, col : col + r]
                    col += r
                del first
                continue
            first = fetch(f"{kind}.{targets[0]}.weight")
            out_dtype = dtype or first.dtype
            weight = torch.empty((first.shape[0], len(targets) * ft), device=device, dtype=out_dtype)
            bias = torch.empty((len(targets) * ft,), device=device, dtype=out_dtype)
            for i, l in enumerate(targets):
                cols = slice(i * ft, (i + 1) * ft)
                weight[:, cols] = first if i == 0 else fetch(f"{kind}.{l}.weight")
                bias[cols] = fetch(f"{kind}.{l}.bias")
                weights[f"{kind}.{l}.weight"], weights[f"{kind}.{l}.bias"] = weight[:, cols], bias[cols]
            del first
    for name in config.weight_shapes():
        if name not in weights:
            t = fetch(name)
            weights[name] = t.to(device=device, dtype=None if keeps_dtype(name) or dtype is None else dtype)
    return weights


def layer_features(layers: list[torch.Tensor], dtype: torch.dtype | None = None) -> torch.Tensor:
    """Ls × (B, H, T, D) → (B, T, Ls, H·D): every token's features per layer, heads head-major.

    The one definition of a row's feature layout, shared by the fit's statistics and the runtime map
    (:func:`kv_features` holds the same rows token-major).
    """
    x = torch.stack([t.to(dtype) if dtype is not None else t for t in layers], dim=2)  # (B, H, Ls, T, D)
    return x.permute(0, 3, 2, 1, 4).flatten(3)  # (B, T, Ls, H·D)


def kv_features(keys: list[torch.Tensor], values: list[torch.Tensor], rows: slice = slice(None),
                dtype: torch.dtype | None = None, device: torch.device | str | None = None) -> torch.Tensor:
    """Ls × (B, H, T, D) keys and values → (T, B, 2, Ls, H, D), columns ``rows`` of each, in one buffer.

    Token-major, so that a chunk's tokens are one block of GEMM rows (B·T of them) and a lag is a shift
    by B rows; keys then values, so a lever reading both reads one contiguous span per token. Each row
    holds :func:`layer_features`' layout.
    """
    b, h, t, d = keys[0][:, :, rows].shape
    out = torch.empty((t, b, 2, len(keys), h, d), dtype=dtype or keys[0].dtype, device=device or keys[0].device)
    for i, layers in enumerate((keys, values)):
        for s, x in enumerate(layers):
            out[:, :, i, s].copy_(x[:, :, rows].permute(2, 0, 1, 3))
    return out


def build_features(kv: torch.Tensor, state: torch.Tensor | None, spec: Features, sources: torch.Tensor | None,
                   positions: torch.Tensor | None, past: int) -> torch.Tensor:
    """x (T·B, F_in), token-major, for the features ``spec`` of the last T of ``kv``'s P+T tokens.

    ``kv`` (P+T, B, 2, Ls, Hs, Ds) from :func:`kv_features`, ``state`` (P+T, B, Hs) or None. Token ``t``
    reads token ``t − j`` for each lag ``j``; a lag that reaches before a row's first token
    (``positions[t] < j``, or ``t < j`` without positions) reads zeros. Lag 0 of the caches alone is
    a view of ``kv`` (no copy). Shared by the fit and :func:`features_matmul`.
    """
    blocks = list(lag_blocks(kv, state, spec, sources, positions, past))
    if len(blocks) == 1 and blocks[0][0] == 0:
        return blocks[0][1]
    rows = (kv.shape[0] - past) * kv.shape[1]
    x = torch.empty((rows, spec.width(kv.shape[-2] * kv.shape[-1])), dtype=kv.dtype, device=kv.device)
    col = 0
    for zeros, block in blocks:
        dst = x[:, col : col + block.shape[1]]
        col += block.shape[1]
        dst[:zeros].zero_()
        dst[zeros:].copy_(block)
    return x


def lag_blocks(kv: torch.Tensor, state: torch.Tensor | None, spec: Features, sources: torch.Tensor | None,
               positions: torch.Tensor | None, past: int):
    """The column blocks of :func:`build_features`' x in order, each as ``(zeros, block)``: its first ``zeros``
    rows read before ``kv``'s first token (zeros), ``block`` holds the others.

    A block is one input (the caches read, or the state) at one lag: rows of ``kv`` shifted by the lag, a
    strided view unless positions mask some of them.
    """
    total, batch = kv.shape[:2]
    rows = (total - past) * batch
    kinds = [KINDS.index(i) for i in spec.inputs if i in KINDS]  # adjacent in kv: key, value
    caches = kv[:, :, kinds[0] : kinds[-1] + 1]  # (P+T, B, I, Ls, Hs, Ds)
    if sources is not None:
        caches = caches.index_select(3, sources)
    parts = [caches.reshape(total * batch, -1)]  # a strided view of kv when every source layer is read
    if "state" in spec.inputs:
        parts.append(state.reshape(total * batch, -1))
    for j in spec.lags:
        zeros = min(max(j - past, 0) * batch, rows)  # rows whose lag j reaches before kv's first token
        mask = None if not j or positions is None else (positions[:, past:] >= j).T.reshape(-1, 1)[zeros:]
        for part in parts:
            block = part[(past - j) * batch + zeros : (total - j) * batch] if zeros < rows else part[:0]
            yield zeros, block if mask is None else block * mask


def features_matmul(bias: torch.Tensor, kv: torch.Tensor, state: torch.Tensor | None, spec: Features,
                    sources: torch.Tensor | None, positions: torch.Tensor | None, past: int, weight: torch.Tensor,
                    out: torch.Tensor | None = None) -> torch.Tensor:
    """``build_features(…) @ weight + bias`` (T·B, N), into ``out`` if given.

    In float32 the features are never assembled: one GEMM per block of :func:`lag_blocks` (shifted rows
    of ``kv``, copied only where positions mask them) against its rows of ``weight`` accumulates in
    ``out``. In lower precision that would round the sum once per block, so the features are built (a
    view for plain layers) and multiplied at once.
    """
    if weight.dtype.itemsize < 4:
        x = build_features(kv, state, spec, sources, positions, past).to(weight.dtype)
        return torch.addmm(bias, x, weight) if out is None else torch.addmm(bias, x, weight, out=out)
    rows = (kv.shape[0] - past) * kv.shape[1]
    out = torch.empty((rows, weight.shape[1]), dtype=weight.dtype, device=weight.device) if out is None else out
    out.copy_(bias)
    first = 0
    for zeros, block in lag_blocks(kv, state, spec, sources, positions, past):
        out[zeros:].addmm_(block.to(weight.dtype), weight[first : first + block.shape[1]])
        first += block.shape[1]
    return out


def head_blocks(x: torch.Tensor, sources: int, blocks: int) -> torch.Tensor:
    """x (N, S·H·D) in :func:`layer_features`' layout → (n, N, S·H/n·D): block g holds heads [g·H/n, (g+1)·H/n)
    of each of the S source layers, layer-major (a copy)."""
    rows = x.shape[0]
    return x.reshape(rows, sources, blocks, -1).permute(2, 0, 1, 3).reshape(blocks, rows, -1)


def head_blocked_matmul(group: GemmGroup, kv: torch.Tensor, positions, past: int, out: torch.Tensor,
                        shared: dict | None = None) -> None:
    """A head-blocked layer (lag 0 of its own kind): ``out`` (T·B, Ft) = per block g, x_g @ W_g, then + bias.
    ``shared``: block-major features already built in this call, by (source layers, blocks); the layers that
    read the same ones (every layer, without ``--top-k``) share one copy."""
    key = (group.features.sources, group.blocks)
    blocks = None if shared is None else shared.get(key)
    if blocks is None:
        x = build_features(kv, None, group.features, group.sources, positions, past)
        blocks = head_blocks(x.to(group.weight.dtype), len(group.features.sources), group.blocks)
        if shared is not None:
            shared[key] = blocks
    z = torch.bmm(blocks, group.weight)
    out.unflatten(1, (group.blocks, -1)).copy_(z.transpose(0, 1))
    out.add_(group.bias)


class Mapper:
    """A fitted cross-model KV mapper. Build with :meth:`from_pretrained` or :func:`kvbridge.fit.fit_mapper`.

    The mapper takes ownership of the tensors it is given: a target layer that forms a GEMM group of its
    own keeps its tensor, the others become views of their group's operand (the map is held once).
    Tensors that already are adjacent slices of one buffer (:func:`assemble`, used by ``from_pretrained``
    and ``to``) are used as they are; others are concatenated, which briefly holds them twice.
    """

    def __init__(self, config: MapperConfig, weights: dict[str, torch.Tensor],
                 run_report: dict[str, Any] | None = None):
        expected = config.weight_shapes()
        missing = sorted(set(expected) - set(weights))
        extra = sorted(set(weights) - set(expected))
        if missing or extra:
            raise ArtifactError(
                f"mapper tensors do not match mapper.json: missing {missing[:3]}, unexpected {extra[:3]}. "
                "The artifact is incomplete or from another mapper; re-download or refit it."
            )
        for name, shape in expected.items():
            if tuple(weights[name].shape) != shape:
                raise ArtifactError(
                    f"mapper tensor {name} has shape {tuple(weights[name].shape)}, mapper.json implies {shape}."
                )
            expected_int = name in INTEGER_TENSORS
            if weights[name].is_floating_point() == expected_int:
                raise ArtifactError(f"mapper tensor {name} has dtype {weights[name].dtype}, expected "
                                    f"{'int64' if expected_int else 'a float type'}.")
        bad = [name for name, t in weights.items() if t.is_floating_point() and not bool(torch.isfinite(t).all())]
        if bad:
            raise ArtifactError(f"mapper tensor {bad[0]} holds NaN or Inf ({len(bad)} tensor(s) in all); the mapper "
                                "would produce garbage. Refit it, or re-download it.")
        self.config = config
        self.weights = dict(weights)  # per-layer entries become views of their group's tensor below
        # how the fit that made it ran (time, throughput, peak memory): saved beside the artifact, outside
        # its checksummed identity, because it changes between identical fits
        self.run_report = dict(run_report or {})
        # the hot path's plan, per kind: target layers that share features share one GEMM (read-only)
        self.groups: dict[str, list[GemmGroup]] = {kind: self._build_groups(kind) for kind in KINDS}
        # where each target layer sits in a mapped buffer: groups in order, so each GEMM writes one column span
        self.slots: dict[str, tuple[int, ...]] = {kind: _slots(self.groups[kind]) for kind in KINDS}

    # -- construction -----------------------------------------------------------------------
    def _build_groups(self, kind: str) -> list[GemmGroup]:
        config = self.config
        groups = []
        slot = 0
        read = config.read_layers  # the runtime's features hold these source layers only: sources index into them
        for spec, targets, has_mlp, factored in config.groups(kind):
            sources = None if spec.sources == read else torch.tensor([read.index(s) for s in spec.sources])
            if factored:
                groups.append(self._factored_group(kind, spec, sources, targets, slot))
                slot += len(targets)
                continue
            if config.blocks(kind, targets[0]) > 1:  # a batch of small maps: its own tensors as they are
                name = f"{kind}.{targets[0]}"
                self.weights[f"{name}.weight"] = weight = self.weights[f"{name}.weight"].contiguous()
                groups.append(GemmGroup(features=spec, sources=None if sources is None else sources.to(weight.device),
                                        targets=tuple(targets), weight=weight, bias=self.weights[f"{name}.bias"],
                                        slot=slot, blocks=config.blocks(kind, targets[0])))
                slot += 1
                continue
            w = [self.weights[f"{kind}.{l}.weight"] for l in targets]
            b = [self.weights[f"{kind}.{l}.bias"] for l in targets]
            weight, bias = (w[0].contiguous(), b[0]) if len(w) == 1 else (_concat(w, 1), _concat(b, 0))
            # the mapper is resident once: each layer's weight is (a view of) its group's GEMM operand
            ft = self.config.target.kv_features
            for i, l in enumerate(targets):
                self.weights[f"{kind}.{l}.weight"] = weight[:, i * ft : (i + 1) * ft] if len(w) > 1 else weight
                self.weights[f"{kind}.{l}.bias"] = bias[i * ft : (i + 1) * ft] if len(b) > 1 else bias
            sources = None if sources is None else sources.to(weight.device)
            mlp = None
            if has_mlp:
                p = f"{kind}.{targets[0]}.mlp"
                names = [f"{p}.{n}" for n in ("in.weight", "in.bias", "out.weight", "out.bias")]
                for name in names:
                    self.weights[name] = self.weights[name].contiguous()
                mlp = tuple(self.weights[name] for name in names)
            groups.append(GemmGroup(features=spec, sources=sources, targets=tuple(targets), weight=weight,
                                 bias=bias, mlp=mlp, slot=slot))
            slot += len(targets)
        return groups

    def _factored_group(self, kind: str, spec: Features, sources, targets: tuple[int, ...], slot: int) -> GemmGroup:
        """Factored target layers that read the same features: one GEMM into their ranks, one small GEMM each."""
        downs = [self.weights[f"{kind}.{l}.down.weight"] for l in targets]
        down = downs[0].contiguous() if len(downs) == 1 else _concat(downs, 1)
        col = 0
        for l, d in zip(targets, downs):  # each layer's down is a view of the group's operand
            self.weights[f"{kind}.{l}.down.weight"] = down[:, col : col + d.shape[1]]
            col += d.shape[1]
        ups = []
        for l in targets:
            self.weights[f"{kind}.{l}.up.weight"] = self.weights[f"{kind}.{l}.up.weight"].contiguous()
            ups.append(self.weights[f"{kind}.{l}.up.weight"])
        return GemmGroup(features=spec, sources=None if sources is None else sources.to(down.device),
                         targets=tuple(targets), weight=down,
                         bias=torch.zeros(down.shape[1], dtype=down.dtype, device=down.device), slot=slot,
                         ups=tuple(ups), biases=tuple(self.weights[f"{kind}.{l}.bias"] for l in targets))

    @property
    def resident_bytes(self) -> int:
        """Bytes the mapper holds: every distinct storage behind its weights and the groups' GEMM operands."""
        storages = {}
        tensors = list(self.weights.values())
        tensors += [t for groups in self.groups.values() for g in groups
                    for t in (g.weight, g.bias, *(g.mlp or ()), *(g.ups or ()), *(g.biases or ()))]
        for t in tensors:
            storage = t.untyped_storage()
            storages[(t.device, storage.data_ptr())] = storage.nbytes()
        return sum(storages.values())

    @property
    def dtype(self) -> torch.dtype:
        return self.groups["key"][0].weight.dtype

    @property
    def device(self) -> torch.device:
        return self.groups["key"][0].weight.device

    def to(self, device: str | torch.device | None = None, dtype: torch.dtype | None = None) -> Mapper:
        """A copy on ``device`` in ``dtype`` (e.g. bfloat16 for runtime), assembled layer by layer."""
        device = self.device if device is None else torch.device(device)
        return Mapper(self.config, assemble(self.config, self.weights.__getitem__, device, dtype), self.run_report)

    @classmethod
    def identity(cls, info: ModelInfo) -> Mapper:
        """The exact map from a model to itself (target layer l ← source layer l, W = I, b = 0).

        Useful to prove that cache handoff, positions and RoPE are exact: mapped == native.
        """
        features = info.kv_features
        eye = torch.eye(features)
        weights = {}
        for kind in KINDS:
            for layer in range(info.num_layers):
                weights[f"{kind}.{layer}.weight"] = eye.clone()
                weights[f"{kind}.{layer}.bias"] = torch.zeros(features)
        selection = {kind: tuple((l,) for l in range(info.num_layers)) for kind in KINDS}
        return cls(MapperConfig(source=info, target=info, selection=selection, fit={"kind": "identity"}), weights)

    # -- artifact ---------------------------------------------------------------------------
    @classmethod
    def from_pretrained(
        cls,
        path_or_repo_id: str,
        revision: str | None = None,
        device: str | torch.device = "cpu",
        dtype: torch.dtype | None = None,
        verify: bool = True,
    ) -> Mapper:
        """Load a mapper folder or hub repo.

        Checksums are verified before anything is parsed (``verify``), every field of mapper.json is
        validated, tensor names, shapes and dtypes are compared from the file's header before any tensor
        is read (a file with junk tensors costs no memory), then tensors are read one at a time onto
        ``device`` (and cast to ``dtype``, residual MLPs and tables excepted).
        """
        from .models import check_device, resolve_dtype

        check_device(device, "mapper device")
        if dtype is not None:  # a name ("float16", "bf16") as load_model takes it, or a torch.dtype
            dtype = resolve_dtype(dtype, device)
        directory = artifact.resolve(path_or_repo_id, revision, "mapper")
        if verify:
            problems = artifact.verify_artifact(directory)
            if problems:
                raise ArtifactError(f"mapper at {directory} failed verification: {'; '.join(problems)}. "
                                    "Re-download or refit it; nothing was loaded.")
        config = read_config(directory)
        problems = artifact.header_problems(directory, config.weight_shapes(), config.tensor_dtypes(),
                                            config.computation_digest())
        if problems:
            raise ArtifactError(f"{directory / artifact.WEIGHTS_FILE} does not match {schema.CONFIG_FILE}: "
                                f"{'; '.join(problems[:3])}. Re-download or refit the mapper; nothing was loaded.")
        with artifact.open_tensors(directory, device) as fetch:
            tensors = assemble(config, fetch, device, dtype)
        return cls(config, tensors, run_report=artifact.read_run_report(directory))

    def save_pretrained(self, directory: str | Path) -> Path:
        """Write ``mapper.safetensors`` (float32, the bigram keys int64), ``mapper.json``, ``checksums.sha256``
        and the fit's ``fit_report.json`` atomically (see :func:`kvbridge.core.artifact.write_artifact`)."""
        tensors = {name: t.detach().to("cpu", None if name in INTEGER_TENSORS else torch.float32).contiguous()
                   for name, t in self.weights.items()}
        return artifact.write_artifact(directory, self.config.to_dict(), tensors, self.run_report,
                                       binding=self.config.computation_digest())

    def check_models(self, source: ModelInfo, target: ModelInfo, allow_revision_mismatch: bool = False) -> None:
        """Refuse a source/target pair this mapper was not fitted for (see :func:`models.check_matches`)."""
        check_same_tokenizer(source, target)
        check_matches(source, self.config.source, "source", allow_revision_mismatch)
        check_matches(target, self.config.target, "target", allow_revision_mismatch)

    @property
    def max_lag(self) -> int:
        """How many tokens before a chunk its lagged features read (0 for plain maps)."""
        return self.config.max_lag

    # -- hot path ---------------------------------------------------------------------------
    def map(self, keys: list[torch.Tensor], values: list[torch.Tensor], positions: torch.Tensor | None = None,
            past: int = 0, state: torch.Tensor | None = None) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Content-space source KV → content-space target KV.

        ``keys``/``values``: Ls tensors (B, Hs, P+T, Ds), keys with RoPE removed; the first ``past``
        tokens only feed lagged features of the T tokens after them. ``positions`` (B, P+T): each
        token's position (left padding: pads before position 0); lags that reach before position 0
        read zeros. Without ``positions`` column c is position c. Returns Lt tensors (B, Ht, T, Dt)
        each (views of one buffer per kind), in the mapper's dtype; the caller re-applies the target's RoPE
        to keys. ``state`` (B, P+T, Hs): the source's final hidden states, needed exactly when a lever reads
        them (``config.reads_state``).
        """
        self._check_inputs(keys, values, past, state)
        read = self.config.read_layers
        kv = kv_features([keys[s] for s in read], [values[s] for s in read], dtype=self.dtype, device=self.device)
        mapped = self.map_features(kv, positions, past, None if state is None else state.transpose(0, 1))
        return self.layer_views("key", mapped["key"]), self.layer_views("value", mapped["value"])

    def _check_inputs(self, keys, values, past: int, state=None) -> None:
        """The source's per-layer K/V as ``map`` needs them, or one InputError that says what differs."""
        from ..errors import InputError

        s = self.config.source
        want = (s.num_kv_heads, s.head_dim)
        for name, layers in (("keys", keys), ("values", values)):
            if not isinstance(layers, (list, tuple)) or len(layers) != s.num_layers:
                raise InputError(f"{name} must be a list of the source's {s.num_layers} layers, not "
                                 f"{type(layers).__name__} of {len(layers) if hasattr(layers, '__len__') else '?'}.")
            for t in layers:
                if not isinstance(t, torch.Tensor) or t.dim() != 4 or (t.shape[1], t.shape[3]) != want \
                        or t.shape[:3] != layers[0].shape[:3] or not t.is_floating_point():
                    raise InputError(f"{name} must be float tensors (B, {want[0]}, T, {want[1]}) of one shape, one "
                                     f"per source layer; got {getattr(t, 'shape', type(t).__name__)}.")
        if keys[0].shape != values[0].shape or not 0 <= past < keys[0].shape[2]:
            raise InputError(f"keys {tuple(keys[0].shape)} and values {tuple(values[0].shape)} must match, and past "
                             f"({past}) must leave at least one token to map.")
        width = self.config.state_width
        if width and state is None:
            raise InputError("this mapper reads the source's final hidden states (a lever with input 'state'): pass "
                             "state=… (B, T, hidden) from the source's prefill; a cache alone is not enough.")
        b, _, t, _ = keys[0].shape
        if width and (not isinstance(state, torch.Tensor) or tuple(state.shape) != (b, t, width)
                      or not state.is_floating_point()):
            raise InputError(f"state must be a float tensor (B, T, hidden) = ({b}, {t}, {width}), the source's final "
                             f"hidden states; got {getattr(state, 'shape', type(state).__name__)}.")

    @torch.no_grad()
    def map_features(self, kv: torch.Tensor, positions: torch.Tensor | None = None, past: int = 0,
                     state: torch.Tensor | None = None, out: dict[str, torch.Tensor] | None = None
                     ) -> dict[str, torch.Tensor]:
        """The map proper: ``kv`` (P+T, B, 2, R, Hs, Ds) from :func:`kv_features` over the R source layers the maps
        read (:attr:`MapperConfig.read_layers`, in order), in the mapper's dtype and device → per kind a buffer
        (T, B, Lt, Ht, Dt), target layers in :attr:`slots` order.

        ``state`` (P+T, B, Hs) token-major; ``positions`` and ``past`` as in :meth:`map`. ``out``: buffers of
        that shape, dtype and device to fill (the rows of a cache being built), else new ones. Each GEMM
        writes its target layers' columns of the buffer directly: nothing is copied after it.
        """
        total, batch = kv.shape[:2]
        t_cfg = self.config.target
        shape = (total - past, batch, t_cfg.num_layers, t_cfg.num_kv_heads, t_cfg.head_dim)
        out = out or {kind: torch.empty(shape, dtype=self.dtype, device=self.device) for kind in KINDS}
        state = state.to(self.dtype) if state is not None and self.config.reads_state else None
        for kind in KINDS:
            self._map_kind(kind, kv, state, positions, past, out[kind].view(-1, math.prod(shape[2:])))
        return out

    def _map_kind(self, kind: str, kv: torch.Tensor, state, positions, past: int, out: torch.Tensor) -> None:
        """Every GEMM group of ``kind``: x @ W + b (+ the residual MLP) into its columns of ``out`` (T·B, Lt·Ft)."""
        ft = self.config.target.kv_features
        shared: dict = {}  # head-blocked layers' block-major features, built once per selection
        for g in self.groups[kind]:
            if g.ups is not None:  # factored: z = x @ [down_1 … down_n], then each layer's z_i @ up_i + b_i
                z = features_matmul(g.bias, kv, state, g.features, g.sources, positions, past, g.weight)
                col = 0
                for i, (up, bias) in enumerate(zip(g.ups, g.biases)):
                    y = out[:, (g.slot + i) * ft : (g.slot + i + 1) * ft]
                    y.copy_(bias)
                    y.addmm_(z[:, col : col + up.shape[0]], up)
                    col += up.shape[0]
                continue
            if g.blocks > 1:
                head_blocked_matmul(g, kv, positions, past, out[:, g.slot * ft : (g.slot + 1) * ft], shared)
                continue
            y = out[:, g.slot * ft : (g.slot + len(g.targets)) * ft]
            features_matmul(g.bias, kv, state, g.features, g.sources, positions, past, g.weight, out=y)
            if g.mlp is not None:  # residual MLP in its own dtype (float32), (T·B, Ft)
                w1, b1, w2, b2 = g.mlp
                h = features_matmul(b1, kv, state, g.features, g.sources, positions, past, w1)
                if y.dtype == w2.dtype:  # accumulate in place: no (T·B, Ft) temporary
                    y.addmm_(F.gelu(h, approximate="none"), w2).add_(b2)
                else:
                    y += torch.addmm(b2, F.gelu(h), w2).to(y.dtype)

    def layer_views(self, kind: str, mapped: torch.Tensor) -> list[torch.Tensor]:
        """Per target layer, its (B, Ht, T, Dt) view of a buffer (T, B, Lt, Ht, Dt) from :meth:`map_features`."""
        return [mapped[:, :, slot].permute(1, 2, 0, 3) for slot in self.slots[kind]]


def require_verified(folder: str | Path, nothing_was: str) -> Path:
    """The mapper folder ``folder``, refused unless it is a folder that :func:`check_mapper` passes
    (``nothing_was``: what the caller did not do, e.g. "written", for the message)."""
    from ..errors import InputError

    folder = Path(folder)
    if not folder.is_dir():
        raise InputError(f"{folder} is not a folder; give a mapper folder (kvbridge fit --out).")
    problems = check_mapper(folder)
    if problems:
        raise ArtifactError(f"{folder} does not verify ({'; '.join(problems[:3])}); nothing was {nothing_was}. "
                            "Refit or re-download the mapper first.")
    return folder


def check_mapper(directory: str | Path) -> list[str]:
    """Every problem ``kvbridge verify`` reports: files and checksums, then mapper.json, then tensor names,
    shapes and dtypes from the header, then NaN/Inf read one tensor at a time."""
    problems = artifact.verify_artifact(directory)
    if problems:
        return problems
    try:
        config = read_config(directory)
    except ArtifactError as exc:
        return [str(exc)]
    problems = artifact.header_problems(directory, config.weight_shapes(), config.tensor_dtypes(),
                                        config.computation_digest())
    if problems:
        return problems
    floats = [name for name, code in config.tensor_dtypes().items() if code != "I64"]
    try:
        return [f"tensor {name} holds NaN or Inf" for name in artifact.nonfinite_tensors(directory, floats)]
    except ArtifactError as exc:
        return [str(exc)]
