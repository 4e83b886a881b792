"""Checkpoint files: written atomically, read back as plain tensors and containers only."""

from __future__ import annotations

import os
import pickle
from pathlib import Path
from typing import Any

import torch


class CheckpointError(ValueError):
    """A checkpoint that is missing, truncated or asks to run code on load."""


def save(path: Path, state: dict[str, Any]) -> None:
    """Write to a temporary file, fsync, rename: a crash at any moment leaves the old file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        with open(tmp, "wb") as f:
            torch.save(state, f)
            f.flush()
            os.fsync(f.fileno())
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    os.replace(tmp, path)
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)  # make the rename itself durable
    finally:
        os.close(dir_fd)


def load(path: str | Path) -> dict[str, Any]:
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"ckpt={path}: no such file")
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as error:  # weights_only refused a global
        reason = next((line.strip() for line in str(error).splitlines()
                       if "Unsupported global" in line), "an object that is not plain data")
        raise CheckpointError(f"ckpt={path} holds more than tensors and plain containers "
                              f"({reason}); refusing to load it") from None
    except (RuntimeError, EOFError) as error:
        raise CheckpointError(f"ckpt={path} is not a readable checkpoint "
                              f"({str(error).splitlines()[0]})") from None


def periodic_name(step: int) -> str:
    return f"step_{step:08d}.pt"


def latest(directory: Path) -> Path | None:
    """The newest checkpoint in `directory` by step: the periodic ones, then last.pt."""
    periodic = sorted(directory.glob("step_*.pt"))
    candidates = periodic + ([directory / "last.pt"] if (directory / "last.pt").exists() else [])
    if not candidates:
        return None
    return max(candidates, key=lambda p: torch.load(p, map_location="cpu",
                                                     weights_only=True)["step"])


class Checkpointer:
    """Saves the trainer's state with every rank's RNG state, rank 0 writing the file."""

    def __init__(self, directory: Path, dist, config: dict[str, Any], keep_last_k: int):
        self.directory = directory
        self.dist = dist
        self.config = config
        self.keep_last_k = keep_last_k

    def _rng_states(self) -> list[torch.Tensor]:
        import torch.distributed as torch_dist

        state = torch.get_rng_state()
        if self.dist.backend is None or self.dist.world_size == 1:
            return [state]
        states = [torch.empty_like(state) for _ in range(self.dist.world_size)]
        torch_dist.all_gather(states, state.to(self.dist.device) if
                              self.dist.backend == "nccl" else state)
        return [s.cpu() for s in states]

    def save(self, state: dict[str, Any], name: str) -> Path:
        """Every rank calls this (the RNG states are gathered); rank 0 writes."""
        path = self.directory / name
        rng = self._rng_states()
        if self.dist.is_main:
            try:
                save(path, {**state, "rng": rng, "config": self.config})
            except OSError as error:
                reason = error.strerror or str(error)
                raise CheckpointError(f"could not write checkpoint {path} ({reason}); the "
                                      "previous checkpoints are intact: free space or point "
                                      "hydra.run.dir somewhere writable") from None
            self._prune()
        return path

    def _prune(self) -> None:
        for old in sorted(self.directory.glob("step_*.pt"))[:-self.keep_last_k]:
            old.unlink()
