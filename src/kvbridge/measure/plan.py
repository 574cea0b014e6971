"""Memory and FLOPs of a fit and of the runtime, from the two models' configs alone (``kvbridge plan``).

Nothing is loaded but the configs: a folder, a ``config.json``, a hub id (config only), or the shipped
Ministral-3 3B / 8B text configs (offline). Parameter counts come from the architecture built on the
``meta`` device (no memory). Every figure is arithmetic over the tensors the code allocates, phase by
phase; model activations are an estimate (hidden and MLP widths, no attention matrix: SDPA kernels do not
materialise it on GPU). ``tests/test_plan.py`` holds the fit's arithmetic to a measured peak.

Letters: Fs, Ft features per source / target layer (KV heads × head dim), Fx = Ls·Fs, Fy = Lt·Ft, S the
source features one target layer reads, R observations gathered before one statistics update.

Fit phases (see :mod:`kvbridge.fit.stats` and :func:`kvbridge.fit.fit_mapper`):

* capture — the K and V statistics in float64, 2·8·(Fx² + Fx·Fy + Fx + 2·Fy), on the device when the fit
  keeps them there (``totals="device"``, the fit's choice on a GPU with room for them), else on the host.
  Device: the observation buffers R·(Fx + Fy) for keys (float32: RoPE removed) and for values (model dtype),
  plus the larger of one batch's caches, features and activations, or one blocked update (two R × block
  float64 operands and a block × block product).
* solve — device: one copy of G_SS and its Cholesky factor (2·S²·8) and one layer's C and W, beside the
  statistics when they are there; host: the statistics (when they are there), the index copy of G_SS when a
  layer reads a subset, both kinds' float32 weights.
* lever solve — host: each lever's statistics and the residual MLP's sample (float32), the plain weights;
  device: a lever's G and its factor.
* lever MLP — host: the sample three times (collected, concatenated, standardised) and a training step
  (the lever's statistics are freed by then): the MLP trains in host memory.
* lever tune (``--lever-objective output``) — host: the tuning rows' lever features and the hidden states
  entering the first lever layer (model dtype); device: one step's lever maps with their gradients, one
  layer's activations and the input of every layer it runs (from the first lever layer on; all of them
  when the fit picks the layers: they are checkpointed), the native and mapped log-probabilities.
* mapper — host: the float32 weights, twice while the group operands are concatenated.

The fit's peak on its device is the largest phase; on CPU host and device are one memory and add up.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from ..errors import InputError, ModelLoadError

CONFIGS = Path(__file__).parents[1] / "configs"  # kvbridge/configs
SHIPPED = {  # names and hub ids whose text config ships with kvbridge (no network needed)
    "ministral3-3b-text": "ministral3-3b-text", "mistralai/Ministral-3-3B-Reasoning-2512": "ministral3-3b-text",
    "ministral3-8b-text": "ministral3-8b-text", "mistralai/Ministral-3-8B-Reasoning-2512": "ministral3-8b-text",
}
F64, F32 = 8, 4
DEFAULT_CONTEXTS = (1024, 8192, 32768)


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
    max_positions: int = 0

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
        from ..core.hub import snapshot

        try:
            path, _ = snapshot(spec, revision, ["config.json"], ModelLoadError, "model")
        except ModelLoadError as exc:
            raise ModelLoadError(f"{exc} Offline, pass a folder or a config.json, or one of the shipped configs: "
                                 f"{', '.join(SHIPPED)}.") from None
    try:
        config = AutoConfig.from_pretrained(path)
    except Exception as exc:  # a missing file, bad JSON, an unknown model_type, a field of the wrong type, …
        raise ModelLoadError(f"cannot read the model config in {path}: {_first_line(exc)}") from None
    return config.get_text_config(decoder=True)


def _config_from_dict(data: dict, where: str):
    from transformers import AutoConfig

    if not isinstance(data, dict) or "model_type" not in data:
        raise InputError(f"{where} has no 'model_type': it is not a transformers model config.")
    kwargs = {k: v for k, v in data.items() if k not in ("model_type", "architectures")}
    try:
        config = AutoConfig.for_model(data["model_type"], **kwargs)
    except Exception as exc:  # an unknown model_type, a field of the wrong type, …
        raise InputError(f"{where}: transformers cannot build a config from it ({_first_line(exc)}).") from None
    return config.get_text_config(decoder=True)


# the largest size of each config field plan accepts: far above any released decoder (Llama-3.1-405B: 126 layers,
# 16,384 hidden, 53,248 MLP, 128,256 tokens, 131,072 positions), far below what would tie a machine up
CONFIG_LIMITS = {"num_hidden_layers": 4096, "num_attention_heads": 4096, "num_key_value_heads": 4096,
                 "head_dim": 4096, "hidden_size": 1 << 18, "intermediate_size": 1 << 21, "vocab_size": 1 << 23,
                 "max_position_embeddings": 1 << 26}


def model_shape(config, name: str = "") -> ModelShape:
    """Geometry and exact parameter count (the causal LM built on the meta device) of a decoder config."""
    from transformers import AutoModelForCausalLM

    what = name or "the model"
    missing = [k for k in ("num_hidden_layers", "num_attention_heads", "hidden_size", "intermediate_size",
                           "vocab_size") if not isinstance(getattr(config, k, None), int)]
    if missing:
        raise InputError(f"{what}: its config has no integer {', '.join(missing)}; kvbridge plans decoder-only "
                         "transformers with a KV cache (Llama, Mistral, Ministral-3, Qwen, …).")
    heads = int(config.num_attention_heads)
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // max(heads, 1)
    positions = getattr(config, "max_position_embeddings", None)
    sizes = {"num_hidden_layers": config.num_hidden_layers, "num_attention_heads": heads,
             "num_key_value_heads": kv_heads, "head_dim": head_dim, "hidden_size": config.hidden_size,
             "intermediate_size": config.intermediate_size, "vocab_size": config.vocab_size}
    if positions is not None:
        sizes["max_position_embeddings"] = positions
    for key, value in sizes.items():  # bounded before any arithmetic or allocation: a config may come from anyone
        if not isinstance(value, int) or isinstance(value, bool) or not 1 <= value <= CONFIG_LIMITS[key]:
            raise InputError(f"{what}: its config's {key} is {value!r}; kvbridge plans {key} from 1 to "
                             f"{CONFIG_LIMITS[key]:,}. Check the config.")
    if kv_heads > heads or heads % kv_heads:
        raise InputError(f"{what}: its config has {kv_heads} key-value heads for {heads} attention heads; the "
                         "attention heads must be a multiple of the key-value heads.")
    try:
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config)
    except Exception as exc:  # transformers raises many kinds for a config it cannot build
        raise InputError(f"{what}: transformers cannot build a causal LM from its config ({_first_line(exc)}).") \
            from None
    return ModelShape(
        name=name, layers=int(config.num_hidden_layers), kv_heads=kv_heads, head_dim=head_dim, heads=heads,
        hidden=int(config.hidden_size), intermediate=int(config.intermediate_size), vocab=int(config.vocab_size),
        parameters=sum(p.numel() for p in model.parameters()),
        max_positions=int(getattr(config, "max_position_embeddings", 0) or 0),
    )


def _first_line(exc: BaseException, limit: int = 300) -> str:
    text = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
    return text if len(text) <= limit else text[: limit - 1] + "…"


@dataclass
class Phase:
    """Bytes one phase of a fit holds at its peak, on the host and on the fit's device."""

    name: str
    host: int
    device: int
    parts: dict[str, int] = field(default_factory=dict)


