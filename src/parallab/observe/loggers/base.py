"""What every logger is given: the run it records, and the calls it receives.

A logger (TensorBoard, CSV, MLflow, W&B, or a user's own by `_target_`) lives on rank 0
only. Each receives the same calls at the same steps: start (the run's hyperparameters
and tags), scalars (train figures at each log step, evaluations, comm volume), histograms
(an MoE layer's tokens per expert), text, finish (the final figures) and close.
"""

from __future__ import annotations

import logging
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, ClassVar

from parallab.config.errors import first_line

log = logging.getLogger(__name__)


@dataclass
class RunInfo:
    """The run a logger records."""

    run_dir: Path
    name: str  # a sweep job's dir name (what it changed), else the run dir's date/time
    sweep: str | None  # the sweep dir a multirun's job belongs to; None for a single run
    params: dict[str, Any]  # the resolved config, flattened: `optim.lr` -> 0.01
    config_yaml: str
    overrides: list[str] = field(default_factory=list)  # what the command line changed
    tags: dict[str, str] = field(default_factory=dict)  # parallel, world_size, precision


class Logger:
    """The calls a logger receives, each a no-op here. An exception from any of them is
    one warning line: the logger is dropped and the run goes on."""

    # the package it needs beyond parallab's own (an extra: pip install "parallab[NAME]")
    requires: ClassVar[str | None] = None

    @classmethod
    def check(cls, **config: Any) -> str | None:
        """Its config as its tracker would take it, before launch: None, or one line naming
        the key (a tracker that refuses a value would otherwise drop out after training)."""
        return None

    @classmethod
    def writes(cls, **config: Any) -> list[str]:
        """The files it writes into the run dir given its config (glob patterns): checked
        against the run's own before launch, and removed by trainer.overwrite=true."""
        return []

    def start(self, run: RunInfo) -> None:
        """Before the first step: connect, record the hyperparameters and tags."""

    def scalars(self, values: dict[str, float], step: int) -> None:
        """Figures at an optimizer step (train/*, eval/*, comm/*); must not slow the step."""

    def histogram(self, tag: str, counts: list[float], step: int) -> None:
        """Counts by bin 0, 1, ... at an optimizer step (an MoE layer's tokens per expert);
        a logger without histograms leaves them out (its scalars carry their summary)."""

    def text(self, tag: str, markdown: str) -> None:
        """A table or note (the batch-size finder's trials)."""

    def finish(self, final: dict[str, float], hparams: dict[str, Any], step: int) -> None:
        """The final figures (`final/<name>`) and the hyperparameters runs are compared by
        (those of start plus what only the run knew: its learning rate, world size...)."""

    def close(self, status: str) -> None:
        """The run ended: `finished`, `stopped` (a signal; resumable) or `failed`."""


class Sender:
    """A tracker's requests, in order, on a thread of their own, so that a step never waits
    on the tracker; the first that raises is said once (`where`: the tracker, if it is
    somewhere to be named) and every later one is dropped: the run goes on."""

    def __init__(self, name: str, where: str | None = None) -> None:
        self.name, self.where = name, where
        self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix=name)
        self.failed: str | None = None

    def submit(self, call: Callable[..., Any], *args: Any) -> None:
        if self.failed is None:
            self.pool.submit(self._run, call, *args)

    def _run(self, call: Callable[..., Any], *args: Any) -> None:
        if self.failed is not None:
            return
        try:
            call(*args)
        except Exception as error:  # noqa: BLE001 - whatever a tracker raises: said once
            self.failed = first_line(error)
            said = f"{self.where} stopped answering ({self.failed})" if self.where \
                else self.failed
            log.warning("logger.%s: %s: the run goes on; its figures are in the run dir",
                        self.name, said)

    def close(self) -> None:
        """Every request sent (or dropped) before this returns."""
        self.pool.shutdown(wait=True)
