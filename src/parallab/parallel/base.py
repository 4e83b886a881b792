"""What every parallel strategy provides to the trainer, and the single-device default."""

from __future__ import annotations

import contextlib
import math
from typing import Any

import torch
from torch import nn

from parallab.distributed import Dist
from parallab.precision import Precision
from parallab.loss import loss_fn


class Strategy:
    """Single device: the model on this rank's device, unwrapped."""

    launches_workers = False  # True: one process per rank, started by the launcher
    uses_process_group = False
    sharded_checkpoint = False  # True: every rank saves its part (torch.distributed.checkpoint)
    splits_model = False  # True: the model's stages are cut into parallel.world_size parts
    fixed_batch_shape = False  # True: a short last training batch is dropped
    shards_data = False  # True: each of parallel.world_size ranks/devices reads its own samples

    def __init__(self, cfg, dist: Dist, precision: Precision):
        self.cfg = cfg
        self.dist = dist
        self.precision = precision

    @property
    def devices_per_process(self) -> int:
        """How many devices one process feeds: each gets data.batch_size samples a step."""
        return 1

    @property
    def world_size(self) -> int:
        """Devices the job uses (metrics.json's world_size)."""
        return self.dist.world_size * self.devices_per_process

    @property
    def data_dist(self) -> Dist:
        """The data-parallel view of this rank: which shard of each epoch it reads."""
        return self.dist

    def wrap(self, model: nn.Module) -> nn.Module:
        return model.to(self.dist.device)

    def unwrap(self, model: nn.Module) -> nn.Module:
        """The module without a wrapper: what checkpoints hold and what evaluation runs (with
        the fewest collectives; an fsdp module is its own, its forward gathers parameters)."""
        return model

    def no_sync(self, model: nn.Module) -> contextlib.AbstractContextManager:
        """Where gradients are reduced across ranks: skip it for an accumulation micro-step."""
        return contextlib.nullcontext()

    def forward_backward(self, model: nn.Module, inputs: torch.Tensor, targets: torch.Tensor,
                         precision: Precision, scale: int) -> torch.Tensor:
        """Loss of one (micro-)batch divided by `scale`, gradients accumulated; detached."""
        with precision.autocast():
            loss = loss_fn(model(inputs), targets) / scale
        precision.backward(loss)
        return loss.detach()

    def eval_forward(self, model: nn.Module, inputs: torch.Tensor) -> torch.Tensor | None:
        """Evaluation outputs on the rank that scores them (None on the others)."""
        return model(inputs)

    def clip_grad_norm(self, model: nn.Module, max_norm: float | None) -> torch.Tensor:
        """Clip to `max_norm` (None: only measure); the norm of all gradients of the model."""
        return nn.utils.clip_grad_norm_(model.parameters(), max_norm or math.inf)

    def state_dict(self, model: nn.Module, optimizer: torch.optim.Optimizer
                   ) -> tuple[dict[str, Any], dict[str, Any]]:
        return self.unwrap(model).state_dict(), optimizer.state_dict()

    def load_state_dict(self, model: nn.Module, optimizer: torch.optim.Optimizer,
                        model_state: dict[str, Any], optimizer_state: dict[str, Any]) -> None:
        self.unwrap(model).load_state_dict(model_state)
        optimizer.load_state_dict(optimizer_state)


class ShardedStrategy(Strategy):
    """Ranks hold parts of the model (fsdp: shards, pipeline: stages). State goes through
    torch.distributed.checkpoint's get/set_state_dict: keyed by full parameter names, with
    the optimizer state flattened per parameter, so parts held by different ranks never
    share a key (param_groups.0 would)."""

    sharded_checkpoint = True

    def state_dict(self, model, optimizer):
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

        return get_state_dict(model, optimizer,
                              options=StateDictOptions(flatten_optimizer_state_dict=True))

    def load_state_dict(self, model, optimizer, model_state, optimizer_state) -> None:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_state_dict

        set_state_dict(model, optimizer, model_state_dict=model_state,
                       optim_state_dict=optimizer_state,
                       options=StateDictOptions(flatten_optimizer_state_dict=True))
