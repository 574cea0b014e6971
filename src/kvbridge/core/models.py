"""Loading model pairs: text-only decoders, identity and geometry. The only module that knows
transformers' loading internals.

Ministral-3 checkpoints are multimodal (``Mistral3ForConditionalGeneration``). Loading them with a
text-only class "succeeds" with every weight left random, so we load the text config, map the
language-model weight names onto the causal-LM names, skip the vision tower, and fail loudly if any
decoder weight is missing.

Why one module of ~650 lines: it is the only place that touches transformers' internals (loading, cache classes
and their keyword, the decoder layers' signatures, rotary embeddings' call, logit transforms), so that a transformers
upgrade is checked and fixed in one file; loading sits above, the forward internals (caches, prefill, single
layers) below.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
from dataclasses import asdict, dataclass
from typing import Any

import torch

from ..errors import CompatibilityError, InputError, ModelLoadError, UnsupportedModelError
from .hashing import sha256_bytes, sha256_json
from .hub import is_hub_id, snapshot
from .rope import RopeSpec, rope_spec

# Weight files a causal LM needs; Mistral repos also ship `consolidated.safetensors` (same weights,
# another layout) which we must not download twice.
MODEL_FILES = [
    "config.json",
    "generation_config.json",
    "model*.safetensors",
    "model.safetensors.index.json",
    "tokenizer*",
    "special_tokens_map.json",
    "chat_template*",
]

# Multimodal wrappers store the decoder under these prefixes.
_TEXT_KEY_MAPPING = {
    r"^language_model\.model\.": "model.",
    r"^language_model\.lm_head\.": "lm_head.",
    r"^model\.language_model\.": "model.",
}


@dataclass(frozen=True)
class ModelInfo:
    """Identity and KV geometry of a loaded model, as recorded in and checked against ``mapper.json``."""

    name_or_path: str
    revision: str | None
    architecture: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    max_positions: int
    rope: RopeSpec
    tokenizer_sha256: str
    # sampled bytes of the checkpoint's weights (see weights_fingerprint); None: not safetensors, or
    # a mapper written before it was recorded
    weights_sha256: str | None = None

    @property
    def kv_features(self) -> int:
        """Features of one layer's keys (or values): all KV heads concatenated, H·D."""
        return self.num_kv_heads * self.head_dim

    @property
    def geometry(self) -> tuple[int, int, int]:
        return (self.num_layers, self.num_kv_heads, self.head_dim)

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["rope"] = self.rope.to_dict()
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ModelInfo:
        fields = {k: data[k] for k in cls.__dataclass_fields__ if k in data}
        fields["rope"] = RopeSpec.from_dict(data["rope"])
        return cls(**fields)


@dataclass
class LoadedModel:
    model: Any
    tokenizer: Any
    info: ModelInfo

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device


def check_device(device: str | torch.device | None, flag: str = "--device") -> torch.device:
    """A torch device that exists on this machine, or a ModelLoadError that says which ones do."""
    try:
        dev = torch.device(device if device is not None else "cpu")
    except (RuntimeError, TypeError, ValueError):
        raise ModelLoadError(f"{flag} {device!r} is not a device; use cpu, cuda, cuda:N or mps.") from None
    available = {"cpu": True, "cuda": torch.cuda.is_available(),
                 "mps": getattr(torch.backends, "mps", None) is not None and torch.backends.mps.is_available(),
                 "xpu": hasattr(torch, "xpu") and torch.xpu.is_available()}
    if dev.type not in available:
        raise ModelLoadError(f"{flag} {device}: kvbridge runs on cpu, cuda, mps or xpu devices, not {dev.type}.")
    if not available[dev.type]:
        raise ModelLoadError(f"{flag} {device}: no {dev.type} device is available on this machine (torch "
                             f"{torch.__version__}); use {flag} cpu, or install a torch build for it.")
    if dev.type == "cuda" and dev.index is not None and dev.index >= torch.cuda.device_count():
        raise ModelLoadError(f"{flag} {device}: this machine has {torch.cuda.device_count()} CUDA device(s).")
    return dev


def default_dtype(device_type: str) -> torch.dtype:
    """What ``auto`` means: bfloat16 on accelerators, float32 on CPU."""
    return torch.float32 if device_type == "cpu" else torch.bfloat16


