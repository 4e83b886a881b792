"""What a run measures about memory: its peak (CUDA, or the process's resident set on CPU)
and the training state a rank holds."""

from __future__ import annotations

import contextlib
import logging
import resource
from pathlib import Path
from typing import Iterator

import torch
from torch import nn

log = logging.getLogger(__name__)
SNAPSHOT_STEPS = 3  # the steps a memory snapshot records: set-up, the first update, a steady one
SNAPSHOT_ENTRIES = 100_000  # allocation events kept (torch's ring buffer)


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
    from parallab.batch import local

    params = list(model.parameters())
    tensors = params + [p for p in params if p.requires_grad] + [
        v for state in optimizer.state.values() for v in state.values() if torch.is_tensor(v)]
    return sum(local(t).numel() * local(t).element_size() for t in tensors) / 2**20


def snapshot_problem(enabled: bool, device_type: str) -> str | None:
    if enabled and device_type != "cuda":
        return (f"trainer.memory_snapshot=true records CUDA's caching allocator, and "
                f"device={device_type} has none: use device=cuda, or trainer.max_memory_mb and "
                "the peak_memory_mb figure on CPU")
    return None


class MemorySnapshot:
    """Records every CUDA allocation (with its Python stack) from the first step; after
    SNAPSHOT_STEPS steps writes <run dir>/memory_snapshot/rank<r>.pickle, which
    pytorch.org/memory_viz draws, and stops recording (its stacks cost host time)."""

    def __init__(self, run_dir: Path, rank: int, is_main: bool):
        self.path = Path(run_dir) / "memory_snapshot" / f"rank{rank}.pickle"
        self.is_main = is_main
        self.steps = 0
        self.written = False
        # Python stacks only: C++ frames cost far more host time and memory_viz shows these
        torch.cuda.memory._record_memory_history(stacks="python", max_entries=SNAPSHOT_ENTRIES)

    def step(self) -> None:
        self.steps += 1
        if self.steps == SNAPSHOT_STEPS:
            self.close()

    def close(self) -> None:
        """Write the snapshot and stop recording, once (a later dump would hold no trace)."""
        if self.written:
            return
        self.written = True
        self.path.parent.mkdir(parents=True, exist_ok=True)
        torch.cuda.memory._dump_snapshot(str(self.path))
        torch.cuda.memory._record_memory_history(enabled=None)
        if self.is_main:
            log.info("memory snapshot of the first %d steps written to %s (open it in "
                     "pytorch.org/memory_viz)", self.steps, self.path)


@contextlib.contextmanager
def snapshot(enabled: bool, run_dir: Path, rank: int, is_main: bool
             ) -> Iterator[MemorySnapshot | None]:
    """trainer.memory_snapshot: the recorder to step once per training step (it writes
    after SNAPSHOT_STEPS, or at the end of a shorter run), or None."""
    if not enabled:
        yield None
        return
    recorder = MemorySnapshot(run_dir, rank, is_main)
    try:
        yield recorder
    finally:
        recorder.close()
