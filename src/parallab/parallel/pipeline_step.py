"""What a pipeline rank runs for a batch: torch's schedule over the parts it holds, built
for one batch shape (its stages infer their buffers' shapes from the first batch they
take: Shaped), training's or evaluation's forward-only one, and the values scoped to one
step rather than kept between them (the step's count of loss terms, whether the replicas
average this batch's gradients), which torch's schedule reads through the loss function it
holds."""

from __future__ import annotations

import contextlib
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any, Callable, Iterator

from torch import nn

from parallab.parallel.schedules import SCHEDULES

# the step's terms per data-parallel rank that each micro-batch's loss is divided by
# (Objective.step_loss), while forward_backward runs
ITEMS: ContextVar[Any] = ContextVar("items", default=1)
# False inside the trainer's no_sync: gradients kept for the step's last batch to average
SYNCING: ContextVar[bool] = ContextVar("syncing", default=True)


@contextlib.contextmanager
def scoped(var: ContextVar, value: Any) -> Iterator[None]:
    """`var` set to `value` inside, as it was after."""
    token = var.set(value)
    try:
        yield
    finally:
        var.reset(token)


@dataclass(frozen=True)
class Shaped:
    """A schedule and the rows of the batch shape it was built for (a batch of another
    number of rows needs another: the batch-size finder tries several)."""

    rows: int
    schedule: Any


@dataclass(frozen=True)
class Placed:
    """Where a rank's parts sit in its pipeline: its parts (Parts, in the model's order) and
    their indices, the pipeline's ranks, parts a rank, its device and process group."""

    parts: list[nn.Module]
    held: list[int]
    pp: int
    per_rank: int
    device: Any
    group: Any

    def schedule(self, name: str, microbatches: int, loss: Callable | None):
        """torch's schedule `name` over a pipeline stage for each part."""
        import torch.distributed.pipelining as pipelining

        schedule = SCHEDULES[name]
        stages = [pipelining.PipelineStage(part, k, self.pp * self.per_rank, self.device,
                                           group=self.group)
                  for k, part in zip(self.held, self.parts)]
        # not scale_grads: it divides all gradients held, those of earlier accumulated
        # batches too; the loss scales each micro-batch's instead
        return getattr(pipelining, schedule.torch_class)(
            stages if schedule.multi else stages[0], n_microbatches=microbatches,
            loss_fn=loss, scale_grads=False)

    def forward_only(self, name: str, microbatches: int):
        """Evaluation's: GPipe where each rank holds one part; else the run's own schedule
        with its backward actions left out, lowered to sends and receives by torch (its
        eval of a V-shaped schedule runs the backward actions and fails; a forward never
        waits for a backward, so the order stays valid)."""
        if self.per_rank == 1:
            return self.schedule("gpipe", microbatches, None)
        from torch.distributed.pipelining.schedules import (
            _add_send_recv,
            _add_unshard_reshard,
            _ComputationType,
            _PipelineScheduleRuntime,
        )

        train = self.schedule(name, microbatches, None)
        placed = train.stage_index_to_group_rank

        def forwards(actions) -> list:
            subs = [a for action in actions if action is not None
                    for a in (action.sub_actions or [action])]
            return _add_unshard_reshard(
                [a for a in subs if a.computation_type == _ComputationType.FORWARD])

        schedule = _PipelineScheduleRuntime(train._stages, microbatches, scale_grads=False)
        schedule.stage_index_to_group_rank = placed
        for stage in train._stages:
            stage.stage_index_to_group_rank = placed
        schedule.pipeline_order_with_comms = _add_send_recv(
            {rank: forwards(actions) for rank, actions in train.pipeline_order.items()},
            stage_to_rank=placed.__getitem__, num_stages=len(placed))
        return schedule
