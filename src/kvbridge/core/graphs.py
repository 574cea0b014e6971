"""CUDA graphs: the mapped path without its fixed per-kernel cost.

Eager transformers at batch 1 is launch-bound on a GPU: a forward over one held-back token, or a short
prefill, spends most of its time launching a few hundred small kernels from Python (the 8B's forward over
one token: ~27 ms eager on an H200 against ~3.5 ms of weight reads). A CUDA graph records those launches
once and replays them as one: :class:`Graphed` captures a function of fixed device inputs (after warm-up
runs on a side stream, as CUDA requires) and replays it; :class:`GraphCache` keeps one per input shape.

What a captured function may not do: read a device value on the host (``.item()``, ``int(t)``, a Python
``if`` on a tensor), copy from pageable host memory, or change shapes between replays. kvbridge's mapped
path is written so that an unpadded batch (every row a whole prompt: the time-to-first-token case) needs
none of that: :func:`unpadded` tells it so — lengths then come from shapes, transformers gets no padding
mask to inspect — and checks that need a host value (token ids in range, a finite cache) run before
capture or are recorded on the device (:func:`capturing`).

Graph capture needs CUDA; on other devices :class:`Graphed` runs the function eagerly (``reason`` says why),
so the same code path is exercised and tested on CPU.
"""

from __future__ import annotations

import contextlib
import threading
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import torch

_STATE = threading.local()


@contextlib.contextmanager
def unpadded():
    """Inside, the mapped path treats every batch as unpadded: held-back and recompute counts from the prompt
    length, no attention mask handed to transformers. Callers make sure of it (:meth:`GraphCache.__call__`
    checks the mask on the host)."""
    before = getattr(_STATE, "unpadded", False)
    _STATE.unpadded = True
    try:
        yield
    finally:
        _STATE.unpadded = before


def assumed_unpadded() -> bool:
    """Whether the caller promised an unpadded batch (:func:`unpadded`)."""
    return getattr(_STATE, "unpadded", False)


def capturing() -> bool:
    """Whether a CUDA graph is being captured on the current stream (then nothing may read a device value), or
    :func:`capture_rules` pretends so."""
    return getattr(_STATE, "rules", False) or (torch.cuda.is_available() and torch.cuda.is_current_stream_capturing())


# operators that hand a device value to the host (or size an output by one): illegal while a graph records
HOST_READS = ("aten::_local_scalar_dense", "aten::equal", "aten::nonzero", "aten::is_nonzero", "aten::masked_select",
              "aten::_unique2", "aten::unique_consecutive", "aten::unique_dim", "aten::repeat_interleave")


@contextlib.contextmanager
def capture_rules():
    """Run under a CUDA graph's rules on any device, CPU included: :func:`capturing` is true, and an operator that
    reads a device value on the host raises ``RuntimeError`` naming it. How the CPU tests check that a path can be
    captured on a GPU (copies from pageable host memory, the other illegal act, are not seen on CPU)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class _HostReads(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func._schema.name in HOST_READS:
                raise RuntimeError(f"{func._schema.name} reads a device value on the host: a CUDA graph cannot "
                                   "record it")
            return func(*args, **(kwargs or {}))

    before = getattr(_STATE, "rules", False)
    _STATE.rules = True
    try:
        with _HostReads():
            yield
    finally:
        _STATE.rules = before


def graphs_unavailable(device: torch.device) -> str | None:
    """Why CUDA graphs cannot run on ``device`` (None: they can)."""
    if device.type != "cuda":
        return f"CUDA graphs need a CUDA device, not {device.type}: run eagerly"
    return None


# SDPA kernels in the order a capture asks for them: eager dispatch is free to pick the fastest kernel for each call,
# but inside a capture the default order measured slower on an H200 (a causal 16,384-token prefill 1.6x as long as
# eager, the gap growing with the square of the length: the attention); None: the default order, tried second
ATTENTION_PRIORITIES = (("FLASH_ATTENTION", "CUDNN_ATTENTION", "EFFICIENT_ATTENTION", "MATH"), None)


@contextlib.contextmanager
def attention_priority(names: tuple[str, ...] | None):
    """Inside, PyTorch's scaled_dot_product_attention tries its kernels in the order ``names`` (None: unchanged)."""
    if names is None:
        yield
        return
    from torch.nn.attention import SDPBackend, sdpa_kernel

    with sdpa_kernel([getattr(SDPBackend, n) for n in names], set_priority=True):
        yield


