"""A run's layout: how many ranks on how many nodes, how they are arranged, and what
follows from that for the rest of parallab (torchtitan's ParallelDims). Made once by the
checks (Plan.resolve: the world size and node count, a null degree, a pipeline's stages
per rank resolved) and carried to every rank; every reader after the checks takes it,
while the parallel config keeps what the user composed.

The mesh's degrees, outermost first: dp_replicate (replicas, gradients all-reduced),
dp_shard (FSDP2 shards), pp (pipeline parts), tp (tensor-parallel slices, innermost so
that a tp group sits on one node's GPUs). Their product is the world size. The layouts of
one process (dp's GPUs, model parallelism's devices) have degrees too, but no process
group: one process drives every device.

A planned layout (the grid's, parallel/grid.py: Layout.planned) also fixes how a rank's
batch is cut and what its blocks keep: the schedule and micro-batches, gradient
accumulation, the batch per rank, activation checkpointing, sequence parallelism (and its
gathered inputs gathered again in backward);
`overrides` renders it as `parallab train`'s command.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any

from parallab.config.errors import ConfigError
from parallab.config.schema import AutoConfig

DEGREES = ("dp_replicate", "dp_shard", "tp")  # the mesh layouts' (the pipeline adds pp)
PIPELINE_DEGREES = ("dp_replicate", "dp_shard", "pp", "tp")
# every key Layout.overrides may set: a user's own setting of one gives way to the
# layout's in a planner's command (parallel/grid.py overrides_kept)
SET_KEYS = ("parallel=", "parallel.world_size=",
            *(f"parallel.{key}=" for key in AutoConfig.decides),  # what a layout decides
            "data.batch_size=", "trainer.accumulate_grad_batches=",
            "trainer.activation_checkpointing=")


def resolve_degrees(given: dict[str, int | None], world_size: int) -> dict[str, int]:
    """The degrees `given` (parallel.KEY by KEY, one of them null at most) with the null one
    filled so that their product is `world_size`; ConfigError naming the degrees and the
    world size where they do not fit. The parallel config keeps what the user composed."""
    said = ", ".join(f"parallel.{k}={v if v is not None else 'null'}" for k, v in given.items())
    for key, value in given.items():
        if value is not None and value < 1:
            raise ConfigError(f"parallel.{key}={value} is out of range: a degree is >= 1 (or "
                              "null: inferred from the world size)")
    unknown = [k for k, v in given.items() if v is None]
    if len(unknown) > 1:
        raise ConfigError(f"{said}: at most one degree may be null (inferred): set all but one")
    known = math.prod(v for v in given.values() if v is not None)
    if unknown and world_size % known == 0:
        return {**given, unknown[0]: world_size // known}
    if math.prod(v or 0 for v in given.values()) != world_size:
        raise ConfigError(f"{said} multiply to {known}{' x ?' if unknown else ''}, but "
                          f"parallel.world_size={world_size}: make their product the world "
                          "size")
    return dict(given)


def _planned_dims(world_size: int, pp: int) -> tuple[str, ...]:
    """A planned layout's mesh: none for one rank, the pipeline's where pp > 1."""
    return () if world_size == 1 else PIPELINE_DEGREES if pp > 1 else DEGREES


@dataclass(frozen=True)
class Layout:
    """The degrees of a run's ranks and what they imply; checked here once more (a bug, not
    a user's error, if they do not fit: Plan.layout_of refused those with one line)."""

    world_size: int = 1
    dims: tuple[str, ...] = ()  # the degrees the ranks are arranged by, outermost first
    processes: bool = False  # a process per rank (launched, in a process group); else one
    dp_replicate: int = 1
    dp_shard: int = 1
    pp: int = 1
    tp: int = 1
    nnodes: int = 1  # the nodes the ranks span (one agent each: torchrun, SLURM, mpirun)
    stages_per_rank: int = 1  # the parts a pipeline's rank holds (its schedule's v)
    ep: int = 1  # ranks each MoE layer's experts are split over (carved from dp_shard x tp)
    # set once by the checks (Plan.resolve) and carried to every rank: the plan, whose
    # Runtime runs this layout, and the CUDA ordinals a one-process layout puts
    # its replicas or parts on
    plan: Any = field(default=None, compare=False)
    gpus: tuple[int, ...] = ()
    # what a layout fixes besides its degrees: a plan writes its schedule, micro-batches and
    # sequence parallelism; a planned one (Layout.planned) the accumulation, the batch and
    # checkpointing too
    schedule: str | None = None  # a pipeline's (parallel.schedule)
    microbatches: int = 1  # a pipeline's micro-batches a pass (parallel.microbatches)
    accumulation: int = 1  # passes an optimizer step (trainer.accumulate_grad_batches)
    batch_size: int = 1  # sequences a data-parallel rank takes an optimizer step
    checkpointing: str = "none"  # trainer.activation_checkpointing
    sequence_parallel: bool = False
    regather: bool = False  # its gathered inputs gathered again in backward

    @classmethod
    def planned(cls, world_size: int, dp_replicate: int = 1, dp_shard: int = 1, tp: int = 1,
                pp: int = 1, **fixed: Any) -> "Layout":
        """A layout as a grid plans it: a process per rank over the mesh of these degrees
        (a pipeline's where pp > 1), and what else it fixes (`fixed`: the fields above)."""
        return cls(world_size, _planned_dims(world_size, pp), world_size > 1,
                   dp_replicate=dp_replicate, dp_shard=dp_shard, pp=pp, tp=tp, **fixed)

    def regrown(self, dp_replicate: int, dp_shard: int) -> "Layout":
        """This layout over other data-parallel degrees, its tp, pp and what it fixes kept,
        as a grid plans it (a process per rank)."""
        world = dp_replicate * dp_shard * self.tp * self.pp
        return dataclasses.replace(self, world_size=world, dims=_planned_dims(world, self.pp),
                                   processes=world > 1, dp_replicate=dp_replicate,
                                   dp_shard=dp_shard, plan=None, gpus=())

    def __post_init__(self) -> None:
        for dim in ("dp_replicate", "dp_shard", "pp", "tp"):
            if getattr(self, dim) < 1 or dim not in self.dims and getattr(self, dim) != 1:
                raise ValueError(f"{dim}={getattr(self, dim)} in a layout of {self.dims}")
        if math.prod(self.shape) != self.world_size:
            raise ValueError(f"degrees {self.shape} of {self.dims} do not multiply to "
                             f"world_size={self.world_size}")
        if self.nnodes < 1 or self.world_size % self.nnodes:
            raise ValueError(f"world_size={self.world_size} over nnodes={self.nnodes}")
        if self.ep < 1 or self.dp_shard * self.tp % self.ep:
            raise ValueError(f"ep={self.ep} is not carved from dp_shard x tp={self.shape}")

    def as_run(self, given: dict[str, Any]) -> dict[str, Any]:
        """The parallel config `given` (as composed) with what this layout resolved written
        in: the world size and nodes a launcher started, the degrees, a pipeline's stages per
        rank. What a run records (its checkpoints' config, its loggers' params), so that a
        sweep's runs compare by the values they ran at, not the nulls they were given."""
        ran = dict(given)
        if self.processes:
            ran.update(world_size=self.world_size, nnodes=self.nnodes)
        elif ran.get("world_size") is None:  # one process: its devices (dp on a CPU: one)
            ran["world_size"] = self.world_size
        ran.update({dim: getattr(self, dim) for dim in (*self.dims, "ep") if dim in ran})
        if self.pipelined and "stages_per_rank" in ran:
            ran["stages_per_rank"] = self.stages_per_rank
        return ran

    @property
    def shape(self) -> tuple[int, ...]:
        """The device mesh's shape, by `dims`."""
        return tuple(getattr(self, dim) for dim in self.dims)

    @property
    def per_node(self) -> int:
        """Ranks (a process each, or devices of one process) on each node."""
        return self.world_size // self.nnodes

    @property
    def dp(self) -> int:
        """Data-parallel ranks: those reading different samples each step."""
        return self.dp_replicate * self.dp_shard

    @property
    def cuts_model(self) -> bool:
        """The model's stages are cut into pp parts (a pipeline; model parallelism)."""
        return "pp" in self.dims

    @property
    def pipelined(self) -> bool:
        """Parts on ranks of their own, fed micro-batches by a schedule whose stages have
        fixed shapes: a short last training batch is dropped."""
        return self.processes and self.cuts_model

    @property
    def replicas_only(self) -> bool:
        """Every rank holds the whole model and reads its own batch: DDP's replicas."""
        return self.processes and not self.cuts_model and self.dp_shard == self.tp == 1

    @property
    def sharded(self) -> bool:
        """Ranks hold parts of the model (shards, slices, stages): each writes its part of a
        .dcp checkpoint, rather than rank 0 one file."""
        return self.processes and not self.replicas_only

    def part_of(self, rank: int) -> int:
        """The pipeline part `rank` holds (0 where the model is not cut): its coordinate on
        the mesh's pp dimension, which only tp's sits inside."""
        return rank // self.tp % self.pp

    @property
    def uses_stages(self) -> bool:
        """The model's stages matter: each is an FSDP2 unit, or the model is cut at them."""
        return self.processes or self.cuts_model

    @property
    def bubble(self) -> float:
        """Compute time over the same work without idle ranks: its pipeline schedule's fill
        and drain (schedules.bubble); 1 where no schedule runs (model parallelism's parts
        on one process's devices run one after another, each a full step)."""
        from parallab.parallel import schedules

        if self.schedule is None:
            return 1.0
        return schedules.bubble(self.schedule, self.pp, self.stages_per_rank,
                                self.microbatches)

    @property
    def passes(self) -> int:
        """Micro-batches a rank runs an optimizer step: its pipeline's, each accumulated."""
        return self.microbatches * self.accumulation

    @property
    def rows(self) -> int:
        """Sequences in a micro-batch."""
        return self.batch_size // self.passes

    @property
    def gathered(self) -> bool:
        """FSDP2 holds its weights, and gathers them in the compute dtype: any sharded mesh
        layout, and a pipeline's parts sharded over dp_shard."""
        return self.dp_shard > 1 or (self.tp > 1 and self.pp == 1)

    @property
    def preset(self) -> str:
        """The parallel=NAME that trains this layout."""
        if self.dims and not self.processes:  # one process's devices
            return "model" if self.cuts_model else "dp"
        if self.pp > 1:
            return "pipeline"
        if self.world_size == 1:
            return "none"
        if self.tp > 1:
            return "tp" if self.dp == 1 else "fsdp_tp"
        return "ddp" if self.dp_shard == 1 else "fsdp" if self.dp_replicate == 1 else "hsdp"

    def overrides(self, global_batch: bool = False) -> list[str]:
        """What `parallab train` needs beyond the user's overrides to train this way
        (`global_batch`: the user gave data.global_batch_size, which sets the batch); each
        of its keys is in SET_KEYS."""
        from parallab.parallel import schedules

        found = [f"parallel={self.preset}", f"parallel.world_size={self.world_size}"]
        if self.processes and self.preset != "none":  # else its preset fixes the degrees
            found += [f"parallel.dp_replicate={self.dp_replicate}",
                      f"parallel.dp_shard={self.dp_shard}", f"parallel.tp={self.tp}"]
        if self.pipelined:
            found += [f"parallel.pp={self.pp}", f"parallel.schedule={self.schedule}",
                      f"parallel.microbatches={self.microbatches}"]
            if self.stages_per_rank != schedules.stages_per_rank(self.schedule, None):
                found.append(f"parallel.stages_per_rank={self.stages_per_rank}")
        if self.sequence_parallel:
            found.append("parallel.sequence_parallel=true")
        if self.regather:
            found.append("parallel.regather_in_backward=true")
        if self.ep > 1:
            found.append(f"parallel.ep={self.ep}")
        if not global_batch:
            found.append(f"data.batch_size={self.batch_size // self.accumulation}")
        # both said even at their defaults, which the user's config files may not keep
        found += [f"trainer.accumulate_grad_batches={self.accumulation}",
                  f"trainer.activation_checkpointing={self.checkpointing}"]
        return found

    @property
    def label(self) -> str:
        """In a table's row: preset(degrees) schedule or accumulation, sp, batch, mode."""
        degrees = [f"{k}{v}" for k, v in (("R", self.dp_replicate), ("F", self.dp_shard),
                                          ("T", self.tp), ("P", self.pp), ("E", self.ep))
                   if v > 1]
        v = f" v{self.stages_per_rank}" if self.stages_per_rank > 1 else ""
        way = (f" {self.schedule}{v} m{self.microbatches}" if self.pipelined else "") + (
            f" accum{self.accumulation}" if self.accumulation > 1 else "")
        sp = (" sp" if self.sequence_parallel else "") + (" regather" if self.regather else "")
        return (f"{self.preset}({'x'.join(degrees) or '1'}){way}{sp} b{self.batch_size} "
                f"ac={self.checkpointing}")
