"""Where does a mapper fail? Per-layer diagnostics on held-out text.

Letters: B batch, T tokens, H query heads, Hkv kv heads, D head dim, L target layers.

* **R² of K and V** per target layer (pooled over features; content keys).
* **Attention-output cosine** per target layer: the target's own queries (from its native forward,
  RoPE and any position-dependent query scaling applied, e.g. Ministral3's) attend causally over
  native K/V and over mapped K/V; the cosine between the two attention outputs (before ``o_proj``),
  averaged over heads and positions. The method's authors found it predicts task retention better
  than R².
* **Next-token KL and top-1 agreement** between the target's native logits and its logits from a
  mapped cache over the same context (the last context token read natively, as at runtime).
* **Oracle** (``--oracle``): for each target layer and kind (key, value, both), the mean
  floor-normalized retention on the family tasks when that layer's native K/V replace the mapped
  ones. Where the retention jumps, the map loses quality; that is where levers should go.
* **Windowed oracle** (``--oracle-window W``): the same, each layer's K/V taken from the target's own forward
  with every layer's attention limited to the last ``W`` tokens (a banded causal mask). It says what a layer that
  loses quality needs: if a short window recovers it, its K/V are a function of nearby tokens (which the target
  itself could compute over a window, or a map could learn from them); if not, they carry long-range context.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..core.models import attention_queries, cache_kv, make_cache, positions_from_mask, prefill
from ..core.outputs import save_figure
from ..core.rope import rotary_factors
from ..core.transfer import Bridge
from ..fit.closed_form import heldout_r2
from .evaluate import family_tasks, heldout_rows, mean_retention


def _attend(q, k, v) -> torch.Tensor:
    """Causal attention with GQA: q (B, H, T, D), k/v (B, Hkv, T, D) → (B, H, T, D)."""
    groups = q.shape[1] // k.shape[1]
    k, v = k.float().repeat_interleave(groups, 1), v.float().repeat_interleave(groups, 1)
    return F.scaled_dot_product_attention(q, k, v, is_causal=True)


@torch.no_grad()
def attention_cosine(bridge: Bridge, rows: torch.Tensor) -> list[float]:
    """Per target layer, mean cosine of attention outputs with native vs mapped K/V."""
    model = bridge.target.model
    device = bridge.target.device
    ids = rows.to(device)
    mask = torch.ones_like(ids)
    positions = positions_from_mask(mask)
    hidden_in: dict[int, torch.Tensor] = {}
    hooks = [layer.register_forward_pre_hook(
                 lambda m, a, kw, i=i: hidden_in.__setitem__(i, (a or (kw["hidden_states"],))[0]), with_kwargs=True)
             for i, layer in enumerate(model.get_decoder().layers)]
    try:
        native_cache, _ = prefill(model, ids, mask, positions, logits="none")
    finally:
        for h in hooks:
            h.remove()
    mapped_cache = bridge.mapped_cache(rows, torch.ones_like(rows))
    nk, nv = cache_kv(native_cache)
    mk, mv = cache_kv(mapped_cache)
    cos, sin = rotary_factors(model, positions)
    out = []
    for layer in range(len(nk)):
        q = attention_queries(model, hidden_in[layer], layer, cos, sin, positions)
        a, b = _attend(q, nk[layer], nv[layer]), _attend(q, mk[layer].to(device), mv[layer].to(device))
        out.append(float(F.cosine_similarity(a, b, dim=-1).mean()))
    return out


@torch.no_grad()
def logit_agreement(bridge: Bridge, rows: torch.Tensor, batch_size: int = 8) -> tuple[float, float]:
    """(mean next-token KL(native ‖ mapped) in nats, top-1 agreement) after each row's context."""
    kls, agree = [], []
    for start in range(0, rows.shape[0], batch_size):
        batch = rows[start : start + batch_size]
        mask = torch.ones_like(batch)
        logits = {mode: torch.log_softmax(bridge.first_token_logits(batch, mask, mode)[1].float(), -1)
                  for mode in ("native", "mapped")}
        p, q = logits["native"], logits["mapped"]
        kls.append((p.exp() * (p - q)).sum(-1))
        agree.append((p.argmax(-1) == q.argmax(-1)).float())
    return float(torch.cat(kls).mean()), float(torch.cat(agree).mean())


