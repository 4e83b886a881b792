"""The error every check raises for bad input: one line that names the key and the fix;
and what a block holds for its length: another's logger down, environment variables set."""

from __future__ import annotations

import contextlib
import logging
import os
from typing import Iterator


class OneLineError(Exception):
    """An error whose message is the whole story: the job ends with that line and exit
    status `status`, no traceback, whether the controller or a worker raised it."""

    status = 1


class ConfigError(OneLineError, ValueError):
    """Bad input, stated in one line that names the key and the fix."""

    status = 2


def require(ok: bool, message: str | None) -> None:
    """`message` as the ConfigError it names where `ok` is false."""
    if not ok:
        raise ConfigError(message)


def refuse(problem: str | None) -> None:
    """An owner's problem() (None: nothing wrong) as the ConfigError it names."""
    require(not problem, problem)


class NothingFits(ConfigError):
    """No layout fits the GPUs' memory: the smallest need first, and where every
    candidate was weighed (advise's grid, whose exit status is 1) each one's reason on a
    line of its own below."""

    def __init__(self, message: str, status: int = 2):
        super().__init__(message)
        self.status = status


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


@contextlib.contextmanager
def environment_set(values: dict[str, str]) -> Iterator[None]:
    """os.environ with `values` set, put back as it was after."""
    saved = {key: os.environ.get(key) for key in values}
    os.environ.update(values)
    try:
        yield
    finally:
        _put_back(saved)


@contextlib.contextmanager
def environment_kept_if_refused(*names: str) -> Iterator[None]:
    """os.environ's `names` put back as they were where the block raises ConfigError: a
    refused config leaves the calling process (a notebook, a sweep's) as it found it."""
    saved = {key: os.environ.get(key) for key in names}
    try:
        yield
    except ConfigError:
        _put_back(saved)
        raise


def _put_back(saved: dict[str, str | None]) -> None:
    for key, value in saved.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value
