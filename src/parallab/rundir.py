"""A run dir belongs to one run: a fresh run does not start over an earlier one, and two runs
never write into one dir at once."""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
from pathlib import Path
from typing import Iterator

from parallab.errors import ConfigError

LOCK = ".parallab.lock"
RECORD = ("metrics.json", "checkpoints")  # what makes a dir hold a run


def held_run(run_dir: Path) -> list[str]:
    """What of an earlier run the dir holds: metrics.json, and checkpoints/ if not empty."""
    held = []
    if (run_dir / "metrics.json").exists():
        held.append("metrics.json")
    if any((run_dir / "checkpoints").glob("*")):
        held.append("checkpoints/")
    return held


def check_fresh(run_dir: Path, resume: str | None, overwrite: bool, delete: bool) -> None:
    """A run that does not resume starts only in a dir holding no run; with
    trainer.overwrite=true the earlier run's checkpoints and metrics are deleted (by the
    main process, `delete`) first."""
    held = held_run(run_dir)
    if resume is not None or not held:
        return
    if not overwrite:
        raise ConfigError(f"hydra.run.dir={run_dir} already holds a run ({', '.join(held)}): "
                          "continue it with trainer.resume=auto, start this one in a new "
                          "hydra.run.dir, or replace it with trainer.overwrite=true")
    if delete:
        shutil.rmtree(run_dir / "checkpoints", ignore_errors=True)
        (run_dir / "metrics.json").unlink(missing_ok=True)


@contextlib.contextmanager
def lock(run_dir: Path) -> Iterator[None]:
    """Hold the dir's lock file for the run; ConfigError at once if another run holds it.
    The OS drops the lock when the holder dies, so a killed run leaves no stale lock."""
    run_dir.mkdir(parents=True, exist_ok=True)
    with open(run_dir / LOCK, "a+") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as error:
            if not isinstance(error, BlockingIOError):
                raise ConfigError(f"hydra.run.dir={run_dir}: its file system cannot lock files "
                                  f"({error.strerror}): put the run dir on a local disk") from None
            handle.seek(0)
            holder = handle.read().strip() or "another process"
            raise ConfigError(f"hydra.run.dir={run_dir} is in use by a run still going "
                              f"(pid {holder}): wait for it to end, or choose another "
                              "hydra.run.dir") from None
        handle.seek(0)
        handle.truncate()
        handle.write(str(os.getpid()))
        handle.flush()
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)
