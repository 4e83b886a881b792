"""Pipeline parallelism with torch.distributed.pipelining: one part of the model per rank.

Every rank builds the whole model, then replaces the stages other ranks own with
nn.Identity: what is left runs its part (the identities pass activations through), and the
parameter names are the whole model's, so checkpoints load into any strategy. Each batch is
cut into parallel.microbatches micro-batches that flow through the parts by the GPipe or
1F1B schedule. The ranks of a pipeline read the same batches; the first feeds the inputs,
the last scores them. A stage's buffers have fixed shapes, so training drops a short last
batch and evaluation pads its last batch.

dp x pp x tp, one mesh (dp_replicate, dp_shard, pp, tp), tp innermost as torchtitan orders
it: dp_replicate x dp_shard pipelines side by side, each reading its own shard of every
epoch. With dp_shard = 1 the ranks holding the same stage average their gradients once per
optimizer step; with dp_shard > 1 each part is sharded by FSDP2 over them (HSDP with
replicas too), which reduces the gradients itself. With parallel.tp > 1 each part is split
by the model's tensor-parallel plan over tp neighbouring ranks (a node's GPUs), which read
the same batches and form tp pipelines of their own.
"""

from __future__ import annotations

import contextlib
import logging
import math
from collections.abc import Mapping
from typing import Any, Iterator

import torch
from torch import nn

from parallab import batch as batches
from parallab.config.errors import ConfigError
from parallab.loss import from_model
from parallab.parallel import stages as stages_of
from parallab.parallel.fsdp import norm_squares, shard
from parallab.parallel.layout import Layout
from parallab.parallel.mesh import MeshPlan, MeshStrategy
from parallab.parallel.split import check_parts, part_ranges
from parallab.precision import Precision

log = logging.getLogger(__name__)


SCHEDULES = ("gpipe", "1f1b")


def keep_only(model: nn.Module, stages: list[nn.Module], keep: range,
              names: dict[int, str] | None = None) -> None:
    """Hold only the model's stages in `keep`, the others nn.Identity, names unchanged.
    `names` (each module's name by id, read from the whole model): to cut it again, a stage
    cut before coming back where it is kept."""
    names = names or {id(module): name for name, module in model.named_modules()}
    for index, stage in enumerate(stages):
        parent, _, child = names[id(stage)].rpartition(".")
        model.get_submodule(parent).register_module(
            child, stage if index in keep else nn.Identity())


