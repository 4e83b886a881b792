"""A torch file (.pt): a one-file checkpoint, rank 0 writing the whole training state, or
export's file of a model's weights and its run's record."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn

from parallab.training.formats.base import (
    CheckpointFormat,
    FileFormat,
    Lazy,
    all_wrote,
    held_as,
    load,
    plain_name,
    save,
    write_failure,
)


class TorchFile(CheckpointFormat, FileFormat):
    said = ".pt (a torch file)"
    suffix = ".pt"
    checkpoint_suffix, sharded = ".pt", False

    @staticmethod
    def holds(path: Path) -> bool:
        return not path.is_dir() and path.suffix != ".safetensors"

    def _weights(self, mmap: bool) -> dict[str, torch.Tensor]:
        state = load(self.path, mmap=mmap)
        weights = state.get("model", state) if isinstance(state, dict) else {}
        return {plain_name(k): v for k, v in weights.items() if isinstance(v, torch.Tensor)}

    def _shapes(self) -> dict[str, tuple[int, ...]]:
        return {k: tuple(v.shape) for k, v in self._weights(mmap=True).items()}

    def read(self, model: nn.Module) -> dict[str, torch.Tensor]:
        return self._weights(mmap=False)

    def lazy(self) -> Lazy:
        mapped = self._weights(mmap=True)
        return Lazy(mapped, lambda tensor: tensor, _let_go)

    def record(self) -> dict[str, Any]:
        """The file with its tensors memory-mapped: checking a resume target reads no
        weights."""
        return load(self.path, mmap=True)

    @staticmethod
    def write(model: nn.Module, record: dict[str, Any], target: Path) -> str:
        save(target, {"model": model.state_dict(), **record})
        return "the full model state as one torch file"

    def write_state(self, state: dict[str, Any], dist) -> None:
        """Rank 0 writes the whole state; the others wait to hear it did."""
        failure = None
        if dist.is_main:
            try:
                save(self.path, state)
            except (OSError, RuntimeError) as error:  # torch.save: RuntimeError on disk full
                failure = error
        if not all_wrote(dist, failure is None):  # every rank stops, not rank 0 alone
            raise write_failure(self.path, failure or RuntimeError("rank 0 could not write"))

    def read_state(self, template: dict[str, Any]) -> dict[str, Any]:
        """Every rank reads the file and cuts its own part (held_as)."""
        state = load(self.path)
        if not self.by_name(state):
            return state  # by an earlier parallab, for the layout that wrote it (validate)
        return {**state, **{key: held_as(mine, state[key], self.path)
                            for key, mine in template.items()}}

    def resumable(self, meta: dict[str, Any]) -> bool:
        return "epoch_step" in meta and "optimizer" in meta

    def by_name(self, meta: dict[str, Any]) -> bool:
        return not isinstance(meta.get("optimizer", {}).get("param_groups"), list)


def _let_go(tensor: torch.Tensor) -> None:
    """A memory-mapped tensor's pages let go once its part is copied: read, they stay in
    the rank's resident set until the whole file is unmapped (the kernel reads them again
    from the file if touched; nothing is written to them)."""
    import ctypes
    import os

    page = os.sysconf("SC_PAGE_SIZE")
    start = tensor.data_ptr() // page * page
    madvise = ctypes.CDLL(None).madvise
    madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    madvise(start, tensor.data_ptr() + tensor.nbytes - start, 4)  # MADV_DONTNEED
