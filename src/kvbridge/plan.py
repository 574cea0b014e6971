"""Memory and FLOPs of a fit and of the runtime, from the two models' configs alone (``kvbridge plan``).

Nothing is loaded but the configs: a folder, a ``config.json``, a hub id (config only), or the shipped
Ministral-3 3B / 8B text configs (offline). Parameter counts come from the architecture built on the
``meta`` device (no memory). Every figure is arithmetic over the tensors the code allocates, phase by
phase; model activations are an estimate (hidden and MLP widths, no attention matrix: SDPA kernels do not
materialise it on GPU). ``tests/test_plan.py`` holds the fit's arithmetic to a measured peak.

Letters: Fs, Ft features per source / target layer (KV heads × head dim), Fx = Ls·Fs, Fy = Lt·Ft, S the
source features one target layer reads, R observations gathered before one statistics update.

Fit phases (see :mod:`kvbridge.stats` and :func:`kvbridge.fit.fit_mapper`):

* capture — host: K and V statistics in float64, 2·8·(Fx² + Fx·Fy + Fx + 2·Fy). Device: the observation
  buffers 2·R·(Fx + Fy) in the model dtype, plus the larger of one batch's caches, features and
  activations, or one blocked update (two R × block float64 operands and a block × block product).
* solve — device: one copy of G_SS and its Cholesky factor (2·S²·8) and one layer's C and W; host: the
  statistics, the index copy of G_SS when a layer reads a subset, the float32 weights solved so far.
* levers — host: each lever's statistics and the residual MLP's training sample (float32, twice while it
  is concatenated); device: a lever's G and factor, the MLP's training step.
* mapper — host: the float32 weights, twice while the group operands are concatenated.

The fit's peak on its device is the largest phase; on CPU host and device are one memory and add up.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from .errors import InputError, ModelLoadError

CONFIGS = Path(__file__).parent / "configs"
SHIPPED = {  # names and hub ids whose text config ships with kvbridge (no network needed)
    "ministral3-3b-text": "ministral3-3b-text", "mistralai/Ministral-3-3B-Reasoning-2512": "ministral3-3b-text",
    "ministral3-8b-text": "ministral3-8b-text", "mistralai/Ministral-3-8B-Reasoning-2512": "ministral3-8b-text",
}
F64, F32 = 8, 4


@dataclass(frozen=True)
class ModelShape:
    """What the plan needs of one model."""

    name: str
    layers: int
    kv_heads: int
    head_dim: int
    heads: int
    hidden: int
    intermediate: int
    vocab: int
    parameters: int

    @property
    def kv_features(self) -> int:
        return self.kv_heads * self.head_dim

    def activations(self, tokens: int, itemsize: int) -> int:
        """Estimated transient bytes of one forward over ``tokens`` (batch × length): the residual stream,
        attention projections and the gated MLP of one layer at a time."""
        width = 4 * self.hidden + (self.heads + 2 * self.kv_heads) * self.head_dim + 3 * self.intermediate
        return tokens * width * itemsize

    def cache(self, tokens: int, itemsize: int) -> int:
        return 2 * self.layers * tokens * self.kv_features * itemsize


def read_config(spec: str, revision: str | None = None):
    """The decoder config of ``spec``: a shipped name or known hub id, a config.json, a folder, or a hub id."""
    from transformers import AutoConfig

    if not isinstance(spec, str) or not spec.strip():
        raise InputError("pass a model: a folder, a config.json, a hub id, or one of " + ", ".join(SHIPPED) + ".")
    if spec in SHIPPED:
        return _config_from_dict(json.loads((CONFIGS / f"{SHIPPED[spec]}.json").read_text()), spec)
    path = Path(spec).expanduser()
    if path.is_file():
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, ValueError) as exc:
            raise InputError(f"{spec} is not a readable JSON model config ({exc}).") from None
        return _config_from_dict(data, spec)
    if not path.is_dir():
        from .hub import snapshot

        try:
            path, _ = snapshot(spec, revision, ["config.json"], ModelLoadError, "model")
        except ModelLoadError as exc:
            raise ModelLoadError(f"{exc} Offline, pass a folder or a config.json, or one of the shipped configs: "
                                 f"{', '.join(SHIPPED)}.") from None
    try:
        config = AutoConfig.from_pretrained(path)
    except (OSError, ValueError, KeyError) as exc:
        raise ModelLoadError(f"cannot read the model config in {path}: {exc}") from None
    return config.get_text_config(decoder=True)


def _config_from_dict(data: dict, where: str):
    from transformers import AutoConfig

    if not isinstance(data, dict) or "model_type" not in data:
        raise InputError(f"{where} has no 'model_type': it is not a transformers model config.")
    kwargs = {k: v for k, v in data.items() if k not in ("model_type", "architectures")}
    try:
        config = AutoConfig.for_model(data["model_type"], **kwargs)
    except (ValueError, KeyError, TypeError) as exc:
        raise InputError(f"{where}: transformers cannot build a config from it ({exc}).") from None
    return config.get_text_config(decoder=True)


def model_shape(config, name: str = "") -> ModelShape:
    """Geometry and exact parameter count (the causal LM built on the meta device) of a decoder config."""
    from transformers import AutoModelForCausalLM

    try:
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config)
    except (ValueError, KeyError, TypeError) as exc:
        raise InputError(f"{name or 'the model'}: transformers cannot build a causal LM from its config ({exc}).") \
            from None
    heads = int(config.num_attention_heads)
    return ModelShape(
        name=name, layers=int(config.num_hidden_layers), kv_heads=int(getattr(config, "num_key_value_heads", heads)),
        head_dim=int(getattr(config, "head_dim", None) or config.hidden_size // heads), heads=heads,
        hidden=int(config.hidden_size), intermediate=int(config.intermediate_size), vocab=int(config.vocab_size),
        parameters=sum(p.numel() for p in model.parameters()),
    )


@dataclass
class Phase:
    """Bytes one phase of a fit holds at its peak, on the host and on the fit's device."""

    name: str
    host: int
    device: int
    parts: dict[str, int] = field(default_factory=dict)