class PipelineStrategy(MeshStrategy):
    """The mesh with a pp degree: the model's parts on the pp dimension's ranks."""

    @property
    def pp(self) -> int:
        """Ranks of one pipeline: its number of parts."""
        return self.layout.pp

    @property
    def stage_index(self) -> int:
        return self.layout.part_of(self.dist.rank)

    @property
    def activation_share(self) -> float:
        """GPipe holds every micro-batch's activations before the first backward; a 1F1B
        stage at most (stages to the pipeline's end) of them."""
        micro = self.p.microbatches
        if self.p.schedule != "1f1b":
            return 1.0
        return min(self.pp - self.stage_index, micro) / micro

    @property
    def is_first(self) -> bool:
        return self.stage_index == 0

    @property
    def is_last(self) -> bool:
        return self.stage_index == self.pp - 1

    @contextlib.contextmanager
    def no_sync(self, model: nn.Module) -> Iterator[None]:
        self.syncing = False
        try:
            yield
        finally:
            self.syncing = True

    def sum_partial_gradients(self) -> None:
        """Sequence parallelism leaves the norms' gradients partial on the tp ranks (each
        rank's share from its slice of the sequence): summed over them once per optimizer
        step, as the parameters they update are whole on every tp rank."""
        from torch.distributed.tensor import DTensor

        for param in self.model.parameters():
            grad = param.grad
            if isinstance(grad, DTensor) and any(p.is_partial() for p in grad.placements):
                param.grad = grad.redistribute(placements=param.placements)

    def average_gradients(self) -> None:
        """One all-reduce of this stage's gradients over its replicas (pp x dp)."""
        import torch.distributed as torch_dist
        from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

        # a tp-split gradient's replicas hold the same shard: its local tensor is averaged
        grads = [p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad
                 for p in self.model.parameters() if p.grad is not None]
        if not grads:
            return
        flat = _flatten_dense_tensors(grads)
        torch_dist.all_reduce(flat, group=self.dp_group)
        flat /= self.layout.dp_replicate
        for grad, averaged in zip(grads, _unflatten_dense_tensors(flat, grads)):
            grad.copy_(averaged)

    def part(self, model: nn.Module) -> nn.Module:
        """This rank's stages (the others nn.Identity), before tensor parallelism."""
        p = self.p
        self.pp_group, self.dp_group = (self.mesh["pp"].get_group(),
                                        self.mesh["dp_replicate"].get_group())
        stages = stages_of.find(model, p.stages)
        parts = part_ranges(stages, self.pp, p.split)
        keep_only(model, stages, parts[self.stage_index])
        if self.dist.is_main:
            log.info("parallel=pipeline (%s, %d micro-batches): stages %s on a pipeline's "
                     "ranks 0-%d", p.schedule, p.microbatches,
                     [f"{part.start}-{part.stop - 1}" for part in parts], len(parts) - 1)
        return model

    def part_plan(self, model: nn.Module, plan: dict) -> dict:
        """The entries of the tensor-parallel plan for modules this part holds (the others
        are nn.Identity, or gone with the stage they belonged to)."""
        kept = {name for name, module in model.named_modules()
                if not isinstance(module, nn.Identity)}
        return {name: style for name, style in plan.items() if name in kept}

    def wrap(self, model: nn.Module) -> nn.Module:
        p = self.p
        if self.layout.dp_shard > 1:  # gathered once per step, not once per micro-batch (torchtitan)
            model = shard(model, self.data_parallel_mesh(), p, self.precision.dtype,
                          self.dist.is_main, False)
        self.syncing = True
        self.model = model
        self.items = 1  # the step's terms per data-parallel rank (Objective.step_loss)
        self.train_schedule = None  # built for each batch shape (the finder tries several)
        self.train_rows = 0
        self.eval_schedule = None  # built at the first evaluation, for its batch shape
        self.eval_rows = 0
        return self.model

    def _loss(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        """A micro-batch's share of the step's loss: its terms' sum / the step's count, so
        its gradients add up to those of the mean over every micro-batch of the step."""
        return self.loss.total(self.loss.scored(output), target) / self.items

    def _schedule(self, name: str, loss):
        from torch.distributed.pipelining import (
            PipelineStage,
            Schedule1F1B,
            ScheduleGPipe,
        )

        stage = PipelineStage(self.model, self.stage_index, self.pp, self.dist.device,
                              group=self.pp_group)
        schedule = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}[name]
        # not scale_grads: it divides all gradients held, those of earlier accumulated
        # batches too; _loss scales each micro-batch's instead
        return schedule(stage, n_microbatches=self.p.microbatches, loss_fn=loss,
                        scale_grads=False)

    def forward_backward(self, model: nn.Module, batch: Any, precision: Precision,
                         items) -> torch.Tensor:
        inputs, targets = batches.inputs_of(batch), batches.labels_of(batch)
        losses: list[torch.Tensor] = []
        # what _loss divides by, this step (the batch's own count where the trainer left it)
        self.items = self.loss.count(targets) if items is None else items

        def step() -> None:
            with precision.autocast():
                self.train_schedule.step(*self.first_args(inputs),
                                         **self.first_kwargs(inputs),
                                         target=targets if self.is_last else None,
                                         losses=losses, return_outputs=False)

        rows = batches.rows(batch)
        if rows != self.train_rows:  # its stages infer their shapes at the first step
            self.train_schedule = self._schedule(self.p.schedule, self._loss)
            self.train_rows = rows
            self.dry_run(step)
            losses.clear()
        step()
        if self.layout.dp_shard == 1 and self.syncing:  # (FSDP2 reduces its own)
            if self.p.sequence_parallel:
                self.sum_partial_gradients()
            if self.layout.dp_replicate > 1:
                self.average_gradients()
        if not self.is_last:  # its share of the logged loss: nothing
            return torch.zeros((), device=self.dist.device)
        return torch.stack(losses).detach().sum()  # this batch's share of the step's loss

    def first_args(self, inputs: Any) -> tuple:
        """What the first stage's forward takes positionally (the schedule cuts every tensor
        of it into micro-batches); the other stages get their predecessor's output."""
        if not self.is_first or isinstance(inputs, Mapping):
            return ()
        return (inputs,)

    def first_kwargs(self, inputs: Any) -> dict:
        return dict(inputs) if self.is_first and isinstance(inputs, Mapping) else {}

    def trial_step(self, model: nn.Module, batch: Any, precision: Precision) -> None:
        """The whole schedule: a part alone has no loss to run backward from."""
        self.forward_backward(model, batch, precision, 1)

    def dry_run(self, step) -> None:
        """Run the first step once and undo it: its shape inference feeds each stage
        uninitialised tensors in training mode, which would leave garbage in BatchNorm
        statistics; buffers, RNG states and gradients are restored after."""
        buffers = {name: b.clone() for name, b in self.model.named_buffers()}
        cpu_rng = torch.get_rng_state()
        cuda_rng = torch.cuda.get_rng_state_all() if self.dist.device.type == "cuda" else None
        step()
        with torch.no_grad():
            for name, buffer in self.model.named_buffers():
                buffer.copy_(buffers[name])
        torch.set_rng_state(cpu_rng)
        if cuda_rng is not None:
            torch.cuda.set_rng_state_all(cuda_rng)
        self.model.zero_grad(set_to_none=True)

    def eval_forward(self, model: nn.Module, batch: Any) -> Any:
        inputs = batches.inputs_of(batch)
        rows = batches.rows(batch)
        if self.eval_schedule is None:  # every evaluation batch takes the first one's shape
            micro = self.p.microbatches
            self.eval_rows = math.ceil(rows / micro) * micro
            self.eval_schedule = self._schedule("gpipe", None)
        # pad with copies of the first sample, dropped below
        inputs = batches.pad_rows(inputs, self.eval_rows)
        output = self.eval_schedule.eval(*self.first_args(inputs), **self.first_kwargs(inputs))
        return output[:rows] if self.is_last else None

    def grad_norm(self, model: nn.Module) -> torch.Tensor:
        """The norm over every part's gradients (each rank holds one part's)."""
        squares = norm_squares(model, self.dist.device)  # this part's, whole on its tp ranks
        self.dist.all_reduce_sum(squares)
        # each part counted once: not once per replica, shard group and tp rank holding it
        return (squares / (self.data_dist.world_size * self.layout.tp)).sqrt()


