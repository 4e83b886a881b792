"""A layout's two halves, and the single device's: its Plan (pure: the degrees resolved
from the parallel config, its checks, the command of a layout of the grid, its compute and
communication model) and its Runtime (built on a rank with the resolved
layout: it lays the model out, runs the step, gives and takes checkpoint state)."""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from parallab import batch as batches
from parallab.config.errors import ConfigError
from parallab.config.schema import MeshConfig
from parallab.launching.distributed import Dist
from parallab.loss import Objective
from parallab.parallel.layout import Layout
from parallab.precision import Precision


@dataclasses.dataclass(frozen=True)
class Ranks:
    """This rank's view of the layout that its data, step, meter and checkpoints read, made
    once with its runtime (whose properties define it: `data` is its `data_dist`)."""

    world_size: int  # devices the job uses (metrics.json's world_size)
    data: Dist  # the data-parallel ranks, each reading its own samples, and this one's place
    readers: int  # ranks reading each batch (a tp group's, a pipeline's)
    loss_ranks: int  # ranks holding a loss each step
    devices_per_process: int  # devices one process feeds, data.batch_size samples each


class Runtime:
    """Single device: the model on this rank's device, unwrapped."""

    # the head's logits stay cut by vocabulary over the tp ranks (tp_plans.shard_logits)
    sharded_logits = False

    def __init__(self, p, layout: Layout, dist: Dist, precision: Precision, loss: Objective,
                 model: nn.Module):
        """p: the parallel config; layout: the one the checks resolved (Plan.resolve); model:
        the one it lays out, whole, converted by its precision already (a pipeline records
        its cut of the model's modules here, and puts those back when it cuts)."""
        self.p = p
        self.layout = layout
        self.dist = dist
        self.precision = precision
        self.loss = loss
        self.ranks = Ranks(self.world_size, self.data_dist, self.readers, self.loss_ranks,
                           self.devices_per_process)

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

    @property
    def activation_share(self) -> float:
        """The share of one step's micro-batch activations this rank holds at once (a
        pipeline's 1F1B stage holds fewer than all)."""
        return 1.0

    @property
    def readers(self) -> int:
        """Ranks that read each batch (a tp group's, a pipeline's): a count over all ranks
        over this counts each sample once."""
        return self.dist.world_size // self.data_dist.world_size

    @property
    def loss_ranks(self) -> int:
        """Ranks that hold a loss each step (their sum over all ranks / this = the mean)."""
        return self.data_dist.world_size

    @property
    def seed_rank(self) -> int:
        """Added to the seed for this rank's dropout draws: ranks that compute one batch
        together draw alike."""
        return self.dist.rank

    def gpus(self) -> list[int]:
        return list(self.layout.gpus)

    def cut_model(self, model: nn.Module) -> nn.Module:
        """The layout's cut of the model, before activation checkpointing and compile
        (tensor parallel; a pipeline's part); wrap() does the rest after them."""
        return model

    def runs(self, model: nn.Module) -> list[nn.Module]:
        """The modules whose forward the step calls (compile compiles each): the model, or a
        pipeline's parts."""
        return [model]

    def wrap(self, model: nn.Module) -> nn.Module:
        return self.on_device(model)

    def on_device(self, model: nn.Module) -> nn.Module:
        """`model` on this rank's device; one already there is left as it is (advise.py
        lays out fake-tensor models, which cannot be moved, to predict their memory)."""
        tensors = itertools.chain(model.parameters(), model.buffers())
        # on meta: laid out first, given storage where its weights are loaded (training/weights.py)
        if all(t.device == self.dist.device or t.is_meta for t in tensors):
            return model
        if any(p.is_meta for p in model.parameters()):  # its buffers alone go over
            return model._apply(lambda t: t if t.is_meta else t.to(self.dist.device))
        return model.to(self.dist.device)

    def tied_embeddings(self) -> set[int]:
        """Ids of parameters this rank holds outside an embedding that one device holds in
        one (a pipeline's tied head: parallel/tied.py): optim leaves them undecayed, as it
        leaves embeddings."""
        return set()

    def unwrap(self, model: nn.Module) -> nn.Module:
        """The module without a wrapper: what checkpoints hold and what evaluation runs (with
        the fewest collectives; an fsdp module is its own, its forward gathers parameters)."""
        return model

    def no_sync(self, model: nn.Module) -> contextlib.AbstractContextManager:
        """Where gradients are reduced across ranks: what of it an accumulation micro-step skips."""
        return contextlib.nullcontext()

    def forward_backward(self, model: nn.Module, batch: Any, items) -> torch.Tensor:
        """One (micro-)batch's share of the step's loss (the sum of its terms / `items`, the
        step's terms per data-parallel rank), gradients accumulated; detached."""
        with self.loss_context():
            with self.precision.autocast():
                loss = self.loss.step_loss(model, batch, items)[1]
            self.precision.backward(loss)
        return loss.detach()

    def loss_context(self) -> contextlib.AbstractContextManager:
        """Where the loss and its backward run: under torch's loss_parallel where the logits
        are cut by vocabulary (its cross-entropy over the shards, backward included)."""
        if not self.sharded_logits:  # every run but tp's with the logits cut: no import
            return contextlib.nullcontext()
        from parallab.parallel import tp_plans

        return tp_plans.loss_context(True)

    def scored(self, output: Any) -> Any:
        """An evaluation output as evaluation reads it: its logits whole (accuracy and
        metrics read every class)."""
        return batches.whole(output) if self.sharded_logits else output

    def trial_step(self, model: nn.Module, batch: Any) -> None:
        """Forward and backward of a batch-size finder trial (training/batch_size.py): the unwrapped
        module, so that DDP's all-reduce does not run inside a trial (a sharded module
        still gathers: it is its own unwrapped form)."""
        with self.loss_context():
            with self.precision.autocast():
                loss = self.loss.step_loss(self.unwrap(model), batch, 1)[1]
            loss.backward()

    def eval_forward(self, model: nn.Module, batch: Any) -> Any:
        """Evaluation outputs on the rank that scores them (None on the others)."""
        return self.scored(batches.call(model, batch, with_targets=False))

    def clip_grad_norm(self, model: nn.Module, max_norm: float | None) -> torch.Tensor:
        """Clip to `max_norm` (None: only measure, leaving the gradients untouched); the norm
        of all gradients of the model (grad_norm)."""
        norm = self.grad_norm(model)
        if max_norm is not None:  # one call per mesh: a multi-tensor kernel takes one
            for params in params_by_mesh(model).values():
                nn.utils.clip_grads_with_norm_(params, max_norm, norm)
        return norm

    def grad_norm(self, model: nn.Module) -> torch.Tensor:
        """The 2-norm of every gradient of the model, this rank's and the others' parts."""
        return nn.utils.get_total_norm([p.grad for p in model.parameters() if p.grad is not None])

    def state_dict(self, model: nn.Module, optimizer: torch.optim.Optimizer
                   ) -> tuple[dict[str, Any], dict[str, Any]]:
        """The model's and optimizer's state as torch.distributed.checkpoint's get_state_dict
        gives it under every layout: keyed by parameter name (wrappers' prefixes dropped),
        the optimizer's state flattened per parameter, so that no key depends on how the
        model is held (param_groups.0 would) and any layout reads what another wrote. Plain
        tensors here; DTensors under a sharded layout."""
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            get_state_dict,
        )

        return get_state_dict(self.unwrap(model), optimizer,
                              options=StateDictOptions(flatten_optimizer_state_dict=True))

    def load_state_dict(self, model: nn.Module, optimizer: torch.optim.Optimizer,
                        model_state: dict[str, Any], optimizer_state: dict[str, Any]) -> None:
        """`state_dict`'s form, shaped as this rank holds it (run.read_checkpoint)."""
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            set_state_dict,
        )

        # the kernels this run chose for its parameters (optim.kernels: a multi-tensor one
        # takes DTensors or plain tensors, not both), which a layout holding them otherwise
        # saved in its param_groups, and loading would put back
        kernels = [{k: group[k] for k in ("foreach", "fused") if k in group}
                   for group in optimizer.param_groups]
        if isinstance(optimizer_state.get("param_groups"), list):  # a one-file checkpoint
            self.unwrap(model).load_state_dict(model_state)  # by an earlier parallab: its
            optimizer.load_state_dict(optimizer_state)  # optimizer state by parameter index
        else:
            set_state_dict(self.unwrap(model), optimizer, model_state_dict=model_state,
                           optim_state_dict=optimizer_state,
                           options=StateDictOptions(flatten_optimizer_state_dict=True))
        for group, kept in zip(optimizer.param_groups, kernels):
            group.update(kept)


