"""The mapper.json format: its name, version, feature layout, and the validation of every field.

Validation runs on the raw JSON before any object is built, so a malformed field is one
:class:`~kvbridge.errors.ArtifactError` that names it, never a TypeError from deep inside. The typed
side of the format is :meth:`kvbridge.core.mapper_config.MapperConfig.to_dict` / ``from_dict``.
"""

from __future__ import annotations

import json
from typing import Any

from ..errors import ArtifactError

FORMAT = "kvbridge-mapper"
FORMAT_VERSION = 5  # the newest version read. 2 adds "levers" (lags, inputs, residual MLPs) and "runtime" (version-1
# files read as plain maps); 3 adds the lever input "state", the source's final hidden state; 4 adds "ranks",
# reduced-rank (factored) plain maps; 5 adds "heads", head-blocked (head-matched) plain maps. A file is written with
# the lowest version that holds it (``version_for``), so maps without a state input, ranks or heads stay readable by
# older releases.
CONFIG_FILE = "mapper.json"
FEATURE_LAYOUT = (
    "content keys (RoPE removed with the model's own rotary module) and values; a layer's features are its "
    "KV heads concatenated head-major (feature h*head_dim + d); x = selected source layers concatenated in "
    "ascending order, of the target's own kind at the same token; y = x @ weight + bias. A lever on (kind, "
    "layer) makes x the concatenation over its lags j (ascending), then its inputs (key before value), then "
    "the selected source layers, then (input 'state') the source's final hidden state (its decoder's output, "
    "state features), of the source token t - j (zeros before a sequence's first token), and adds "
    "gelu(x @ mlp.in.weight + mlp.in.bias) @ mlp.out.weight + mlp.out.bias when hidden > 0"
)


def version_for(reads_state: bool, factored: bool = False, head_blocked: bool = False) -> int:
    """The format version a mapper is written with: the lowest that can hold it."""
    return 5 if head_blocked else 4 if factored else 3 if reads_state else 2


# -- mapper.json validation: every field's type and range, checked before any object is built --------
def _bad(field: str, what: str, value: Any = None, missing: bool = False) -> ArtifactError:
    shown = "missing" if missing else f"{_short(value)} ({type(value).__name__})"
    return ArtifactError(f"{CONFIG_FILE}: field {field!r} must be {what}, but is {shown}. The file is malformed or "
                         "was edited; re-download or refit the mapper.")


def _short(value: Any) -> str:
    text = json.dumps(value) if not isinstance(value, str) else repr(value)
    return text if len(text) <= 40 else text[:39] + "…"


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _get(obj: dict, key: str, where: str, check, what: str, required: bool = True) -> Any:
    field = f"{where}.{key}" if where else key
    if key not in obj:
        if required:
            raise _bad(field, what, missing=True)
        return None
    if not check(obj[key]):
        raise _bad(field, what, obj[key])
    return obj[key]


