"""Weights & Biases, through its own client: a run per parallab run, grouped by sweep;
offline (files in the run dir, `wandb sync` later) unless the user has set W&B up."""

from __future__ import annotations

import netrc
import os
from typing import Any

from parallab.observe.loggers.base import Logger, RunInfo, Sender


MODES = ("online", "offline", "disabled", "shared")  # what wandb.init takes as its mode
PROJECT_REFUSES = ("/", "\\", "#", "?", "%", ":")  # characters W&B refuses in a project name


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
        self.sender = Sender("wandb")

    @classmethod
    def check(cls, project: str = "parallab", mode: str | None = None,
              **config: Any) -> str | None:
        if mode is not None and mode not in MODES:
            return (f"logger.wandb.mode={mode} is not one of W&B's modes: "
                    f"{', '.join(MODES)} (or null: offline unless W&B is set up)")
        refused = [c for c in PROJECT_REFUSES if c in project]
        if not project or len(project) > 128 or refused:
            why = (f"it holds {' '.join(refused)}" if refused else "it is empty" if not project
                   else f"it is {len(project)} characters, W&B takes 128")
            return (f"logger.wandb.project={project!r} is a name W&B refuses ({why}): give "
                    "another")
        return None

    def start(self, run: RunInfo) -> None:
        import wandb

        self.run = wandb.init(
            project=self.project, entity=self.entity, group=self.group or run.sweep,
            name=run.name, dir=str(run.run_dir), mode=self.mode or default_mode(),
            config=run.params, tags=[f"{k}={v}"[:64] for k, v in run.tags.items()],
            settings=wandb.Settings(quiet=True), reinit="finish_previous")
        self.run.config.update({"overrides": " ".join(run.overrides)})

    def scalars(self, values: dict[str, float], step: int) -> None:
        self.sender.submit(lambda: self.run.log(values, step=step))

    def histogram(self, tag: str, counts: list[float], step: int) -> None:
        import wandb

        edges = [i - 0.5 for i in range(len(counts) + 1)]
        histogram = wandb.Histogram(np_histogram=(counts, edges))
        self.sender.submit(lambda: self.run.log({tag: histogram}, step=step))

    def text(self, tag: str, markdown: str) -> None:
        self.run.summary[tag] = markdown

    def finish(self, final: dict[str, float], hparams: dict[str, Any], step: int) -> None:
        self.scalars(final, step)
        self.sender.close()
        self.run.summary.update(final)
        self.run.config.update({k: v for k, v in hparams.items() if k not in self.run.config},
                               allow_val_change=True)

    def close(self, status: str) -> None:
        self.sender.close()
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
