"""What a command's process does once Hydra has composed its config, before Hydra names and
makes the run dir (a Hydra callback, conf/config.yaml's `hydra.callbacks.start`):

- the ranks a launcher started in place meet at their master, within
  parallel.rendezvous_timeout, and rank 0 hands every rank its start time, which names the
  run dir (in_place.meet_in_place): the same rule under torchrun, SLURM and mpirun;
- the dir Hydra is about to make (hydra.run.dir, or a multirun's hydra.sweep.dir) is
  checked: one that cannot be made or written ends the command in one line, where Hydra
  ended every rank in a NotADirectoryError or PermissionError traceback.

Hydra turns a callback's exception into a warning and goes on, so a refusal here prints its
line and exits itself.
"""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path
from typing import Any, NoReturn

from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf

from parallab.config.errors import ConfigError, OneLineError
from parallab.launching import in_place


def dir_problem(key: str, path: str | Path) -> str | None:
    """Why the dir `path` (given as `key`) cannot be made, or written once made, in one
    line; None where it can. A few stat calls on the dir, or its nearest existing parent, and
    one probe dir made and removed there."""
    path = Path(path).absolute()
    found = path
    while not (found.exists() or found.is_symlink()) and found != found.parent:
        found = found.parent
    if not found.is_dir():
        what = "is a file" if found.is_file() else "is not a directory"
        return (f"{key}={path} cannot be made: {found} {what}: give another {key}, or move "
                f"{found} aside")
    if not os.access(found, os.W_OK | os.X_OK):
        return (f"{key}={path} cannot be made: {found} is not writable here (read-only, or "
                f"another user's): give a {key} where this user can write")
    try:  # what access() does not see: a file system that takes no new directory (/proc,
        # /sys), whose permissions root is not held to
        os.rmdir(tempfile.mkdtemp(prefix=".parallab-probe-", dir=found))
    except OSError as error:
        return (f"{key}={path} cannot be made: {found} takes no new directory "
                f"({error.strerror}): give a {key} where this user can write")
    return None


def _processes(config: DictConfig) -> bool:
    """The layout runs a process per rank (its config class says so before torch loads)."""
    if OmegaConf.select(config, "parallel") is None:
        return True
    return getattr(OmegaConf.get_type(config, "parallel"), "processes", True)


def _end(error: OneLineError) -> NoReturn:
    print(error, file=sys.stderr, flush=True)
    raise SystemExit(error.status)


class RunStart(Callback):
    """The ranks meet and the run's dir is checked, before Hydra makes it."""

    def on_run_start(self, config: DictConfig, **kwargs: Any) -> None:
        self._start(config, "hydra.run.dir")

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        self._start(config, "hydra.sweep.dir")

    @staticmethod
    def _start(config: DictConfig, key: str) -> None:
        timeout = OmegaConf.select(config, "parallel.rendezvous_timeout", default=60.0)
        try:
            # else the checks refuse it on every rank, before anything runs: a timeout <= 0,
            # or a launcher's ranks under a one-process layout, which reads no rank and
            # whose ranks never meet (a launcher's variables left in a shell: no wait)
            if timeout > 0 and _processes(config):
                in_place.meet_in_place(timeout)
        except OneLineError as error:
            _end(error)
        try:
            named = OmegaConf.select(config, key)
        except Exception:  # noqa: BLE001 - a name Hydra alone resolves (${hydra:...}): its own
            return
        problem = dir_problem(key, str(named))
        if problem is not None:
            _end(ConfigError(problem))