class PipelinePlan(MeshPlan):
    """The mesh with a pp degree: one pipeline, or pipelines over replicas and shards."""

    dims = ("dp_replicate", "dp_shard", "pp", "tp")
    runtime = PipelineStrategy

    @classmethod
    def layout_of(cls, p) -> Layout:
        """dp_replicate and pp both null: one pipeline over every rank."""
        if p.pp is None and p.dp_replicate is None:
            p.dp_replicate = 1
        return super().layout_of(p)

    @classmethod
    def check(cls, cfg, layout: Layout, stages=None) -> None:
        super().check(cfg, layout)  # the tp plan
        p = cfg.parallel
        if cfg.trainer.channels_last:
            raise ConfigError("trainer.channels_last=true with parallel=pipeline: the parts "
                              "send their activations between ranks, contiguous only, and "
                              "channels-last makes them NHWC: set trainer.channels_last=false, "
                              "or use parallel=ddp")
        check_parts(cfg, stages, p.pp)
        if from_model(cfg.loss):
            raise ConfigError("loss=model with parallel=pipeline: the last stage computes the "
                              "loss from the output, which a model returning its own loss does "
                              "not give: use a loss of output and targets")
        if p.schedule not in SCHEDULES:
            raise ConfigError(f"parallel.schedule={p.schedule} is unknown: use "
                              f"parallel.schedule={' or '.join(SCHEDULES)}")
        least = p.pp if p.schedule == "1f1b" else 1
        if p.microbatches < least:
            raise ConfigError(f"parallel.microbatches={p.microbatches} is out of range: it "
                              f"must be >= {least}")
        if cfg.data.batch_size % p.microbatches:
            d = cfg.data  # the key the user set: a global batch is per rank x the rest
            unit = p.microbatches * (d.global_batch_size // d.batch_size
                                     if d.global_batch_size else 1)
            raise ConfigError(f"{d.batch_said()} does not split into "
                              f"parallel.microbatches={p.microbatches} equal micro-batches: "
                              f"use a multiple of {unit}")

    @classmethod
    def layouts(cls, world_size: int, device_type: str, options) -> list[list[str]]:
        """pp x dp for every pp > 1 dividing the world size, by schedule and micro-batches."""
        n = world_size
        return [[f"parallel.world_size={n}", f"parallel.pp={pp}",
                 f"parallel.dp_replicate={n // pp}", f"parallel.schedule={schedule}",
                 f"parallel.microbatches={micro}"]
                for pp in range(2, n + 1) if n % pp == 0
                for schedule in options.schedules for micro in options.microbatches]

    @classmethod
    def bubble(cls, cfg) -> float:
        p = cfg.parallel
        return 1 + (p.pp - 1) / p.microbatches
