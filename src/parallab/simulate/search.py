"""The layouts a simulation weighs: the one the command gives, or under parallel=auto every
layout of the GPU count (dp_replicate x dp_shard x tp x pp, the pipeline's schedules and
micro-batches, gradient accumulation, activation checkpointing), each checked as train's
checks would check it, without a trial (the model on meta, nothing run)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any


from parallab.config.errors import ConfigError
from parallab.parallel import schedules
from parallab.parallel.activations import CONTEXTS
from parallab.simulate.step import Prediction

# the modes in order of what they recompute: none, the selective ones, full
CHECKPOINTING = ("none", *CONTEXTS, "full")
# what a candidate sets: the user's own settings of these give way to it in its command
# (the layout's other keys, such as parallel.bucket_cap_mb, stay as the user set them)
DECIDED = ("parallel=", "parallel.world_size=", "parallel.dp_replicate=",
           "parallel.dp_shard=", "parallel.tp=", "parallel.pp=", "parallel.schedule=",
           "parallel.microbatches=", "parallel.stages_per_rank=",
           "parallel.sequence_parallel=", "parallel.ep=", "trainer.activation_checkpointing=",
           "trainer.accumulate_grad_batches=", "data.batch_size=", "cluster=", "cluster.",
           "simulate.", "hydra.", "advise.")


@dataclass
class Candidate:
    world_size: int
    dp_replicate: int = 1
    dp_shard: int = 1
    tp: int = 1
    pp: int = 1
    batch_size: int = 1  # sequences per data-parallel rank and optimizer step
    microbatches: int = 1  # a pipeline's micro-batches, or gradient accumulation's steps
    schedule: str | None = None
    stages_per_rank: int = 1  # v: the model cut into pp x v parts, v on each rank
    checkpointing: str = "none"
    sequence_parallel: bool = False
    given_global: int | None = None  # data.global_batch_size as the user gave it
    reason: str | None = None  # why it cannot run
    prediction: Prediction | None = None
    state_gb: float | None = None  # not traced: its training state alone is over the memory
    ep: int = 1  # ranks each MoE layer's experts are split over (carved from dp_shard x tp)

    @property
    def memory_gb(self) -> float | None:
        """GiB a GPU holds: the prediction's, else the training state's alone, if known."""
        return self.prediction.memory_per_gpu_gb if self.prediction else self.state_gb

    def fits(self, memory_bytes: float) -> bool:
        """Predicted, and within a GPU's memory."""
        return self.prediction is not None and \
            self.prediction.memory_per_gpu_gb * 2**30 <= memory_bytes

    @property
    def dp(self) -> int:
        return self.dp_replicate * self.dp_shard

    @property
    def rows(self) -> int:
        return self.batch_size // self.microbatches

    @property
    def preset(self) -> str:
        if self.pp > 1:
            return "pipeline"
        if self.world_size == 1:
            return "none"
        if self.tp > 1:
            return "tp" if self.dp == 1 else "fsdp_tp"
        return "ddp" if self.dp_shard == 1 else "fsdp" if self.dp_replicate == 1 else "hsdp"

    @property
    def gathered(self) -> bool:
        """FSDP2 holds its weights, and gathers them in the compute dtype: any sharded mesh
        layout, and a pipeline's parts sharded over dp_shard."""
        return self.dp_shard > 1 or (self.tp > 1 and self.pp == 1)

    def overrides(self) -> list[str]:
        """What `parallab train` needs beyond the user's overrides to train this way."""
        found = [f"parallel={self.preset}"]
        if self.preset != "none":
            found += [f"parallel.world_size={self.world_size}",
                      f"parallel.dp_replicate={self.dp_replicate}",
                      f"parallel.dp_shard={self.dp_shard}", f"parallel.tp={self.tp}"]
        if self.pp > 1:
            found += [f"parallel.pp={self.pp}", f"parallel.schedule={self.schedule}",
                      f"parallel.microbatches={self.microbatches}"]
            if self.stages_per_rank != schedules.stages_per_rank(self.schedule, None):
                found.append(f"parallel.stages_per_rank={self.stages_per_rank}")
        if self.sequence_parallel:
            found.append("parallel.sequence_parallel=true")
        if self.ep > 1:
            found.append(f"parallel.ep={self.ep}")
        accumulate = 1 if self.pp > 1 else self.microbatches
        if self.given_global is None:
            found.append(f"data.batch_size={self.batch_size // accumulate}")
        if accumulate > 1:
            found.append(f"trainer.accumulate_grad_batches={accumulate}")
        found.append(f"trainer.activation_checkpointing={self.checkpointing}")
        return found

    @property
    def label(self) -> str:
        degrees = [f"{k}{v}" for k, v in (("R", self.dp_replicate), ("F", self.dp_shard),
                                          ("T", self.tp), ("P", self.pp), ("E", self.ep))
                   if v > 1]
        v = f" v{self.stages_per_rank}" if self.stages_per_rank > 1 else ""
        way = f" {self.schedule}{v} m{self.microbatches}" if self.pp > 1 else (
            f" accum{self.microbatches}" if self.microbatches > 1 else "")
        sp = " sp" if self.sequence_parallel else ""
        return (f"{self.preset}({'x'.join(degrees) or '1'}){way}{sp} b{self.batch_size} "
                f"ac={self.checkpointing}")


