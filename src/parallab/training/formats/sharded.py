"""A sharded checkpoint: a `.dcp` directory of torch.distributed.checkpoint files, every
rank writing its shards of the model and optimizer state (keyed by full parameter names, so
any world size and layout reads them), and `trainer.pt` with the rest of the state
(position, RNG states, config). Its index is read through an allow-list: torch's own
reader would unpickle anything."""

from __future__ import annotations

import contextlib
import functools
import os
import pickle
import shutil
from pathlib import Path
from typing import Any

import torch
from torch import nn

from parallab.training.formats.base import (
    CheckpointError,
    CheckpointFormat,
    all_wrote,
    load,
    plain_name,
    save,
    write_failure,
)

SHARDED_META = "trainer.pt"  # in a .dcp directory: all but the model and optimizer tensors
TENSORS = ("model", "optimizer")  # what dcp writes, each rank its shards


class Sharded(CheckpointFormat):
    said = ".dcp (a sharded checkpoint)"
    checkpoint_suffix, sharded = ".dcp", True

    @staticmethod
    def holds(path: Path) -> bool:
        """A DCP directory (not a folder of exported weights)."""
        return path.is_dir() and (path.suffix == ".dcp" or (path / ".metadata").exists())

    @functools.cached_property
    def index(self) -> Any:
        """Its .metadata, read once (through the allow-list) for the shapes, the shards'
        check and DCP's reader alike."""
        return _read_index(self.path, self.key, self.instead)

    def _shapes(self) -> dict[str, tuple[int, ...]]:
        entries = self.index.state_dict_metadata
        return {plain_name(k[len("model."):]): tuple(v.size) for k, v in entries.items()
                if k.startswith("model.") and hasattr(v, "size")}

    def read(self, model: nn.Module) -> dict[str, torch.Tensor]:
        saved = self.shapes()  # (a weight of another shape is left out, as a file's is)
        template = {k: v.detach().clone() for k, v in model.state_dict().items()
                    if saved.get(plain_name(k)) == tuple(v.shape)}
        self.read_state({"model": template})
        return {plain_name(k): v for k, v in template.items()}

    def record(self) -> dict[str, Any]:
        """trainer.pt, its shards checked against the index first."""
        check_shards(self.path, self.index, self.key, self.instead)
        return load(self.path / SHARDED_META)

    def resumable(self, meta: dict[str, Any]) -> bool:
        return "epoch_step" in meta  # the optimizer's state is in the shards

    def by_name(self, meta: dict[str, Any]) -> bool:
        return True

    def read_state(self, template: dict[str, Any]) -> dict[str, Any]:
        """Read into `template` in place, resharded by DCP; works without a process group
        too (one process reads all)."""
        import warnings

        import torch.distributed.checkpoint as dcp

        meta = self.record()
        reader = _safe_reader(self.path, self.index)
        with warnings.catch_warnings():  # "assuming ... a single process": yes, that is meant
            warnings.filterwarnings("ignore", message=".*single process")
            with _unstrided_for_load(template) as readable:
                dcp.load(readable, storage_reader=reader)
        return {**meta, **template}

    def write_state(self, state: dict[str, Any], dist) -> None:
        """Shards into a temporary directory, then one rename: a crash leaves the old one."""
        import torch.distributed as torch_dist
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.api import CheckpointException

        path = self.path
        tmp = path.with_name(f".{path.name}.tmp")
        if dist.is_main:
            shutil.rmtree(tmp, ignore_errors=True)
        torch_dist.barrier()
        tensors = _mapped({key: state[key] for key in TENSORS}, _plain)
        failure = None
        try:
            dcp.save(tensors, checkpoint_id=str(tmp))  # collective: raises on every rank
            if dist.is_main:
                save(tmp / SHARDED_META, {k: v for k, v in state.items() if k not in tensors})
        # CheckpointException derives from BaseException: named, or it would pass through
        except (Exception, CheckpointException) as error:  # noqa: BLE001 - any write failure
            failure = error
        if not all_wrote(dist, failure is None):  # trainer.pt is rank 0's alone
            if dist.is_main:
                shutil.rmtree(tmp, ignore_errors=True)  # no half-written .tmp left on disk
            torch_dist.barrier()
            raise write_failure(path, failure or RuntimeError("another rank could not write"))
        if dist.is_main:
            old = path.with_name(f".{path.name}.old")
            shutil.rmtree(old, ignore_errors=True)  # a crash's leftover would block the move
            if path.exists():
                os.replace(path, old)
            os.replace(tmp, path)
            shutil.rmtree(old, ignore_errors=True)
        torch_dist.barrier()  # no rank reads or prunes before the rename


