"""Layouts from one device mesh: dp_replicate x dp_shard x tp ranks (torchtitan's order,
tp innermost so a tensor-parallel group sits on neighbouring ranks: one node's GPUs); the
pipeline adds pp before tp (parallel/pipeline.py).

The model is first split by tensor parallelism over the `tp` dimension
(torch.distributed.tensor.parallel.parallelize_module with its plan: parallel.tp_plan, the
model's tp_plan(), or a transformers model's own; tp_plans.py), then sharded with FSDP2 over
the data-parallel dimensions: over dp_shard alone, or replicate x shard (HSDP: sharded
within a group, gradients all-reduced across the groups). Replicas alone (dp_shard = tp =
1) are DistributedDataParallel's, whose bucketed all-reduce overlaps the backward
(torchtitan does the same). Presets, each a setting of the
degrees: ddp (replicas), fsdp (shards), hsdp (replicas x shards), tp, fsdp_tp (2-D).
Ranks of one tp group read the same batch; the data-parallel rank (replicate x shard)
picks the shard of each epoch.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from collections.abc import Mapping
from typing import Iterator

import torch
from torch import nn

from parallab.config.errors import ConfigError, refuse
from parallab.launching.distributed import Dist
from parallab.models import experts, hf, tied_names
from parallab.parallel import expert_parallel, tp_plans
from parallab.parallel.base import Options, Plan, Runtime, bucket_problem
from parallab.parallel.fsdp import mixed_precision, norm_squares, shard
from parallab.parallel.layout import DEGREES, Layout, resolve_degrees

log = logging.getLogger(__name__)


def _tied_problem(model: nn.Module, plan: dict, tp: int) -> str | None:
    """None if each tied weight the plan splits is cut alike in every module sharing it (so
    that it stays one parameter: tp_plans.split), else one line. (A pipeline that would
    hold the pair on two ranks is refused by the cut: split.shared_across.)"""
    for alias, first in tied_names(model).items():
        pair = [name.rpartition(".")[0] for name in (first, alias)]
        cuts = {tp_plans.cut_dim(model.get_submodule(n), plan.get(n)) for n in pair}
        if cuts != {None} and (len(cuts) > 1 or not set(pair) <= set(plan)):
            return (f"parallel.tp={tp} splits {' and '.join(sorted(pair))}, which share one "
                    "weight (tied embeddings), differently: split the embedding by rows and "
                    "the head by columns (parallel.tp_plan), untie them (a transformers "
                    "model: model.config.tie_word_embeddings=false), or use parallel=fsdp")
    return None


def tp_problem(model: nn.Module, tp: int, given: dict[str, str] | None = None,
               ep: int = 1) -> str | None:
    """None if `model` (built on meta) has a tensor-parallel plan (tp_plans.py) whose split
    sizes and attention heads divide by `tp`, else one line (its experts' too, where ep
    does not split them)."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    if tp_plans.source(model, given) is None:
        return (f"parallel.tp={tp}: {type(model).__name__} declares no tensor-parallel plan "
                "(a tp_plan() method as gpt and mlp have, or a transformers config's "
                "base_model_tp_plan): give one as parallel.tp_plan='{q_proj: colwise, "
                "o_proj: rowwise}', use parallel.tp=1, or parallel=fsdp or ddp")
    own = getattr(model, "tp_problem", None)
    problem = (own(tp) if callable(own) else None) or hf.heads_problem(model, tp)
    if problem:
        return problem
    try:
        plan = tp_plans.plan_of(model, given)
    except tp_plans.PlanError as error:
        return str(error)
    problem = _tied_problem(model, plan, tp)
    if problem:
        return problem
    for name, style in plan.items():
        try:
            module = model.get_submodule(name)
        except AttributeError:
            return (f"the tensor-parallel plan ({tp_plans.source(model, given)}) names {name}, "
                    f"which is not a module of {type(model).__name__}: name its modules")
        if isinstance(style, expert_parallel.tp_style()):
            problem = None if ep > 1 else expert_parallel.tp_problem(module, tp)
            if problem:
                return problem
            continue
        dim = {ColwiseParallel: "out_features", RowwiseParallel: "in_features"}.get(type(style))
        if isinstance(module, nn.Embedding):
            dim = "num_embeddings"
        size = getattr(module, dim, None) if dim else None
        if size is not None and size % tp:
            return (f"parallel.tp={tp} does not divide {name}.{dim}={size}: pick a tp that "
                    "divides the model's widths")
        if dim and not isinstance(module, (nn.Linear, nn.Embedding)):
            return (f"the tensor-parallel plan splits {name}, a {type(module).__name__}: only "
                    "nn.Linear and nn.Embedding split by columns or rows; leave it out of "
                    "parallel.tp_plan")
    return None


