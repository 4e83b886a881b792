"""One optimizer step: the global batch's loss terms counted, each micro-batch's forward
and backward (gradients reduced across ranks on the last), clipping and trainer.on_nan=skip,
the optimizer and the learning-rate schedule."""

from __future__ import annotations

import contextlib
import logging
from collections import deque
from typing import Any

import torch
from torch import nn

from parallab import batch as batch_of
from parallab.config.errors import OneLineError
from parallab.config.schema import TrainerConfig
from parallab.launching.distributed import Dist
from parallab.training.loss_window import LossWindow
from parallab.parallel.base import Runtime

log = logging.getLogger("parallab.training.trainer")  # its lines read as the loop's

Batch = Any  # as the data gives it (batch.py): an (inputs, targets) pair, a dict, ...
SKIP_HORIZON = 20  # on_nan=skip stops when it drops over half of this many recent steps


class Diverged(OneLineError, RuntimeError):
    """The train loss went NaN or inf under trainer.on_nan=stop (or most steps were
    dropped under on_nan=skip)."""


def diverged(loss: float, step: int) -> Diverged:
    return Diverged(f"train loss is {loss} at step {step}: stopped; every checkpoint kept "
                    "holds finite weights; lower optim.lr, set trainer.clip_grad_norm, or set "
                    "trainer.on_nan=skip to drop such steps")


class Step:
    """Runs optimizer steps over a rank's micro-batches (`all_valid`: the training data's
    labels all count, so the global count follows from shapes)."""

    def __init__(self, cfg: TrainerConfig, model: nn.Module, runtime: Runtime,
                 optimizer: torch.optim.Optimizer, dist: Dist,
                 all_valid: bool, window: LossWindow, scheduler: Any = None):
        self.cfg, self.model, self.runtime = cfg, model, runtime
        self.optimizer, self.precision, self.dist = optimizer, runtime.precision, dist
        self.all_valid, self.window, self.scheduler = all_valid, window, scheduler
        self.data_world = runtime.ranks.data.world_size  # ranks reading different samples
        self.skipped = 0  # steps dropped: non-finite gradients (on_nan=skip), or no label
        self.recent_skips: deque[bool] = deque(maxlen=SKIP_HORIZON)  # dropped or not, per step
        self.lr: float | None = None  # the rate the last step used, before its schedule moved

    def __call__(self, batches: list[Batch], done: int) -> torch.Tensor:
        """One optimizer step over `batches` (gradient accumulation when more than one),
        after `done` steps; returns this rank's share of the step's loss, detached: the sum
        of its terms over the count of the global batch's terms (all micro-batches, all
        data-parallel ranks), times the data-parallel ranks, which average it."""
        items = self.items(batches)
        if isinstance(items, float) and not items:  # (a tensor on a GPU: no host check)
            return self.skip_empty(done + 1)
        total = None
        for index, batch in enumerate(batches):
            if self.cfg.channels_last:
                batch = to_channels_last(batch)
            last = index == len(batches) - 1
            # reduce gradients across ranks once per step, on its last micro-batch
            with contextlib.nullcontext() if last else self.runtime.no_sync(self.model):
                loss = self.runtime.forward_backward(self.model, batch, items)
            total = loss if total is None else total + loss
        skip = self.cfg.on_nan == "skip"
        if self.cfg.clip_grad_norm is not None or skip:
            self.precision.unscale_(self.optimizer)
            norm = self.runtime.clip_grad_norm(self.model, self.cfg.clip_grad_norm)
            # gradients are already reduced, so every rank decides alike
            dropped = skip and not bool(torch.isfinite(norm))
            if dropped:
                self.skipped += 1
                self.window.skip()
                total = torch.zeros_like(total)
                if not self.precision.scaler.is_enabled():  # a scaler skips it by itself
                    self.optimizer.zero_grad(set_to_none=True)
            # a GradScaler's overflow steps are its calibration, not divergence
            if skip and not self.precision.scaler.is_enabled():
                self.recent_skips.append(dropped)
                self.check_skips(done)
        self.precision.step(self.optimizer)
        self.optimizer.zero_grad(set_to_none=True)
        if self.scheduler is not None:
            self.lr = self.optimizer.param_groups[0]["lr"]  # the rate this step used
            self.scheduler.step()
        return total

    def items(self, batches: list[Batch]):
        """The global batch's loss terms (valid labels) per data-parallel rank: what each
        micro-batch's sum is divided by; 0 where there are none (the step is skipped); None
        where the one batch of a one-rank step holds every label (its own mean is the
        step's: no counting, as a hand-written loop)."""
        if len(batches) == 1 and self.data_world == 1 and self.all_valid:
            return None
        counts = [self.runtime.loss.count(batch_of.labels_of(b)) for b in batches]
        n = counts[0] if len(counts) == 1 else sum(counts)
        if self.all_valid:  # every rank's shard of one split batched alike:
            n = n * self.data_world  # the global count follows from this rank's shapes
        elif self.data_world > 1:  # one all-reduce of a scalar; tp/pipeline ranks count alike
            n = self.dist.all_reduce_sum(torch.as_tensor(n, dtype=torch.float64,
                                                         device=self.dist.device))
            n = n / self.runtime.ranks.readers
        if isinstance(n, torch.Tensor) and n.device.type == "cpu":
            n = n.item()  # free on the CPU: an exact skip of an empty step, a plain divisor
        if isinstance(n, torch.Tensor):  # on a GPU: no sync; an empty step's gradients are 0
            return n.clamp(min=1).float() / self.data_world
        return n / self.data_world

    def skip_empty(self, number: int) -> torch.Tensor:
        """A global batch whose labels are all ignored (-100): nothing to learn; the
        optimizer does not step."""
        self.skipped += 1
        self.window.skip(empty=True)
        if self.dist.is_main:
            log.warning("step %d: no label of its global batch counts (all are -100): the "
                        "step is skipped", number)
        return torch.zeros((), device=self.dist.device)

    def check_skips(self, done: int) -> None:
        """on_nan=skip that drops most of the recent steps learns nothing: stop as `stop`."""
        recent = self.recent_skips
        if len(recent) >= SKIP_HORIZON // 2 and sum(recent) * 2 > len(recent):
            raise Diverged(f"trainer.on_nan=skip dropped {sum(recent)} of the last "
                           f"{len(recent)} steps (non-finite gradients) at step {done}: "
                           "stopped, every checkpoint kept holds finite weights; lower "
                           "optim.lr or set trainer.clip_grad_norm")


def to_channels_last(batch: Batch) -> Batch:
    """trainer.channels_last: a pair's image inputs (N, C, H, W) in NHWC memory format."""
    if batch_of.is_pair(batch) and isinstance(batch[0], torch.Tensor) and batch[0].dim() == 4:
        return batch[0].contiguous(memory_format=torch.channels_last), batch[1]
    return batch