def validate(data: Any) -> None:
    """Raise one ArtifactError naming the first malformed field of a parsed mapper.json."""
    if not isinstance(data, dict):
        raise ArtifactError(f"{CONFIG_FILE} must hold a JSON object, not {type(data).__name__}; the file is corrupted.")
    if data.get("format") != FORMAT:
        raise ArtifactError(f"{CONFIG_FILE} is not a kvbridge mapper (format {_short(data.get('format'))}).")
    version = data.get("format_version")
    if _is_int(version) and version > FORMAT_VERSION:
        raise ArtifactError(f"{CONFIG_FILE} has format version {version}; this kvbridge reads up to {FORMAT_VERSION}. "
                            "Upgrade kvbridge (`pip install -U kvbridge`).")
    _get(data, "format_version", "", lambda v: _is_int(v) and 1 <= v, f"an integer from 1 to {FORMAT_VERSION}")
    # sizes beyond 2**40 are not a model: bounding them keeps every product of shapes a machine integer
    integer = lambda lo, hi=2**40: (lambda v: _is_int(v) and lo <= v <= hi)  # noqa: E731
    text = lambda v: isinstance(v, str)  # noqa: E731
    for role in ("source", "target"):
        info = _get(data, role, "", lambda v: isinstance(v, dict), "an object")
        _get(info, "name_or_path", role, text, "a string")
        _get(info, "revision", role, lambda v: v is None or isinstance(v, str), "a string or null")
        _get(info, "architecture", role, text, "a string")
        for key, lo in (("num_layers", 1), ("num_kv_heads", 1), ("head_dim", 1), ("max_positions", 0)):
            _get(info, key, role, integer(lo), f"an integer from {lo} to 2**40")
        _get(info, "tokenizer_sha256", role, text, "a string")
        _get(info, "weights_sha256", role, lambda v: v is None or isinstance(v, str), "a string or null",
             required=False)
        rope = _get(info, "rope", role, lambda v: isinstance(v, dict), "an object")
        _get(rope, "model_type", f"{role}.rope", text, "a string")
        _get(rope, "rope_type", f"{role}.rope", text, "a string")
        _get(rope, "head_dim", f"{role}.rope", integer(1), "an integer from 1 to 2**40")
        _get(rope, "parameters", f"{role}.rope", lambda v: isinstance(v, dict) and all(
            x is None or isinstance(x, (str, int, float, bool)) for x in v.values()),
            "an object of numbers, strings, booleans or nulls", required=False)
    selection = _get(data, "selection", "", lambda v: isinstance(v, dict), "an object")
    for kind in ("key", "value"):
        _get(selection, kind, "selection", lambda v: isinstance(v, list) and all(
            isinstance(layers, list) and all(_is_int(s) for s in layers) for layers in v),
            "a list (one per target layer) of lists of source layer indices")
    fit = _get(data, "fit", "", lambda v: isinstance(v, dict), "an object", required=False) or {}
    _get(fit, "settings", "fit", lambda v: isinstance(v, dict), "an object", required=False)
    levers = _get(data, "levers", "", lambda v: isinstance(v, list), "a list", required=False) or []
    for i, lever in enumerate(levers):
        where = f"levers[{i}]"
        if not isinstance(lever, dict):
            raise _bad(where, "an object", lever)
        _get(lever, "kind", where, text, "'key' or 'value'")
        _get(lever, "layer", where, integer(0), "an integer from 0 to 2**40")
        _get(lever, "lags", where, lambda v: isinstance(v, list) and all(_is_int(j) for j in v),
             "a list of integers", required=False)
        _get(lever, "inputs", where, lambda v: isinstance(v, list) and all(isinstance(k, str) for k in v),
             "a list of 'key'/'value'/'state'", required=False)
        _get(lever, "hidden", where, integer(0), "an integer >= 0", required=False)
        if _get(lever, "state", where, integer(0), "an integer >= 0", required=False) and version < 3:
            raise ArtifactError(f"{CONFIG_FILE} {where} reads the source's state, which format version {version} "
                                "cannot hold (version 3 can); the file was edited or is corrupted.")
    ranks = _get(data, "ranks", "", lambda v: isinstance(v, dict) and set(v) <= {"key", "value"} and all(
        isinstance(r, list) and all(_is_int(x) and x >= 0 for x in r) for r in v.values()),
        "an object of 'key'/'value' lists of integers >= 0 (one per target layer)", required=False)
    if ranks and any(any(r) for r in ranks.values()) and version < 4:
        raise ArtifactError(f"{CONFIG_FILE} holds reduced-rank maps, which format version {version} cannot hold "
                            "(version 4 can); the file was edited or is corrupted.")
    heads = _get(data, "heads", "", lambda v: isinstance(v, dict) and set(v) <= {"key", "value"} and all(
        isinstance(n, list) and all(_is_int(x) and x >= 1 for x in n) for n in v.values()),
        "an object of 'key'/'value' lists of integers >= 1 (one per target layer)", required=False)
    if heads and any(any(n != 1 for n in v) for v in heads.values()) and version < 5:
        raise ArtifactError(f"{CONFIG_FILE} holds head-blocked maps, which format version {version} cannot hold "
                            "(version 5 can); the file was edited or is corrupted.")
    runtime = _get(data, "runtime", "", lambda v: isinstance(v, dict), "an object", required=False) or {}
    _get(runtime, "hold_back", "runtime", integer(1), "an integer >= 1", required=False)
    _get(runtime, "recompute", "runtime", lambda v: isinstance(v, (int, float)) and not isinstance(v, bool)
         and 0 <= v <= 1, "a number in [0, 1]", required=False)
    _get(runtime, "recompute_by", "runtime", text, "a string", required=False)
    _get(runtime, "recompute_window", "runtime", lambda v: integer(1)(v) and v % 2 == 1, "an odd integer >= 1",
         required=False)
    _get(runtime, "sink", "runtime", lambda v: isinstance(v, bool), "true or false", required=False)
    for key in ("bigram_pairs", "bigram_vocab"):
        _get(runtime, key, "runtime", integer(0), "an integer >= 0", required=False)
