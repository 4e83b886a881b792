"""The run's log file (train.log, simulate.log, train_rank{k}.log): a handler that, once its
file can no longer be written (a full disk, a removed mount), says so in one line and goes
on without it, where logging printed a traceback for every line after."""

from __future__ import annotations

import logging
import sys


class RunLog(logging.FileHandler):
    """logging.FileHandler whose first failed write is one line on stderr, and the last."""

    lost = False

    def emit(self, record: logging.LogRecord) -> None:
        if not self.lost:
            super().emit(record)

    def handleError(self, record: logging.LogRecord) -> None:  # noqa: N802 - logging's name
        error = sys.exc_info()[1]
        if self.lost or not isinstance(error, OSError):
            return super().handleError(record)
        self.lost = True
        print(f"parallab: {self.baseFilename} can no longer be written ({error.strerror}): "
              "its lines go to the console only", file=sys.stderr, flush=True)