def sp_problem(model: nn.Module, data, tp: int, given: dict[str, str] | None = None
               ) -> str | None:
    """None if `model` has a sequence-parallel plan and data's sequences split over `tp`."""
    if experts.count(model) is not None and hf.tp_plan(model):
        return ("parallel.sequence_parallel=true with a transformers mixture of experts: "
                "parallab cuts the sequence around a transformers block's attention and MLP, "
                "not around its MoE layer (gpt's model.moe takes it): set "
                "parallel.sequence_parallel=false")
    if not tp_plans.takes_sequence_parallel(model, given):
        return (f"parallel.sequence_parallel=true: the plan of {type(model).__name__} "
                f"({tp_plans.source(model, given)}) takes no sequence_parallel argument (gpt's "
                "tp_plan() does): set it false")
    if hf.tp_plan(model):
        try:
            tp_plans.plan_of(model, None, sequence_parallel=True)
        except tp_plans.PlanError as error:
            return str(error)
    # the data's own keys and its train and eval sets' (a dict data's, the example's)
    for key, owner in (("data", data), ("data.train", getattr(data, "train", None)),
                       ("data.eval", getattr(data, "eval", None))):
        seq_len = _get(owner, "seq_len")
        if isinstance(seq_len, int) and seq_len % tp:
            return (f"parallel.sequence_parallel=true cuts each sequence over parallel.tp="
                    f"{tp} ranks, which {key}.seq_len={seq_len} does not divide by: pick a "
                    "tp or seq_len that divide")
    return None


def _get(owner, key: str):
    """`owner`'s `key`: an attribute, a mapping's entry (a DictConfig's), or None."""
    if isinstance(owner, Mapping):
        return owner.get(key)
    return getattr(owner, key, None)


def regather_problem(sequence_parallel: bool, tp: int, trainer, precision) -> str | None:
    """What keeps parallel.regather_in_backward=true from gathering anything again (a
    layout's sequence parallelism and tp, the trainer's and the precision's config)."""
    key = "parallel.regather_in_backward=true"
    if not sequence_parallel:
        needs = "parallel.sequence_parallel=true" + (" and parallel.tp > 1" if tp == 1
                                                     else "")
        return (f"{key} gathers again what sequence parallelism gathers, and there is none: "
                f"it needs {needs} (or set it false)")
    if trainer.compile:
        return (f"{key} with trainer.compile=true: torch.compile does not take the "
                "saved-tensor hooks that gather the inputs again: set one of them false")
    from parallab.parallel.float8_split import gathers_in_float8

    if gathers_in_float8(precision):
        return (f"{key} with precision=fp8's tensorwise recipe: torchao's float8 styles "
                "gather the split layers' inputs in float8 and keep those, which nothing "
                "gathers again: use precision.fp8_recipe=rowwise, or set it false")
    return None


def refuse_tp(cfg, tp: int, sequence_parallel: bool = False, ep: int = 1) -> None:
    """ConfigError where tp > 1 and the model (built on meta) has no plan that splits over
    `tp` ranks, or no sequence-parallel one where asked."""
    given = cfg.parallel.tp_plan  # the mesh's and the pipeline's configs hold one
    if given is not None and (not isinstance(given, Mapping) or not given):
        raise ConfigError(f"parallel.tp_plan={_shown(given)} is not a plan: give module "
                          "patterns and their styles, e.g. parallel.tp_plan='{q_proj: colwise, "
                          "o_proj: rowwise}', or null for the model's own plan")
    if tp == 1:
        if given:
            raise ConfigError("parallel.tp_plan is set but parallel.tp=1 splits nothing: "
                              "set parallel.tp > 1 (or drop the plan)")
        return
    from parallab.models import build_on_meta

    model = build_on_meta(cfg.model)
    problem = tp_problem(model, tp, given, ep) or sequence_parallel and sp_problem(
        model, cfg.data, tp, given)
    if problem:
        raise ConfigError(problem)


def _shown(value) -> str:
    """A config value as the command line writes it ({} for an empty mapping)."""
    from omegaconf import OmegaConf

    if OmegaConf.is_config(value):
        value = OmegaConf.to_container(value)
    return "{}" if value == {} else str(value).replace("'", "")


