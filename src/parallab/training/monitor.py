"""trainer.monitor: the best evaluation so far, for checkpoints/best.pt and early stopping.

Every rank holds the same eval figures (they are all-reduced), so every rank reaches the
same verdict without a collective of its own. The state travels in checkpoints, so a
resumed run keeps its best figure and its count of evaluations without improvement.
"""

from __future__ import annotations

import logging
import math
from typing import Any

from parallab import metrics

log = logging.getLogger(__name__)
# the figures whose better direction is known; any other names its mode
MODES = {metrics.LOSS: "min", metrics.ACCURACY: "max"}


def problem(cfg, reported: list[str]) -> str | None:
    """None if trainer.monitor names a figure the run reports with a known mode (resolving
    a null monitor_mode), else one line naming the key and the fix."""
    if cfg.monitor not in reported:
        return (f"trainer.monitor={cfg.monitor} is not a figure this run reports "
                f"({', '.join(reported)}): pick one of them")
    if cfg.monitor_mode is None:
        if cfg.monitor not in MODES:
            return (f"trainer.monitor={cfg.monitor}: say whether higher is better with "
                    "trainer.monitor_mode=max, or lower with trainer.monitor_mode=min")
        cfg.monitor_mode = MODES[cfg.monitor]
    if cfg.monitor_mode not in ("min", "max"):
        return f"trainer.monitor_mode={cfg.monitor_mode} is unknown: use min or max"
    if cfg.early_stop_patience is not None and cfg.early_stop_patience < 1:
        return (f"trainer.early_stop_patience={cfg.early_stop_patience} is out of range: it "
                "must be >= 1 (or null for no early stopping)")
    return None


class Monitor:
    def __init__(self, name: str, mode: str, patience: int | None):
        """`mode` as problem() resolved it: min or max."""
        assert mode in ("min", "max"), f"monitor mode {mode!r}: problem() resolves it first"
        self.name = name
        self.mode = mode
        self.patience = patience
        self.best: float | None = None
        self.best_step: int | None = None
        self.stale = 0  # evaluations since the last improvement
        self.stopped_early = False  # the run ended here, before its length (set by the trainer)

    def update(self, figures: dict[str, float], step: int) -> bool:
        """Record an evaluation at `step`; True if it is the best so far."""
        value = figures.get(self.name)
        finite = value is not None and math.isfinite(value)
        better = finite and (self.best is None or
                             (value < self.best if self.mode == "min" else value > self.best))
        if better:
            self.best, self.best_step, self.stale = value, step, 0
        else:
            self.stale += 1
        return better

    @property
    def exhausted(self) -> bool:
        """trainer.early_stop_patience evaluations in a row without improvement."""
        return self.patience is not None and self.stale >= self.patience

    def summary(self) -> dict[str, Any]:
        return {f"best_{self.name}": self.best, "best_step": self.best_step,
                "stopped_early": self.stopped_early}

    def state_dict(self) -> dict[str, Any]:
        return {"best": self.best, "best_step": self.best_step, "stale": self.stale,
                "name": self.name, "mode": self.mode}

    def load_state_dict(self, state: dict[str, Any] | None) -> None:
        """The checkpoint's best and count, where it monitored the same figure the same way
        (another trainer.monitor or monitor_mode here: its best is another figure's, and
        would stand as this one's; the best starts afresh at the resume)."""
        if not state:  # a checkpoint from before best.pt existed holds none
            return
        if (state.get("name", self.name), state.get("mode", self.mode)) != (self.name,
                                                                           self.mode):
            log.info("trainer.monitor=%s (%s) here, %s (%s) in the checkpoint: the best "
                     "starts afresh", self.name, self.mode, state["name"], state["mode"])
            return
        self.best, self.best_step, self.stale = (state["best"], state["best_step"],
                                                 state["stale"])
