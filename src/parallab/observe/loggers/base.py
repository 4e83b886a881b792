"""What every logger is given: the run it records, and the calls it receives.

A logger (TensorBoard, CSV, MLflow, W&B, or a user's own by `_target_`) lives on rank 0
only. Each receives the same calls at the same steps: start (the run's hyperparameters
and tags), scalars (train figures at each log step, evaluations, comm volume), text, finish
(the final figures) and close.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar


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

    def start(self, run: RunInfo) -> None:
        """Before the first step: connect, record the hyperparameters and tags."""

    def scalars(self, values: dict[str, float], step: int) -> None:
        """Figures at an optimizer step (train/*, eval/*, comm/*); must not slow the step."""

    def text(self, tag: str, markdown: str) -> None:
        """A table or note (the batch-size finder's trials)."""

    def finish(self, final: dict[str, float], hparams: dict[str, Any], step: int) -> None:
        """The final figures (`final/<name>`) and the hyperparameters runs are compared by
        (those of start plus what only the run knew: its learning rate, world size...)."""

    def close(self, status: str) -> None:
        """The run ended: `finished`, `stopped` (a signal; resumable) or `failed`."""