def banded_mask(mask: torch.Tensor, window: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """(B, 1, T, T) additive attention mask in ``dtype`` (the model's: attention adds it to its scores): causal, over
    real tokens only, and each query sees the last ``window`` positions (itself included). ``mask``: (B, T) of 1 for
    real tokens, 0 for (left) padding."""
    t = mask.shape[1]
    i = torch.arange(t, device=mask.device)
    band = (i[None, :] <= i[:, None]) & (i[None, :] > i[:, None] - window)  # (T, T): key j visible to query i
    visible = band[None] & mask.bool()[:, None, :]  # (B, T, T)
    visible |= torch.eye(t, dtype=torch.bool, device=mask.device)[None]  # a padded query still sees itself
    return torch.zeros(visible.shape, dtype=dtype, device=mask.device).masked_fill(
        ~visible, torch.finfo(dtype).min)[:, None]


def windowed_kv(model, ids: torch.Tensor, mask: torch.Tensor, window: int):
    """Per-layer (B, H, T, D) keys and values of ``model``'s forward with attention limited to ``window`` tokens."""
    band = banded_mask(mask, window, next(model.parameters()).dtype)
    return cache_kv(prefill(model, ids, band, positions_from_mask(mask), logits="none")[0])


class OracleBridge(Bridge):
    """A bridge whose mapped cache takes the chosen layers' keys and/or values from the target's own prefill
    (``window``: a prefill whose attention sees only the last ``window`` tokens)."""

    def __init__(self, bridge: Bridge, native: dict[int, str], window: int | None = None):
        self.__dict__.update(bridge.__dict__)
        if any(kind not in ("key", "value", "both") for kind in native.values()):
            raise ValueError("oracle kinds are key, value or both")
        if window is not None and window < 1:
            raise ValueError("an oracle window is at least one token")
        self.native = native  # target layer → "key" | "value" | "both"
        self.window = window

    def mapped_cache(self, ids: torch.Tensor, mask: torch.Tensor, owing: bool = False):
        mk, mv = cache_kv(super().mapped_cache(ids, mask))  # always complete: nothing is left owing
        if self.window is None:
            nk, nv = cache_kv(prefill(self.target.model, ids, mask, logits="none")[0])
        else:
            nk, nv = windowed_kv(self.target.model, ids, mask, self.window)
        for layer, kind in self.native.items():
            if kind in ("key", "both"):
                mk[layer] = nk[layer]
            if kind in ("value", "both"):
                mv[layer] = nv[layer]
        return make_cache(self.target.model, mk, mv)


def oracle(bridge: Bridge, texts: list[str], items: int = 16, seq_len: int = 256, progress: bool = True,
           windows: tuple[int, ...] = ()) -> dict:
    """Mean floor-normalized retention of the mapped cache (with the mapper's runtime options) and of each one-layer
    oracle; with ``windows``, also each layer's K/V (both) from the target's forward over a window of that many
    tokens (rows with a ``window``)."""
    from tqdm.auto import tqdm

    baseline = family_tasks(bridge, texts, items, seq_len)
    rows = [{"target_layer": None, "kind": "none", "mean_floor_normalized_retention": mean_retention(baseline)}]
    layers = range(bridge.target.info.num_layers)
    variants = ([(layer, kind, None) for layer in layers for kind in ("key", "value", "both")]
                + [(layer, "both", w) for w in windows for layer in layers])
    for layer, kind, window in tqdm(variants, desc="oracle", disable=not progress):
        results = family_tasks(OracleBridge(bridge, {layer: kind}, window), texts, items, seq_len, reference=baseline)
        rows.append({"target_layer": layer, "kind": kind, "mean_floor_normalized_retention": mean_retention(results),
                     "tasks": {r.task: r.floor_normalized_retention for r in results}}
                    | ({} if window is None else {"window": window}))
    return {"items": items, "seq_len": seq_len, "baseline": [r.to_dict() for r in baseline], "rows": rows}


def oracle_cell(rows: list[dict], layer: int, kind: str, window: int | None = None) -> float:
    """The mean floor-normalized retention of one oracle row (``window``: a windowed row)."""
    return next(r["mean_floor_normalized_retention"] for r in rows
                if r["target_layer"] == layer and r["kind"] == kind and r.get("window") == window)


def diagnose(bridge: Bridge, texts: list[str], items: int = 16, seq_len: int = 256) -> dict:
    """Every diagnostic on ``items`` held-out rows of ``seq_len`` tokens."""
    rows = heldout_rows(bridge.tokenizer, texts, items, seq_len)
    r2 = heldout_r2(bridge.mapper, bridge.source, bridge.target, rows)
    kl, top1 = logit_agreement(bridge, rows)
    return {"items": items, "seq_len": seq_len, "key_r2": r2["key"], "value_r2": r2["value"],
            "attention_cosine": attention_cosine(bridge, rows), "next_token_kl": kl, "top1_agreement": top1}


def plot_diagnostics(report: dict, out_dir) -> list[str]:
    """One PNG per per-layer metric; returns the paths written."""
    import matplotlib

    matplotlib.use("Agg")
    from pathlib import Path

    import matplotlib.pyplot as plt

    paths = []
    for key, label in (("key_r2", "R² of keys"), ("value_r2", "R² of values"),
                       ("attention_cosine", "attention-output cosine")):
        fig, ax = plt.subplots(figsize=(6, 3.2))
        values = report[key]
        ax.bar(range(len(values)), values, color="tab:blue")
        ax.set(xlabel="target layer", ylabel=label, title=f"{label} by layer (held-out)")
        ax.set_ylim(min(0.0, min(values)), 1.0)
        fig.tight_layout()
        path = Path(out_dir) / f"{key}.png"
        save_figure(fig, path, dpi=110)
        plt.close(fig)
        paths.append(str(path))
    if "oracle" in report:
        rows = report["oracle"]["rows"]
        layers = sorted({r["target_layer"] for r in rows if r["target_layer"] is not None})
        windows = sorted({r["window"] for r in rows if "window" in r})
        bars = [(kind, None, f"native {kind}") for kind in ("key", "value", "both")]
        bars += [("both", w, f"both, window {w}") for w in windows]
        width = 0.8 / len(bars)
        fig, ax = plt.subplots(figsize=(max(6, len(layers) * 0.17 * len(bars) + 2), 3.4))
        for i, (kind, window, label) in enumerate(bars):
            values = [100 * oracle_cell(rows, layer, kind, window) for layer in layers]
            ax.bar([layer + (i - (len(bars) - 1) / 2) * width for layer in layers], values, width=width, label=label)
        ax.axhline(100 * rows[0]["mean_floor_normalized_retention"], color="black", lw=1, ls="--",
                   label="mapped, no layer native")
        ax.set(xlabel="target layer made native", ylabel="mean floor-normalized retention (%)",
               title="oracle: where the map loses quality")
        ax.legend(fontsize=8)
        fig.tight_layout()
        path = Path(out_dir) / "oracle.png"
        save_figure(fig, path, dpi=110)
        plt.close(fig)
        paths.append(str(path))
    return paths
