"""Checkpoints: written atomically, read back as plain tensors and containers only.

Two layouts, chosen by the strategy: one file `<name>.pt` (rank 0 writes the whole state),
or a directory `<name>.dcp` for strategies whose ranks each hold part of the model (fsdp,
pipeline): torch.distributed.checkpoint files, every rank writing its shards, and
`trainer.pt` with the rest of the state (position, RNG states, config).
"""

from __future__ import annotations

import contextlib
import logging
import os
import pickle
import shutil
from pathlib import Path
from typing import Any

import torch

from parallab.config.errors import OneLineError

log = logging.getLogger(__name__)


class CheckpointError(OneLineError, ValueError):
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


SHARDED_META = "trainer.pt"  # in a .dcp directory: all but the model and optimizer tensors


def periodic_name(step: int) -> str:
    return f"step_{step:08d}"


def is_sharded(path: str | Path) -> bool:
    """A DCP directory (not a folder of exported weights)."""
    path = Path(path)
    return path.is_dir() and (path.suffix == ".dcp" or (path / ".metadata").exists())


def load_meta(path: str | Path) -> dict[str, Any]:
    """What a checkpoint holds besides sharded tensors: a .dcp's trainer.pt (its shards
    checked against its index first), or a file with its tensors memory-mapped (checking a
    resume target reads no weights)."""
    path = Path(path)
    if path.is_dir():
        check_shards(path)
        return load(path / SHARDED_META)
    return load(path, mmap=True)


def _read_index(path: Path) -> Any:
    if not (path / ".metadata").is_file():
        raise CheckpointError(f"ckpt={path} has no .metadata: not a complete sharded checkpoint")
    try:
        with open(path / ".metadata", "rb") as f:
            return _MetadataUnpickler(f).load()
    except CheckpointError:  # the unpickler's own refusal says what it refused
        raise
    except Exception as error:  # noqa: BLE001 - garbage can fail any way at all
        raise CheckpointError(f"ckpt={path}: its .metadata index cannot be read "
                              f"({type(error).__name__}): the checkpoint is damaged") from None


def check_shards(path: Path) -> None:
    """Every shard file the index names is there and long enough for what it should hold:
    a missing or truncated shard is one line before anything starts, not a traceback from
    every rank inside torch.distributed.checkpoint."""
    needed: dict[str, int] = {}
    for info in getattr(_read_index(path), "storage_data", {}).values():
        name = str(info.relative_path)
        needed[name] = max(needed.get(name, 0), int(info.offset) + int(info.length))
    for name, size in sorted(needed.items()):
        shard = path / name
        if not shard.is_file():
            raise CheckpointError(f"ckpt={path} is missing its shard {name}: copy the whole "
                                  ".dcp directory, or resume from another checkpoint")
        if shard.stat().st_size < size:
            raise CheckpointError(f"ckpt={path}: its shard {name} is truncated "
                                  f"({shard.stat().st_size} of {size} bytes): resume from "
                                  "another checkpoint")
    if not (path / SHARDED_META).is_file():
        raise CheckpointError(f"ckpt={path} has no {SHARDED_META}: not a complete sharded "
                              "checkpoint")


class _MetadataUnpickler(pickle.Unpickler):
    """Only the classes a .dcp index is made of: torch's own reader would unpickle anything."""

    MODULES = ("torch.distributed.checkpoint.metadata", "torch.distributed.checkpoint.filesystem")
    NAMES = {("torch", "Size"), ("torch.serialization", "_get_layout"), ("pathlib", "PosixPath")}

    def find_class(self, module: str, name: str) -> Any:
        dtype = module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)
        if module in self.MODULES or (module, name) in self.NAMES or dtype:
            return super().find_class(module, name)
        raise CheckpointError(f"the index of this sharded checkpoint names {module}.{name}, "
                              "which is not checkpoint metadata; refusing to load it")