def _capture(fn, device: torch.device, warmup: int, pool):
    """``(graph, outputs)`` of ``fn`` after ``warmup`` runs on a side stream (what CUDA requires before a capture)."""
    stream = torch.cuda.Stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream):
        for _ in range(max(1, warmup)):
            fn()
    torch.cuda.current_stream(device).wait_stream(stream)
    torch.cuda.synchronize(device)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool):
        outputs = fn()
    return graph, outputs


class Graphed:
    """``fn()`` recorded once as a CUDA graph and replayed by each call, returning the same output objects (their
    tensors refilled by every replay: read or copy them before the next call).

    ``fn`` must read only device tensors that outlive this object at fixed addresses (its static inputs: write
    new values into them before calling) and follow the rules in this module's docstring. ``warmup`` eager runs
    on a side stream come first (kernels load, allocators settle, compiled kernels are built). On a device
    without CUDA graphs, or when capture fails (``reason`` then says why), each call simply runs ``fn``.
    ``pool``: a memory pool shared with graphs that never run at the same time. ``priorities``: the attention kernel
    orders to try capturing with (:data:`ATTENTION_PRIORITIES`; ``(None,)``: the caller's own); ``strict``: raise
    what stopped a capture instead of running eagerly.
    """

    def __init__(self, fn: Callable[[], Any], device: torch.device | str, warmup: int = 2, pool=None,
                 strict: bool = False, priorities=None):
        self.fn, self.device = fn, torch.device(device)
        self.graph, self.outputs, self.attention = None, None, None
        self.reason = graphs_unavailable(self.device)
        if self.reason is not None:
            return
        failures = []
        for priority in priorities or ATTENTION_PRIORITIES:  # flash first; the default order if that cannot record
            try:
                with attention_priority(priority):
                    self.graph, self.outputs = _capture(fn, self.device, warmup, pool)
                self.attention = "default" if priority is None else priority
                return
            except Exception as exc:  # a host read or an illegal copy inside fn
                if strict:
                    raise
                failures.append(f"{type(exc).__name__}: {(str(exc).splitlines() or [''])[0][:200]}")
                torch.cuda.synchronize(self.device)
        self.reason = f"capture failed ({'; '.join(failures)}): run eagerly"

    @property
    def captured(self) -> bool:
        return self.graph is not None

    def __call__(self):
        if self.graph is None:
            return self.fn()
        self.graph.replay()
        return self.outputs


class GraphCache:
    """One :class:`Graphed` per input signature (shapes and dtypes) of ``fn(*tensors)``, the ``size`` most recent
    kept: each signature gets static device inputs that every call's tensors are copied into before the replay.

    ``fn`` runs under :func:`unpadded`; callers pass unpadded batches only. Outputs are the graph's own tensors,
    valid until the next call with the same signature.
    """

    def __init__(self, fn: Callable[..., Any], device: torch.device | str, size: int = 8, warmup: int = 2):
        self.fn, self.device, self.size, self.warmup = fn, torch.device(device), size, warmup
        self.entries: OrderedDict[tuple, tuple[list[torch.Tensor], Graphed]] = OrderedDict()
        self.pool = torch.cuda.graph_pool_handle() if self.device.type == "cuda" else None

    def __call__(self, *tensors: torch.Tensor):
        key = tuple((tuple(t.shape), t.dtype) for t in tensors)
        entry = self.entries.get(key)
        if entry is None:
            static = [t.to(self.device, copy=True) for t in tensors]

            def run():
                with unpadded():
                    return self.fn(*static)

            entry = self.entries[key] = (static, Graphed(run, self.device, self.warmup, self.pool))
            while len(self.entries) > self.size:
                self.entries.popitem(last=False)
        else:
            self.entries.move_to_end(key)
            for dst, src in zip(entry[0], tensors):
                dst.copy_(src)
        return entry[1]()

    def reasons(self) -> list[str]:
        """Why any kept signature runs eagerly (empty: every one replays a graph)."""
        return sorted({g.reason for _, g in self.entries.values() if g.reason})
