"""A run dir belongs to one run: a fresh run does not start over an earlier one, and two runs
never write into one dir at once."""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
from pathlib import Path
from typing import Iterator

from parallab.config.errors import ConfigError


def held_run(run_dir: Path) -> list[str]:
    """What of an earlier run the dir holds: metrics.json, checkpoints/ if not empty, and
    advise's answer."""
    held = [name for name in ("metrics.json", "advise.md") if (run_dir / name).exists()]
    if any((run_dir / "checkpoints").glob("*")):
        held.append("checkpoints/")
    return held


def check_unused(run_dir: Path, command: str, earlier: list[str] = ()) -> None:
    """`command` (evaluate, advise), which writes its own record into the run dir, starts
    only in a dir holding none: never over a training run's or an earlier answer, nor over
    `earlier`, what the dir held before this command (a killed run's .hydra/)."""
    held = [*held_run(run_dir), *earlier]
    if held:
        raise ConfigError(f"hydra.run.dir={run_dir} holds a run ({', '.join(held)}), which "
                          f"{command} would write over: give {command} a new hydra.run.dir "
                          "(or leave it out: each run gets its own)")


def check_fresh(run_dir: Path, resume: str | None, overwrite: bool, delete: bool,
                logged: tuple[str, ...] | list[str] = ()) -> None:
    """A run that does not resume starts only in a dir holding no run; with
    trainer.overwrite=true the earlier run's checkpoints, metrics and the files its loggers
    wrote (`logged`: glob patterns) are deleted (by the main process, `delete`) first."""
    held = held_run(run_dir)
    if resume is not None or not held:
        return
    if not overwrite:
        raise ConfigError(f"hydra.run.dir={run_dir} already holds a run ({', '.join(held)}): "
                          "continue it with trainer.resume=auto, start this one in a new "
                          "hydra.run.dir, or replace it with trainer.overwrite=true")
    if delete:
        for path in checkpoints_written(run_dir / "checkpoints"):
            shutil.rmtree(path) if path.is_dir() else path.unlink()
        (run_dir / "metrics.json").unlink(missing_ok=True)
        for pattern in logged:  # a CSV's rows, TensorBoard's events
            for path in run_dir.glob(pattern):
                if path.is_file():
                    path.unlink()


def checkpoints_written(directory: Path) -> list[Path]:
    """What parallab's checkpointer writes into `directory` (last, best, step_N in any
    format, and a save's temporary): a file of the user's own beside them stays."""
    import re

    from parallab.training import checkpoint, formats

    suffixes = "|".join(re.escape(kind.checkpoint_suffix)
                        for kind in formats.checkpoint_formats())
    ours = re.compile(rf"(last|best|{checkpoint.PERIODIC})({suffixes})|"
                      rf"\.(last|best|{checkpoint.PERIODIC})({suffixes})\.tmp")
    return sorted(p for p in directory.iterdir() if ours.fullmatch(p.name)) \
        if directory.is_dir() else []


def earlier_loggers(run_dir: Path) -> dict | None:
    """The loggers the run a dir holds was trained with (its last checkpoint's config):
    their files go with it under trainer.overwrite=true; None where no checkpoint says."""
    from parallab.training import checkpoint

    try:
        found = checkpoint.latest(run_dir / "checkpoints")
        return None if found is None else \
            checkpoint.saved_config(checkpoint.load_meta(found)).get("logger")
    except checkpoint.CheckpointError:
        return None


@contextlib.contextmanager
def lock(run_dir: Path) -> Iterator[None]:
    """Hold a lock on the run dir for the run; ConfigError at once if another run holds it.
    The lock is on the directory itself (flock), so nothing is left in it, and the OS drops
    it when the holder dies: a killed run leaves no stale lock."""
    run_dir.mkdir(parents=True, exist_ok=True)
    fd = os.open(run_dir, os.O_RDONLY)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise ConfigError(f"hydra.run.dir={run_dir} is in use by a run still going: wait "
                              "for it to end, or choose another hydra.run.dir") from None
        except OSError as error:
            raise ConfigError(f"hydra.run.dir={run_dir}: its file system cannot lock it "
                              f"({error.strerror}): put the run dir on a local disk") from None
        yield
    finally:
        os.close(fd)  # releases the lock
