"""One command as the user gave it (Invocation), and how a job of it ends when it does not
end well: JobFailed (its line and exit status), Stopped (a signal stopped it)."""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import shutil
import signal
from pathlib import Path
from typing import Iterator

from parallab.config import naming
from parallab.config.errors import ConfigError
from parallab.config.hydra_app import entry_command
from parallab.observe import summary


@dataclasses.dataclass
class Invocation:
    """One command as the user gave it (its argv, read and never changed) and what its jobs
    share: the record of an earlier run in the dir it names (Hydra writes .hydra/ there
    before the config can be checked; a refused command puts it back), whether it advises,
    and, for a sweep a signal stopped, the signal and the command that continues it."""

    argv: list[str] = dataclasses.field(default_factory=lambda: ["train.py"])
    earlier: dict[Path, bytes] = dataclasses.field(default_factory=dict)
    advising: bool = False  # parallab advise: every job advises
    stopped_by: int | None = None
    stopped_sweep: str | None = None
    fresh: Path | None = None  # the .hydra/ this command writes in a dir that held none
    logs: dict[Path, dict[Path, int]] = dataclasses.field(default_factory=dict)  # by dir

    @classmethod
    def read(cls, argv: list[str], advising: bool = False) -> "Invocation":
        earlier, fresh, logs = {}, None, {}
        for run_dir in naming.run_dirs_named(argv[1:]):
            hydra_dir = Path(run_dir).absolute() / ".hydra"
            if hydra_dir.is_dir():
                earlier.update({p: p.read_bytes() for p in hydra_dir.iterdir() if p.is_file()})
            else:
                fresh = hydra_dir
            logs[hydra_dir.parent] = {p: p.stat().st_size for p in
                                      hydra_dir.parent.glob("*.log") if p.is_file()}
        return cls(list(argv), earlier, advising, fresh=fresh, logs=logs)

    def held_before(self) -> list[str]:
        """The earlier run's record in the dir named on the command line, if it held one."""
        return [".hydra/"] if self.earlier else []

    def restore(self) -> None:
        """A refused command leaves an earlier run's record as it was, and no record of its
        own where the dir held none (the corrected command may use the same dir)."""
        for path, content in self.earlier.items():
            path.write_bytes(content)
        if self.fresh is not None:
            shutil.rmtree(self.fresh, ignore_errors=True)
        self._unlog()

    def _unlog(self) -> None:
        """The refused command's lines leave the dir's logs (its refusal still goes to the
        console): an earlier run's log ends where it ended, a log the command began is gone."""
        root = logging.getLogger()
        for handler in list(root.handlers):
            path = Path(getattr(handler, "baseFilename", "/"))
            if path.parent not in self.logs:
                continue
            root.removeHandler(handler)
            handler.close()
            if path in self.logs[path.parent]:
                os.truncate(path, self.logs[path.parent][path])
            else:
                path.unlink(missing_ok=True)

    @contextlib.contextmanager
    def refusing(self) -> Iterator[None]:
        """A ConfigError inside ends the job as a refusal: its message, its exit status (2;
        advise's NothingFits 1), and an earlier run's record put back."""
        try:
            yield
        except ConfigError as error:
            self.restore()
            raise JobFailed(str(error), error.status) from None

    def entry(self) -> list[str]:
        return entry_command(self.argv)


class JobFailed(Exception):
    """A job that cannot go on: its message, exit status, and a one-line summary."""

    def __init__(self, message: str, status: int, line: str | None = None):
        super().__init__(message)
        self.status = status
        self.line = line or message


class Stopped(JobFailed):
    """A run a signal stopped (saved where it had trained): exit status 128 + the signal,
    its record (status.json) saying so; `said`: its line was logged by the run already."""

    def __init__(self, signum: int, steps: int | None, said: bool = True,
                 resume: str | None = None):
        self.signum, self.steps, self.said = signum, steps, said
        name = signal.Signals(signum).name
        # `resume`: where the ranks had trained and saved before a second signal, or the
        # stop's watchdog, ended them unsaved (it had said nothing was saved)
        message = f"stopped by {name} before training began: nothing was saved" if \
            resume is None else (f"stopped by {name}: the ranks ended without saving this "
                                 f"step (a second signal, or a stop that did not end); "
                                 f"resume from the last checkpoint with: {resume}")
        super().__init__(message, 128 + signum,
                         f"stopped by {name}" + (f" at step {steps}" if steps else ""))

    def record(self, run_dir: str | Path) -> None:
        summary.record_stopped(run_dir, self.signum, self.steps)
