"""Pipeline parallelism with torch.distributed.pipelining: the model's stages cut into pp x v
parts, v on each rank (parallel.stages_per_rank), run by one of torch's schedules.

Every rank builds the whole model, then replaces the stages other ranks hold with
nn.Identity: the parameter names stay the whole model's, so checkpoints load into any
layout. Each part this rank holds is a Part (stages.py: its stages chained), one of torch's
pipeline stages, placed as its schedule expects (parallel/schedules.py: round-robin, or a
V). Each batch is cut into parallel.microbatches micro-batches; the ranks of a pipeline read
the same batches, the rank holding the first part feeds the inputs, the one holding the last
scores them. A stage's buffers have fixed shapes, so training drops a short last batch and
evaluation pads its last batch. A transformers causal LM runs as its own chain of stages
(models/hf.py), its loss computed from the last part's logits as its forward would.

dp x pp x tp, one mesh (dp_replicate, dp_shard, pp, tp), tp innermost as torchtitan orders
it: dp_replicate x dp_shard pipelines side by side, each reading its own shard of every
epoch. With dp_shard = 1 the ranks holding the same stage average their gradients once per
optimizer step, each bucket as its last micro-batch's backward lands (replicas.py); with
dp_shard > 1 each Part is sharded by FSDP2 over them as a root of its
own (HSDP with replicas too), which reduces the gradients itself. With parallel.tp > 1 each
part is split by the model's tensor-parallel plan over tp neighbouring ranks (a node's GPUs),
which read the same batches and form tp pipelines of their own.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
from collections.abc import Mapping
from typing import Any, Iterator

import torch
from torch import nn

from parallab import batch as batches
from parallab.config.errors import ConfigError
from parallab.loss import FromModel, from_model, scores
from parallab.models import experts, hf, moe
from parallab.parallel import expert_parallel, schedules, tp_plans
from parallab.parallel.base import Options
from parallab.parallel.fsdp import norm_squares, shard
from parallab.parallel.layout import Layout
from parallab.parallel.mesh import MeshPlan, MeshRuntime
from parallab.parallel.pipeline_step import ITEMS, SYNCING, Placed, Shaped, scoped
from parallab.parallel.replicas import Replicas
from parallab.parallel.schedules import SCHEDULES, activations_held
from parallab.parallel.split import Cut, check_parts, part_ranges, refuse_shared_parts
from parallab.parallel.tied import Tied, tied_sets

log = logging.getLogger(__name__)


class LogitsLoss(FromModel):
    """loss=model (a transformers causal LM's own loss) under the pipeline: the last part
    gives logits, not the forward's output, and the loss of them is the model's own
    (its loss_function, labels shifted), counted and scaled as FromModel counts it."""

    from_model = False  # computed here, from the output

    def __init__(self, own: FromModel, model: nn.Module):
        self.__dict__.update(vars(own))
        self.model = model

    def scored(self, output: Any) -> Any:
        return scores(output)

    def total(self, output: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return hf.summed_loss(self.model, output, targets)

    def __call__(self, output: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        count = self.count(targets)
        return self.total(output, targets) / (count.clamp(min=1) if torch.is_tensor(count)
                                              else max(count, 1))


class PipelineRuntime(MeshRuntime):
    """The mesh with a pp degree: the model's parts on the pp dimension's ranks. Its groups,
    its cut of the model, the parts it holds and the step's state are made here; the
    schedules once they have a batch's shape (pipeline_step.py)."""

    def __init__(self, p, layout, dist, precision, loss, model: nn.Module):
        # loss=model: a transformers causal LM's own loss, of the last part's logits
        super().__init__(p, layout, dist, precision,
                         LogitsLoss(loss, model) if loss.from_model else loss, model)
        self.pp_group, self.dp_group = (self.mesh["pp"].get_group(),
                                        self.mesh["dp_replicate"].get_group())
        self.cut = Cut(model, p, layout, self.stage_index)  # recorded whole; part() cuts
        # parameters stages on other ranks share (tied embeddings): a copy each, kept equal
        self.tied = Tied(tied_sets(self.cut.stages, self.cut.ranges, p.schedule, self.pp,
                                   self.per_rank, self.stage_index, self.cut.names),
                         self.mesh, self.stage_index)
        self.parts = None  # the schedules' modules, made at the first runs()
        self.averaging = None  # the replicas' gradient average, made with the parts
        # training's schedule for the batch shape last seen, evaluation's for its first
        self.shaped: dict[str, Shaped] = {}

    @property
    def pp(self) -> int:
        """Ranks of one pipeline."""
        return self.layout.pp

    @property
    def per_rank(self) -> int:
        """Parts each rank holds (v): the model is cut into pp x v."""
        return self.layout.stages_per_rank

    @property
    def stage_index(self) -> int:
        """This rank's place in its pipeline (its coordinate on the mesh's pp dimension)."""
        return self.layout.part_of(self.dist.rank)

    @property
    def held(self) -> list[int]:
        """The parts (of pp x v) this rank holds, in the model's order (its cut's)."""
        return self.cut.held

    @property
    def activation_share(self) -> float:
        """The share of a step's micro-batches whose activations this rank holds at once
        (GPipe all of them, 1F1B at most its distance to the pipeline's end, ...)."""
        p = self.p
        return activations_held(p.schedule, self.pp, self.per_rank, p.microbatches,
                                self.stage_index) / p.microbatches

    @property
    def is_first(self) -> bool:
        return 0 in self.held

    @property
    def is_last(self) -> bool:
        return self.pp * self.per_rank - 1 in self.held

    @contextlib.contextmanager
    def no_sync(self, model: nn.Module) -> Iterator[None]:
        with scoped(SYNCING, False):
            yield

    def sum_partial_gradients(self, model: nn.Module) -> None:
        """Weights whole on every tp rank that each applies to its own slice leave their
        gradients partial there: the norms under sequence parallelism (each rank's share
        from its slice of the sequence), a plan's replicated_with_grad_allreduce (Qwen 3's
        q and k norms, over each rank's heads). Summed over the tp ranks once per optimizer
        step, as FSDP2 sums them where it shards: an optimizer's state made from a partial
        gradient would be partial too, which no checkpoint takes."""
        from torch.distributed.tensor import DTensor

        for param in model.parameters():
            grad = param.grad
            if isinstance(grad, DTensor) and any(p.is_partial() for p in grad.placements):
                param.grad = grad.redistribute(placements=param.placements)

    def replicas(self) -> Replicas | None:
        """The replicas' average of this rank's parts' gradients (dp_shard = 1: FSDP2
        reduces its own), made once the parts are; None without replicas."""
        if self.layout.dp_shard > 1 or self.layout.dp_replicate == 1:
            return None
        if self.averaging is None:
            self.averaging = Replicas(self.parts, self.dp_group, self.layout.dp_replicate,
                                      self.p.microbatches, self.p.bucket_cap_mb,
                                      self.precision.reduce_dtype)
        return self.averaging

    def part(self, model: nn.Module) -> nn.Module:
        """This rank's stages (the others nn.Identity), before tensor parallelism (advise's
        memory predictor runs the earlier stages through the cut before it)."""
        p = self.p
        self.cut.keep(model)
        if self.dist.is_main:
            log.info("parallel=pipeline (%s, %d micro-batches): stages %s in parts, a "
                     "pipeline's ranks holding parts %s", p.schedule, p.microbatches,
                     [f"{r.start}-{r.stop - 1}" for r in self.cut.ranges],
                     [schedules.stages_of_rank(p.schedule, self.pp, self.per_rank, r)
                      for r in range(self.pp)])
        return model

    def runs(self, model: nn.Module) -> list[nn.Module]:
        """The modules this rank's schedule calls, compiled where the run compiles: its
        Parts, made the first time it is asked, holding its stages as the model holds them
        then (speed_up asks after activation checkpointing has wrapped them)."""
        if self.parts is None:
            self.parts = self.cut.parts(model)
            if self.p.sequence_parallel and tp_plans.keeps_stream_whole(model,
                                                                        self.p.tp_plan):
                for part in self.parts:
                    tp_plans.send_sequence_slices(part, self.mesh["tp"])
        return self.parts

    def wrap(self, model: nn.Module) -> nn.Module:
        p = self.p
        parts = self.runs(model)  # the schedules' modules, checkpointing's wrappers in them
        # each part gathered once per step, not once per micro-batch (torchtitan)
        if self.layout.dp_shard > 1:
            policy = self.fsdp_policy()
            # the experts by the whole model's ep plan (a part holds none)
            held = {m for _, m in experts.experts_of(model)} if self.ep is not None else ()
            for part in parts:
                if self.ep is not None:  # the experts' own units first (MeshRuntime.wrap)
                    expert_parallel.shard([m for m in part.modules() if m in held], self.ep,
                                          policy, False)
                shard(part, self.data_parallel_mesh(), p, policy, self.dist.is_main, False)
        return model

    def _loss(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        """A micro-batch's share of the step's loss: its terms' sum / the step's count, so
        its gradients add up to those of the mean over every micro-batch of the step."""
        # float16: scaled here, where the schedule runs its backward from
        return self.precision.scaled(self.loss.total(self.loss.scored(output), target)
                                     / ITEMS.get())

    def placed(self) -> Placed:
        """Where this rank's parts sit in its pipeline, which its schedules are built over."""
        return Placed(self.parts, self.held, self.pp, self.per_rank, self.dist.device,
                      self.pp_group)

    def forward_backward(self, model: nn.Module, batch: Any, items) -> torch.Tensor:
        inputs, targets = batches.inputs_of(batch), batches.labels_of(batch)
        losses: list[torch.Tensor] = []
        syncing = SYNCING.get()

        def step(schedule) -> None:  # its last stage's loss and backward under its context
            with self.loss_context(), self.precision.autocast(), \
                    moe.split_share(self.p.microbatches):
                schedule.step(*self.first_args(inputs), **self.kwargs(inputs),
                              target=targets if self.is_last else None, losses=losses,
                              return_outputs=False)

        rows = batches.rows(batch)
        # what _loss divides by, this step (the batch's own count where the trainer left it)
        with scoped(ITEMS, self.loss.count(targets) if items is None else items):
            shaped = self.shaped.get("train")
            if shaped is None or shaped.rows != rows:  # a shape's first step
                # float16's scale made on every rank, not only where the loss is: each
                # unscales
                self.precision.scaled(torch.zeros((), device=self.dist.device))
                shaped = self.shaped["train"] = Shaped(rows, self.placed().schedule(
                    self.p.schedule, self.p.microbatches, self._loss))
                self.dry_run(model, lambda: step(shaped.schedule))  # its shapes inferred
                losses.clear()
            replicas = self.replicas() if syncing else None
            if replicas is not None:  # each bucket reduced as its last micro-batch lands
                replicas.arm()
            try:
                step(shaped.schedule)
            finally:  # (raised: every bucket still issued once, as the other replicas do)
                if replicas is not None:
                    replicas.finish()
        if self.layout.dp_shard == 1 and syncing and self.layout.tp > 1:
            self.sum_partial_gradients(model)  # (after the replicas': both are sums)
        if syncing:
            self.tied.reduce()
        if not self.is_last:  # its share of the logged loss: nothing
            return torch.zeros((), device=self.dist.device)
        # this batch's share of the step's loss, as computed (float16's scale taken off)
        return self.precision.unscaled(torch.stack(losses).detach().sum())

    def first_args(self, inputs: Any) -> tuple:
        """What the first stage takes positionally (the schedule cuts every tensor of it
        into micro-batches); the other stages get their predecessor's output."""
        if not self.is_first or isinstance(inputs, Mapping):
            return ()
        return (inputs,)

    def kwargs(self, inputs: Any) -> dict:
        """A dict batch's inputs, as keywords of every stage this rank holds: the first takes
        them as the model does, a transformers block its attention mask."""
        return dict(inputs) if isinstance(inputs, Mapping) else {}

    def trial_step(self, model: nn.Module, batch: Any) -> None:
        """The whole schedule: a part alone has no loss to run backward from."""
        self.forward_backward(model, batch, 1)

    def dry_run(self, model: nn.Module, step) -> None:
        """Run the first step once and undo it: its shape inference feeds each stage
        uninitialised tensors in training mode, which would leave garbage in BatchNorm
        statistics; buffers, RNG states and gradients are restored after."""
        buffers = {name: b.clone() for name, b in model.named_buffers()}
        cpu_rng = torch.get_rng_state()
        cuda_rng = torch.cuda.get_rng_state_all() if self.dist.device.type == "cuda" else None
        step()
        with torch.no_grad():
            for name, buffer in model.named_buffers():
                buffer.copy_(buffers[name])
        torch.set_rng_state(cpu_rng)
        if cuda_rng is not None:
            torch.cuda.set_rng_state_all(cuda_rng)
        model.zero_grad(set_to_none=True)
        moe.reset(model)  # its routers' counts of uninitialised tensors

    def eval_forward(self, model: nn.Module, batch: Any) -> Any:
        inputs = batches.inputs_of(batch)
        rows = batches.rows(batch)
        shaped = self.shaped.get("eval")
        if shaped is None:  # every evaluation batch takes the first one's shape
            micro = self.p.microbatches
            shaped = self.shaped["eval"] = Shaped(math.ceil(rows / micro) * micro,
                                                  self.placed().forward_only(
                                                      self.p.schedule, micro))
        # pad with copies of the first sample, dropped below
        inputs = batches.pad_rows(inputs, shaped.rows)
        output = shaped.schedule.eval(*self.first_args(inputs), **self.kwargs(inputs))
        return self.scored(output[:rows]) if self.is_last else None

    def tied_embeddings(self) -> set[int]:
        return self.tied.embeddings()

    def state_dict(self, model: nn.Module, optimizer: torch.optim.Optimizer
                   ) -> tuple[dict[str, Any], dict[str, Any]]:
        """MeshRuntime's, a tied copy's optimizer state under one device's name for it."""
        model_state, optimizer_state = super().state_dict(model, optimizer)
        return model_state, self.tied.renamed(optimizer_state)

    def load_state_dict(self, model: nn.Module, optimizer: torch.optim.Optimizer,
                        model_state: dict[str, Any], optimizer_state: dict[str, Any]) -> None:
        super().load_state_dict(model, optimizer, model_state,
                                self.tied.renamed(optimizer_state, back=True))

    def grad_norm(self, model: nn.Module) -> torch.Tensor:
        """The norm over every part's gradients (each rank holds its parts')."""
        # this rank's, whole on its tp ranks; a tied parameter on the first of its ranks
        squares = norm_squares(model, self.dist.device, leave=self.tied.uncounted())
        self.dist.all_reduce_sum(squares)
        # each part counted once: not once per replica, shard group and tp rank holding it
        return (squares / (self.layout.dp * self.layout.tp)).sqrt()


class PipelinePlan(MeshPlan):
    """The mesh with a pp degree: one pipeline, or pipelines over replicas and shards."""

    dims = ("dp_replicate", "dp_shard", "pp", "tp")
    runtime = PipelineRuntime

    @classmethod
    def overlapped_kinds(cls, layout: Layout) -> tuple[str, ...]:
        """The replicas' average runs beside the backwards left once the schedule settles a
        part (replicas.py); with one part a rank, or W by hand, it waits for the flush."""
        settled = layout.dp_replicate > 1 and layout.dp_shard == 1 and layout.schedule and \
            SCHEDULES[layout.schedule].settled(layout.pp, layout.stages_per_rank,
                                               layout.microbatches)
        return ("all_reduce",) if settled and any(settled) else ()

    @classmethod
    def layout_of(cls, p, world_size: int) -> Layout:
        """The schedule and its micro-batches, and its stages per rank resolved here too,
        where null."""
        schedules.check(p)
        v = schedules.stages_per_rank(p.schedule, p.stages_per_rank)
        return dataclasses.replace(super().layout_of(p, world_size), stages_per_rank=v,
                                   schedule=p.schedule, microbatches=p.microbatches)

    @classmethod
    def given_degrees(cls, p) -> dict[str, int | None]:
        """dp_replicate and pp both null: one pipeline over every rank."""
        given = super().given_degrees(p)
        if given["pp"] is None and given["dp_replicate"] is None:
            given["dp_replicate"] = 1
        return given

    @classmethod
    def check(cls, cfg, layout: Layout, stages=None) -> None:
        super().check(cfg, layout)  # the tp plan
        p = cfg.parallel
        if cfg.trainer.channels_last:
            raise ConfigError("trainer.channels_last=true with parallel=pipeline: the parts "
                              "send their activations between ranks, contiguous only, and "
                              "channels-last makes them NHWC: set trainer.channels_last=false, "
                              "or use parallel=ddp")
        model = None
        if stages is None or from_model(cfg.loss):
            from parallab.models import build_on_meta

            model = build_on_meta(cfg.model)
            stages = stages if stages is not None else hf.pipeline_stages(model)
        v = layout.stages_per_rank

        def rank_of(part: int) -> int:
            return schedules.rank_of(p.schedule, layout.pp, v, part)

        check_parts(cfg, layout, stages, layout.pp * v, v, rank_of)
        if layout.dp_shard > 1 and v > 1:
            refuse_shared_parts(layout, stages, part_ranges(stages, layout.pp * v, p.split),
                                rank_of)
        if from_model(cfg.loss) and not hf.shifts_labels(model):
            raise ConfigError("loss=model with parallel=pipeline: the last stage computes the "
                              "loss from the output, which a model returning its own loss does "
                              "not give: use a loss of output and targets")
        schedules.check_microbatches(cfg, layout)
        schedules.refuse_split_backward(cfg)
        if (cfg.model.get("config") or {}).get("output_router_logits"):
            raise ConfigError("model.config.output_router_logits=true with parallel=pipeline: "
                              "the last stage computes the loss from the logits alone, and "
                              "the earlier stages' router logits do not reach it: set it "
                              "false (or use parallel=fsdp with parallel.ep)")

    @classmethod
    def options(cls, p) -> Options:
        """A pipeline's sharded parts stay gathered from their forward to their backward
        (torch's stages reshard at the flush)."""
        return Options(p.tp_plan or None, p.bucket_cap_mb, False,
                       tuple(p.split) if p.split else None)
