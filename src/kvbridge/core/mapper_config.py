"""The mapper's format in memory: :class:`MapperConfig` (what ``mapper.json`` holds: layer selection, levers,
feature layout, dtypes, the pair's identity), the runtime options (:class:`RuntimeOptions`: hold-back, recompute,
window), their validation, serialisation and digest. :mod:`kvbridge.core.mapper` runs the map they describe.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..errors import ArtifactError
from . import artifact, schema
from .models import ModelInfo, position_limit
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



def read_config(directory: str | Path) -> MapperConfig:
    """The validated config of the mapper folder ``directory``."""
    return MapperConfig.from_dict(artifact.read_config_json(directory))