class MeshRuntime(Runtime):
    """One device mesh of the layout's degrees, made with the runtime: tensor parallel
    over its tp dimension, FSDP2 over dp_shard (HSDP with replicas), or DDP where every
    rank holds the whole model."""

    def __init__(self, p, layout: Layout, dist: Dist, precision, loss, model: nn.Module):
        super().__init__(p, layout, dist, precision, loss, model)
        from torch.distributed.device_mesh import init_device_mesh

        self.mesh = None if layout.replicas_only else init_device_mesh(
            dist.device.type, layout.shape, mesh_dim_names=layout.dims)
        # a mixture of experts (known of the whole model, before a pipeline cuts it: every
        # rank makes its groups, whether or not its part holds an MoE layer)
        self.mixes = experts.count(model) is not None
        self.ep = None  # the expert-parallel meshes, made where the model is cut

    @property
    def data_dist(self) -> Dist:
        """The ranks of a tp group (and of a pipeline) are one data-parallel rank: they read
        the same batch."""
        data_ranks = self.layout.dp
        return dataclasses.replace(self.dist, world_size=data_ranks,
                                   rank=self.dist.rank // (self.dist.world_size // data_ranks))

    @property
    def loss_ranks(self) -> int:
        # each rank of a tp group holds its loss (under a pipeline, those of its last part)
        return self.layout.dp * self.layout.tp

    @property
    def seed_rank(self) -> int:
        return self.dist.rank // self.layout.tp  # a tp group draws one dropout mask for its batch

    def cut_model(self, model: nn.Module) -> nn.Module:
        """Tensor parallel, first of all (torchtitan's order): activation checkpointing and
        compile then wrap the split blocks, and the plan's module names stay as declared."""
        p = self.p
        model = self.on_device(self.part(model))
        if self.layout.tp > 1:
            self.sharded_logits = tp_plans.split(
                model, self.mesh["tp"], p.tp_plan or None, p.sequence_parallel, self.loss,
                whole=not self.layout.cuts_model,  # checked whole before launch
                ep=self.layout.ep, regather=p.regather_in_backward)
        if self.mixes:  # the routers' data-parallel group; the experts split over ep
            self.ep = expert_parallel.attach(model, self.mesh, self.layout)
        if self.dist.is_main:
            log.info("parallel=%s: mesh %s%s", p.name,
                     " x ".join(f"{d}={n}" for d, n in zip(self.layout.dims, self.layout.shape)),
                     " (sequence parallel)" if p.sequence_parallel else
                     " (replicas only: DistributedDataParallel)" if self.mesh is None else "")
        return model

    def part(self, model: nn.Module) -> nn.Module:
        """What of the model this rank holds before tensor parallelism (all of it)."""
        return model

    def fsdp_policy(self):
        """FSDP2's MixedPrecisionPolicy: the precision's compute and reduce dtypes."""
        return mixed_precision(self.precision.dtype, self.precision.reduce_dtype)

    def data_parallel_mesh(self):
        """The mesh FSDP2 shards over: dp_shard, or replicate x shard (HSDP)."""
        names = ("dp_replicate", "dp_shard") if self.layout.dp_replicate > 1 else ("dp_shard",)
        return self.mesh[names]

    def wrap(self, model: nn.Module) -> nn.Module:
        p = self.p
        if self.layout.replicas_only:
            from torch.nn.parallel import DistributedDataParallel

            model = self.on_device(model)
            device_ids = [self.dist.device] if self.dist.device.type == "cuda" else None
            model = DistributedDataParallel(
                model, device_ids=device_ids, bucket_cap_mb=p.bucket_cap_mb,
                find_unused_parameters=p.find_unused_parameters,
                gradient_as_bucket_view=p.gradient_as_bucket_view)
            hook = self.precision.ddp_hook()  # (reduced in precision.reduce_dtype)
            if hook is not None:
                model.register_comm_hook(None, hook)
            return model
        policy = self.fsdp_policy()
        if self.ep is not None:  # the experts' own units first, over the ranks ep leaves
            expert_parallel.shard([m for _, m in experts.experts_of(model)], self.ep,
                                  policy, p.reshard_after_forward)
        return shard(model, self.data_parallel_mesh(), p, policy,
                     self.dist.is_main, p.reshard_after_forward)

    def unwrap(self, model: nn.Module) -> nn.Module:
        return model.module if self.layout.replicas_only else model

    @contextlib.contextmanager
    def no_sync(self, model: nn.Module) -> Iterator[None]:
        if self.layout.replicas_only:
            with model.no_sync():
                yield
            return
        # each micro-batch's gradients are reduce-scattered all the same, so what accumulates
        # is this rank's shard: skipping it would keep the whole model's gradients unsharded
        # on every rank till the last (a 70B's: 280 GB in float32), what sharding avoids;
        # torchtitan's way, and FSDP2's advice where memory counts. Only HSDP's all-reduce
        # over the replicas waits for the last micro-batch.
        replicated = self.layout.dp_replicate > 1
        if replicated:
            model.set_requires_all_reduce(False)
        try:
            yield
        finally:
            if replicated:
                model.set_requires_all_reduce(True)

    def grad_norm(self, model: nn.Module) -> torch.Tensor:
        if self.layout.replicas_only:  # whole gradients: the plain norm, as ddp had
            return super().grad_norm(model)
        return norm_squares(model, self.dist.device).sqrt()


def _no_ep_ranks(p, ep: int, world_size: int, parts: bool) -> str:
    """Where no shard or tp rank is there to carve ep from: one rank, or replicas (or a
    pipeline's parts) each whole."""
    if world_size == 1:
        return (f"parallel.ep={ep} with parallel.world_size=1: one rank holds every expert: "
                f"give parallel.world_size >= {ep} (ep is carved from the shard and tp "
                "ranks), or parallel.ep=1")
    held = "its part of the model whole" if parts else "the whole model"
    return (f"parallel.ep={ep} with parallel={p.name}: every rank holds {held} (dp_shard=1, "
            "tp=1), with no shard or tp ranks to carve ep from: use parallel=fsdp, hsdp, tp "
            "or fsdp_tp, or a pipeline with parallel.dp_shard > 1; or parallel.ep=1")


class MeshPlan(Plan):
    """One device mesh of the degrees `dims`, each a key of the parallel config."""

    dims: tuple[str, ...] = DEGREES
    processes = True
    splits_experts = True
    runtime = MeshRuntime

    @classmethod
    def layout_of(cls, p, world_size: int) -> Layout:
        degrees = resolve_degrees(cls.given_degrees(p), world_size)
        ep = p.ep
        if ep > 1 and degrees["dp_shard"] == degrees["tp"] == 1:
            raise ConfigError(_no_ep_ranks(p, ep, world_size, "pp" in cls.dims))
        if ep > 1 and degrees["dp_shard"] * degrees["tp"] % ep:
            raise ConfigError(f"parallel.ep={ep} is carved from the data-parallel shard and "
                              f"tp ranks (parallel.dp_shard={degrees['dp_shard']} x parallel.tp="
                              f"{degrees['tp']}), which it does not divide: set dp_shard (or "
                              "tp) so that ep divides their product")
        return Layout(world_size, cls.dims, True, **degrees, ep=ep,
                      sequence_parallel=p.sequence_parallel, regather=p.regather_in_backward)

    @classmethod
    def options(cls, p) -> Options:
        return Options(p.tp_plan or None, p.bucket_cap_mb, p.reshard_after_forward)

    @classmethod
    def given_degrees(cls, p) -> dict[str, int | None]:
        """The degrees the parallel config `p` sets (one may be null), by name."""
        return {dim: getattr(p, dim) for dim in cls.dims}

    @classmethod
    def overlapped_kinds(cls, layout: Layout) -> tuple[str, ...]:
        """Replicas only run as DDP (MeshRuntime.wrap), whose bucket all-reduces run
        beside the rest of backward."""
        return ("all_reduce",) if layout.replicas_only else ()

    @classmethod
    def check(cls, cfg, layout: Layout, stages=None) -> None:
        p = cfg.parallel
        if layout.ep > 1:
            expert_parallel.refuse(cfg, layout)
        if bucket_problem(p.bucket_cap_mb):  # refused where it would not be read too
            raise ConfigError(bucket_problem(p.bucket_cap_mb))
        if layout.sharded:
            cls.refuse_sharded(cfg, layout)
        if layout.dp_shard > 1 and cfg.trainer.channels_last:
            raise ConfigError(f"trainer.channels_last=true with parallel={p.name} (dp_shard="
                              f"{layout.dp_shard}): FSDP2 shards contiguous parameters only, "
                              "and channels-last lays a convolution's weights out NHWC: set "
                              "trainer.channels_last=false, or use parallel=ddp")
        if p.sequence_parallel and layout.tp == 1:
            raise ConfigError("parallel.sequence_parallel=true cuts a tensor-parallel "
                              "group's activations: it needs parallel.tp > 1 (or set it "
                              "false)")
        if p.regather_in_backward:
            refuse(regather_problem(p.sequence_parallel, layout.tp, cfg.trainer,
                                    cfg.precision))
        refuse_tp(cfg, layout.tp, p.sequence_parallel, layout.ep)

    @staticmethod
    def refuse_sharded(cfg, layout: Layout) -> None:
        """What needs every rank to hold the whole model: post-training quantization."""
        p, t = cfg.parallel, cfg.trainer
        if t.quantize is not None:
            raise ConfigError(f"trainer.quantize={t.quantize} with parallel={p.name}: quantize "
                              "needs the whole model in one process: use parallel=none or ddp "
                              "(dp_shard=1, tp=1)")
