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
    with open(tmp, "wb") as f:
        torch.save(state, f)
        f.flush()
        os.fsync(f.fileno())
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