def _square(n: int) -> int:
    return n * n


def fit_phases(source: ModelShape, target: ModelShape, config, itemsize: int) -> list[Phase]:
    """The fit's phases for :class:`kvbridge.fit.FitConfig` ``config``, models in ``itemsize``-byte floats.

    Device figures exclude the model weights (see :func:`plan`).
    """
    from .stats import BLOCK, FLUSH_OBSERVATIONS

    fs, ft = source.kv_features, target.kv_features
    fx, fy = source.layers * fs, target.layers * ft
    stats = 2 * F64 * (_square(fx) + fx * fy + fx + 2 * fy)
    observed = math.ceil(config.seq_len / config.stride)
    batch_tokens = config.batch_size * config.seq_len
    total_obs = config.num_texts * observed
    rows = min(FLUSH_OBSERVATIONS, max(total_obs, 1))
    b_left, b_right = min(BLOCK, fx), min(BLOCK, max(fx, fy))
    update = F64 * (rows * b_left + rows * b_right + b_left * b_right)
    buffers = 2 * rows * (fx + fy) * itemsize
    caches = source.cache(batch_tokens, itemsize) + target.cache(batch_tokens, itemsize)
    content = batch_tokens * (fx + fy) * F32  # content keys are float32 after RoPE removal
    features = 2 * batch_tokens * (fx + fy) * itemsize + 2 * config.batch_size * observed * (fx + fy) * itemsize
    forward = max(source.activations(batch_tokens, itemsize), target.activations(batch_tokens, itemsize))
    batch = caches + content + features
    capture = Phase("capture", stats, buffers + max(batch + forward, batch // 2 + update),
                    {"statistics (host)": stats, "observation buffers": buffers, "one batch": batch + forward,
                     "one blocked update": update})

    sel = fx if config.top_k is None or config.top_k >= source.layers else config.top_k * fs
    subset = sel != fx
    layer_solve = sel * ft * (F64 + F64 + F32) + ft * F64  # C (on the device), W, W in float32, bias
    weights_key = target.layers * (fx if not subset else sel) * ft * F32
    solve_device = 2 * F64 * _square(sel) + layer_solve
    solve_host = stats + weights_key + (F64 * (_square(sel) + sel * ft) if subset else 0)
    solve = Phase("solve", solve_host, solve_device,
                  {"G_SS copy and factor (device)": 2 * F64 * _square(sel), "one layer's C and W": layer_solve,
                   "statistics (host)": stats, "key weights (host)": weights_key})
    phases = [capture, solve]

    levers = _levers(config, source, target)
    if levers:
        widths = [w for w, _ in levers]
        lever_stats = sum(F64 * (_square(w) + w * ft) for w in widths)
        lever_obs = config.num_texts * math.ceil(config.seq_len / config.lever_stride)
        sample = max((min(config.mlp_observations, lever_obs) * (w + ft) * F32 * 2 for w, h in levers if h), default=0)
        plain_weights = 2 * target.layers * (fx if not subset else sel) * ft * F32
        device = max(2 * F64 * _square(w) + w * ft * 3 * F64 for w in widths)
        mlp = max((config.mlp_batch * (w + 2 * h + 2 * ft) * F32 * 4 for w, h in levers if h), default=0)
        phases.append(Phase("levers", lever_stats + sample + plain_weights, max(device, mlp + batch + forward),
                            {"lever statistics (host)": lever_stats, "MLP sample (host)": sample,
                             "lever G and factor (device)": device}))
    params = _mapper_parameters(source, target, config, sel, levers)
    phases.append(Phase("mapper", 2 * params * F32, 0, {"float32 weights, concatenated once": 2 * params * F32}))
    return phases


def _levers(config, source: ModelShape, target: ModelShape) -> list[tuple[int, int]]:
    """(input features, MLP width) of each lever the fit adds."""
    if not config.has_levers:
        return []
    count = len(config.lever_layers) if config.lever_layers is not None else config.lever_count
    top = source.layers if config.lever_top_k is None else min(config.lever_top_k, source.layers)
    if config.top_k is not None:
        top = min(top, config.top_k)
    per_lag = sum(top * source.kv_features if kind != "state" else source.hidden
                  for kind in (config.lever_input_kinds or ("key",)))
    return [(len(config.lags) * per_lag, config.mlp_hidden)] * (count * len(config.lever_kinds))


def _mapper_parameters(source, target, config, sel, levers) -> int:
    ft = target.kv_features
    plain = 2 * target.layers * (sel * ft + ft)
    extra = sum((w - sel) * ft + (w * h + h + h * ft + ft if h else 0) for w, h in levers)
    return plain + extra


def plan(source: ModelShape, target: ModelShape, config, device: str = "cuda", dtype: str = "bfloat16",
         contexts: tuple[int, ...] = (1024, 8192), batch: int = 1, chunk_tokens: int = 1024) -> dict:
    """The whole plan as a JSON-ready dict: ``fit_peak_bytes`` is the fit's working memory on ``device``
    (beyond the model weights; on CPU host memory included)."""
    itemsize = torch.empty(0, dtype=getattr(torch, dtype)).element_size()
    cpu = torch.device(device).type == "cpu"
    phases = fit_phases(source, target, config, itemsize)
    weights = (source.parameters + target.parameters) * itemsize
    on_device = [p.device + (p.host if cpu else 0) for p in phases]
    peak = max(on_device)
    runtime = [runtime_row(source, target, config, n, batch, itemsize, chunk_tokens) for n in contexts]
    levers = _levers(config, source, target)
    sel = source.layers * source.kv_features if config.top_k is None else min(config.top_k, source.layers) * \
        source.kv_features
    params = _mapper_parameters(source, target, config, sel, levers)
    return {
        "source": asdict(source), "target": asdict(target), "device": device, "dtype": dtype,
        "fit_settings": asdict(config),
        "fit_peak_bytes": peak,
        "fit_peak_phase": phases[on_device.index(peak)].name,
        "fit_host_peak_bytes": max(p.host for p in phases) if not cpu else peak + weights,
        "fit_models_bytes": weights,
        "fit_device_total_bytes": peak + weights,
        "fit_phases": [asdict(p) for p in phases],
        "fit_statistics_gflop": _statistics_flops(source, target, config) / 1e9,
        "mapper_parameters": params,
        "mapper_bytes": params * itemsize,
        "runtime": runtime,
    }


def _statistics_flops(source: ModelShape, target: ModelShape, config) -> float:
    fx, fy = source.layers * source.kv_features, target.layers * target.kv_features
    n = config.num_texts * math.ceil(config.seq_len / config.stride)
    return 2.0 * 2 * n * fx * (fx + fy)


def runtime_row(source: ModelShape, target: ModelShape, config, tokens: int, batch: int, itemsize: int,
                chunk_tokens: int) -> dict:
    """Bytes of one mapped prefill of ``batch`` × ``tokens`` on one device: weights, both caches, the map's
    transient (one chunk's features and outputs) and the larger forward's activations."""
    levers = _levers(config, source, target)
    sel = source.layers * source.kv_features if config.top_k is None else min(config.top_k, source.layers) * \
        source.kv_features
    params = _mapper_parameters(source, target, config, sel, levers)
    chunk = batch * min(tokens, chunk_tokens)
    widest = max([sel] + [w for w, _ in levers])
    mapping = chunk * (widest + target.layers * target.kv_features * 2) * itemsize
    parts = {
        "models": (source.parameters + target.parameters) * itemsize,
        "mapper": params * itemsize,
        "source cache": source.cache(batch * tokens, itemsize),
        "target cache": target.cache(batch * tokens, itemsize),
        "map transient": mapping,
        "activations": max(source.activations(batch * tokens, itemsize),
                           target.activations(batch * max(config.hold_back, 1), itemsize)),
    }
    return {"context_tokens": tokens, "batch": batch, "total_bytes": sum(parts.values()), "parts": parts}


def plan_table(result: dict) -> str:
    """The plan as text: fit phases and runtime rows, in GiB."""
    def gib(v):
        return f"{v / 2**30:,.2f} GiB"

    s, t = result["source"], result["target"]
    lines = [f"{s['name']} ({s['parameters'] / 1e9:.2f} B parameters) → {t['name']} "
             f"({t['parameters'] / 1e9:.2f} B), {result['dtype']} on {result['device']}", "",
             "| Fit phase | Host | Device (beyond the models) |", "|---|---:|---:|"]
    for p in result["fit_phases"]:
        lines.append(f"| {p['name']} | {gib(p['host'])} | {gib(p['device'])} |")
    lines += ["", f"fit peak on {result['device']}: {gib(result['fit_peak_bytes'])} ({result['fit_peak_phase']}), "
                  f"plus the models' weights {gib(result['fit_models_bytes'])} = "
                  f"{gib(result['fit_device_total_bytes'])}; host peak {gib(result['fit_host_peak_bytes'])}; "
                  f"statistics {result['fit_statistics_gflop']:,.0f} GFLOP",
              f"mapper: {result['mapper_parameters'] / 1e9:.3f} B parameters, {gib(result['mapper_bytes'])}", "",
              "| Context tokens | Models | Mapper | Source cache | Target cache | Map transient | Activations | "
              "Total |", "|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for row in result["runtime"]:
        p = row["parts"]
        lines.append(f"| {row['context_tokens']:,} | {gib(p['models'])} | {gib(p['mapper'])} | "
                     f"{gib(p['source cache'])} | {gib(p['target cache'])} | {gib(p['map transient'])} | "
                     f"{gib(p['activations'])} | {gib(row['total_bytes'])} |")
    return "\n".join(lines)


def parse_contexts(text: str) -> tuple[int, ...]:
    if not re.fullmatch(r"\s*\d+(\s*,\s*\d+)*\s*", text or "") or any(int(v) < 1 for v in text.split(",")):
        raise InputError(f"--contexts must be positive integers separated by commas, e.g. 1024,8192, not {text!r}.")
    return tuple(int(v) for v in text.split(","))


def measured_peak(fn, device: str | torch.device = "cpu"):
    """``(fn(), peak bytes of the tensors fn allocated beyond those alive before it)``.

    On CUDA the caching allocator's peak; on CPU a tensor-bytes account: every allocation and free torch
    records (``torch.profiler`` memory events) summed in order.
    """
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        base = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        result = fn()
        torch.cuda.synchronize(device)
        return result, int(torch.cuda.max_memory_allocated(device)) - base
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        result = fn()
    live = peak = 0
    events = [e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]" and e.device_type() ==
              torch.autograd.DeviceType.CPU]
    for e in sorted(events, key=lambda e: e.start_ns()):
        live += e.nbytes()
        peak = max(peak, live)
    return result, peak
