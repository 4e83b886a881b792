"""The train loss between log steps and over the epoch: what the loop reports as train/loss
and carries in its checkpoints (a resumed epoch's mean goes on from its steps so far), the
steps dropped over the run, and the error that ends a run whose train loss went non-finite
or that drops most of its steps (Diverged)."""

from __future__ import annotations

import math
from collections import deque
from typing import Any

import torch

from parallab.config.errors import OneLineError
from parallab.launching.distributed import Dist

SKIP_HORIZON = 20  # on_nan=skip stops when it drops over half of this many recent steps


class Diverged(OneLineError, RuntimeError):
    """The train loss went NaN or inf under trainer.on_nan=stop (or most steps were
    dropped under on_nan=skip)."""


def diverged(loss: float, step: int) -> Diverged:
    return Diverged(f"train loss is {loss} at step {step}: stopped; every checkpoint kept "
                    "holds finite weights; lower optim.lr, set trainer.clip_grad_norm, or set "
                    "trainer.on_nan=skip to drop such steps")


class LossWindow:
    """This rank's train loss between log steps, kept on the device (an add per step costs
    more) and summed at the log step, and the epoch's mean loss from the windows' means."""

    def __init__(self, device: torch.device):
        self.device = device
        self.losses: list[torch.Tensor] = []
        self.skipped = 0  # steps of the window dropped (on_nan=skip) or with no label
        self.empty = 0  # of those, steps whose labels were all ignored
        self.epoch_loss = 0.0  # the epoch's windows' losses, weighted by their trained steps
        self.epoch_steps = 0
        self.run_skipped = 0  # steps dropped over the run: non-finite gradients, or no label
        self.recent: deque[bool] = deque(maxlen=SKIP_HORIZON)  # dropped or not, per step

    def __len__(self) -> int:
        return len(self.losses)

    def add(self, loss: torch.Tensor) -> None:
        self.losses.append(loss)

    def skip(self, empty: bool = False) -> None:
        self.skipped += 1
        self.empty += empty
        self.run_skipped += 1

    def judged(self, dropped: bool, step: int) -> None:
        """on_nan=skip's verdict on a step; a run that drops most of its recent steps learns
        nothing: Diverged, as a non-finite loss under on_nan=stop."""
        self.recent.append(dropped)
        recent = self.recent
        if len(recent) >= SKIP_HORIZON // 2 and sum(recent) * 2 > len(recent):
            raise Diverged(f"trainer.on_nan=skip dropped {sum(recent)} of the last "
                           f"{len(recent)} steps (non-finite gradients) at step {step}: "
                           "stopped, every checkpoint kept holds finite weights; lower "
                           "optim.lr or set trainer.clip_grad_norm")

    def sum(self) -> torch.Tensor:
        """This rank's summed loss of the steps since the last log step."""
        if not self.losses:
            return torch.zeros((), device=self.device)
        return torch.stack(self.losses).float().sum()

    def check_finite(self, dist: Dist, step: int) -> None:
        """Diverged where any step since the last log step, on any rank, had a non-finite
        loss: the weights may be non-finite too (one all-reduce)."""
        if self.losses:
            bad = torch.tensor(float(not torch.isfinite(self.sum())), device=dist.device)
            if dist.all_reduce_sum(bad).item() > 0:
                raise diverged(math.nan, step)

    def close(self, loss_sum: float, loss_ranks: int) -> float | None:
        """The window's mean train loss over its trained steps and all ranks (`loss_sum`:
        summed over the ranks, `loss_ranks` of which hold a loss each step), added to the
        epoch's where finite; None where every step had nothing to learn from (all labels
        ignored). The next window starts empty."""
        steps, trained = len(self.losses), len(self.losses) - self.skipped
        mean = None
        if trained or self.empty != steps:
            mean = loss_sum / (trained * loss_ranks) if trained else math.nan
        if mean is not None and math.isfinite(mean):
            self.epoch_loss += mean * trained
            self.epoch_steps += trained
        self.losses.clear()
        self.skipped = self.empty = 0
        return mean

    def epoch_started(self) -> None:
        self.epoch_loss, self.epoch_steps = 0.0, 0

    def state_dict(self) -> dict[str, Any]:
        """The epoch's loss so far (a window is always closed before a checkpoint), the
        run's dropped steps."""
        return {"epoch_loss": self.epoch_loss, "epoch_steps": self.epoch_steps,
                "skipped_steps": self.run_skipped}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.epoch_loss, self.epoch_steps = state["epoch_loss"], state["epoch_steps"]
        self.run_skipped = state["skipped_steps"]

    def epoch_mean(self) -> float:
        """The epoch's train loss; NaN where no step computed one."""
        return self.epoch_loss / self.epoch_steps if self.epoch_steps else math.nan
