"""The map itself: content-space source KV → content-space target KV. Hot path only.

Letters: B batch, T tokens, Ls/Lt source/target layers, H kv heads, D head dim, F features of one
layer (H·D, heads concatenated head-major: feature ``h*D + d``), S selected source layers.

For every target layer ``l`` and for keys and values separately::

    x_l = concat(content KV of source layers S_l)          # (B, T, |S_l|·Fs)
    y_l = x_l @ W_l + b_l                                   # (B, T, Ft)

Target layers that select the same source layers share one GEMM: their weights are concatenated
along the output dimension once, when the mapper is built, so the seed's top_k = all-layers mapper
is a single ``addmm`` per K and V. Nothing in :meth:`Mapper.map` touches files, logs or syncs.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from .errors import ArtifactError
from .models import ModelInfo, check_matches, check_same_tokenizer

KINDS = ("key", "value")


@dataclass(frozen=True)
class MapperConfig:
    """Everything ``mapper.json`` says about a mapper, validated on construction."""

    source: ModelInfo
    target: ModelInfo
    selection: dict[str, tuple[tuple[int, ...], ...]]  # kind -> per target layer, sorted source layers
    fit: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self):
        for kind in KINDS:
            layers = self.selection.get(kind)
            if layers is None or len(layers) != self.target.num_layers:
                raise ArtifactError(
                    f"mapper selection for {kind}s must list {self.target.num_layers} target layers, "
                    f"got {None if layers is None else len(layers)}."
                )
            for chosen in layers:
                if not chosen or any(not 0 <= s < self.source.num_layers for s in chosen) or list(chosen) != sorted(set(chosen)):
                    raise ArtifactError(
                        f"mapper selection {list(chosen)} is not a sorted, non-empty set of source layers "
                        f"in [0, {self.source.num_layers})."
                    )

    def weight_shapes(self) -> dict[str, tuple[int, ...]]:
        """Name → shape of every tensor the artifact must contain."""
        fs, ft = self.source.kv_features, self.target.kv_features
        shapes = {}
        for kind in KINDS:
            for layer, chosen in enumerate(self.selection[kind]):
                shapes[f"{kind}.{layer}.weight"] = (len(chosen) * fs, ft)
                shapes[f"{kind}.{layer}.bias"] = (ft,)
        return shapes

    def num_parameters(self) -> int:
        return sum(int(torch.Size(s).numel()) for s in self.weight_shapes().values())


@dataclass(frozen=True)
class _Group:
    """Target layers sharing one source selection, mapped by one GEMM."""

    sources: torch.Tensor | None  # (S,) source layer ids, None = all source layers in order
    targets: tuple[int, ...]
    weight: torch.Tensor  # (S·Fs, n·Ft)
    bias: torch.Tensor  # (n·Ft,)


def layer_features(layers: list[torch.Tensor], dtype: torch.dtype | None = None) -> torch.Tensor:
    """Ls × (B, H, T, D) → (B, T, Ls, H·D): every token's features per layer, heads head-major.

    The one definition of the feature layout, shared by the fit's statistics and the runtime map.
    """
    x = torch.stack([t.to(dtype) if dtype is not None else t for t in layers], dim=2)  # (B, H, Ls, T, D)
    return x.permute(0, 3, 2, 1, 4).flatten(3)  # (B, T, Ls, H·D)


class Mapper:
    """A fitted cross-model KV mapper. Build with :meth:`from_pretrained` or :func:`kvbridge.fit.fit_mapper`."""

    def __init__(self, config: MapperConfig, weights: dict[str, torch.Tensor]):
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
            if not weights[name].is_floating_point():
                raise ArtifactError(f"mapper tensor {name} has dtype {weights[name].dtype}, expected a float type.")
        self.config = config
        self.weights = weights
        self._groups = {kind: self._build_groups(kind) for kind in KINDS}

    # -- construction -----------------------------------------------------------------------
    def _build_groups(self, kind: str) -> list[_Group]:
        by_selection: dict[tuple[int, ...], list[int]] = {}
        for layer, chosen in enumerate(self.config.selection[kind]):
            by_selection.setdefault(tuple(chosen), []).append(layer)
        groups = []
        all_layers = tuple(range(self.config.source.num_layers))
        for chosen, targets in by_selection.items():
            w = [self.weights[f"{kind}.{l}.weight"] for l in targets]
            b = [self.weights[f"{kind}.{l}.bias"] for l in targets]
            weight = w[0] if len(w) == 1 else torch.cat(w, dim=1)
            bias = b[0] if len(b) == 1 else torch.cat(b, dim=0)
            sources = None if chosen == all_layers else torch.tensor(chosen, device=weight.device)
            groups.append(_Group(sources=sources, targets=tuple(targets), weight=weight.contiguous(), bias=bias))
        return groups

    @property
    def dtype(self) -> torch.dtype:
        return next(iter(self.weights.values())).dtype

    @property
    def device(self) -> torch.device:
        return next(iter(self.weights.values())).device

    def to(self, device: str | torch.device | None = None, dtype: torch.dtype | None = None) -> "Mapper":
        """A copy on ``device`` in ``dtype`` (e.g. bfloat16 for runtime)."""
        moved = {name: t.to(device=device, dtype=dtype) for name, t in self.weights.items()}
        return Mapper(self.config, moved)

    @classmethod
    def identity(cls, info: ModelInfo) -> "Mapper":
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
    ) -> "Mapper":
        """Load a mapper folder or hub repo; checksums and shapes are verified before any tensor is used."""
        from .artifact import load_mapper

        return load_mapper(path_or_repo_id, revision=revision, device=device, dtype=dtype, verify=verify)

    def save_pretrained(self, directory: str) -> None:
        """Write ``mapper.safetensors`` (float32), ``mapper.json`` and ``checksums.sha256`` atomically."""
        from .artifact import save_mapper

        save_mapper(self, directory)

    def check_models(self, source: ModelInfo, target: ModelInfo, allow_revision_mismatch: bool = False) -> None:
        """Refuse a source/target pair this mapper was not fitted for (see :func:`models.check_matches`)."""
        check_same_tokenizer(source, target)
        check_matches(source, self.config.source, "source", allow_revision_mismatch)
        check_matches(target, self.config.target, "target", allow_revision_mismatch)

    # -- hot path ---------------------------------------------------------------------------
    def map(self, keys: list[torch.Tensor], values: list[torch.Tensor]) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Content-space source KV → content-space target KV.

        ``keys``/``values``: Ls tensors (B, Hs, T, Ds), keys with RoPE removed. Returns Lt tensors
        (B, Ht, T, Dt) each, in the mapper's dtype; the caller re-applies the target's RoPE to keys.
        """
        return self._map_kind("key", keys), self._map_kind("value", values)

    def _map_kind(self, kind: str, layers: list[torch.Tensor]) -> list[torch.Tensor]:
        batch, _, tokens, _ = layers[0].shape
        ht, dt = self.config.target.num_kv_heads, self.config.target.head_dim
        x = layer_features(layers, self.dtype).flatten(0, 1)  # (B·T, Ls, Fs)
        out: list[torch.Tensor | None] = [None] * self.config.target.num_layers
        for group in self._groups[kind]:
            xs = x if group.sources is None else x.index_select(1, group.sources)  # (B·T, S, Fs)
            y = torch.addmm(group.bias, xs.reshape(batch * tokens, -1), group.weight)  # (B·T, n·Ft)
            y = y.view(batch, tokens, len(group.targets), ht, dt)  # (B, T, n, Ht, Dt)
            for i, layer in enumerate(group.targets):
                out[layer] = y[:, :, i].transpose(1, 2)  # (B, Ht, T, Dt)
        return out  # type: ignore[return-value]
