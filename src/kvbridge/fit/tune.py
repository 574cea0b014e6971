"""Tuning the levers end to end: on what the target predicts from their K/V, not on the K/V themselves.

Letters: N rows, T tokens a row, F_in features of one lever, H kv heads, D head dim, V vocabulary.

The closed form and the residual MLP (:mod:`kvbridge.fit.levers`) fit a lever layer's K/V by mean squared
error. That spends as much accuracy on directions of a key that no query reads as on those it does, and
as much on a token nothing attends to as on a name recalled 800 tokens later. Tuning starts from those
weights and trains every lever's parameters (the linear map and its MLP) on the target's own output:

* for calibration rows, the native hidden states entering the first lever layer are kept, with each
  lever's source features (host memory, the model dtype);
* a step runs the target's layers from there to the end by hand (:func:`kvbridge.core.models.decoder_layer`),
  the lever layers with their mapped K/V in place of their own, and once more without (no gradient);
* the loss is the KL divergence of the result from the native next-token distribution, averaged over
  tokens; AdamW, a warm-up and a cosine schedule, a fixed budget of steps, seeded. Through more than one
  layer, each layer's activations are recomputed in the backward pass (activation checkpointing), so a
  step holds one layer's activations and every layer's input.

The first 5 % of the (seeded) sample of rows, at least one, validate: the tuned weights are kept only if they lower the
validation KL, so tuning never makes a mapper worse on data it did not train on. Layers between lever
layers compute their own K/V from the hidden states in both passes (at runtime the plain map provides
them; their errors change little, see ``kvbridge diagnose --oracle``).

The target's layers must follow the Llama-style formula :func:`~kvbridge.core.models.decoder_layer` writes;
:func:`~kvbridge.core.models.check_decoder_layers` checks that on the first rows before anything is trained.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import torch
from torch.utils.checkpoint import checkpoint

from ..core.mapper_config import Features, Lever
from ..core.models import (
    LoadedModel,
    check_decoder_layers,
    decoder_layer,
    layer_inputs,
    next_token_logprobs,
    prefill_content,
)
from ..core.rope import rotary_factors
from ..errors import FitError
from .stats import iter_batches

OBJECTIVES = ("kv", "output")  # --lever-objective: mean squared error on K/V only, or then tuned on the output
PARTS = ("weight", "bias", "mlp.in.weight", "mlp.in.bias", "mlp.out.weight", "mlp.out.bias")


@dataclass(frozen=True)
class TuneBudget:
    """How the levers are tuned: a fixed, stated budget, seeded."""

    steps: int = 600
    batch: int = 2  # rows a step
    lr: float = 3e-4
    rows: int = 160  # calibration rows kept for tuning (a seeded sample beyond)
    seed: int = 0


def _tolerance(dtype: torch.dtype) -> float:
    """Mean KL (nats a token) between the model's forward and the hand-written one that still counts as equal:
    rounding only (bfloat16 kernels differ), where a missing step of a layer costs far more."""
    return 1e-5 if dtype in (torch.float32, torch.float64) else 1e-2


@torch.no_grad()
def tuning_rows(source: LoadedModel, target: LoadedModel, sequences: torch.Tensor, specs: dict, first: int,
                batch_size: int, progress: bool):
    """(features per lever key (N, T, F_in), hidden states entering layer ``first`` (N, T, hidden)), host memory."""
    from tqdm.auto import tqdm

    from .levers import source_features

    features: dict[tuple, list] = {key: [] for key in specs}
    hidden = []
    with tqdm(total=sequences.shape[0], desc="tuning rows", unit="seq", disable=not progress) as bar:
        for batch in iter_batches(sequences, batch_size):
            for key, x in source_features(source, batch, specs).items():
                features[key].append(x.cpu())
            with layer_inputs(target.model, (first,)) as entering:
                prefill_content(target.model, batch.to(target.device), torch.ones_like(batch).to(target.device))
            hidden.append(entering[first].cpu())
            bar.update(batch.shape[0])
    return {key: torch.cat(parts) for key, parts in features.items()}, torch.cat(hidden)


def mapped(params: dict, x: torch.Tensor, heads: int) -> torch.Tensor:
    """(B, H, T, D) content K or V of one lever from its features ``x`` (B, T, F_in): the runtime formula."""
    y = x @ params["weight"] + params["bias"]
    if "mlp.in.weight" in params:
        hid = torch.nn.functional.gelu(x @ params["mlp.in.weight"] + params["mlp.in.bias"])
        y = y + hid @ params["mlp.out.weight"] + params["mlp.out.bias"]
    return y.view(*y.shape[:2], heads, -1).transpose(1, 2)


def _descend(divergence, flat: list[torch.Tensor], train: torch.Tensor, budget: TuneBudget, g: torch.Generator,
             progress: bool) -> None:
    """AdamW on ``flat`` over ``budget.steps`` batches of rows drawn from ``train`` with ``g``: a 20-step warm-up,
    then a cosine schedule."""
    from tqdm.auto import tqdm

    opt = torch.optim.AdamW(flat, lr=budget.lr, weight_decay=0.0)
    schedule = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / 20) * 0.5 * (1 + math.cos(math.pi * s / budget.steps)))
    with tqdm(total=budget.steps, desc="tuning levers", unit="step", disable=not progress) as bar:
        for _ in range(budget.steps):
            idx = train[torch.randint(len(train), (min(budget.batch, len(train)),), generator=g)]
            loss = divergence(idx, True)
            if not torch.isfinite(loss):
                raise FitError("tuning the levers diverged (a non-finite loss); lower --tune-lr.")
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            schedule.step()
            bar.update(1)
            bar.set_postfix(kl=f"{loss.item():.4f}", refresh=False)


def tune_levers(source: LoadedModel, target: LoadedModel, sequences: torch.Tensor, selection: dict,
                levers: tuple[Lever, ...], weights: dict[str, torch.Tensor], budget: TuneBudget, batch_size: int,
                progress: bool = True, plain: tuple[tuple[str, int], ...] = ()) -> tuple[dict[str, torch.Tensor], dict]:
    """Tune the levers' weights (names as :func:`kvbridge.fit.levers.fit_levers` writes them) on the KL divergence
    from the target's native next-token distribution; returns (weights, report). ``plain``: (kind, layer) maps
    without a lever, on lever layers, trained with them (their plain linear map: the runtime cost is unchanged);
    ``weights`` holds theirs too."""
    model, device = target.model, target.device
    n = sequences.shape[0]
    if n < 2:
        raise FitError("tuning the levers needs at least 2 calibration sequences (one validates); pass more texts.")
    g = torch.Generator().manual_seed(budget.seed)
    rows = sequences[torch.randperm(n, generator=g)[: budget.rows].sort().values]  # a seeded sample, in order
    n = rows.shape[0]
    n_val = max(1, n // 20)
    first = min(v.layer for v in levers)
    check_decoder_layers(model, rows[:1, : min(rows.shape[1], 256)].to(device), first,
                         _tolerance(next(model.parameters()).dtype))
    specs = {(v.kind, v.layer): Features(tuple(selection[v.kind][v.layer]), v.inputs, v.lags, v.state) for v in levers}
    specs |= {(kind, layer): Features(tuple(selection[kind][layer]), (kind,)) for kind, layer in plain}
    features, hidden = tuning_rows(source, target, rows, specs, first, batch_size, progress)
    heads = target.info.num_kv_heads
    params = {key: {part: weights[f"{key[0]}.{key[1]}.{part}"].to(device, torch.float32).clone().requires_grad_(True)
                    for part in PARTS if f"{key[0]}.{key[1]}.{part}" in weights} for key in specs}
    t = rows.shape[1]
    positions = torch.arange(t, device=device)[None]
    cos, sin = rotary_factors(model, positions)
    layers = len(model.get_decoder().layers)
    checkpointed = layers - first > 1

    def divergence(idx: torch.Tensor, grad: bool) -> torch.Tensor:
        """Mean KL(native ‖ mapped) per token over rows ``idx``."""
        h0 = hidden[idx].to(device)
        with torch.no_grad():
            h = h0
            for j in range(first, layers):
                h = decoder_layer(model, j, h, cos, sin, positions)
            native = next_token_logprobs(model, h)
        with torch.set_grad_enabled(grad):
            h = h0
            for j in range(first, layers):
                kv = {kind: mapped(params[(kind, j)], features[(kind, j)][idx].to(device, torch.float32), heads)
                      for kind in ("key", "value") if (kind, j) in params}
                args = (model, j, h, cos, sin, positions, kv.get("key"), kv.get("value"))
                # through several layers, each one's activations are recomputed in the backward pass, not kept
                h = checkpoint(decoder_layer, *args, use_reentrant=False) if grad and checkpointed else \
                    decoder_layer(*args)
            logp = next_token_logprobs(model, h)
            return (native.exp() * (native - logp)).sum(-1).mean()

    val, train = torch.arange(n_val), torch.arange(n_val, n)  # the sample's first rows validate

    def validation() -> float:
        with torch.no_grad():
            return float(sum(divergence(i, False) * len(i) for i in val.split(budget.batch)) / len(val))

    frozen = [p for p in model.parameters() if p.requires_grad]
    for p in frozen:  # gradients reach the levers' parameters only
        p.requires_grad_(False)
    try:
        before = validation()
        _descend(divergence, [p for group in params.values() for p in group.values()], train, budget, g, progress)
        after = validation()
    finally:
        for p in frozen:
            p.requires_grad_(True)
    kept = after < before
    tuned = dict(weights)
    if kept:
        for (kind, layer), group in params.items():
            for part, p in group.items():
                name = f"{kind}.{layer}.{part}"
                tuned[name] = p.detach().to(weights[name].dtype).cpu().contiguous()
    report = {"objective": "output", "budget": asdict(budget), "rows": n, "validation_rows": n_val,
              "validation_kl_before": before, "validation_kl_after": after, "kept": kept}
    return tuned, report