def resolve_dtype(dtype: str | torch.dtype | None, device: str | torch.device) -> torch.dtype:
    """``auto``/None: bfloat16 on accelerators, float32 on CPU."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype in (None, "auto"):
        return default_dtype(check_device(device).type)
    names = {"float32": torch.float32, "fp32": torch.float32, "float16": torch.float16, "fp16": torch.float16,
             "bfloat16": torch.bfloat16, "bf16": torch.bfloat16, "float64": torch.float64}
    if dtype not in names:
        raise ModelLoadError(f"unknown dtype {dtype!r}; use one of auto, {', '.join(names)}.")
    return names[dtype]


def tokenizer_fingerprint(tokenizer) -> str:
    """SHA-256 of everything that decides how text becomes ids (model, merges, normalizer, specials)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        return sha256_json(json.loads(backend.to_str()))
    return sha256_json({"vocab": sorted(tokenizer.get_vocab().items()), "special": tokenizer.all_special_ids})


FINGERPRINT_ELEMENTS = 1024  # per tensor, at its start, middle and end


def weights_fingerprint(local_dir) -> str | None:
    """SHA-256 of a checkpoint's tensors as stored: every tensor's name, dtype and shape and the bytes of
    up to 1,024 elements at its start, middle and end, read through safetensors' lazy slices.

    Cheap (a few MB read for an 8B checkpoint, whatever dtype or device the model is loaded in) and
    independent of how the tensors are sharded; re-initialized or fine-tuned weights of the same
    architecture change it. ``None`` when the folder holds no ``model*.safetensors``.
    """
    from pathlib import Path

    from safetensors import SafetensorError, safe_open

    index = Path(local_dir) / "model.safetensors.index.json"
    try:  # a sharded checkpoint: exactly the shards its index names (a stray file is not the model)
        files = sorted({Path(local_dir) / f for f in json.loads(index.read_text())["weight_map"].values()})
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        files = sorted(Path(local_dir).glob("model*.safetensors"))
    if not files:
        return None
    entries = []
    try:
        for path in files:
            with safe_open(str(path), framework="pt") as handle:
                for name in handle.keys():
                    view = handle.get_slice(name)
                    shape = list(view.get_shape())
                    e = FINGERPRINT_ELEMENTS
                    if not shape or not shape[0]:
                        picks = [handle.get_tensor(name)]
                    elif len(shape) == 1:
                        picks = [view[i : i + e] for i in (0, shape[0] // 2, max(0, shape[0] - e))]
                    else:  # one row each: a slice reads only what it returns
                        picks = [view[i : i + 1] for i in (0, shape[0] // 2, shape[0] - 1)]
                    data = b"".join(t.reshape(-1)[:e].contiguous().view(torch.uint8).numpy().tobytes() for t in picks)
                    entries.append((name, view.get_dtype(), shape, data))
    except (SafetensorError, OSError, RuntimeError) as exc:
        raise ModelLoadError(f"cannot read the weights in {local_dir} ({exc}); the checkpoint is incomplete or "
                             "corrupted.") from None
    return sha256_bytes(json.dumps([name, dtype, shape]).encode() + b"\0" + data
                        for name, dtype, shape, data in sorted(entries, key=lambda entry: entry[0]))


@contextlib.contextmanager
def _quiet_transformers():
    from transformers.utils import logging as hf_logging

    level = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        hf_logging.set_verbosity(level)
        hf_logging.enable_progress_bar()


def resolve_model(id_or_path: str, revision: str | None) -> str:
    """A model folder for a folder or a hub id (downloaded once, or read from the hub cache)."""
    from .hub import snapshot

    return str(snapshot(id_or_path, revision, MODEL_FILES, ModelLoadError, "model")[0])


def text_config(local_dir):
    """The decoder config; for a multimodal repo, its text part plus whether names need mapping."""
    from transformers import AutoConfig

    try:
        config = AutoConfig.from_pretrained(local_dir)
    except (OSError, ValueError, KeyError) as exc:
        raise ModelLoadError(f"cannot read the model config in {local_dir}: {exc}") from None
    text = config.get_text_config(decoder=True)
    if text is config:
        return config, False
    # Tying is decided by the top-level config of a multimodal repo (Ministral-3 3B ties, 8B does not).
    text.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", text.tie_word_embeddings))
    return text, True


def load_model(
    id_or_path: str,
    revision: str | None = None,
    device: str | torch.device = "cpu",
    dtype: str | torch.dtype | None = None,
) -> LoadedModel:
    """Load a text-only causal LM and its tokenizer from a folder or a hub id (pinned revision)."""
    from transformers import AutoModelForCausalLM

    check_device(device)
    local_dir, commit = snapshot(id_or_path, revision, MODEL_FILES, ModelLoadError, "model")
    config, multimodal = text_config(local_dir)
    torch_dtype = resolve_dtype(dtype, device)
    kwargs: dict[str, Any] = {"config": config, "dtype": torch_dtype, "output_loading_info": True}
    if multimodal:
        kwargs["key_mapping"] = _TEXT_KEY_MAPPING
    with _quiet_transformers():
        try:
            model, report = AutoModelForCausalLM.from_pretrained(local_dir, **kwargs)
        except ValueError as exc:
            raise ModelLoadError(f"{id_or_path!r} is not a causal language model "
                                 f"transformers can load: {exc}") from None
        except OSError as exc:
            raise ModelLoadError(f"cannot load weights of {id_or_path!r}: {exc}") from None
    missing = sorted(report.get("missing_keys") or [])
    if missing:
        raise ModelLoadError(
            f"{id_or_path!r} loaded with {len(missing)} decoder weights missing (e.g. {missing[0]!r}); they would "
            "be random. The checkpoint's weight names do not match its architecture: check that the folder "
            "holds the full model, or that the multimodal layout is one kvbridge knows."
        )
    model.eval().to(device)
    return _loaded(model, id_or_path, commit, config, local_dir, type(model).__name__)


def _loaded(model, id_or_path: str, commit: str | None, config, local_dir, architecture: str) -> LoadedModel:
    """``model`` with its tokenizer and :class:`ModelInfo`."""
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(local_dir)
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"cannot load the tokenizer of {id_or_path!r}: {exc}") from None
    info = ModelInfo(
        name_or_path=str(id_or_path),
        revision=commit,
        architecture=architecture,
        num_layers=int(config.num_hidden_layers),
        num_kv_heads=int(getattr(config, "num_key_value_heads", None) or config.num_attention_heads),
        head_dim=int(getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads),
        max_positions=int(getattr(config, "max_position_embeddings", 0) or 0),
        rope=rope_spec(model),
        tokenizer_sha256=tokenizer_fingerprint(tokenizer),
        weights_sha256=weights_fingerprint(local_dir),
    )
    return LoadedModel(model=model, tokenizer=tokenizer, info=info)


class RopeOnly(torch.nn.Module):
    """A causal LM's config and rotary module without its weights: all that mapping needs of a model whose cache
    it only un-rotates or rotates (:func:`load_rope_model`). ``model.rotary_emb`` as in transformers' causal LMs;
    an empty parameter tells the device and dtype the map writes in."""

    def __init__(self, config, rotary: torch.nn.Module, device, dtype: torch.dtype):
        super().__init__()
        self.config = config
        self.model = torch.nn.Module()
        self.model.rotary_emb = rotary
        self.anchor = torch.nn.Parameter(torch.empty(0, device=device, dtype=dtype), requires_grad=False)

    def get_decoder(self):
        return self.model


def load_rope_model(id_or_path: str, revision: str | None = None, device: str | torch.device = "cpu",
                    dtype: str | torch.dtype | None = None) -> LoadedModel:
    """A checkpoint's config, rotary module, tokenizer and identity, without loading its weights (a few MB read
    for the fingerprint): what a process that maps K/V but never runs the model needs of it (the source engine's
    map-ahead). The rotary module is the architecture's own class, built from the config as the model builds it."""
    from transformers import AutoModelForCausalLM

    check_device(device)
    local_dir, commit = snapshot(id_or_path, revision, MODEL_FILES, ModelLoadError, "model")
    config, _ = text_config(local_dir)
    with _quiet_transformers(), torch.device("meta"):
        try:
            skeleton = AutoModelForCausalLM.from_config(config)
        except ValueError as exc:
            raise ModelLoadError(f"{id_or_path!r} is not a causal language model transformers can build: "
                                 f"{exc}") from None
    from .rope import rotary_module

    rotary = type(rotary_module(skeleton))(config).to(device)  # (meta buffers are not moved: build it anew)
    model = RopeOnly(config, rotary, device, resolve_dtype(dtype, device)).eval()
    return _loaded(model, id_or_path, commit, config, local_dir, type(skeleton).__name__)


def position_limit(*positions: int | None) -> int:
    """The positions every model supports: the smallest known limit among ``positions`` (0 or None: none known),
    2**62 when none is known."""
    return min([p for p in positions if p] + [1 << 62])


def check_same_tokenizer(source: ModelInfo, target: ModelInfo) -> None:
    if source.tokenizer_sha256 != target.tokenizer_sha256:
        raise CompatibilityError(
            f"the tokenizers of {source.name_or_path!r} and {target.name_or_path!r} differ "
            f"({source.tokenizer_sha256[:12]} vs {target.tokenizer_sha256[:12]}): a KV cache can only be "
            "transferred between models that read the same token ids. Pick two models of one family."
        )


def check_matches(loaded: ModelInfo, recorded: ModelInfo, role: str, allow_revision_mismatch: bool = False) -> None:
    """Refuse a loaded model that is not the one a mapper was fitted for.

    Geometry, RoPE and tokenizer must match, always. The revision (and, for hub ids, the repo id)
    must match unless ``allow_revision_mismatch``: then the caller accepts that the weights may differ.
    """
    if loaded.geometry != recorded.geometry:
        raise CompatibilityError(
            f"{role} model {loaded.name_or_path!r} has KV geometry (layers, kv heads, head dim) = {loaded.geometry} "
            f"but the mapper was fitted for {recorded.geometry} ({recorded.name_or_path!r}). A mapper cannot be "
            "applied to another geometry: use the matching model or fit a new mapper."
        )
    if loaded.rope.to_dict() != recorded.rope.to_dict():
        raise CompatibilityError(
            f"{role} model {loaded.name_or_path!r} uses RoPE {loaded.rope.to_dict()} but the mapper recorded "
            f"{recorded.rope.to_dict()}. Use the model the mapper was fitted for, or refit."
        )
    if loaded.tokenizer_sha256 != recorded.tokenizer_sha256:
        raise CompatibilityError(
            f"{role} model {loaded.name_or_path!r} has a different tokenizer than the one the mapper was fitted "
            "with. Use the matching model, or refit."
        )
    if allow_revision_mismatch:
        return
    problems = []
    if recorded.revision and loaded.revision != recorded.revision:
        problems.append(f"revision {loaded.revision or 'unknown (local folder)'} != recorded {recorded.revision}")
    if (is_hub_id(loaded.name_or_path) and is_hub_id(recorded.name_or_path)
            and loaded.name_or_path != recorded.name_or_path):
        problems.append(f"repo {loaded.name_or_path!r} != recorded {recorded.name_or_path!r}")
    if recorded.weights_sha256 and loaded.weights_sha256 and loaded.weights_sha256 != recorded.weights_sha256:
        problems.append(f"its weights differ from the ones the mapper was fitted on (fingerprint "
                        f"{loaded.weights_sha256[:12]} != recorded {recorded.weights_sha256[:12]}: re-initialized, "
                        "fine-tuned or another checkpoint)")
    if problems:
        raise CompatibilityError(
            f"{role} model is not the checkpoint the mapper was fitted for: {'; '.join(problems)}. Load the "
            "recorded checkpoint, or pass --allow-revision-mismatch (allow_revision_mismatch=True) to accept "
            "possibly lower quality."
        )


# -- running models: prefill and caches (transformers' cache layout is known only here) ------------
def positions_from_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """Position ids of a left-padded batch, as ``generate`` computes them (pads get 0)."""
    return (attention_mask.long().cumsum(-1) - 1).masked_fill(attention_mask == 0, 0)


@functools.cache
def cache_keyword() -> str:
    """The keyword transformers' models and ``generate`` take a cache by, and the output field that returns it:
    ``cache`` in recent releases, ``past_key_values`` before (e.g. 5.17). Decided once, here only."""
    from transformers.modeling_outputs import BaseModelOutputWithPast

    return "cache" if "cache" in {f.name for f in dataclasses.fields(BaseModelOutputWithPast)} else "past_key_values"


def with_cache(cache) -> dict[str, Any]:
    """``model(**with_cache(c), ...)``: pass a cache whatever this transformers calls the keyword."""
    return {cache_keyword(): cache}


def cache_of(output):
    """The cache a model's forward returned (``output.cache`` or ``output.past_key_values``)."""
    return getattr(output, cache_keyword())


class _CacheComplete(Exception):
    """Raised by :func:`cache_only` once the last decoder layer has stored its keys and values."""


def cache_only(decoder, kwargs: dict[str, Any], cache=None, depth: int | None = None):
    """The cache of ``decoder(**kwargs)`` without the work that only feeds its hidden states.

    The last layer's keys and values are projections of that layer's input; its attention, MLP and the final
    norm serve the output only. The forward is stopped right after the last layer stores its K/V in the cache —
    the model's own code computes every stored value, so the cache equals the full forward's bit for bit (a
    test pins it) — which saves most of one layer of the model's L (nearly half of a 2-layer source, a 26th of
    Ministral 3 3B).
    ``depth``: stop after layer ``depth - 1`` instead (the cache then holds the first ``depth`` layers: a map that
    reads no deeper source layer, or a target computing its own lower layers, needs no more).
    A model whose attention does not store through ``cache.update``, or whose decoder has no ``layers``, simply
    runs to the end.
    """
    from transformers import DynamicCache

    if cache is None:
        cache = DynamicCache(config=decoder.config)
    kwargs = {**kwargs, **with_cache(cache)}
    if not hasattr(decoder, "layers"):  # not a stack kvbridge knows: the whole forward
        return cache_of(decoder(**kwargs))
    layers = len(decoder.layers)
    if depth is not None and not 1 <= depth <= layers:
        raise InputError(f"depth {depth}: the model has {layers} decoder layers; pass 1 to {layers}.")
    last, update, own = (layers if depth is None else depth) - 1, cache.update, vars(cache).get("update")

    def stop_after_last(key_states, value_states, layer_idx, *args, **kw):
        out = update(key_states, value_states, layer_idx, *args, **kw)
        if layer_idx == last:
            raise _CacheComplete
        return out

    cache.update = stop_after_last
    try:
        return cache_of(decoder(**kwargs))  # the stop never came: the forward's own cache
    except _CacheComplete:
        return cache
    finally:
        if own is None:
            del cache.update
        else:
            cache.update = own


@torch.no_grad()
def prefill(model, input_ids: torch.Tensor, attention_mask: torch.Tensor, position_ids: torch.Tensor | None = None,
            logits: str = "all", cache=None, depth: int | None = None):
    """Run ``model`` over a (left-padded) batch; returns ``(cache, logits)``. ``cache``: a cache of earlier
    tokens to continue (``attention_mask`` then covers them too). ``depth`` (with ``logits="none"`` only): the
    first ``depth`` layers' cache (:func:`cache_only`).

    ``logits``: ``"all"`` positions, ``"last"`` (what a serving prefill computes), ``"none"`` (the cache
    only: a source prefill for transfer needs no vocabulary projection, nor the last layer's attention and MLP,
    :func:`cache_only`) or ``"hidden"``
    (decoder only, and its final hidden states (B, T, hidden) in place of the logits).
    """
    from .graphs import assumed_unpadded

    device = next(model.parameters()).device
    if position_ids is None:
        position_ids = positions_from_mask(attention_mask)
    # an unpadded batch needs no mask: transformers would read it on the host to find that out
    mask = None if assumed_unpadded() else attention_mask.to(device)
    kwargs = dict(input_ids=input_ids.to(device), attention_mask=mask, position_ids=position_ids.to(device),
                  use_cache=True)
    if cache is not None:
        kwargs.update(with_cache(cache))
    if depth is not None and logits != "none":
        raise InputError(f"prefill computes the first {depth} layers only for logits='none', not {logits!r}.")
    if logits == "none":
        return cache_only(model.get_decoder(), kwargs, cache, depth), None
    if logits == "hidden":
        out = model.get_decoder()(**kwargs)
        return cache_of(out), out.last_hidden_state
    out = model(**kwargs, logits_to_keep=1 if logits == "last" else 0)
    return cache_of(out), out.logits


def cache_kv(cache) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Per-layer (B, H, T, D) keys (RoPE applied) and values of a transformers cache: its first layers that hold
    any (a prefill stopped early, :func:`cache_only`'s ``depth``, leaves the deeper ones empty)."""
    layers = [layer for layer in cache.layers if layer.keys is not None]
    return [layer.keys for layer in layers], [layer.values for layer in layers]


def make_cache(model, keys: list[torch.Tensor], values: list[torch.Tensor]):
    """A transformers ``DynamicCache`` for ``model`` from per-layer rotated keys and values.

    A plain ``DynamicLayer`` holds the given tensors themselves (views are fine: its first update
    concatenates them into a new tensor anyway); filling it through ``update`` would copy every layer
    once more. Other layer types (sliding windows, …) are filled through ``update``.
    """
    from transformers import DynamicCache
    from transformers.cache_utils import DynamicLayer

    cache = DynamicCache(config=model.config)
    for layer, k, v in zip(cache.layers, keys, values):
        if type(layer) is DynamicLayer:
            layer.lazy_initialization(k, v)  # what its first update does before concatenating
            layer.keys, layer.values = k, v
        else:
            layer.update(k, v)
    return cache


@torch.no_grad()
def content_kv(model, cache, position_ids: torch.Tensor) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Content keys (RoPE removed with ``model``'s rotary module, float32) and values of ``cache``."""
    from .rope import remove_rope, rotary_factors

    keys, values = cache_kv(cache)
    cos, sin = rotary_factors(model, position_ids)
    cos, sin = cos.to(keys[0].device), sin.to(keys[0].device)
    return [remove_rope(k.float(), cos, sin) for k in keys], values


def source_hidden_size(model) -> int:
    """Width of ``model``'s final hidden state (its decoder's output), from its text config."""
    return int(model.config.get_text_config(decoder=True).hidden_size)


# config fields that make a model's logits more than ``lm_head(final hidden state)`` (Gemma's softcapping,
# Cohere's logit_scale, Granite's logits_scaling): none of the supported families has them
LOGIT_TRANSFORMS = ("final_logit_softcapping", "logit_scale", "logits_scaling")


def logits_from_hidden(model, hidden: torch.Tensor) -> torch.Tensor:
    """(B, T, V) logits from the decoder's final hidden states, as the model's own forward computes them."""
    text = model.config.get_text_config(decoder=True)
    odd = [name for name in LOGIT_TRANSFORMS if getattr(text, name, None) not in (None, 1, 1.0)]
    if odd:
        raise UnsupportedModelError(f"{type(model).__name__} transforms its logits ({', '.join(odd)}); the logits "
                                    "cannot be recomputed from its hidden states. Use recompute_by='logit'.")
    return model.get_output_embeddings()(hidden)


@torch.no_grad()
def prefill_content(model, input_ids: torch.Tensor, attention_mask: torch.Tensor, state: bool = False):
    """Prefill (decoder only) and return ``(content keys, values, position_ids)``; Ls × (B, H, T, D).
    With ``state``, a fourth item: the final hidden states (B, T, hidden)."""
    position_ids = positions_from_mask(attention_mask)
    cache, hidden = prefill(model, input_ids, attention_mask, position_ids, logits="hidden" if state else "none")
    return (*content_kv(model, cache, position_ids), position_ids) + ((hidden,) if state else ())


def attention_queries(model, hidden: torch.Tensor, layer: int, cos, sin, positions) -> torch.Tensor:
    """(B, H, T, D) queries of ``layer`` from its input hidden states, exactly as the model forms them."""
    block = model.get_decoder().layers[layer]
    attn = block.self_attn
    x = block.input_layernorm(hidden)
    b, t, _ = x.shape
    q = attn.q_proj(x).view(b, t, -1, attn.head_dim)
    if hasattr(attn, "q_norm"):  # Qwen3 normalises queries per head before RoPE
        q = attn.q_norm(q)
    from .rope import apply_rope, query_scale

    q = apply_rope(q.transpose(1, 2).float(), cos, sin)
    scale = query_scale(model, positions)
    return q if scale is None else q * scale.to(q.device)


@contextlib.contextmanager
def layer_inputs(model, layers):
    """``with layer_inputs(model, layers) as hidden:`` after a forward pass inside the block, ``hidden[j]``
    holds the hidden states (B, T, hidden) that entered decoder layer ``j``, for each ``j`` in ``layers``."""
    blocks = model.get_decoder().layers
    hidden: dict[int, torch.Tensor] = {}

    def keep(j):
        def hook(module, args, kwargs):
            hidden[j] = (args or (kwargs["hidden_states"],))[0]
        return hook

    hooks = [blocks[j].register_forward_pre_hook(keep(j), with_kwargs=True) for j in set(layers)]
    try:
        yield hidden
    finally:
        for h in hooks:
            h.remove()


def decoder_layer(model, layer: int, hidden: torch.Tensor, cos, sin, positions, keys: torch.Tensor | None = None,
                  values: torch.Tensor | None = None) -> torch.Tensor:
    """Hidden states (B, T, hidden) leaving decoder ``layer`` of an unpadded batch, computed by hand with causal
    attention, so that content ``keys`` / ``values`` (B, H, T, D, before RoPE) can replace the layer's own
    and gradients reach them. The formula of Llama-style layers (Mistral, Ministral-3, Qwen3)::

        h = x + o_proj(attention(norm₁(x)));  out = h + mlp(norm₂(h))

    :func:`check_decoder_layers` tells whether a model's layers follow it.
    """
    import torch.nn.functional as F

    from .rope import apply_rope

    block = model.get_decoder().layers[layer]
    attn = block.self_attn
    q = attention_queries(model, hidden, layer, cos, sin, positions)  # (B, H, T, D) float32
    if keys is None or values is None:
        x = block.input_layernorm(hidden)
        shape = (*x.shape[:2], -1, attn.head_dim)
        if keys is None:
            keys = attn.k_proj(x).view(shape)
            keys = (attn.k_norm(keys) if hasattr(attn, "k_norm") else keys).transpose(1, 2)
        if values is None:
            values = attn.v_proj(x).view(shape).transpose(1, 2)
    k = apply_rope(keys.float(), cos, sin)
    groups = q.shape[1] // k.shape[1]
    scale = getattr(attn, "scaling", attn.head_dim ** -0.5)
    o = F.scaled_dot_product_attention(q, k.repeat_interleave(groups, 1), values.float().repeat_interleave(groups, 1),
                                       is_causal=True, scale=scale)
    h = hidden + attn.o_proj(o.transpose(1, 2).flatten(2).to(hidden.dtype))
    return h + block.mlp(block.post_attention_layernorm(h))


def next_token_logprobs(model, hidden: torch.Tensor) -> torch.Tensor:
    """(B, T, V) float32 log-probabilities from the hidden states leaving the last decoder layer (before the
    decoder's final norm)."""
    return torch.log_softmax(logits_from_hidden(model, model.get_decoder().norm(hidden)).float(), -1)


@torch.no_grad()
def check_decoder_layers(model, ids: torch.Tensor, first: int, tolerance: float) -> float:
    """The mean KL divergence per token from ``model``'s own next-token distribution on ``ids`` (B, T) to that
    of :func:`decoder_layer` run from layer ``first`` on; raises ``UnsupportedModelError`` above ``tolerance``."""
    from .rope import rotary_factors

    positions = torch.arange(ids.shape[1], device=ids.device).expand(ids.shape[0], -1)
    with layer_inputs(model, (first,)) as captured:
        own = torch.log_softmax(model(input_ids=ids, position_ids=positions).logits.float(), -1)
    cos, sin = rotary_factors(model, positions)
    h = captured[first]
    for j in range(first, len(model.get_decoder().layers)):
        h = decoder_layer(model, j, h, cos, sin, positions)
    gap = float((own.exp() * (own - next_token_logprobs(model, h))).sum(-1).mean())  # mean KL per token
    if not gap <= tolerance:
        raise UnsupportedModelError(
            f"{type(model).__name__}'s decoder layers do not follow the formula kvbridge tunes levers through "
            f"(its next-token distributions differ by a KL of {gap:.3g} nats a token, more than {tolerance:g}); "
            "fit with --lever-objective kv.")
    return gap
