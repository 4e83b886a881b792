"""What every parallel strategy provides to the trainer."""

from __future__ import annotations

import contextlib

from torch import nn

from parallab.distributed import Dist


class Strategy:
    """Single device: the model on this rank's device, unwrapped."""

    launches_workers = False  # True: one process per rank, started by the launcher
    uses_process_group = False

    @property
    def devices_per_process(self) -> int:
        """How many devices one process feeds: each gets data.batch_size samples a step."""
        return 1

    def __init__(self, cfg, dist: Dist):
        self.cfg = cfg
        self.dist = dist

    def wrap(self, model: nn.Module) -> nn.Module:
        return model.to(self.dist.device)

    def unwrap(self, model: nn.Module) -> nn.Module:
        """The plain module: what checkpoints hold and what evaluation runs."""
        return model

    def no_sync(self, model: nn.Module) -> contextlib.AbstractContextManager:
        """Where gradients are reduced across ranks: skip it for an accumulation micro-step."""
        return contextlib.nullcontext()