def _safe_reader(path: Path):
    """torch's FileSystemReader, with the index read once, through _MetadataUnpickler (a
    refusal surfaces here in one line, not deep inside dcp.load)."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import StorageMeta

    metadata = _read_index(path)

    class SafeReader(FileSystemReader):
        def read_metadata(self, *args: Any, **kwargs: Any):
            if getattr(metadata, "storage_meta", None) is None:
                metadata.storage_meta = StorageMeta()
            metadata.storage_meta.load_id = self.load_id
            return metadata

    return SafeReader(str(path))


def load_sharded(path: Path, template: dict[str, Any]) -> dict[str, Any]:
    """A .dcp checkpoint read into `template` ({"model": ..., "optimizer": ...} shaped as
    this rank holds them); works without a process group too (one process reads all)."""
    import warnings

    import torch.distributed.checkpoint as dcp

    meta = load_meta(path)
    reader = _safe_reader(path)
    with warnings.catch_warnings():  # "assuming ... a single process": yes, that is meant
        warnings.filterwarnings("ignore", message=".*single process")
        dcp.load(template, storage_reader=reader)
    return {**meta, **template}


def held_as(template: dict[str, Any], full: dict[str, Any], path: str | Path
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


def saved_config(meta: dict[str, Any]) -> dict[str, Any]:
    """The run config a checkpoint records (plain containers; {} when it holds none)."""
    config = meta.get("config") if isinstance(meta, dict) else None
    return config if isinstance(config, dict) else {}


def saved_model(meta: dict[str, Any], path: str | Path) -> dict[str, Any]:
    """The model spec (_target_ and arguments) a checkpoint was trained with; CheckpointError
    when it records none (not parallab's, or saved before models were given by _target_)."""
    model = saved_config(meta).get("model")
    if not isinstance(model, dict) or "_target_" not in model:
        raise CheckpointError(f"ckpt={path} records no model._target_: not a checkpoint of "
                              "this parallab")
    return dict(model)


def saved_parallel(meta: dict[str, Any]) -> str | None:
    """The strategy (parallel.name) a checkpoint was saved under."""
    parallel = saved_config(meta).get("parallel")
    return parallel.get("name") if isinstance(parallel, dict) else None


def same_model(meta: dict[str, Any], spec: dict[str, Any]) -> bool:
    """The checkpoint was trained with this model spec (_target_ and every argument)."""
    return saved_config(meta).get("model") == spec


def by_name(path: str | Path, meta: dict[str, Any]) -> bool:
    """The optimizer state is keyed by parameter name (any layout reads it), not by index."""
    return is_sharded(path) or not isinstance(meta.get("optimizer", {}).get("param_groups"),
                                              list)


def resumable(path: str | Path, meta: dict[str, Any]) -> bool:
    """A training checkpoint: a position to resume from, and its optimizer state."""
    return "epoch_step" in meta and (is_sharded(path) or "optimizer" in meta)


def _step(path: Path) -> int:
    if path.name.startswith("step_"):
        return int(path.name[len("step_"):].split(".")[0])
    return load_meta(path)["step"]  # mapped: no tensors read


def latest(directory: Path) -> Path | None:
    """The newest readable checkpoint in `directory` by step, last.* winning a tie; an
    unreadable newer one (truncated by a crash, a shard lost) is passed over, saying so."""
    candidates = [p for p in directory.glob("step_*") if p.suffix in (".pt", ".dcp")]
    candidates += [p for p in (directory / "last.pt", directory / "last.dcp") if p.exists()]
    ranked = []
    for path in candidates:
        try:
            ranked.append(((_step(path), path.name.startswith("last")), path))
        except (CheckpointError, KeyError, TypeError) as error:
            log.warning("passing over %s: %s", path, error)
    for _, path in sorted(ranked, reverse=True):
        try:
            load_meta(path)
            return path
        except CheckpointError as error:
            log.warning("passing over %s: %s", path, error)
    return None


def write_failure(path: Path, error: BaseException) -> CheckpointError:
    """A failed checkpoint write as one line: why, and that the earlier ones are intact."""
    if isinstance(error, OSError) and error.strerror:
        reason = error.strerror
    else:
        reason = (str(error).strip().splitlines() or [type(error).__name__])[0][:200]
        with contextlib.suppress(OSError):
            if shutil.disk_usage(path.parent).free < 1 << 20:
                reason = "no space left on the device"
    return CheckpointError(f"could not write checkpoint {path} ({reason}); the previous "
                           "checkpoints are intact: free space or point hydra.run.dir "
                           "somewhere writable")


class Checkpointer:
    """Saves the trainer's state with every rank's RNG state: rank 0 writes the file, or
    under a sharded strategy every rank its part of the .dcp directory."""

    def __init__(self, directory: Path, dist, config: dict[str, Any], keep_last_k: int,
                 sharded: bool = False):
        self.directory = directory
        self.sharded = sharded
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
        """Every rank calls this (the RNG states are gathered); rank 0 writes, or with
        sharded=True every rank writes its shards."""
        rng = self._rng_states()
        path = self.directory / f"{name}{'.dcp' if self.sharded else '.pt'}"
        if self.sharded:
            self._save_sharded(path, state, rng)
        else:
            failure = None
            if self.dist.is_main:
                try:
                    save(path, {**state, "rng": rng, "config": self.config})
                except (OSError, RuntimeError) as error:  # torch.save: RuntimeError on disk full
                    failure = error
            if not self._all_wrote(failure is None):  # every rank stops, not rank 0 alone
                raise write_failure(path, failure or RuntimeError("rank 0 could not write"))
        if self.dist.is_main:
            self._prune()
        return path

    def _all_wrote(self, wrote: bool) -> bool:
        """Whether every rank's part of the write succeeded (one all-reduce where there are
        several ranks), so that all ranks go on, or all stop, together."""
        if self.dist.backend is None or self.dist.world_size == 1:
            return wrote
        flag = torch.tensor([float(wrote)], device=self.dist.device)
        return bool(self.dist.all_reduce_min(flag).item())

    def _save_sharded(self, path: Path, state: dict[str, Any], rng: list) -> None:
        """Shards into a temporary directory, then one rename: a crash leaves the old one."""
        import torch.distributed as torch_dist
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.api import CheckpointException

        tmp = path.with_name(f".{path.name}.tmp")
        if self.dist.is_main:
            shutil.rmtree(tmp, ignore_errors=True)
        torch_dist.barrier()
        tensors = {"model": state["model"], "optimizer": state["optimizer"]}
        failure = None
        try:
            dcp.save(tensors, checkpoint_id=str(tmp))  # collective: raises on every rank
            if self.dist.is_main:
                rest = {k: v for k, v in state.items() if k not in tensors}
                save(tmp / SHARDED_META, {**rest, "rng": rng, "config": self.config})
        # CheckpointException derives from BaseException: named, or it would pass through
        except (Exception, CheckpointException) as error:  # noqa: BLE001 - any write failure
            failure = error
        if not self._all_wrote(failure is None):  # trainer.pt is rank 0's alone
            if self.dist.is_main:
                shutil.rmtree(tmp, ignore_errors=True)  # no half-written .tmp left on disk
            torch_dist.barrier()
            raise write_failure(path, failure or RuntimeError("another rank could not write"))
        if self.dist.is_main:
            old = path.with_name(f".{path.name}.old")
            shutil.rmtree(old, ignore_errors=True)  # a crash's leftover would block the move
            if path.exists():
                os.replace(path, old)
            os.replace(tmp, path)
            shutil.rmtree(old, ignore_errors=True)
        torch_dist.barrier()  # no rank reads or prunes before the rename

    def _prune(self) -> None:
        for suffix in (".pt", ".dcp"):
            for old in sorted(self.directory.glob(f"step_*{suffix}"))[:-self.keep_last_k]:
                shutil.rmtree(old) if old.is_dir() else old.unlink()