def powers_of_two(limit: int) -> list[int]:
    return [2**k for k in range(int(math.log2(limit)) + 1)] if limit >= 1 else []


def per_rank_batch(cfg, dp: int) -> tuple[int | None, str | None]:
    """The sequences a data-parallel rank takes a step: data.global_batch_size / dp where
    given (None and why where it does not divide), else data.batch_size."""
    d = cfg.data
    if d.global_batch_size is None:
        return d.batch_size, None
    if d.global_batch_size % dp:
        return None, (f"data.global_batch_size={d.global_batch_size} does not split over "
                      f"{dp} data-parallel ranks: give a multiple of {dp}")
    return d.global_batch_size // dp, None


def grid(cfg, facts, gpus_per_node: int) -> list[Candidate]:
    """Every layout of parallel.world_size GPUs for the model (`facts`: simulate.Facts);
    those the model, the batch or the precision (float8 gathers without shards) cannot take carry
    their reason."""
    from parallab.precision import layout_problem

    n = cfg.parallel.world_size
    found: list[Candidate] = []
    for tp in [t for t in powers_of_two(min(n, gpus_per_node)) if n % t == 0]:
        tp_reason = facts.tp_problem(tp)
        for pp in [p for p in powers_of_two(n // tp) if (n // tp) % p == 0]:
            if pp > 1 and facts.pipeline_problem(pp) is not None:
                continue  # said once, in the notes
            dp = n // (tp * pp)
            shards = sorted({f for f in powers_of_two(dp) if dp % f == 0} | {dp})
            batch, batch_reason = per_rank_batch(cfg, dp)
            for shard in shards:
                base = dict(world_size=n, dp_replicate=dp // shard, dp_shard=shard, tp=tp,
                            pp=pp, batch_size=batch or 1, given_global=cfg.data.global_batch_size)
                for way in _ways(pp, batch or 1, facts):
                    for ac in ("none",) if facts.checkpoint_problem else CHECKPOINTING:
                        if way.get("schedule") and schedules.split_backward_clash(
                                way["schedule"], ac, cfg.trainer.compile):
                            continue  # train refuses it
                        for ep in expert_degrees(facts.mix, tp, shard):
                            c = Candidate(**base, **way, checkpointing=ac, ep=ep)
                            c.reason = tp_reason or batch_reason or \
                                layout_problem(cfg.precision, shard)
                            found.append(c)
                            if tp > 1 and facts.takes_sequence_parallel and not c.reason \
                                    and facts.sp_problem(tp) is None:
                                found.append(Candidate(**base, **way, checkpointing=ac, ep=ep,
                                                       sequence_parallel=True))
    return found


def expert_degrees(mix, tp: int, shards: int) -> list[int]:
    """The ep a layout of `tp` and `shards` may take for a mixture (`mix`; none: [1]): 1, and
    tp x each power of two of the shards, where it divides the experts (train's rule:
    parallel/expert_parallel.py)."""
    if mix is None:
        return [1]
    carved = [tp * s for s in powers_of_two(shards) if shards % s == 0 and tp * s > 1]
    return [1, *(ep for ep in carved if mix.experts % ep == 0)]


def _ways(pp: int, batch: int, facts) -> list[dict[str, Any]]:
    """How a rank's batch is cut: a pipeline's micro-batches (pp, 2pp, 4pp: at least one
    per part) by schedule and stages per rank (the schedule's own, and 4 for the
    interleaved ones), those torch's schedules take and the model has stages for; or
    accumulation's steps (1, 2, 4, 8)."""
    if pp == 1:
        return [{"microbatches": a} for a in (1, 2, 4, 8) if batch % a == 0 and a <= batch]
    found = []
    for name, schedule in schedules.SCHEDULES.items():
        default = schedules.stages_per_rank(name, None)
        for v in sorted({default, *(() if schedule.stages_per_rank else (4,))}):
            if facts.pipeline_problem(pp * v) is not None:
                continue
            found += [{"microbatches": m, "schedule": name, "stages_per_rank": v}
                      for m in (pp, 2 * pp, 4 * pp) if batch % m == 0 and
                      schedules.microbatches_problem(name, pp, v, m) is None]
    return found


def given(cfg, layout) -> Candidate:
    """The one layout the command gives (checked and resolved by its plan)."""
    p = cfg.parallel
    pp = layout.pp
    micro = p.microbatches if pp > 1 else cfg.trainer.accumulate_grad_batches
    batch = cfg.data.batch_size * (1 if pp > 1 else micro)
    schedule = p.schedule if pp > 1 else None
    v = schedules.stages_per_rank(schedule, getattr(p, "stages_per_rank", None)) if schedule \
        else 1
    return Candidate(layout.world_size, layout.dp_replicate, layout.dp_shard, layout.tp, pp,
                     batch, micro, schedule, v, cfg.trainer.activation_checkpointing,
                     bool(getattr(p, "sequence_parallel", False)), cfg.data.global_batch_size,
                     ep=layout.ep)


def scaled(cfg, layout, world_size: int) -> Candidate:
    """The layout of a checked config on `world_size` GPUs: its tp, pp and batch per
    data-parallel rank kept, its data-parallel degrees grown (fsdp's shards, hsdp's and
    ddp's replicas). ConfigError where the GPUs do not split so."""
    return grown(given(cfg, layout), world_size)


def grown(c: Candidate, world_size: int) -> Candidate:
    """`c` on `world_size` GPUs (see scaled)."""
    import dataclasses

    if world_size == c.world_size:
        return c
    if world_size % (c.tp * c.pp):
        raise ConfigError(f"{world_size} GPUs do not split into tp={c.tp} x pp={c.pp}")
    dp = world_size // (c.tp * c.pp)
    shard = dp if c.dp_replicate == 1 and c.dp_shard > 1 else c.dp_shard
    if dp % shard:
        raise ConfigError(f"{world_size} GPUs do not split into shard groups of {shard}")
    return dataclasses.replace(c, world_size=world_size, dp_shard=shard,
                               dp_replicate=dp // shard, prediction=None)


def user_overrides(overrides: list[str]) -> list[str]:
    """The user's overrides less those each candidate decides."""
    return [o for o in overrides if not o.lstrip("+~").startswith(DECIDED)]


def command_overrides(user: list[str], c: Candidate) -> list[str]:
    """The user's overrides as a candidate's command keeps them: a tensor-parallel plan only
    where it splits (train refuses one at tp 1)."""
    return [o for o in user if c.tp > 1 or not o.lstrip("+~").startswith("parallel.tp_plan=")]


def refuse(reason: str | None) -> None:
    if reason:
        raise ConfigError(reason)
