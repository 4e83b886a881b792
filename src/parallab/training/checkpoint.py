"""Checkpoints: a run's training state saved as it trains, found again to resume, pruned,
and what one records (its config, model, layout).

Each checkpoint file format is one class in formats/ that both writes and reads it (a
CheckpointFormat): the Checkpointer writes in the one the layout asks for (Layout.sharded:
`<name>.dcp`, every rank its shards; else `<name>.pt`, rank 0 the whole state); `latest`
and pruning find checkpoints by the suffixes of those in formats.FORMATS.
"""

from __future__ import annotations

import logging
import re
import shutil
from pathlib import Path
from typing import Any

import torch

from parallab.training import formats
from parallab.training.formats import SHARDED_META, CheckpointError, load, save

log = logging.getLogger(__name__)

__all__ = ["SHARDED_META", "CheckpointError", "Checkpointer", "load", "save", "latest",
           "load_meta", "read_state", "resumable", "by_name", "periodic_name",
           "saved_config", "saved_model", "saved_parallel", "same_model"]


def periodic_name(step: int) -> str:
    return f"step_{step:08d}"


# the names periodic_name writes: a user's own step_4.pt beside them is not one (it had been
# pruned with them, or resumed from as the newest)
PERIODIC = r"step_\d{8,}"


def load_meta(path: str | Path, key: str = "ckpt",
              instead: str = "use another checkpoint") -> dict[str, Any]:
    """What a checkpoint holds besides sharded tensors: a .dcp's trainer.pt (its shards
    checked against its index first), or a file with its tensors memory-mapped (checking a
    resume target reads no weights). `key`: the setting that named it, `instead` what to do
    where it cannot be read, as a .dcp's refusal says them."""
    return formats.state_format(path, key, instead).record()


def read_state(path: str | Path, template: dict[str, Any]) -> dict[str, Any]:
    """A checkpoint's whole state, its {"model": ..., "optimizer": ...} shaped as `template`
    (this rank's, under whichever layout and world size reads it)."""
    return formats.state_format(path).read_state(template)


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
    """The layout (parallel.name) a checkpoint was saved under."""
    parallel = saved_config(meta).get("parallel")
    return parallel.get("name") if isinstance(parallel, dict) else None


def same_model(meta: dict[str, Any], spec: dict[str, Any]) -> bool:
    """The checkpoint was trained with this model spec (_target_ and every argument)."""
    return saved_config(meta).get("model") == spec


def changed_batch(saved: dict[str, Any], here: int, resume: str) -> str | None:
    """A resume at another global batch (`here` samples a step over all ranks) than its
    checkpoint's (`saved`: its meta or state) counts the rest of its epochs in steps of
    `here` (training/loop_state.py). Refused mid-epoch in data without a place of its own:
    map-style data skips the batches its steps took, which at another size are other
    samples."""
    was = saved.get("global_batch_size")
    if was is None or was == here or not saved.get("epoch_step") or \
            saved.get("data") is not None:  # (a checkpoint that records none: taken)
        return None
    return (f"trainer.resume={resume} was saved {saved['epoch_step']} steps into an epoch, "
            f"at {was} samples a step over all ranks, and this run takes {here}: it would "
            f"go on from other samples than those steps took: give data.global_batch_size="
            f"{was} (or resume a checkpoint saved at an epoch's end)")


def first_difference(saved: Any, here: Any, key: str) -> tuple[str, Any, Any] | None:
    """The first key (dotted, under `key`) whose value differs between two configs, with
    the saved value and this one's (a key one lacks: None there); None where they match."""
    if isinstance(saved, dict) and isinstance(here, dict):
        for name in [*saved, *(k for k in here if k not in saved)]:
            found = first_difference(saved.get(name), here.get(name), f"{key}.{name}")
            if found:
                return found
        return None
    return None if saved == here else (key, saved, here)


def by_name(path: str | Path, meta: dict[str, Any]) -> bool:
    """The optimizer state is keyed by parameter name (any layout reads it), not by index."""
    return formats.state_format(path).by_name(meta)


def resumable(path: str | Path, meta: dict[str, Any]) -> bool:
    """A training checkpoint: a position to resume from, and its optimizer state."""
    return formats.state_format(path).resumable(meta)


