"""Weights & Biases, through its own client: a run per parallab run, grouped by sweep;
offline (files in the run dir, `wandb sync` later) unless the user has set W&B up."""

from __future__ import annotations

import logging
import netrc
import os
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from parallab.config.errors import first_line
from parallab.observe.loggers.base import Logger, RunInfo

log = logging.getLogger(__name__)


class WandbLogger(Logger):
    requires = "wandb"

    def __init__(self, project: str = "parallab", group: str | None = None,
                 entity: str | None = None, mode: str | None = None) -> None:
        self.project = project
        self.group = group
        self.entity = entity
        self.mode = mode
        self.run = None
        # run.log takes about a millisecond (it encodes and hands the record to W&B's own
        # process): on a thread of its own, in order, the step does not wait for it
        self.sender = ThreadPoolExecutor(max_workers=1, thread_name_prefix="wandb")
        self.failed: str | None = None

    def start(self, run: RunInfo) -> None:
        import wandb

        self.run = wandb.init(
            project=self.project, entity=self.entity, group=self.group or run.sweep,
            name=run.name, dir=str(run.run_dir), mode=self.mode or default_mode(),
            config=run.params, tags=[f"{k}={v}"[:64] for k, v in run.tags.items()],
            settings=wandb.Settings(quiet=True), reinit="finish_previous")
        self.run.config.update({"overrides": " ".join(run.overrides)})

    def scalars(self, values: dict[str, float], step: int) -> None:
        if self.failed is None:
            self.sender.submit(self.send, values, step)

    def send(self, values: dict[str, float], step: int) -> None:
        try:
            self.run.log(values, step=step)
        except Exception as error:  # noqa: BLE001 - W&B's process gone: said once
            self.failed = first_line(error)
            log.warning("logger.wandb: %s: the run goes on; its figures are in the run dir",
                        self.failed)

    def text(self, tag: str, markdown: str) -> None:
        self.run.summary[tag] = markdown

    def finish(self, final: dict[str, float], hparams: dict[str, Any], step: int) -> None:
        self.scalars(final, step)
        self.sender.shutdown(wait=True)
        self.run.summary.update(final)
        self.run.config.update({k: v for k, v in hparams.items() if k not in self.run.config},
                               allow_val_change=True)

    def close(self, status: str) -> None:
        self.sender.shutdown(wait=True)
        if self.run is not None:
            if status == "stopped":
                self.run.mark_preempting()
            self.run.finish(exit_code=1 if status == "failed" else 0)


def default_mode() -> str | None:
    """None (W&B decides: online) where the user has set W&B up (WANDB_MODE, an API key, or
    `wandb login`), else offline: nothing leaves the machine unasked."""
    if os.environ.get("WANDB_MODE") or os.environ.get("WANDB_API_KEY"):
        return None
    try:
        known = netrc.netrc().authenticators("api.wandb.ai")
    except (OSError, netrc.NetrcParseError):
        known = None
    return None if known else "offline"
