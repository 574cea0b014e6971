"""The map itself: content-space source KV → content-space target KV. Hot path only.

Letters: B batch, T tokens, P past tokens (lag context only), Ls/Lt source/target layers, H kv heads,
D head dim, F features of one layer (H·D, heads concatenated head-major: feature ``h*D + d``),
S selected source layers, J lags, I input kinds, N hidden units of a residual MLP.

For every target layer ``l`` and for keys and values separately::

    x_l = concat over lags j, input kinds i, source layers s ∈ S_l of content_i,s(t − j)   # (B, T, J·I·S·Fs)
          [then, per lag, the source's final hidden state h(t − j), when a lever reads "state"]  # + (J·Hs)
    y_l = x_l @ W_l + b_l  [+ GELU(x_l @ W1_l + b1_l) @ W2_l + b2_l]                        # (B, T, Ft)

A plain layer (version-1 maps) reads lag 0 of its own kind only: ``x_l`` = the selected source
layers' keys (for keys) or values (for values) at the same token. A :class:`Lever` widens one
target layer's features with neighbouring tokens (``lags``), with the other cache and the source's final
hidden state (``inputs``: the residual stream after its last layer, which no cache holds), and adds a
residual MLP (``hidden``). Lagged features before a sequence's first token are zeros.

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
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from ..errors import ArtifactError
from . import artifact, schema
from .models import ModelInfo, check_matches, check_same_tokenizer, position_limit
from .recompute import CRITERIA, is_window

KINDS = ("key", "value")
INPUTS = KINDS + ("state",)  # what a lever can read: the two caches, and the source's final hidden state
MAX_LAG = 64
# runtime tables stored beside the weights: never cast to the weights' dtype (keys are exact integers)
INTEGER_TENSORS = ("recompute.bigram.keys",)
FIXED_DTYPE_TENSORS = ("recompute.bigram.keys", "recompute.bigram.counts", "recompute.unigram.counts")


def keeps_dtype(name: str) -> bool:
    """Tensors a dtype change leaves alone: the runtime tables, and residual MLPs, which stay float32 (their
    folded standardisation cancels large terms that bfloat16 would round away)."""
    return name in FIXED_DTYPE_TENSORS or ".mlp." in name


@dataclass(frozen=True)
class Lever:
    """Extra capacity for one target layer and kind: neighbouring tokens, the other cache, a residual MLP."""

    kind: str  # which target cache: "key" or "value"
    layer: int  # target layer
    lags: tuple[int, ...] = (0,)  # source tokens t − j that feed target token t
    inputs: tuple[str, ...] = ()  # source caches read ("key", "value") and "state"; () = the same kind as the target
    hidden: int = 0  # width of the residual MLP; 0 = linear map only
    state: int = 0  # width of the source's final hidden state, when ``inputs`` holds "state" (else 0)

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ArtifactError(f"lever kind must be one of {KINDS}, not {self.kind!r}.")
        if not isinstance(self.layer, int) or self.layer < 0:
            raise ArtifactError(f"lever layer must be a target layer index >= 0, not {self.layer!r}.")
        lags = tuple(self.lags)
        if not lags or list(lags) != sorted(set(lags)) or not all(isinstance(j, int) and 0 <= j <= MAX_LAG
                                                                   for j in lags):
            raise ArtifactError(f"lever lags {list(lags)} must be a sorted, non-empty set of integers in "
                                f"[0, {MAX_LAG}].")
        if any(i not in INPUTS for i in self.inputs) or len(set(self.inputs)) != len(self.inputs) or (
                self.inputs and not set(self.inputs) & set(KINDS)):
            raise ArtifactError(f"lever inputs {list(self.inputs)} must be distinct values of {INPUTS}, with at "
                                "least one cache.")
        if not isinstance(self.state, int) or self.state < 0 or (self.state > 0) != ("state" in self.inputs):
            raise ArtifactError(f"lever state must be the source's hidden size (> 0) exactly when its inputs read "
                                f"'state', else 0; got {self.state!r} with inputs {list(self.inputs)}.")
        if not isinstance(self.hidden, int) or self.hidden < 0:
            raise ArtifactError(f"lever hidden must be an integer >= 0, not {self.hidden!r}.")
        object.__setattr__(self, "lags", lags)
        object.__setattr__(self, "inputs", tuple(i for i in INPUTS if i in (self.inputs or (self.kind,))))

    def to_dict(self) -> dict[str, Any]:
        data = {"kind": self.kind, "layer": self.layer, "lags": list(self.lags), "inputs": list(self.inputs),
                "hidden": self.hidden}
        return data | ({"state": self.state} if self.state else {})

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Lever:
        return cls(kind=data["kind"], layer=data["layer"], lags=tuple(data.get("lags", (0,))),
                   inputs=tuple(data.get("inputs", ())), hidden=data.get("hidden", 0), state=data.get("state", 0))


@dataclass(frozen=True)
class RuntimeOptions:
    """How a mapper is meant to be used at runtime; a ``Bridge`` takes these unless told otherwise.

    ``hold_back``: last prompt tokens the target reads itself (fewer for a batch whose shortest prompt
    is not longer); ``recompute``: fraction of the prefix
    tokens the target recomputes over the mapped cache (:mod:`kvbridge.core.recompute`), chosen by
    ``recompute_by`` averaged over a ``recompute_window`` of tokens (odd; 1: each token's own score, as
    artifacts without the field were used); ``sink``: always recompute each row's first token;
    ``native_layers``: the target computes its first N layers' K/V itself over the whole prompt (its own prefill,
    stopped there) in place of their maps — what a layer whose information the map cannot recover costs.
    """

    hold_back: int = 1
    recompute: float = 0.0
    recompute_by: str = "logit"
    sink: bool = False
    recompute_window: int = 1
    bigram_pairs: int = 0  # size of the bigram table the artifact carries for recompute_by="bigram" (0: none)
    bigram_vocab: int = 0
    native_layers: int = 0

    def __post_init__(self):
        if not isinstance(self.hold_back, int) or self.hold_back < 1:
            raise ArtifactError(f"runtime hold_back must be an integer >= 1, not {self.hold_back!r}.")
        if not isinstance(self.recompute, (int, float)) or not 0.0 <= self.recompute <= 1.0:
            raise ArtifactError(f"runtime recompute must be a fraction in [0, 1], not {self.recompute!r}.")
        if self.recompute_by not in CRITERIA:
            raise ArtifactError(f"runtime recompute_by must be one of {', '.join(CRITERIA)}, not "
                                f"{self.recompute_by!r}.")
        for name in ("bigram_pairs", "bigram_vocab", "native_layers"):
            if not isinstance(getattr(self, name), int) or isinstance(getattr(self, name), bool) \
                    or getattr(self, name) < 0:
                raise ArtifactError(f"runtime {name} must be an integer >= 0, not {getattr(self, name)!r}.")
        if self.recompute_by == "bigram" and not (self.bigram_pairs and self.bigram_vocab):
            raise ArtifactError("runtime recompute_by 'bigram' needs the bigram table "
                                "(bigram_pairs, bigram_vocab > 0); refit with --recompute-by bigram.")
        if not isinstance(self.sink, bool):
            raise ArtifactError(f"runtime sink must be true or false, not {self.sink!r}.")
        if not is_window(self.recompute_window):
            raise ArtifactError(f"runtime recompute_window must be an odd integer >= 1 (1: each token's own score), "
                                f"not {self.recompute_window!r}; the file was edited or is corrupted.")

    def override(self, hold_back: int | None = None, recompute: float | None = None, recompute_by: str | None = None,
                 sink: bool | None = None, recompute_window: int | None = None,
                 native_layers: int | None = None) -> RuntimeOptions:
        """These options with a caller's overrides (None keeps the mapper's); bad values are the caller's
        mistake, so they raise :class:`~kvbridge.errors.InputError`, not ArtifactError."""
        from dataclasses import replace

        from ..errors import InputError

        if hold_back is not None and (not isinstance(hold_back, int) or isinstance(hold_back, bool)):
            raise InputError(f"hold_back must be an integer, not {hold_back!r}.")
        if hold_back is not None and hold_back < 1:
            raise InputError("hold_back must be >= 1: the target must consume at least the last prompt token itself.")
        if recompute is not None and (isinstance(recompute, bool) or not isinstance(recompute, (int, float))
                                      or not 0.0 <= recompute <= 1.0):
            raise InputError(f"recompute must be a fraction in [0, 1], not {recompute!r}.")
        if sink is not None and not isinstance(sink, bool):
            raise InputError(f"sink must be True or False, not {sink!r}.")
        if recompute_by is not None and recompute_by not in CRITERIA:
            raise InputError(f"recompute_by must be one of {', '.join(CRITERIA)}, not {recompute_by!r}.")
        if recompute_window is not None and not is_window(recompute_window):
            raise InputError(f"recompute_window must be an odd integer >= 1 (1: each token's own score), not "
                             f"{recompute_window!r}.")
        if native_layers is not None and (not isinstance(native_layers, int) or isinstance(native_layers, bool)
                                          or native_layers < 0):
            raise InputError(f"native_layers must be an integer >= 0 (0: every layer mapped), not {native_layers!r}.")
        if recompute_by == "bigram" and not self.bigram_pairs:
            raise InputError("this mapper carries no bigram table (fitted by an older kvbridge): use "
                             "recompute_by='logit' or 'surprisal', or refit it.")
        given = dict(hold_back=hold_back, recompute=None if recompute is None else float(recompute),
                     recompute_by=recompute_by, sink=sink, recompute_window=recompute_window,
                     native_layers=native_layers)
        return replace(self, **{k: v for k, v in given.items() if v is not None})

    def to_dict(self) -> dict[str, Any]:
        window = {} if self.recompute_window == 1 else {"recompute_window": self.recompute_window}  # (older files)
        native = {"native_layers": self.native_layers} if self.native_layers else {}  # (older files)
        return {"hold_back": self.hold_back, "recompute": float(self.recompute), "recompute_by": self.recompute_by,
                **window, "sink": self.sink, "bigram_pairs": self.bigram_pairs, "bigram_vocab": self.bigram_vocab,
                **native}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> RuntimeOptions:
        known = {k: data[k] for k in ("hold_back", "recompute", "recompute_by", "recompute_window", "sink",
                                      "bigram_pairs", "bigram_vocab", "native_layers") if k in data}
        return cls(**known)

    def tensor_shapes(self) -> dict[str, tuple[int, ...]]:
        """The runtime tables the artifact carries beside the weights (integer keys, float32 counts)."""
        if not self.bigram_pairs:
            return {}
        return {"recompute.bigram.keys": (self.bigram_pairs,), "recompute.bigram.counts": (self.bigram_pairs,),
                "recompute.unigram.counts": (self.bigram_vocab,)}


@dataclass(frozen=True)
class Features:
    """What feeds one target layer: source layers, input kinds, lags (lag-major, then kind, then layer;
    the final hidden state, ``state`` features wide, after the caches of each lag)."""

    sources: tuple[int, ...]
    inputs: tuple[str, ...]
    lags: tuple[int, ...] = (0,)
    state: int = 0

    def width(self, fs: int) -> int:
        caches = sum(1 for i in self.inputs if i in KINDS)
        return len(self.lags) * (caches * len(self.sources) * fs + (self.state if "state" in self.inputs else 0))


@dataclass(frozen=True)
class MapperConfig:
    """Everything ``mapper.json`` says about a mapper, validated on construction."""

    source: ModelInfo
    target: ModelInfo
    selection: dict[str, tuple[tuple[int, ...], ...]]  # kind -> per target layer, sorted source layers
    fit: dict[str, Any] = field(default_factory=dict)
    levers: tuple[Lever, ...] = ()
    runtime: RuntimeOptions = RuntimeOptions()
    # kind -> per target layer, the rank of a factored (reduced-rank) map: x @ down (F_in, r) @ up (r, Ft) + b; 0: full
    ranks: dict[str, tuple[int, ...]] = field(default_factory=dict)
    # kind -> per target layer, its head blocks: n > 1 splits the map into n blocks, block g of the target's KV heads
    # reading only block g of the source's (of every selected layer): a head-matched map at n = the head count;
    # 1: the full map
    heads: dict[str, tuple[int, ...]] = field(default_factory=dict)

    def __post_init__(self):
        for kind in KINDS:
            layers = self.selection.get(kind)
            if layers is None or len(layers) != self.target.num_layers:
                raise ArtifactError(
                    f"mapper selection for {kind}s must list {self.target.num_layers} target layers, "
                    f"got {None if layers is None else len(layers)}."
                )
            for chosen in layers:
                if (not chosen or any(not 0 <= s < self.source.num_layers for s in chosen)
                        or list(chosen) != sorted(set(chosen))):
                    raise ArtifactError(
                        f"mapper selection {list(chosen)} is not a sorted, non-empty set of source layers "
                        f"in [0, {self.source.num_layers})."
                    )
        seen = set()
        for lever in self.levers:
            if lever.layer >= self.target.num_layers:
                raise ArtifactError(f"lever for target layer {lever.layer}, but the target has "
                                    f"{self.target.num_layers} layers.")
            if (lever.kind, lever.layer) in seen:
                raise ArtifactError(f"two levers for the {lever.kind}s of target layer {lever.layer}.")
            seen.add((lever.kind, lever.layer))
        limit = position_limit(self.source.max_positions, self.target.max_positions)
        for name in ("hold_back", "recompute_window"):  # the runtime's lengths are bounded by the models' positions
            if getattr(self.runtime, name) > limit:
                raise ArtifactError(f"runtime {name} is {getattr(self.runtime, name)}, more than the {limit} positions "
                                    "the models support; the file was edited or is corrupted.")
        if self.runtime.native_layers >= self.target.num_layers:
            raise ArtifactError(f"runtime native_layers is {self.runtime.native_layers}, but the target has "
                                f"{self.target.num_layers} layers (at least one must be mapped); the file was edited "
                                "or is corrupted.")
        object.__setattr__(self, "ranks", {k: tuple(v) for k, v in self.ranks.items() if any(v)})
        for kind, ranks in self.ranks.items():
            if kind not in KINDS or len(ranks) != self.target.num_layers:
                raise ArtifactError(f"mapper ranks must list the {self.target.num_layers} target layers of keys "
                                    f"and/or values, not {kind!r}: {list(ranks)}.")
            for layer, r in enumerate(ranks):
                widest = min(self.features(kind, layer).width(self.source.kv_features), self.target.kv_features)
                if not isinstance(r, int) or isinstance(r, bool) or not 0 <= r <= widest or (
                        r and self.lever(kind, layer) is not None):
                    raise ArtifactError(f"mapper rank {r!r} for the {kind}s of target layer {layer} must be 0 (full) "
                                        f"or 1 to {widest}, and 0 where a lever is; the file was edited or is "
                                        "corrupted.")
        object.__setattr__(self, "heads", {k: tuple(v) for k, v in self.heads.items() if any(n != 1 for n in v)})
        for kind, blocks in self.heads.items():
            if kind not in KINDS or len(blocks) != self.target.num_layers:
                raise ArtifactError(f"mapper heads must list the {self.target.num_layers} target layers of keys "
                                    f"and/or values, not {kind!r}: {list(blocks)}.")
            for layer, n in enumerate(blocks):
                if not isinstance(n, int) or isinstance(n, bool) or n < 1 or self.source.num_kv_heads % n or (
                        self.target.num_kv_heads % n) or (n > 1 and (self.lever(kind, layer) is not None
                                                                     or self.rank(kind, layer))):
                    raise ArtifactError(f"mapper head blocks {n!r} for the {kind}s of target layer {layer} must "
                                        f"divide both models' KV heads ({self.source.num_kv_heads} and "
                                        f"{self.target.num_kv_heads}), and be 1 where a lever or a rank is; the "
                                        "file was edited or is corrupted.")
        widths = sorted({v.state for v in self.levers if v.state})
        if len(widths) > 1:
            raise ArtifactError(f"levers read source states of different widths {widths}; one source has one hidden "
                                "size. The file was edited or is corrupted.")
        object.__setattr__(self, "levers", tuple(sorted(self.levers, key=lambda v: (KINDS.index(v.kind), v.layer))))

    def rank(self, kind: str, layer: int) -> int:
        """The rank of (kind, layer)'s factored map; 0: a full map."""
        return self.ranks[kind][layer] if kind in self.ranks else 0

    @property
    def factored(self) -> bool:
        return bool(self.ranks)

    def blocks(self, kind: str, layer: int) -> int:
        """The head blocks of (kind, layer)'s map; 1: a full map."""
        return self.heads[kind][layer] if kind in self.heads else 1

    @property
    def head_blocked(self) -> bool:
        return bool(self.heads)

    def lever(self, kind: str, layer: int) -> Lever | None:
        return next((v for v in self.levers if v.kind == kind and v.layer == layer), None)

    def features(self, kind: str, layer: int) -> Features:
        lever = self.lever(kind, layer)
        sources = tuple(self.selection[kind][layer])
        return Features(sources, (kind,)) if lever is None else Features(sources, lever.inputs, lever.lags,
                                                                         lever.state)

    @property
    def max_lag(self) -> int:
        return max((max(v.lags) for v in self.levers), default=0)

    @property
    def read_layers(self) -> tuple[int, ...]:
        """The source layers any map reads, in order: the only ones a transfer needs to gather (the runtime's
        features hold these, :meth:`Mapper.map_features`)."""
        return tuple(sorted({s for kind in KINDS for chosen in self.selection[kind] for s in chosen}))

    @property
    def source_depth(self) -> int:
        """How many of the source's layers (its first) the maps read: its prefill for a transfer can stop there."""
        return 1 + max(s for kind in KINDS for chosen in self.selection[kind] for s in chosen)

    @property
    def state_width(self) -> int:
        """The source hidden size the levers read (one source: one width, checked on construction); 0: none."""
        return max((v.state for v in self.levers), default=0)

    @property
    def reads_state(self) -> bool:
        """Whether a lever reads the source's final hidden state: the map then needs it beside the cache."""
        return self.state_width > 0

    def weight_shapes(self) -> dict[str, tuple[int, ...]]:
        """Name → shape of every tensor the artifact must contain."""
        fs, ft = self.source.kv_features, self.target.kv_features
        shapes = {}
        for kind in KINDS:
            for layer in range(self.target.num_layers):
                f_in = self.features(kind, layer).width(fs)
                r, n = self.rank(kind, layer), self.blocks(kind, layer)
                if n > 1:  # (n, the block's inputs, its outputs): a batch of n small maps
                    shapes[f"{kind}.{layer}.weight"] = (n, f_in // n, ft // n)
                elif r:
                    shapes[f"{kind}.{layer}.down.weight"] = (f_in, r)
                    shapes[f"{kind}.{layer}.up.weight"] = (r, ft)
                else:
                    shapes[f"{kind}.{layer}.weight"] = (f_in, ft)
                shapes[f"{kind}.{layer}.bias"] = (ft,)
                lever = self.lever(kind, layer)
                if lever is not None and lever.hidden:
                    shapes[f"{kind}.{layer}.mlp.in.weight"] = (f_in, lever.hidden)
                    shapes[f"{kind}.{layer}.mlp.in.bias"] = (lever.hidden,)
                    shapes[f"{kind}.{layer}.mlp.out.weight"] = (lever.hidden, ft)
                    shapes[f"{kind}.{layer}.mlp.out.bias"] = (ft,)
        return shapes | self.runtime.tensor_shapes()

    def num_parameters(self) -> int:
        return sum(math.prod(s) for s in self.weight_shapes().values())

    def groups(self, kind: str) -> list[tuple[Features, tuple[int, ...], bool, bool]]:
        """Target layers mapped by one GEMM: ``(features, target layers, has_mlp, factored)``; an MLP layer and a
        head-blocked layer stand alone; factored layers reading the same features share their first GEMM
        (``x @ [down_1 … down_n]``)."""
        by_features: dict[tuple, list[int]] = {}
        for layer in range(self.target.num_layers):
            spec = self.features(kind, layer)
            lever = self.lever(kind, layer)
            key = ((spec, "mlp", layer) if lever is not None and lever.hidden else (spec, "factored") if self.rank(
                kind, layer) else (spec, "heads", layer) if self.blocks(kind, layer) > 1 else (spec,))
            by_features.setdefault(key, []).append(layer)
        return [(key[0], tuple(targets), key[1:2] == ("mlp",), key[1:] == ("factored",))
                for key, targets in by_features.items()]

    def tensor_dtypes(self) -> dict[str, str]:
        """Name → safetensors dtype code of every tensor on disk: float32 weights, int64 table keys."""
        return {name: "I64" if name in INTEGER_TENSORS else "F32" for name in self.weight_shapes()}

    def computation_digest(self) -> str:
        """SHA-256 (32 hex digits) of the fields that decide what the weights compute without deciding a tensor's
        shape — layer selection, levers (lags, inputs), feature layout, geometry — stored beside the weights so that
        an edit of them, checksums resealed or not, fails verification. Runtime options are not in it: they are
        meant to be overridden."""
        from .hashing import sha256_json

        geometry = {role: getattr(self, role).geometry for role in ("source", "target")}
        ranks = {"ranks": {k: list(v) for k, v in sorted(self.ranks.items())}} if self.ranks else {}
        ranks |= {"heads": {k: list(v) for k, v in sorted(self.heads.items())}} if self.heads else {}
        return sha256_json({"selection": {k: [list(v) for v in self.selection[k]] for k in sorted(self.selection)},
                            "levers": [v.to_dict() for v in self.levers], "layout": schema.FEATURE_LAYOUT,
                            "geometry": geometry} | ranks)[:32]

    # -- mapper.json (the format's name, version and validation: kvbridge.core.schema) ---------------
    def to_dict(self) -> dict[str, Any]:
        from ..version import __version__

        return {
            "format": schema.FORMAT,
            "format_version": schema.version_for(self.reads_state, self.factored, self.head_blocked),
            "kvbridge_version": __version__,
            "source": self.source.to_dict(),
            "target": self.target.to_dict(),
            "feature_layout": schema.FEATURE_LAYOUT,
            "selection": {kind: [list(layers) for layers in self.selection[kind]] for kind in self.selection},
            "levers": [lever.to_dict() for lever in self.levers],
            **({"ranks": {kind: list(r) for kind, r in self.ranks.items()}} if self.ranks else {}),
            **({"heads": {kind: list(n) for kind, n in self.heads.items()}} if self.heads else {}),
            "runtime": self.runtime.to_dict(),
            "num_parameters": self.num_parameters(),
            "weights_dtype": "float32",  # runtime tables: recompute.bigram.keys int64, counts float32
            "fit": self.fit,
        }

    @classmethod
    def from_dict(cls, data: Any) -> MapperConfig:
        """A validated config from parsed mapper.json; a malformed field is one ArtifactError that names it.
        Unknown keys are ignored (newer files still load); version-1 files read as plain maps."""
        schema.validate(data)
        version = data["format_version"]
        try:
            config = cls(
                source=ModelInfo.from_dict(data["source"]),
                target=ModelInfo.from_dict(data["target"]),
                selection={k: tuple(tuple(layers) for layers in data["selection"][k]) for k in KINDS},
                fit=dict(data.get("fit", {})),
                levers=tuple(Lever.from_dict(v) for v in data.get("levers", [])) if version >= 2 else (),
                runtime=RuntimeOptions.from_dict(data.get("runtime", {})) if version >= 2 else RuntimeOptions(),
                ranks={k: tuple(v) for k, v in data.get("ranks", {}).items()} if version >= 4 else {},
                heads={k: tuple(v) for k, v in data.get("heads", {}).items()} if version >= 5 else {},
            )
        except (KeyError, TypeError, ValueError) as exc:  # validate() should have named it: a last defence
            raise ArtifactError(f"{schema.CONFIG_FILE} is incomplete or malformed ({exc!r}); "
                                "re-download or refit the mapper.") from None
        recorded = {"num_parameters": data.get("num_parameters", config.num_parameters()),
                    "weights_dtype": data.get("weights_dtype", "float32")}
        for name, expected in (("num_parameters", config.num_parameters()), ("weights_dtype", "float32")):
            if recorded[name] != expected:
                raise ArtifactError(f"{schema.CONFIG_FILE} records {name} {recorded[name]!r}, but its selection and "
                                    f"levers give {expected!r}; the file was edited or is corrupted. Re-download or "
                                    "refit the mapper.")
        return config


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


def read_config(directory: str | Path) -> MapperConfig:
    """The validated config of the mapper folder ``directory``."""
    return MapperConfig.from_dict(artifact.read_config_json(directory))


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
