"""What a run measures about memory: its peak (CUDA, or the process's resident set on CPU)
and the training state a rank holds."""

from __future__ import annotations

import contextlib
import resource
from pathlib import Path

import torch
from torch import nn


def reset_peak_memory(device: torch.device) -> None:
    """Start this run's own high-water mark: CUDA's peak statistics, or on Linux the
    process's peak resident set (VmHWM, reset by writing 5 to /proc/self/clear_refs): a
    sweep's jobs share one process, and ru_maxrss would carry a big job's peak into the
    next. Where the OS allows neither, the process's lifetime peak stands."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        return
    with contextlib.suppress(OSError):
        Path("/proc/self/clear_refs").write_text("5")


def peak_memory_mb(device: torch.device) -> float:
    """Peak CUDA memory allocated, or on CPU the peak resident set since reset_peak_memory."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    with contextlib.suppress(OSError, StopIteration, ValueError):
        status = Path("/proc/self/status").read_text().splitlines()
        return int(next(line for line in status if line.startswith("VmHWM:")).split()[1]) / 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB


def held_state_mb(model: nn.Module, optimizer: torch.optim.Optimizer) -> float:
    """Parameters, gradients (one like each trainable parameter) and optimizer state this
    rank holds: its shards under fsdp, its part under pipeline, everything under ddp."""
    from torch.distributed.tensor import DTensor

    params = list(model.parameters())
    tensors = params + [p for p in params if p.requires_grad] + [
        v for state in optimizer.state.values() for v in state.values() if torch.is_tensor(v)]
    local = [t.to_local() if isinstance(t, DTensor) else t for t in tensors]
    return sum(t.numel() * t.element_size() for t in local) / 2**20
