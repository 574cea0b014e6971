"""Fits across processes: ``torchrun --nproc-per-node N -m kvbridge fit …``.

Every process loads both models, reads its share of the calibration sequences
(:func:`kvbridge.fit.stats.shard`) and accumulates statistics; the statistics are all-reduced
(:meth:`kvbridge.fit.stats.KVStats.all_reduce`), and rank 0 alone solves, fits the levers and writes the
artifact. Backend: NCCL when the fit's device is CUDA (each process takes ``cuda:LOCAL_RANK``), gloo on CPU.
"""

from __future__ import annotations

import os

import torch

from ..errors import InputError


def launched() -> bool:
    """Whether torchrun (or another launcher setting WORLD_SIZE) started this process as one of several."""
    return int(os.environ.get("WORLD_SIZE", "1")) > 1


def start(device: str) -> str:
    """Join the process group torchrun describes; returns this process's device (``cuda:LOCAL_RANK`` on GPU)."""
    import torch.distributed as dist

    if dist.is_initialized():
        return device
    local = int(os.environ.get("LOCAL_RANK", "0"))
    kind = torch.device(device).type
    if kind == "cuda":
        if torch.device(device).index is not None:
            raise InputError(f"under torchrun pass --device cuda, not {device}: each process takes cuda:LOCAL_RANK.")
        device = f"cuda:{local}"
        torch.cuda.set_device(local)
    elif kind != "cpu":
        raise InputError(f"a multi-process fit runs on cuda (NCCL) or cpu (gloo), not {device}.")
    dist.init_process_group("nccl" if kind == "cuda" else "gloo")
    return device


def rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def is_main() -> bool:
    return rank() == 0


def stop() -> None:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