# --- strided shards ---------------------------------------------------------------------
# A packed weight split over tp ranks as _StridedShard (a transformers MoE's gate_up_proj:
# each rank its slice of gate and of up, parallel/expert_parallel.py) is one chunk a rank to
# torch's checkpoint planner, at an offset that overlaps its neighbour's: DCP refuses to
# write it. It goes to the files as the same tensor cut in plain Shards, and comes back
# through one: the files are as any layout writes them. Its whole tensor is put together
# for the move, one weight at a time.

def _strided(value: Any) -> bool:
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.placement_types import _StridedShard

    return isinstance(value, DTensor) and any(isinstance(p, _StridedShard)
                                              for p in value.placements)


def _plain_placements(value: Any) -> list[Any]:
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    return [Shard(p.dim) if isinstance(p, _StridedShard) else p for p in value.placements]


def _plain(value: Any) -> Any:
    """A strided DTensor's tensor cut in plain Shards of its dims."""
    from torch.distributed.tensor import distribute_tensor

    return distribute_tensor(value.full_tensor(), value.device_mesh, _plain_placements(value),
                             src_data_rank=None)


def _mapped(tree: Any, change) -> Any:
    """`tree` (dicts and lists of a state) with each strided DTensor `change`d."""
    if isinstance(tree, dict):
        return {k: _mapped(v, change) for k, v in tree.items()}
    if isinstance(tree, list):
        return [_mapped(v, change) for v in tree]
    return change(tree) if _strided(tree) else tree


@contextlib.contextmanager
def _unstrided_for_load(template: dict[str, Any]):
    """`template` with plain-Shard stand-ins for its strided DTensors, read into; each
    copied back into its own after."""
    pairs: list[tuple[Any, Any]] = []

    def stand_in(value: Any) -> Any:
        from torch.distributed.tensor import empty

        pairs.append((value, empty(value.shape, dtype=value.dtype,
                                   device_mesh=value.device_mesh,
                                   placements=_plain_placements(value))))
        return pairs[-1][1]

    readable = _mapped(template, stand_in)
    yield readable
    from torch.distributed.tensor import distribute_tensor

    for own, read in pairs:
        own.copy_(distribute_tensor(read.full_tensor(), own.device_mesh, own.placements,
                                    src_data_rank=None))


def _read_index(path: Path, key: str, instead: str) -> Any:
    """The .metadata of the .dcp at `path`, which `key` named."""
    if not (path / ".metadata").is_file():
        raise CheckpointError(f"{key}={path} has no .metadata: not a complete sharded "
                              f"checkpoint: {instead}")
    try:
        with open(path / ".metadata", "rb") as f:
            return _MetadataUnpickler(f).load()
    except CheckpointError:  # the unpickler's own refusal says what it refused
        raise
    except Exception as error:  # noqa: BLE001 - garbage can fail any way at all
        raise CheckpointError(f"{key}={path}: its .metadata index cannot be read "
                              f"({type(error).__name__}), the checkpoint is damaged: "
                              f"{instead}") from None


def check_shards(path: Path, index: Any, key: str = "ckpt",
                 instead: str = "use another checkpoint") -> None:
    """Every shard file the index (path's .metadata) names is there and long enough for what
    it should hold: a missing or truncated shard is one line before anything starts, not a
    traceback from every rank inside torch.distributed.checkpoint. `key`: the setting that
    named `path`; `instead`: what to do where a shard is gone, in its words."""
    needed: dict[str, int] = {}
    for info in getattr(index, "storage_data", {}).values():
        name = str(info.relative_path)
        needed[name] = max(needed.get(name, 0), int(info.offset) + int(info.length))
    for name, size in sorted(needed.items()):
        shard = path / name
        if not shard.is_file():
            raise CheckpointError(f"{key}={path} is missing its shard {name}, which its "
                                  f".metadata lists: copy the whole .dcp directory, or "
                                  f"{instead}")
        if shard.stat().st_size < size:
            raise CheckpointError(f"{key}={path}: its shard {name} is truncated "
                                  f"({shard.stat().st_size} of {size} bytes): {instead}")
    if not (path / SHARDED_META).is_file():
        raise CheckpointError(f"{key}={path} has no {SHARDED_META}: not a complete sharded "
                              f"checkpoint: {instead}")


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


def _safe_reader(path: Path, metadata: Any):
    """torch's FileSystemReader, handed the index read through _MetadataUnpickler (a
    refusal surfaces there in one line, not deep inside dcp.load)."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import StorageMeta

    class SafeReader(FileSystemReader):
        def read_metadata(self, *args: Any, **kwargs: Any):
            if getattr(metadata, "storage_meta", None) is None:
                metadata.storage_meta = StorageMeta()
            metadata.storage_meta.load_id = self.load_id
            return metadata

    return SafeReader(str(path))
