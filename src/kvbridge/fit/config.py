"""The settings of a fit: :class:`FitConfig`, validated on construction, and what ``mapper.json`` records of them.

Kept apart from the solve (:mod:`.closed_form`) so that the commands, the frontier and the demo can build and check
settings without reading the fit's numerics.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from ..core.mapper_config import KINDS, MAX_LAG, Lever
from ..core.recompute import CRITERIA, is_window
from ..errors import InputError
from .texts import MAX_SPANS
from .tune import OBJECTIVES

MAX_WIDTH = 65_536  # widest residual MLP a fit accepts (the published geometry's features: 1,024)
MAX_RIDGE = 1e3  # relative ridge: at 1e3 the map keeps about a thousandth of the signal
# --lever-inputs → what a lever reads (() = its own kind); "state": the source's final hidden state
LEVER_INPUTS = {"same": (), "kv": ("key", "value"), "kvs": ("key", "value", "state")}


@dataclass(frozen=True)
class FitConfig:
    """Settings of a fit; validated on construction."""

    num_texts: int = 160
    seq_len: int = 1024
    stride: int = 2
    # source layers per target layer (best single-layer R²); None: every source layer. One, chosen across the
    # embedded families on validation data: it ties every layer on the default family and on deep-pruned (two seeds
    # each) and beats it with the levers on the deep one (28.7 / 28.8 % vs 19.3 / 20.1 % at seeds 0 / 1), at a
    # fraction of the FLOPs
    top_k: int | None = 1
    # maps read only the source's first D layers (None: any): the source's prefill then stops after layer D − 1
    source_depth: int | None = None
    ridge: float = 0.01
    # reduced-rank plain maps (kvbridge.fit.rank): one rank for every layer without levers, or a share of their
    # full-rank FLOPs spent where held-out R² gains most; None: full-rank maps
    rank: int | None = None
    rank_flops: float | None = None
    # head-blocked plain maps: every layer without levers split into this many blocks of KV heads, target block g
    # reading source block g only (head-matched at the head count); None: full maps
    head_blocks: int | None = None
    batch_size: int = 4
    heldout_texts: int = 4
    # levers (see kvbridge.fit.levers): extra capacity for a few target layers
    # the defaults are the frontier's recommended point on the embedded family (kvbridge.measure.frontier.RECOMMENDED)
    lags: tuple[int, ...] = (0, 1, 2)  # source tokens t − j feeding target token t
    lever_inputs: str = "kv"  # "same": keys from keys, values from values; "kv": both caches; "kvs": both caches
    # and the source's final hidden state (its decoder's output, which no cache holds)
    lever_kinds: tuple[str, ...] = ("key",)  # target caches that get levers
    lever_layers: tuple[int, ...] | None = None  # None: the lever_count layers with the lowest fit R²
    lever_count: int = 1
    lever_stride: int = 1  # observe every S-th token for the levers' statistics
    lever_top_k: int | None = 1  # source layers feeding a lever layer (best single-layer R², at most top_k); None: its
    # own selection
    lever_weighting: str = "none"  # "attention": weighted ridge, tokens weighted by the attention they receive
    mlp_hidden: int = 128  # residual MLP width (0: linear levers only)
    mlp_steps: int = 4000
    mlp_batch: int = 1024
    mlp_lr: float = 1e-3
    mlp_observations: int = 262_144  # the MLP's training sample, kept in host memory (float32)
    repeat_spans: float = 0.5  # spans written twice per lever calibration row, on average (texts.repeat_spans)
    lever_objective: str = "output"  # "kv": mean squared error on K/V; "output": then tuned on the target's
    # next-token distribution (kvbridge.fit.tune)
    tune_plain: bool = True  # "output" also tunes the plain maps of the lever layers' other kinds (same runtime cost)
    tune_steps: int = 600
    tune_batch: int = 2  # rows a tuning step
    tune_lr: float = 3e-4
    tune_rows: int = 160  # calibration rows kept for tuning (host memory: rows × seq_len × features)
    seed: int = 0
    # runtime options recorded in mapper.json (a Bridge uses them unless told otherwise)
    # the target reads the last 256 prompt tokens itself and recomputes none of the mapped ones: chosen on third-party
    # validation code (kvbridge gap --split validation) at 1,024 and 2,048 tokens, where it kept 81 % and 76 % of the
    # target's perplexity lead over the source at 1.6x and 2.0x TTFT (CPU); recomputing 4 % of the prefix instead
    # kept 52 % at 1.5x, and the last token alone 49 % at 2.5x (docs/measures.md)
    hold_back: int = 256
    recompute: float = 0.0
    recompute_by: str = "logit"  # "surprisal" (exact, costs source logits) or "bigram" (a calibration table)
    recompute_window: int = 9  # its score averaged over the 9 tokens centred on each: unpredictable spans go whole
    sink: bool = False
    native_layers: int = 0  # the target computes its first N layers itself (levers then go to the mapped ones)

    @property
    def lever_input_kinds(self) -> tuple[str, ...]:
        """The lever inputs this setting names (() = each lever reads its own kind)."""
        return LEVER_INPUTS[self.lever_inputs]

    def lever(self, kind: str, layer: int, source_hidden: int) -> Lever:
        """The lever these settings put on (kind, layer); ``source_hidden``: the source's hidden size, recorded
        when the inputs read its state."""
        inputs = self.lever_input_kinds
        return Lever(kind, layer, self.lags, inputs, self.mlp_hidden, source_hidden if "state" in inputs else 0)

    @property
    def has_levers(self) -> bool:
        return (self.lags != (0,) or self.lever_inputs != "same" or self.mlp_hidden > 0) and (
            self.lever_count > 0 if self.lever_layers is None else bool(self.lever_layers))

    def __post_init__(self):
        _check_types(self)
        if len(set(self.lags)) != len(tuple(self.lags)):
            raise InputError(f"--lags {','.join(map(str, self.lags))} names a lag twice; give each once, e.g. 0,1,2.")
        object.__setattr__(self, "lags", tuple(sorted(set(int(j) for j in self.lags))))
        if self.lever_layers is not None:
            object.__setattr__(self, "lever_layers", tuple(sorted(set(int(j) for j in self.lever_layers))))
        object.__setattr__(self, "lever_kinds", tuple(self.lever_kinds))
        if not self.lags or min(self.lags) < 0 or max(self.lags) > MAX_LAG:
            raise InputError(f"--lags must be integers in [0, {MAX_LAG}], e.g. 0,1,2.")
        if self.lever_inputs not in LEVER_INPUTS:
            raise InputError("--lever-inputs must be 'same', 'kv' or 'kvs'.")
        if not self.lever_kinds or any(k not in KINDS for k in self.lever_kinds):
            raise InputError("--lever-kinds must be key, value or key,value.")
        if self.lever_weighting not in ("none", "attention"):
            raise InputError("--lever-weighting must be 'none' or 'attention'.")
        if self.lever_top_k is not None and self.lever_top_k < 1:
            raise InputError("--lever-top-k must be at least 1.")
        if self.lever_count < 0 or self.lever_stride < 1:
            raise InputError("--lever-count must be >= 0 and --lever-stride >= 1.")
        if self.lever_layers is not None and any(j < 0 for j in self.lever_layers):
            raise InputError("--lever-layers must be target layer indices >= 0.")
        if self.mlp_hidden > MAX_WIDTH or self.hold_back > MAX_WIDTH * 16:
            raise InputError(f"--mlp-hidden must be at most {MAX_WIDTH:,} and --hold-back at most {MAX_WIDTH * 16:,}.")
        if not 0 <= self.seed < 2**63:
            raise InputError("--seed must be an integer from 0 to 2**63 - 1.")
        if self.mlp_hidden < 0 or self.mlp_steps < 1 or self.mlp_batch < 1 or not self.mlp_lr > 0 \
                or self.mlp_observations < 20:
            raise InputError("--mlp-hidden must be >= 0, --mlp-steps and --mlp-batch >= 1, --mlp-lr > 0, "
                             "--mlp-observations >= 20.")
        if not 0.0 <= self.repeat_spans <= MAX_SPANS:
            raise InputError(f"--repeat-spans must be a number from 0 to {MAX_SPANS} (spans a row, on average).")
        if self.lever_objective not in OBJECTIVES:
            raise InputError(f"--lever-objective must be {' or '.join(OBJECTIVES)}.")
        if self.tune_steps < 1 or self.tune_batch < 1 or not self.tune_lr > 0 or self.tune_rows < 2:
            raise InputError("--tune-steps and --tune-batch must be >= 1, --tune-lr > 0, --tune-rows >= 2.")
        if self.native_layers < 0:
            raise InputError("--native-layers must be >= 0 (0: the map fills every target layer).")
        if self.hold_back < 1 or not 0.0 <= self.recompute <= 1.0:
            raise InputError("--hold-back must be >= 1 and --recompute a fraction in [0, 1].")
        if self.recompute_by not in CRITERIA:
            raise InputError(f"--recompute-by must be one of {', '.join(CRITERIA)}.")
        if not is_window(self.recompute_window):
            raise InputError(f"--recompute-window must be an odd integer >= 1 (1: each token's own score), not "
                             f"{self.recompute_window}.")
        if self.num_texts < 1:
            raise InputError("--num-texts must be at least 1.")
        if self.seq_len < 2:
            raise InputError("--seq-len must be at least 2.")
        if self.stride < 1 or self.stride > self.seq_len:
            raise InputError(f"--stride must be between 1 and --seq-len ({self.seq_len}).")
        if self.top_k is not None and self.top_k < 1:
            raise InputError("--top-k must be at least 1.")
        if self.source_depth is not None and self.source_depth < 1:
            raise InputError("--source-depth must be at least 1 (leave it out to let maps read every source layer).")
        if self.source_depth is not None and self.top_k is not None and self.top_k > self.source_depth:
            raise InputError(f"--top-k {self.top_k} source layers a map cannot come from the first "
                             f"{self.source_depth} (--source-depth); pass --top-k at most {self.source_depth}.")
        if not 0 <= self.ridge <= MAX_RIDGE:
            raise InputError(f"--ridge must be a number from 0 to {MAX_RIDGE:g} (it is relative to the mean diagonal "
                             f"of the source Gram: beyond that the map is all but zero), not {self.ridge}.")
        if self.batch_size < 1:
            raise InputError("--batch-size must be at least 1.")
        if self.rank is not None and self.rank_flops is not None:
            raise InputError("give --rank or --rank-flops, not both.")
        if self.rank is not None and self.rank < 1:
            raise InputError("--rank must be at least 1 (leave it out for full-rank maps).")
        if self.rank_flops is not None and not 0 < self.rank_flops < 1:
            raise InputError(f"--rank-flops must be a fraction in (0, 1) of the full-rank maps' FLOPs, not "
                             f"{self.rank_flops}.")
        if self.head_blocks is not None and self.head_blocks < 2:
            raise InputError("--head-blocks must be at least 2 (leave it out for full maps).")
        if self.head_blocks is not None and (self.rank is not None or self.rank_flops is not None):
            raise InputError("give --head-blocks or --rank/--rank-flops, not both: a layer's map is one or the other.")
        if self.heldout_texts < 0:
            raise InputError("--heldout-texts must be >= 0.")


_INTS = ("num_texts", "seq_len", "stride", "batch_size", "heldout_texts", "lever_count", "lever_stride", "mlp_hidden",
         "mlp_steps", "mlp_batch", "mlp_observations", "tune_steps", "tune_batch", "tune_rows", "seed", "hold_back",
         "recompute_window", "native_layers")
_OPTIONAL_INTS = ("top_k", "lever_top_k", "rank", "head_blocks", "source_depth")
_NUMBERS = ("ridge", "mlp_lr", "recompute", "repeat_spans", "tune_lr")
_STRINGS = ("lever_inputs", "lever_weighting", "lever_objective", "recompute_by")


def _check_types(config: FitConfig) -> None:
    """One InputError naming the setting, instead of a TypeError from deep in the fit (Python callers)."""
    def is_int(v):
        return isinstance(v, int) and not isinstance(v, bool)

    def bad(name, what):
        return InputError(f"FitConfig.{name} must be {what}, not {getattr(config, name)!r}.")

    for name in _INTS:
        if not is_int(getattr(config, name)):
            raise bad(name, "an integer")
    for name in _OPTIONAL_INTS:
        if getattr(config, name) is not None and not is_int(getattr(config, name)):
            raise bad(name, "an integer or None")
    for name in _NUMBERS:
        value = getattr(config, name)
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise bad(name, "a number")
    if config.rank_flops is not None and (isinstance(config.rank_flops, bool)
                                          or not isinstance(config.rank_flops, (int, float))):
        raise bad("rank_flops", "a number or None")
    for name in _STRINGS:
        if not isinstance(getattr(config, name), str):
            raise bad(name, "a string")
    for name in ("sink", "tune_plain"):
        if not isinstance(getattr(config, name), bool):
            raise bad(name, "True or False")
    for name in ("lags", "lever_layers"):
        value = getattr(config, name)
        if value is None and name == "lever_layers":
            continue
        if not isinstance(value, (tuple, list)) or not all(is_int(v) for v in value):
            raise bad(name, "a tuple of integers")
    if not isinstance(config.lever_kinds, (tuple, list)) or not all(isinstance(k, str) for k in config.lever_kinds):
        raise bad("lever_kinds", "a tuple of 'key'/'value'")


# settings recorded only when used: a fit without them records what fits always did, byte for byte
OPTIONAL_SETTINGS = ("rank", "rank_flops", "head_blocks", "source_depth", "native_layers")


def recorded_settings(config: FitConfig, source_layers: int) -> dict:
    """The fit settings mapper.json records: every FitConfig field but the :data:`OPTIONAL_SETTINGS` left at their
    defaults, and ``top_k`` as the count of source layers a map reads."""
    return ({k: v for k, v in asdict(config).items() if k not in OPTIONAL_SETTINGS or v}
            | {"top_k": config.top_k or config.source_depth or source_layers})
