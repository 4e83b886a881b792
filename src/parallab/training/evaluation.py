"""The run's evaluations: the model scored on the eval set (metrics.evaluate), the figures
logged, and what early stopping and the summary keep of them (the latest figures, the step
they were measured at, the monitor)."""

from __future__ import annotations

import logging
from typing import Any

from torch import nn

from parallab import metrics
from parallab.config.schema import TrainerConfig
from parallab.data import Data
from parallab.launching.distributed import Dist
from parallab.observe.loggers import RunLogger
from parallab.parallel.base import Runtime
from parallab.training.monitor import Monitor

log = logging.getLogger("parallab.training.trainer")  # its lines read as the loop's


class Evaluation:
    def __init__(self, cfg: TrainerConfig, model: nn.Module, runtime: Runtime,
                 data: Data, dist: Dist, logger: RunLogger,
                 metric_specs: dict[str, Any] | None = None):
        self.model = model  # the unwrapped model: same weights, fewest collectives
        self.runtime, self.precision, self.data, self.dist = runtime, runtime.precision, data, dist
        self.logger, self.metric_specs = logger, metric_specs or {}
        self.by_step = cfg.eval_every_n_steps
        self.figures: dict[str, float] = {}
        self.step = -1  # the step the figures were measured at
        self.monitor = Monitor(cfg.monitor, cfg.monitor_mode, cfg.early_stop_patience)
        self.resume_monitor: dict[str, Any] | None = None  # set by an unscheduled evaluation

    def scored(self, step: int) -> bool:
        """The weights of `step` have been evaluated."""
        return self.step == step and bool(self.figures)

    def run(self, step: int, epoch: int, epoch_step: int) -> bool:
        """Evaluate the weights of `step`, log the figures; True where the monitored figure
        improved."""
        self.figures = metrics.evaluate(self.model, self.data.eval, self.dist, self.precision,
                                        self.runtime.loss, self.metric_specs,
                                        self.runtime.eval_forward)
        self.step = step
        improved = self.monitor.update(self.figures, step)
        self.logger.scalars({"eval/" + k.removeprefix(metrics.PREFIX): v
                             for k, v in self.figures.items()}, step)
        if self.dist.is_main:
            # by step where evaluation is by step, or the run ended inside an epoch
            # (trainer.max_steps): the progress lines' numbering, not the epochs completed
            when = f"step {step}" if self.by_step or epoch_step else f"epoch {epoch}"
            log.info("%s: %s", when, ", ".join(f"{k} {v:.4f}" for k, v in self.figures.items()))
        return improved

    def off_schedule(self) -> None:
        """The next evaluation is off the schedule (the final weights, unscored): a run
        resumed from here continues with the monitor as it was, as the uninterrupted run
        never made this evaluation."""
        self.resume_monitor = self.monitor.state_dict()

    def stop_early(self) -> None:
        self.monitor.stopped_early = True
        if self.dist.is_main:
            m = self.monitor
            log.info("early stop: %s has not improved for %d evaluations (best %.6g at step %s)",
                     m.name, m.stale, m.best, m.best_step)

    def state_dict(self) -> dict[str, Any]:
        return self.resume_monitor or self.monitor.state_dict()

    def load_state_dict(self, state: dict[str, Any] | None) -> None:
        self.monitor.load_state_dict(state)