def _square(n: int) -> int:
    return n * n


def selected_features(config, source: ModelShape) -> int:
    """S: the source features each plain target layer reads (all layers, or --top-k of them)."""
    layers = source.layers if config.top_k is None else min(config.top_k, source.layers)
    return layers * source.kv_features


def fit_phases(source: ModelShape, target: ModelShape, config, itemsize: int, totals: str = "host"
               ) -> list[Phase]:
    """The fit's phases for :class:`kvbridge.fit.FitConfig` ``config``, models in ``itemsize``-byte floats,
    the statistics' totals on the ``totals`` side ("host" or "device", :func:`kvbridge.fit.stats.totals_device`).

    Device figures exclude the model weights (see :func:`plan`); host figures are one process's.
    """
    from ..fit.stats import BLOCK, FLUSH_OBSERVATIONS, statistics_bytes

    if totals not in ("host", "device"):
        raise InputError(f"the statistics' totals are kept on the 'host' or the 'device', not {totals!r}.")
    fs, ft = source.kv_features, target.kv_features
    fx, fy = source.layers * fs, target.layers * ft
    stats = statistics_bytes(fx, fy)
    on_host, on_device = (stats, 0) if totals == "host" else (0, stats)
    observed = math.ceil(config.seq_len / config.stride)
    batch_tokens = config.batch_size * config.seq_len
    rows = min(FLUSH_OBSERVATIONS, max(config.num_texts * observed, 1))
    b_left, b_right = min(BLOCK, fx), min(BLOCK, max(fx, fy))
    update = F64 * (rows * b_left + rows * b_right + b_left * b_right)
    buffers = rows * (fx + fy) * (F32 + itemsize)  # content keys are float32 (RoPE removed), values the model's
    caches = source.cache(batch_tokens, itemsize) + target.cache(batch_tokens, itemsize)
    content = batch_tokens * (fx + fy) * F32
    features = (batch_tokens + config.batch_size * observed) * (fx + fy) * (F32 + itemsize)
    forward = max(source.activations(batch_tokens, itemsize), target.activations(batch_tokens, itemsize))
    batch = caches + content + features
    capture = Phase("capture", on_host, on_device + buffers + max(batch + forward, batch // 2 + update),
                    {f"statistics ({totals})": stats, "observation buffers": buffers, "one batch": batch + forward,
                     "one blocked update": update})

    sel = selected_features(config, source)
    subset = sel != fx
    layer_solve = sel * ft * (F64 + F64 + F32) + ft * F64  # C (on the device), W, W in float32, bias
    weights = 2 * target.layers * sel * ft * F32  # both kinds' float32 weights, all solved by the end
    index_copy = F64 * (_square(sel) + sel * ft) if subset else 0  # G_SS and C rows of a subset, where the stats are
    solve_device = on_device + 2 * F64 * _square(sel) + layer_solve + (index_copy if on_device else 0)
    solve_host = on_host + weights + (0 if on_device else index_copy)
    solve = Phase("solve", solve_host, solve_device,
                  {"G_SS copy and factor (device)": 2 * F64 * _square(sel), "one layer's C and W": layer_solve,
                   f"statistics ({totals})": stats, "weights (host)": weights})
    phases = [capture, solve]

    levers = _levers(config, source, target)
    if levers:
        widths = [w for w, _ in levers]
        lever_stats = sum(F64 * (_square(w) + w * ft) for w in widths)
        lever_obs = config.num_texts * math.ceil(config.seq_len / config.lever_stride)
        sample = max((min(config.mlp_observations, lever_obs) * (w + ft) * F32 for w, h in levers if h), default=0)
        device = max(2 * F64 * _square(w) + w * ft * 3 * F64 for w in widths)
        phases.append(Phase("lever solve", lever_stats + sample + weights, max(device, batch + forward),
                            {"lever statistics (host)": lever_stats, "MLP sample (host)": sample,
                             "lever G and factor (device)": device}))
        if sample:  # the residual MLP trains in host memory: the sample concatenated, then standardised
            step = max(config.mlp_batch * (w + 2 * h + 2 * ft) * F32 * 4 for w, h in levers if h)
            phases.append(Phase("lever MLP", 3 * sample + weights + step, 0,  # its statistics are freed by then
                                {"sample, concatenated, standardised (host)": 3 * sample,
                                 "one training step (host)": step}))
        if config.lever_objective == "output":
            phases.append(_tune_phase(config, source, target, levers, weights, itemsize))
    params = mapper_parameters(source, target, config)
    phases.append(Phase("mapper", 2 * params * F32, 0, {"float32 weights, concatenated once": 2 * params * F32}))
    return phases


def _tune_phase(config, source: ModelShape, target: ModelShape, levers: list[tuple[int, int]], weights: int,
                itemsize: int) -> Phase:
    """Tuning the levers (:mod:`kvbridge.fit.tune`): rows and features in host memory, a step's graph on the device."""
    rows = min(config.tune_rows, config.num_texts)
    if config.tune_plain:  # the lever layers' plain maps of the other kinds train too: (features, no MLP) each
        count = len(levers) // len(config.lever_kinds)
        levers = levers + [(selected_features(config, source), 0)] * (count * (2 - len(set(config.lever_kinds))))
    held = rows * config.seq_len * (sum(w for w, _ in levers) + target.hidden) * itemsize
    tokens = min(config.tune_batch, rows) * config.seq_len
    # layers the step runs: from the first lever layer on (unknown before the fit picks them: all, at most)
    layers = target.layers - (min(config.lever_layers) if config.lever_layers else 0)
    maps = tokens * sum(2 * w + 3 * h + 2 * target.kv_features for w, h in levers) * F32
    # a layer's activations, kept for the backward pass; through several, checkpointed: their inputs and one layer's
    graph = target.activations(tokens, F32) + (layers * tokens * target.hidden * F32 if layers > 1 else 0)
    logprobs = 4 * tokens * target.vocab * F32  # native and mapped log-probabilities, their gap, its gradient
    return Phase("lever tune", held + weights, maps + graph + logprobs,
                 {"rows' features and hidden states (host)": held, "lever maps with gradients": maps,
                  "activations kept for the backward pass": graph, "log-probabilities": logprobs})


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


def mapper_parameters(source: ModelShape, target: ModelShape, config) -> int:
    """Parameters of the mapper a fit with ``config`` writes."""
    ft, sel = target.kv_features, selected_features(config, source)
    plain = 2 * target.layers * (sel * ft + ft)
    extra = sum((w - sel) * ft + (w * h + h + h * ft + ft if h else 0) for w, h in _levers(config, source, target))
    return plain + extra


def check_geometry(config, source_layers: int, target_layers: int, max_positions=(), kv_heads=()
                   ) -> None:
    """Settings that name layers or lengths the models do not have, refused before any work (fit and plan).
    ``config``: a :class:`kvbridge.fit.FitConfig`; ``max_positions``: each model's limit, 0 or None when it has none;
    ``kv_heads``: (source, target) KV heads."""
    from ..core.models import position_limit

    if config.head_blocks is not None and kv_heads and any(h % config.head_blocks for h in kv_heads):
        raise InputError(f"--head-blocks {config.head_blocks} must divide both models' KV heads "
                         f"({kv_heads[0]} and {kv_heads[1]}); pass a common divisor of them.")
    if config.source_depth is not None and config.source_depth > source_layers:
        raise InputError(f"--source-depth {config.source_depth}: the source has {source_layers} layers; pass at most "
                         "that (or leave it out).")
    if config.top_k is not None and config.top_k > source_layers:
        raise InputError(f"--top-k {config.top_k}: the source has {source_layers} layers; pass at most that "
                         "(or --top-k all for all of them).")
    limit = position_limit(*max_positions)
    if config.seq_len > limit:
        raise InputError(f"--seq-len {config.seq_len} exceeds the {limit} positions these models support; pass at "
                         f"most {limit}.")
    for flag, value in (("--hold-back", config.hold_back), ("--recompute-window", config.recompute_window)):
        if value > limit:  # recorded as runtime options: a value no prompt can honour would label native as mapped
            raise InputError(f"{flag} {value} exceeds the {limit} positions these models support; pass at most "
                             f"{limit}.")
    if config.native_layers >= target_layers:
        raise InputError(f"--native-layers {config.native_layers}: the target has {target_layers} layers and the map "
                         f"must fill at least one; pass at most {target_layers - 1}.")
    if config.has_levers and config.lever_layers and min(config.lever_layers) < config.native_layers:
        raise InputError(f"--lever-layers {list(config.lever_layers)}: the target computes its first "
                         f"{config.native_layers} layers itself (--native-layers); put levers on layers "
                         f"{config.native_layers} to {target_layers - 1}.")
    if config.has_levers and config.lever_layers is None and config.lever_count > target_layers - config.native_layers:
        raise InputError(f"--lever-count {config.lever_count}: the map fills {target_layers - config.native_layers} "
                         "target layers; pass at most that.")
    if config.has_levers and config.lever_layers is None and config.lever_count > target_layers:
        raise InputError(f"--lever-count {config.lever_count}: the target has {target_layers} layers; pass at most "
                         "that.")
    if config.has_levers and config.lever_layers and max(config.lever_layers) >= target_layers:
        raise InputError(f"--lever-layers {list(config.lever_layers)}: the target has {target_layers} layers "
                         f"(0 to {target_layers - 1}).")


def device_peak(phases: list[Phase], device: str, names: tuple[str, ...] | None = None) -> int:
    """The largest phase on the fit's device (of ``names`` only, if given); on CPU host and device add up."""
    cpu = torch.device(device).type == "cpu"
    return max(p.device + (p.host if cpu else 0) for p in phases if names is None or p.name in names)


def plan(source: ModelShape, target: ModelShape, config, device: str = "cuda", dtype: str = "bfloat16",
         contexts: tuple[int, ...] | None = None, batch: int = 1, processes: int = 1, totals: str | None = None
         ) -> dict:
    """The whole plan as a JSON-ready dict: ``fit_peak_bytes`` is the fit's working memory on ``device``
    (beyond the model weights; on CPU host memory included); ``processes`` fit processes on one machine
    each hold their own statistics. ``totals``: where the fit keeps them, "host" or "device" (default: the
    device on an accelerator, where ``kvbridge fit`` keeps them when they fit, else the host); the plan also
    gives the other choice's peak."""
    from ..core.models import position_limit

    check_geometry(config, source.layers, target.layers, (source.max_positions, target.max_positions))
    limit = position_limit(source.max_positions, target.max_positions)
    if contexts is None:  # the defaults these models support, or their longest context
        contexts = tuple(n for n in DEFAULT_CONTEXTS if n <= limit) or (limit,)
    if max(contexts) > limit:
        raise InputError(f"--contexts {max(contexts):,} exceeds the {limit:,} positions these models support.")
    if processes < 1:
        raise InputError("--processes must be at least 1.")
    itemsize = torch.empty(0, dtype=getattr(torch, dtype)).element_size()
    accelerator = torch.device(device).type != "cpu"
    totals = ("device" if accelerator else "host") if totals is None else totals
    phases = fit_phases(source, target, config, itemsize, totals)
    other = "host" if totals == "device" else "device"
    weights = (source.parameters + target.parameters) * itemsize
    peak = device_peak(phases, device)
    peak_phase = next(p.name for p in phases if device_peak([p], device) == peak)
    host = max(p.host for p in phases)
    params = mapper_parameters(source, target, config)
    return {
        "source": asdict(source), "target": asdict(target), "device": device, "dtype": dtype,
        "fit_settings": asdict(config),
        "fit_peak_bytes": peak,
        "fit_peak_phase": peak_phase,
        "fit_totals": totals,
        f"fit_peak_bytes_totals_on_{other}": device_peak(fit_phases(source, target, config, itemsize, other), device),
        "fit_models_bytes": weights,
        "fit_device_total_bytes": peak + weights,
        "fit_host_peak_bytes_per_process": host,
        "fit_processes": processes,
        # the other processes hold their statistics only until they are all-reduced; rank 0 goes on alone
        "fit_host_peak_bytes_all_processes": max(processes * phases[0].host, max(p.host for p in phases[1:])),
        "fit_phases": [asdict(p) for p in phases],
        "fit_statistics_gflop": _statistics_flops(source, target, config) / 1e9,
        "mapper_parameters": params,
        "mapper_bytes": params * itemsize,
        "runtime": [runtime_row(source, target, config, n, batch, itemsize) for n in contexts],
    }


def _statistics_flops(source: ModelShape, target: ModelShape, config) -> float:
    fx, fy = source.layers * source.kv_features, target.layers * target.kv_features
    n = config.num_texts * math.ceil(config.seq_len / config.stride)
    return 2.0 * 2 * n * fx * (fx + fy)


def runtime_row(source: ModelShape, target: ModelShape, config, tokens: int, batch: int, itemsize: int) -> dict:
    """Bytes of one mapped prefill of ``batch`` × ``tokens`` on one device: weights, both caches (the map
    writes the target's straight into it), the map's transient for one chunk, and the larger forward's
    activations."""
    import inspect

    from ..core.transfer import Bridge

    chunk = batch * min(tokens, inspect.signature(Bridge).parameters["chunk_tokens"].default)  # Bridge's default
    widest = max([selected_features(config, source)] + [w for w, _ in _levers(config, source, target)])
    fx, fy = source.layers * source.kv_features, target.layers * target.kv_features
    # the chunk's source K and V in float32 (kv_features), features built for a low-precision GEMM, and the
    # float32 copy of the mapped keys rotated before they are written into the cache in its dtype
    mapping = chunk * (2 * fx * F32 + (widest * itemsize if itemsize < F32 else 0) + fy * F32)
    parts = {
        "models": (source.parameters + target.parameters) * itemsize,
        "mapper": mapper_parameters(source, target, config) * itemsize,
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
    other = "host" if result["fit_totals"] == "device" else "device"
    lines += ["", f"fit peak on {result['device']}: {gib(result['fit_peak_bytes'])} ({result['fit_peak_phase']}; "
                  f"statistics on the {result['fit_totals']}, "
                  f"{gib(result[f'fit_peak_bytes_totals_on_{other}'])} with them on the {other}), "
                  f"plus the models' weights {gib(result['fit_models_bytes'])} = "
                  f"{gib(result['fit_device_total_bytes'])}; host peak {gib(result['fit_host_peak_bytes_per_process'])}"
                  + (f" in rank 0, {gib(result['fit_host_peak_bytes_all_processes'])} for all "
                     f"{result['fit_processes']} processes" if result['fit_processes'] > 1 else "") + "; "
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
