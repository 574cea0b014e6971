"""Content space: remove and re-apply rotary position embeddings (RoPE) on cached keys.

Cached keys carry RoPE; a linear map between two models is only meaningful on the *content* keys
(RoPE removed), because the two models rotate with different frequencies. We never re-derive a RoPE
formula: the cos/sin come from the model's own rotary module at the given positions, which already
includes any scaling (linear, dynamic, llama3, YaRN's attention factor).

Letters: B batch, H kv heads, T tokens, D head dim.

Half-split layout (Llama, Mistral, Ministral3, Qwen2, Qwen3):
    rotated = k * cos + rotate_half(k) * sin
    k       = (rotated * cos - rotate_half(rotated) * sin) / (cos**2 + sin**2)
The inverse holds because cos/sin repeat across the two halves, so they commute with rotate_half,
and rotate_half∘rotate_half = -1. ``cos**2 + sin**2`` equals the squared attention scaling (1.0 for
plain RoPE, YaRN's mscale² otherwise).
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from typing import Any

import torch

from ..errors import UnsupportedModelError

# Architectures whose attention rotates full keys with the half-split `rotate_half` layout.
SUPPORTED_MODEL_TYPES = ("llama", "mistral", "ministral", "ministral3", "qwen2", "qwen3")
# RoPE types whose cos/sin are a pure function of position (given the sequence length for "dynamic").
SUPPORTED_ROPE_TYPES = ("default", "linear", "dynamic", "llama3", "yarn")
# RoPE types whose cos/sin depend on position alone: one table over positions 0 … L−1 serves every call (a
# "dynamic" module rescales with the longest sequence it has seen)
TABLE_ROPE_TYPES = ("default", "linear", "llama3", "yarn")
# rotary module → (its inv_freq, that tensor's version, (rotation, removal) factors at positions 0 … L−1)
_TABLES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


@dataclass(frozen=True)
class RopeSpec:
    """What a model's RoPE is, as recorded in ``mapper.json`` and compared on load."""

    model_type: str
    rope_type: str
    head_dim: int
    parameters: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {
            "model_type": self.model_type,
            "rope_type": self.rope_type,
            "head_dim": self.head_dim,
            "parameters": dict(self.parameters),
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> RopeSpec:
        return cls(
            model_type=str(data["model_type"]),
            rope_type=str(data["rope_type"]),
            head_dim=int(data["head_dim"]),
            parameters=dict(data.get("parameters", {})),
        )


def _rope_parameters(config) -> dict[str, Any]:
    params = getattr(config, "rope_parameters", None) or {}
    if not isinstance(params, dict):  # per-layer-type RoPE (e.g. Gemma) is a dict of dicts
        params = dict(params)
    return {k: v for k, v in params.items() if isinstance(v, (int, float, str, bool)) or v is None}


def rope_spec(model) -> RopeSpec:
    """Describe ``model``'s RoPE and refuse layouts that cannot be un-rotated exactly."""
    config = model.config
    model_type = getattr(config, "model_type", "?")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise UnsupportedModelError(
            f"model type {model_type!r} is not supported: kvbridge maps keys exactly only for the "
            f"half-split RoPE layout of {', '.join(SUPPORTED_MODEL_TYPES)}. Other layouts (interleaved, "
            "partial rotary, multi-head latent attention) would be mapped wrongly without an error."
        )
    params = _rope_parameters(config)
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise UnsupportedModelError(
            f"RoPE type {rope_type!r} of this {model_type} model is not supported "
            f"(supported: {', '.join(SUPPORTED_ROPE_TYPES)})."
        )
    partial = float(params.get("partial_rotary_factor", getattr(config, "partial_rotary_factor", 1.0)) or 1.0)
    if partial != 1.0:
        raise UnsupportedModelError(
            f"partial rotary embeddings (partial_rotary_factor={partial}) are not supported: only keys "
            "rotated over their full head dimension can be mapped exactly."
        )
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    spec = RopeSpec(model_type=model_type, rope_type=rope_type, head_dim=int(head_dim), parameters=params)
    # The layout check is cheap: ask the module itself for two positions.
    cos, _ = rotary_factors(model, torch.arange(2).unsqueeze(0))
    if cos.shape[-1] != spec.head_dim or not torch.equal(cos[..., : head_dim // 2], cos[..., head_dim // 2 :]):
        raise UnsupportedModelError(
            f"the rotary module of this {model_type} model does not produce half-split cos/sin over the "
            f"full head dimension ({tuple(cos.shape)} for head_dim {head_dim}); refusing to map it."
        )
    return spec


def rotary_module(model):
    """The model's single rotary embedding module (``model.model.rotary_emb`` for causal LMs)."""
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else model
    rotary = getattr(decoder, "rotary_emb", None)
    if rotary is None:
        raise UnsupportedModelError(
            f"{type(model).__name__} has no shared rotary module (`rotary_emb`); kvbridge needs the "
            "model's own RoPE to remove it from cached keys."
        )
    return rotary


@torch.no_grad()
def rotary_factors(model, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin of shape (B, T, D) in float32 from the model's own rotary module at ``position_ids``."""
    rotary = rotary_module(model)
    device = next(iter(rotary.buffers()), torch.empty(0)).device
    probe = torch.empty(0, dtype=torch.float32, device=device)  # only sets dtype/device
    cos, sin = rotary(probe, position_ids.to(device))
    return cos.float(), sin.float()


@torch.no_grad()
def rope_factors(model, position_ids: torch.Tensor, inverse: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Factors ``(c, s)`` (B, T, D) of :func:`rotate_` for ``model``'s RoPE at ``position_ids``: its
    rotation (:func:`rotation`), or with ``inverse`` its removal (:func:`unrotation`). Read-only.

    cos/sin once per length on CPU, where the module's transcendental functions cost a few per cent of a
    warm map: when they depend on position alone, the factors are read from :func:`factor_table` (views
    when every row's positions are 0 … T−1). Otherwise, for negative positions, and on an accelerator
    (where the module is cheap and a table lookup would sync), they come from the module at every call.
    """
    from .graphs import capturing

    rotary = rotary_module(model)
    inv = getattr(rotary, "inv_freq", None)
    if getattr(rotary, "rope_type", None) in TABLE_ROPE_TYPES and isinstance(inv, torch.Tensor) \
            and inv.device.type == "cpu" and not capturing():
        position_ids = position_ids.to(inv.device)
        plain = plain_positions(position_ids)
        if plain or int(position_ids.min()) >= 0:
            high = position_ids.shape[1] - 1 if plain else int(position_ids.max())
            factors = factor_table(model, rotary, high)[inverse]  # (L, D) each
            if plain:
                return tuple(f[: position_ids.shape[1]].expand(*position_ids.shape, -1) for f in factors)
            return tuple(f[position_ids] for f in factors)
    return (unrotation if inverse else rotation)(*rotary_factors(model, position_ids))


def factor_table(model, rotary, high: int) -> tuple[tuple[torch.Tensor, torch.Tensor], ...]:
    """``(rotation, removal)`` factors (L, D) at positions 0 … L−1, L > ``high`` a power of two, made from
    the module's own cos/sin once per length and remade only for a longer L or a changed module (its
    inverse frequencies replaced, or modified in place)."""
    inv = rotary.inv_freq
    table = _TABLES.get(rotary)
    if table is None or table[0] is not inv or table[1] != inv._version or table[2][0][0].shape[0] <= high:
        cos, sin = rotary_factors(model, torch.arange(1 << high.bit_length(), device=inv.device)[None])
        table = _TABLES[rotary] = (inv, inv._version, (rotation(cos[0], sin[0]), unrotation(cos[0], sin[0])))
    return table[2]


def plain_positions(position_ids: torch.Tensor) -> bool:
    """Whether every row's positions are its column indices 0 … T−1 (no padding). Always False on an
    accelerator, where the check would sync, and while a graph records: callers then take the general path."""
    from .graphs import capturing

    return position_ids.device.type == "cpu" and not capturing() and torch.equal(
        position_ids, torch.arange(position_ids.shape[1], device=position_ids.device).expand_as(position_ids))


def rotation(cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Factors ``(c, s)`` of the rotation: ``apply_rope(k) = k·c + swap_halves(k)·s`` (:func:`rotate_`)."""
    half = sin.shape[-1] // 2
    return cos, torch.cat((-sin[..., :half], sin[..., half:]), dim=-1)


def unrotation(cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Factors ``(c, s)`` of the inverse rotation: ``remove_rope(k) = k·c + swap_halves(k)·s``, the division
    by ``cos² + sin²`` folded into them (computed once for every layer and head)."""
    half = sin.shape[-1] // 2
    norm = cos * cos + sin * sin
    return cos / norm, torch.cat((sin[..., :half], -sin[..., half:]), dim=-1) / norm


def rotate_(k: torch.Tensor, c: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """``k ← k·c + swap_halves(k)·s`` in place on ``k`` (…, D), factors from :func:`rotation` or
    :func:`unrotation` broadcastable to it (any layout: every layer and head of a buffer at once), equal to
    :func:`apply_rope`'s formula to float32 rounding. The only temporary is half of ``k``."""
    half = k.shape[-1] // 2
    (k1, k2), (c1, c2), (s1, s2) = ((x.narrow(-1, 0, half), x.narrow(-1, half, half)) for x in (k, c, s))
    t = k1 * s2
    k1.mul_(c1).addcmul_(k2, s1)
    k2.mul_(c2).add_(t)
    return k


def _rotated(k: torch.Tensor, c: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """:func:`rotate_`'s result as a new float32 tensor (one expression: what a fused kernel computes)."""
    x = k.float()
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat((x1 * c[..., :half] + x2 * s[..., :half], x2 * c[..., half:] + x1 * s[..., half:]), dim=-1)


def _rotate_cast_(dst: torch.Tensor, k: torch.Tensor, c: torch.Tensor, s: torch.Tensor) -> None:
    dst.copy_(_rotated(k, c, s))


_FUSED: dict[str, Any] = {"enabled": None, "kernel": None, "failed": None}


def fuse(enabled: bool | None) -> None:
    """Whether :func:`rotate_cast_` runs as one fused kernel (``torch.compile``): True, False, or None (the
    default: on CUDA devices only; on CPU the eager float32 path is as fast and bit-stable)."""
    _FUSED.update(enabled=enabled, failed=None)


def fused_for(device: torch.device) -> bool:
    enabled = _FUSED["enabled"]
    return (device.type == "cuda" if enabled is None else enabled) and _FUSED["failed"] is None


def fuse_failure() -> str | None:
    """Why the fused kernel was given up for the eager path in this process (None: it was not)."""
    return _FUSED["failed"]


def rotate_cast_(dst: torch.Tensor, k: torch.Tensor, c: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """``dst`` ← ``k`` rotated by factors ``c``, ``s`` (:func:`rotate_`'s formula), computed in float32 and written
    in ``dst``'s dtype; ``k`` may be ``dst`` itself or another layout's view (e.g. a cache's (B, H, T, D) permuted
    token-major). One pass over the data where the fused kernel runs (:func:`fuse`; when ``k`` and ``dst`` share no
    storage); else a float32 copy rotated in place. The two agree to float32 rounding."""
    if fused_for(dst.device) and dst.untyped_storage().data_ptr() != k.untyped_storage().data_ptr():
        if _FUSED["kernel"] is None:
            _FUSED["kernel"] = torch.compile(_rotate_cast_, dynamic=True, fullgraph=True)
        try:
            _FUSED["kernel"](dst, k, c, s)
            return dst
        except Exception as exc:  # inductor missing a compiler, an unsupported device: the eager path computes it too
            _FUSED["failed"] = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"[:300]
    keys = k if k is dst and dst.dtype == torch.float32 else k.to(dst.device, torch.float32, copy=True)
    rotate_(keys, c, s)
    if keys is not dst:
        dst.copy_(keys)
    return dst


def swap_halves(k: torch.Tensor) -> torch.Tensor:
    half = k.shape[-1] // 2
    return torch.cat((k[..., half:], k[..., :half]), dim=-1)


def apply_rope(k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate content keys ``k`` (B, H, T, D) with cos/sin (B, T, D)."""
    c, s = rotation(cos.unsqueeze(1), sin.unsqueeze(1))  # (B, 1, T, D) broadcast over heads
    return k * c + swap_halves(k) * s


def remove_rope(k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`apply_rope`: content keys from rotated keys (B, H, T, D)."""
    c, s = unrotation(cos.unsqueeze(1), sin.unsqueeze(1))
    return k * c + swap_halves(k) * s


def query_scale(model, position_ids: torch.Tensor) -> torch.Tensor | None:
    """Position-dependent query scaling some models apply after RoPE (Ministral3's llama-4 scaling).

    Returns (B, 1, T, 1) or ``None`` when the model does not scale queries. Keys are never scaled,
    so mapping ignores this; attention diagnostics must apply it to queries.
    """
    params = getattr(model.config, "rope_parameters", None) or {}
    beta = params.get("llama_4_scaling_beta") if isinstance(params, dict) else None
    if getattr(model.config, "model_type", "") != "ministral3" or beta is None:
        return None
    original = params["original_max_position_embeddings"]
    scale = 1 + beta * torch.log1p(torch.floor(position_ids.float() / original))
    return scale[:, None, :, None]
