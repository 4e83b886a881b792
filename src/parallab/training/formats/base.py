"""What every format shares: the Format a reader and writer of weights is, the
CheckpointFormat that also writes and reads a run's training state, and torch's own files
written atomically and read back as plain tensors and containers only."""

from __future__ import annotations

import contextlib
import errno
import os
import pickle
import re
import shutil
from abc import ABC, abstractmethod
from collections.abc import Mapping
from pathlib import Path
from typing import Any, ClassVar

import torch
from torch import nn

from parallab.config.errors import ConfigError, OneLineError, first_line

# a wrapper's name where a path's part starts (at the start, or after a dot)
_WRAPPERS = re.compile(r"(?<![^.])(?:module|_orig_mod|_checkpoint_wrapped_module)\.")


class CheckpointError(OneLineError, ValueError):
    """A checkpoint that is missing, truncated or asks to run code on load."""


def plain_name(key: str) -> str:
    """`key` without the prefixes wrappers add."""
    return _WRAPPERS.sub("", key)


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


def load(path: str | Path, mmap: bool = False) -> dict[str, Any]:
    """A checkpoint file's contents; with `mmap`, tensors are mapped, not read, until used."""
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"ckpt={path}: no such file")
    try:
        return torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
    except pickle.UnpicklingError as error:  # weights_only refused a global
        reason = next((line.strip() for line in str(error).splitlines()
                       if "Unsupported global" in line), "an object that is not plain data")
        raise CheckpointError(f"ckpt={path} holds more than tensors and plain containers "
                              f"({reason}); refusing to load it") from None
    except (RuntimeError, EOFError, OSError) as error:
        # torch's first sentence says what failed; the rest is advice on torch.load's flags
        # (a zip cut short in its middle: OSError, "Invalid argument", from the reader)
        reason = (str(error).splitlines() or [""])[0].split(". ")[0].rstrip(".")
        raise CheckpointError(f"ckpt={path} is not a readable checkpoint, truncated or corrupt "
                              f"({reason})") from None


def write_failure(path: Path, error: BaseException) -> CheckpointError:
    """A failed checkpoint write as one line: why, and that the earlier ones are intact;
    a fix for the disk only where the disk is why (torch's CheckpointException carries
    each rank's own error: the first is named)."""
    failures = getattr(error, "failures", None)
    if failures:  # torch.distributed.checkpoint's: {rank: (exception, traceback)}
        rank, (error, _) = next(iter(sorted(failures.items())))
        return write_failure(path, error) if isinstance(error, OSError) else CheckpointError(
            f"could not write checkpoint {path} (rank {rank}: {type(error).__name__}: "
            f"{_first_line(error)}); the previous checkpoints are intact")
    reason = disk_reason(path, error) or (error.strerror if isinstance(error, OSError) and
                                          error.strerror else _first_line(error))
    return CheckpointError(f"could not write checkpoint {path} ({reason}); the previous "
                           "checkpoints are intact: free space or point hydra.run.dir "
                           "somewhere writable")


# the disk's refusals (full, over quota, read-only, not ours to write), not a missing input's
DISK_ERRNOS = (errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES, errno.EPERM)


def disk_reason(path: Path, error: BaseException) -> str | None:
    """Why a write to `path` failed where the disk is why: an OSError's own words, or no
    space left (torch's and safetensors' writers fail with words of their own, a position
    or an os error's number); None where the disk is not why."""
    if isinstance(error, OSError) and error.errno in DISK_ERRNOS:
        return error.strerror
    with contextlib.suppress(OSError):
        if shutil.disk_usage(path.parent).free < 1 << 20:
            return "no space left on the device"
    return None


def _first_line(error: BaseException) -> str:
    return (str(error).strip().splitlines() or [type(error).__name__])[0][:200]


def all_wrote(dist, wrote: bool) -> bool:
    """Whether every rank's part of a write succeeded (one all-reduce where there are
    several ranks), so that all ranks go on, or all stop, together."""
    if dist.backend is None or dist.world_size == 1:
        return wrote
    flag = torch.tensor([float(wrote)], device=dist.device)
    return bool(dist.all_reduce_min(flag).item())


