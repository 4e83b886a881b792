"""The error every check raises for bad input: one line that names the key and the fix;
and the noise others' loggers make, held down for a block."""

from __future__ import annotations

import contextlib
import logging
from typing import Iterator


class OneLineError(Exception):
    """An error whose message is the whole story: the job ends with that line and exit
    status `status`, no traceback, whether the controller or a worker raised it."""

    status = 1


class ConfigError(OneLineError, ValueError):
    """Bad input, stated in one line that names the key and the fix."""

    status = 2


def first_line(error: BaseException) -> str:
    """`Type: first line of the message`, for quoting an error inside a one-line message."""
    text = (str(error).strip().splitlines() or [""])[0]
    return f"{type(error).__name__}: {text}" if text else type(error).__name__


@contextlib.contextmanager
def quieted(logger: str, level: int = logging.ERROR) -> Iterator[None]:
    """The logger `logger` says only what is at `level` or above while the block runs."""
    held = logging.getLogger(logger)
    before = held.level
    held.setLevel(level)
    try:
        yield
    finally:
        held.setLevel(before)