@dataclass(frozen=True)
class Options:
    """What a parallel config sets beyond its degrees that shapes each step: the
    tensor-parallel plan (None: the model's own), the replicas' gradient buckets (MiB),
    FSDP2's freeing of gathered weights after forward, a pipeline's cuts (parallel.split).
    A plan whose config has no such key runs as these defaults, the mesh's schema's."""

    tp_plan: Any = None
    bucket_cap_mb: float = MeshConfig.bucket_cap_mb
    reshard_after_forward: bool = MeshConfig.reshard_after_forward
    split: tuple[int, ...] | None = None


class Plan:
    """Single device. A plan's class methods see the whole config (`cfg`) or the parallel
    node (`p`), never the one under the other's name; `runtime` is its Runtime class."""

    dims: tuple[str, ...] = ()  # the degrees its ranks are arranged by (Layout.dims)
    processes = False  # a process per rank, started by the launcher, in a process group
    splits_experts = False  # its ranks may hold a share of each MoE layer's experts (ep)
    runtime = Runtime

    @classmethod
    def resolve(cls, p, device_type: str, world_size: int, nnodes: int = 1) -> Layout:
        """The run's layout, made once by the checks from the parallel config `p` and the
        world size and node count they resolved: the degrees (a null one resolved), this
        plan, and the GPUs a one-process layout uses."""
        ep = p.ep
        if ep < 1:
            raise ConfigError(f"parallel.ep={ep} is out of range: it is >= 1 (1: every rank "
                              "holds every expert)")
        if ep > 1 and not cls.splits_experts:
            raise ConfigError(f"parallel.ep={ep} with parallel={p.name}: one process holds "
                              "the whole model here; experts are split over the ranks of a "
                              "sharded layout: use parallel=fsdp, hsdp, tp, fsdp_tp or "
                              "pipeline, or parallel.ep=1")
        layout = cls.layout_of(p, world_size)
        return dataclasses.replace(layout, nnodes=nnodes, plan=cls,
                                   gpus=cls.gpus_of(p, world_size))

    @classmethod
    def default_world_size(cls, gpus: int) -> int:
        """parallel.world_size where it is null: every GPU the job sees (`gpus`; 0 on a CPU),
        else 2 where the layout needs several ranks or parts, else 1. The checks size a run
        by it, and the SLURM launcher a job's allocation (handed down to
        launching/allocation.py)."""
        return gpus or (2 if cls.processes or "pp" in cls.dims else 1)

    @classmethod
    def layout_of(cls, p, world_size: int) -> Layout:
        """The Layout of the parallel config `p` at `world_size` ranks or devices, a null
        degree resolved in it (`p` is left as it is). ConfigError where the degrees do not
        fit the world size."""
        if world_size != 1:
            raise ConfigError(f"parallel.world_size={world_size} needs several workers, but "
                              f"parallel={p.name} runs one: use parallel=ddp (processes) or "
                              "parallel=dp (GPUs of one process)")
        return Layout()

    @staticmethod
    def gpus_of(p, world_size: int) -> tuple[int, ...]:
        """The CUDA ordinals a one-process layout places its replicas or parts on: those of
        parallel.devices among the visible GPUs (named twice: the same one twice), the
        first world_size of them."""
        ids = p.devices
        if ids is None:
            return tuple(range(world_size))
        visible = list(dict.fromkeys(ids))  # as validate made them visible, in this order
        return tuple(visible.index(i) for i in ids)[:world_size]

    @classmethod
    def options(cls, p) -> Options:
        """The parallel config `p`'s Options: a plan whose config sets none, the defaults."""
        return Options()

    @classmethod
    def check(cls, cfg, layout: Layout, stages: list[nn.Module] | None = None) -> None:
        """This layout's own checks of the whole config and its resolved layout, before
        any worker starts, with the model's stages where the trial found them (a layout
        that cuts the model checks its parts); ConfigError on the first problem."""

    @classmethod
    def overlapped_kinds(cls, layout: Layout) -> tuple[str, ...]:
        """Collective kinds (comm.KINDS) the step starts and leaves running beside its
        compute, waiting for them only at its end (DDP's bucket all-reduces)."""
        return ()


def bucket_problem(mb: float) -> str | None:
    """parallel.bucket_cap_mb, the replicas' gradient buckets (DDP's, a pipeline's), as
    every plan that takes it checks it."""
    if mb > 0:
        return None
    return (f"parallel.bucket_cap_mb={mb} is out of range: it must be > 0 (MiB of the "
            "replicas' gradients each all-reduce carries; DDP's default is 25)")


def params_by_mesh(model: nn.Module, leave: set[int] = frozenset()
                   ) -> dict[object, list[nn.Parameter]]:
    """The parameters with gradients by the device mesh their gradients live on (None: plain
    tensors); under 2-D layouts tp-split and FSDP-only parameters are on different ones.
    `leave`: ids of parameters left out."""
    from torch.distributed.tensor import DTensor

    groups: dict[object, list[nn.Parameter]] = {}
    for param in model.parameters():
        if param.grad is not None and id(param) not in leave:
            key = param.grad.device_mesh if isinstance(param.grad, DTensor) else None
            groups.setdefault(key, []).append(param)
    return groups