def _suffixes() -> list[str]:
    return [kind.checkpoint_suffix for kind in formats.checkpoint_formats()]


def periodic(directory: Path, suffix: str) -> list[Path]:
    """The periodic checkpoints parallab wrote in `directory` (step_NNNNNNNN.pt or .dcp),
    oldest first: a user's own file there (step_notes.pt, step_4.pt, a
    step_00000002.backup.pt copy) is neither resumed from nor pruned."""
    return sorted(p for p in directory.glob(f"step_*{suffix}")
                  if re.fullmatch(rf"{PERIODIC}{re.escape(suffix)}", p.name))


def _step(path: Path) -> int:
    if path.name.startswith("step_"):
        return int(path.name[len("step_"):].split(".")[0])
    return load_meta(path)["step"]  # mapped: no tensors read


def latest(directory: Path) -> Path | None:
    """The newest readable checkpoint in `directory` by step, last.* winning a tie; an
    unreadable newer one (truncated by a crash, a shard lost) is passed over, saying so."""
    suffixes = _suffixes()
    candidates = [p for s in suffixes for p in periodic(directory, s)]
    candidates += [p for p in (directory / f"last{s}" for s in suffixes) if p.exists()]
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


def restore_rng(state: dict[str, Any], dist) -> None:
    """This rank's RNG state as the checkpoint's Checkpointer gathered it, where the run has
    as many ranks."""
    rng = state.get("rng", [])
    if len(rng) == dist.world_size:
        torch.set_rng_state(rng[dist.rank])
    elif dist.is_main:  # once, as the loop's line, whose resume it is part of
        logging.getLogger("parallab.training.trainer").warning(
            "the checkpoint holds RNG states for %d rank%s, this run has %d: random draws "
            "(dropout) will differ from the original run's", len(rng),
            "" if len(rng) == 1 else "s", dist.world_size)


class Checkpointer:
    """Saves the trainer's state with every rank's RNG state, in the checkpoint format of
    the layout (`sharded`: Layout.sharded): rank 0 writes the file, or under a sharded
    layout every rank its part of the .dcp directory."""

    def __init__(self, directory: Path, dist, config: dict[str, Any], keep_last_k: int,
                 sharded: bool = False, base: dict[str, str] | None = None):
        self.directory = directory
        self.format = formats.checkpoint_format(sharded)
        self.dist = dist
        self.config = config
        # the weights it started from (trainer.init_from: weights.base_record), which an
        # export of adapters alone needs again and does not hold
        self.base = base
        self.keep_last_k = keep_last_k
        if dist.is_main:
            self._remove_temporaries()

    def _remove_temporaries(self) -> None:
        """What a save cut short left (a second Ctrl-C, a kill while it wrote): its
        temporary, never a checkpoint, removed as the run starts again."""
        for left in self.directory.glob(".*.tmp"):
            log.info("checkpoints: removing %s, which a save cut short left", left.name)
            shutil.rmtree(left, ignore_errors=True) if left.is_dir() else \
                left.unlink(missing_ok=True)

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
        """Every rank calls this (the RNG states are gathered, and the format's write may be
        collective); CheckpointError on every rank where the write failed."""
        rng = self._rng_states()
        path = self.directory / f"{name}{self.format.checkpoint_suffix}"
        record = {"rng": rng, "config": self.config, **({"base": self.base} if self.base else {})}
        self.format(path).write_state({**state, **record}, self.dist)
        if self.dist.is_main:
            self._prune(path)
        return path

    def _prune(self, saved: Path) -> None:
        """The periodic checkpoints but the last keep_last_k, by step whatever their format
        (a run resumed under another layout writes the other one); and `saved`'s name in
        another format (best.dcp beside a new best.pt: an earlier layout's, now stale)."""
        found = sorted((p for s in _suffixes() for p in periodic(self.directory, s)),
                       key=_step)
        stale = [self.directory / f"{Path(saved.stem).stem}{s}" for s in _suffixes()
                 if not saved.name.startswith("step_") and s != saved.suffix]
        for old in [*found[:-self.keep_last_k], *(p for p in stale if p.exists())]:
            shutil.rmtree(old) if old.is_dir() else old.unlink()