def held_as(template: dict[str, Any], full: Mapping[str, Any], path: str | Path
            ) -> dict[str, Any]:
    """`full` (whole tensors, as a one-file checkpoint holds them) shaped as `template`, a
    rank's own state under its layout: a DTensor's part cut here from the whole tensor (no
    communication: every rank read the file), plain tensors moved to its device; keys this
    rank does not hold (other pipeline parts') left out. CheckpointError naming missing keys."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    missing = [key for key in template if key not in full]
    if missing:
        raise CheckpointError(f"{path} lacks {len(missing)} entries this model holds "
                              f"({', '.join(missing[:5])}): resume a checkpoint of this model")
    held: dict[str, Any] = {}
    for key, mine in template.items():
        value = full[key]
        if isinstance(mine, DTensor):
            value = distribute_tensor(value.to(mine.device, mine.dtype), mine.device_mesh,
                                      mine.placements, src_data_rank=None)
        elif isinstance(mine, torch.Tensor):
            value = value.to(mine.device)
        held[key] = value
    return held


class Lazy(Mapping):
    """Weights by plain name, each read when asked for; release(name) lets go of what a
    read kept mapped."""

    def __init__(self, where: dict[str, Any], get, release=None):
        self.where, self._get, self._release = where, get, release

    def __getitem__(self, key: str) -> torch.Tensor:
        return self._get(self.where[key])

    def release(self, key: str) -> None:
        if self._release is not None:
            self._release(self[key])

    def __contains__(self, key: object) -> bool:  # Mapping's would read the tensor
        return key in self.where

    def __iter__(self):
        return iter(self.where)

    def __len__(self) -> int:
        return len(self.where)


class Format(ABC):
    """One weight format at `path`: its shapes (no tensor data read), its weights, what it
    records besides (step, the run's config), and, where export writes it (`suffix` set),
    the writer: a static write(model, record, target) -> what was written, in words."""

    said: ClassVar[str]  # in messages
    suffix: ClassVar[str | None] = None  # what export's OUT ends with to be written so

    def __init__(self, path: str | Path, key: str = "ckpt",
                 instead: str = "use another checkpoint"):
        # the setting that named `path` and what to do where it cannot be read, in the
        # words of the command that named it: a reader's refusal says them once
        self.path, self.key, self.instead = Path(path), key, instead

    @staticmethod
    @abstractmethod
    def holds(path: Path) -> bool:
        """`path` is in this format (the first of FORMATS that holds it reads it)."""

    def shapes(self) -> dict[str, tuple[int, ...]]:
        """Each saved weight's shape, by plain name, reading no tensor data; CheckpointError
        for a file that cannot be read (truncated, not what its name says)."""
        return self._readable(self._shapes)

    def _readable(self, read: Any) -> Any:
        """read(), a reader's own error as one CheckpointError naming the path."""
        try:
            return read()
        except (CheckpointError, ConfigError):
            raise
        except Exception as error:  # noqa: BLE001 - each reader fails its own way
            raise CheckpointError(
                f"{self.path} cannot be read as weights ({first_line(error)}): give a "
                "checkpoint, or what parallab export or save_pretrained wrote") from None

    @abstractmethod
    def _shapes(self) -> dict[str, tuple[int, ...]]:
        """shapes(), any reader's error left to it."""

    @abstractmethod
    def read(self, model: nn.Module) -> dict[str, torch.Tensor]:
        """Whole tensors on the CPU (`model`: the template a sharded checkpoint needs)."""

    @abstractmethod
    def record(self) -> dict[str, Any]:
        """What it records besides weights: {"step", "config", ...}; CheckpointError where
        it cannot be read."""

    @staticmethod
    def covers(name: str) -> bool:
        """Whether weights in this format hold the model's weight `name` (one held by no
        file of it is missing from it)."""
        return True


class FileFormat(Format):
    """Weights in files read a tensor at a time: a rank keeping its part of each reads
    them through lazy() and never holds them all."""

    @abstractmethod
    def lazy(self) -> Lazy:
        """The weights by plain name, each read when asked for."""


class CheckpointFormat(Format):
    """A format the Checkpointer writes a run's whole training state in (model, optimizer,
    position, RNG states, config), and a resume reads back into any layout: the one whose
    `sharded` is the layout's (Layout.sharded), named `<name><checkpoint_suffix>`; `latest`
    and pruning find checkpoints by these suffixes."""

    checkpoint_suffix: ClassVar[str]
    sharded: ClassVar[bool]  # every rank writes its own part (else rank 0 the whole)

    @abstractmethod
    def write_state(self, state: dict[str, Any], dist) -> None:
        """`state` written at `path`; every rank calls it, and every rank raises the same
        one-line CheckpointError (write_failure) where any rank's part failed, the earlier
        checkpoint at `path` then left whole."""

    @abstractmethod
    def read_state(self, template: dict[str, Any]) -> dict[str, Any]:
        """The whole state, its {"model": ..., "optimizer": ...} shaped as `template` (a
        rank's own, under whichever layout reads it)."""

    @abstractmethod
    def resumable(self, meta: dict[str, Any]) -> bool:
        """`meta` (record()) is of a training checkpoint: a position and optimizer state."""

    @abstractmethod
    def by_name(self, meta: dict[str, Any]) -> bool:
        """The optimizer state is keyed by parameter name (any layout reads it)."""
