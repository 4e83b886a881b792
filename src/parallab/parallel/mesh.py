"""Layouts from one device mesh: dp_replicate x dp_shard x tp ranks (torchtitan's order,
tp innermost so a tensor-parallel group sits on neighbouring ranks: one node's GPUs).

The model is first split by tensor parallelism over the `tp` dimension
(torch.distributed.tensor.parallel.parallelize_module with the plan the model declares in
tp_plan()), then sharded with FSDP2 over the data-parallel dimensions: over dp_shard
alone, or replicate x shard (HSDP: sharded within a group, gradients all-reduced across the
groups). Presets: hsdp (replicate x shard), tp (tensor parallel only), fsdp_tp (2-D).
Ranks of one tp group read the same batch; the data-parallel rank (replicate x shard)
picks the shard of each epoch.
"""

from __future__ import annotations

import dataclasses
import inspect
import logging
import math

from torch import nn

from parallab.distributed import Dist
from parallab.errors import ConfigError
from parallab.parallel.fsdp import FSDPStrategy

log = logging.getLogger(__name__)
DEGREES = ("dp_replicate", "dp_shard", "tp")


def resolve_degrees(p, keys: tuple[str, ...] = DEGREES) -> None:
    """Fill the one degree (of `keys`) left null so that their product is
    parallel.world_size; ConfigError naming the degrees and the world size where they do
    not fit."""
    given = {k: getattr(p, k) for k in keys}
    said = ", ".join(f"parallel.{k}={v if v is not None else 'null'}" for k, v in given.items())
    for key, value in given.items():
        if value is not None and value < 1:
            raise ConfigError(f"parallel.{key}={value} is out of range: a degree is >= 1 (or "
                              "null: inferred from the world size)")
    unknown = [k for k, v in given.items() if v is None]
    if len(unknown) > 1:
        raise ConfigError(f"{said}: at most one degree may be null (inferred): set all but one")
    known = math.prod(v for v in given.values() if v is not None)
    if unknown and p.world_size % known == 0:
        setattr(p, unknown[0], p.world_size // known)
    elif math.prod(getattr(p, k) or 0 for k in keys) != p.world_size:
        raise ConfigError(f"{said} multiply to {known}{' x ?' if unknown else ''}, but "
                          f"parallel.world_size={p.world_size}: make their product the world "
                          "size")


def tp_problem(model: nn.Module, tp: int) -> str | None:
    """None if `model` (built on meta) declares a tensor-parallel plan whose split sizes
    divide by `tp`, else one line."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    plan_of = getattr(model, "tp_plan", None)
    if not callable(plan_of):
        return (f"parallel.tp={tp}: {type(model).__name__} declares no tensor-parallel plan "
                "(a tp_plan() method, as gpt and mlp have): use parallel.tp=1, or "
                "parallel=fsdp or ddp")
    own = getattr(model, "tp_problem", None)
    problem = own(tp) if callable(own) else None
    if problem:
        return problem
    for name, style in plan_of().items():
        module = model.get_submodule(name)
        dim = {ColwiseParallel: "out_features", RowwiseParallel: "in_features"}.get(type(style))
        if isinstance(module, nn.Embedding):
            dim = "num_embeddings"
        size = getattr(module, dim, None) if dim else None
        if size is not None and size % tp:
            return (f"parallel.tp={tp} does not divide {name}.{dim}={size}: pick a tp that "
                    "divides the model's widths")
    return None


def sp_problem(model: nn.Module, data, tp: int) -> str | None:
    """None if `model` has a sequence-parallel plan and data's sequences split over `tp`."""
    plan_of = model.tp_plan
    if "sequence_parallel" not in inspect.signature(plan_of).parameters:
        return (f"parallel.sequence_parallel=true: {type(model).__name__}.tp_plan() takes no "
                "sequence_parallel argument (gpt's does): set it false, or give the plan one")
    seq_len = getattr(data, "seq_len", None)
    if seq_len is not None and seq_len % tp:
        return (f"parallel.sequence_parallel=true cuts each sequence over parallel.tp={tp} "
                f"ranks, which data.seq_len={seq_len} does not divide by: pick a tp or "
                "seq_len that divide")
    return None


def refuse_tp(cfg, tp: int, sequence_parallel: bool = False) -> None:
    """ConfigError where tp > 1 and the model (built on meta) has no plan that splits over
    `tp` ranks, or no sequence-parallel one where asked."""
    if tp == 1:
        return
    from parallab.trial import model_on_meta

    model = model_on_meta(cfg)
    problem = tp_problem(model, tp) or sequence_parallel and sp_problem(model, cfg.data, tp)
    if problem:
        raise ConfigError(problem)


class MeshStrategy(FSDPStrategy):
    @classmethod
    def node_local_kinds(cls, cfg) -> tuple[str, ...]:
        """With replicas, the shard groups' all-gather and reduce-scatter stay in a node;
        only the replicas' all-reduce crosses nodes."""
        return ("all_gather", "reduce_scatter") if cfg.parallel.dp_replicate > 1 else ()

    @classmethod
    def degrees(cls, n: int) -> list[tuple[int, int, int]]:
        """The preset's (dp_replicate, dp_shard, tp) settings for n ranks (advise's
        candidates)."""
        return []

    @classmethod
    def layouts(cls, world_size: int, device_type: str, options) -> list[list[str]]:
        return [[f"parallel.world_size={world_size}", *(f"parallel.{k}={v}" for k, v in
                                                        zip(DEGREES, d))]
                for d in cls.degrees(world_size)]

    @classmethod
    def check(cls, cfg) -> None:
        super().check(cfg)
        p = cfg.parallel
        resolve_degrees(p)
        if p.sequence_parallel and p.tp == 1:
            raise ConfigError("parallel.sequence_parallel=true cuts a tensor-parallel "
                              "group's activations: it needs parallel.tp > 1 (or set it "
                              "false)")
        refuse_tp(cfg, p.tp, p.sequence_parallel)

    @classmethod
    def data_parallel_ranks(cls, cfg) -> int:
        resolve_degrees(cfg.parallel)
        return cfg.parallel.world_size // cfg.parallel.tp

    @property
    def data_dist(self) -> Dist:
        """Ranks of one tp group are one data-parallel rank: they read the same batch."""
        tp = self.cfg.tp
        return dataclasses.replace(self.dist, rank=self.dist.rank // tp,
                                   world_size=self.dist.world_size // tp)

    @property
    def loss_ranks(self) -> int:
        return self.dist.world_size  # each rank of a tp group holds its group's loss

    @property
    def seed_rank(self) -> int:
        return self.data_dist.rank  # a tp group draws one dropout mask for its batch

    def split(self, model: nn.Module) -> nn.Module:
        """Tensor parallel, first of all (torchtitan's order): activation checkpointing and
        compile then wrap the split blocks, and the plan's module names stay as declared."""
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor.parallel import parallelize_module

        p = self.cfg
        self.mesh = init_device_mesh(self.dist.device.type, (p.dp_replicate, p.dp_shard, p.tp),
                                     mesh_dim_names=DEGREES)
        model = self.on_device(model)
        if p.tp > 1:  # a plan without sequence parallelism need not know the argument
            plan = (model.tp_plan(sequence_parallel=True) if p.sequence_parallel
                    else model.tp_plan())
            parallelize_module(model, self.mesh["tp"], plan)
        if self.dist.is_main:
            log.info("parallel=%s: mesh dp_replicate=%d x dp_shard=%d x tp=%d%s", p.name,
                     p.dp_replicate, p.dp_shard, p.tp,
                     " (sequence parallel)" if p.sequence_parallel else "")
        return model

    def wrap(self, model: nn.Module) -> nn.Module:
        mesh, p = self.mesh, self.cfg
        dp = mesh["dp_replicate", "dp_shard"] if p.dp_replicate > 1 else mesh["dp_shard"]
        return self.shard(model, dp)


def _inner_divisors(n: int) -> list[int]:
    return [d for d in range(2, n) if n % d == 0]


class HSDPStrategy(MeshStrategy):
    @classmethod
    def degrees(cls, n: int) -> list[tuple[int, int, int]]:
        """replicas x shards, both > 1 (1 x n is fsdp, n x 1 ddp)."""
        return [(r, n // r, 1) for r in _inner_divisors(n)]


class TPStrategy(MeshStrategy):
    @classmethod
    def degrees(cls, n: int) -> list[tuple[int, int, int]]:
        return [(1, 1, n)] if n > 1 else []


class FSDPTPStrategy(MeshStrategy):
    @classmethod
    def degrees(cls, n: int) -> list[tuple[int, int, int]]:
        """shards x tp, both > 1 (its 1-D cases are fsdp and tp)."""
        return [(1, n // t, t) for t in _inner_divisors(n)]
