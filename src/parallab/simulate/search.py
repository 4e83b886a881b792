"""The layouts a simulation weighs: the one the command gives, or under parallel=auto every
layout of the GPU count (the one grid's dp_replicate x dp_shard x tp x pp, the pipeline's
schedules and micro-batches, gradient accumulation; by activation checkpointing), each
checked as train's checks would check it, without a trial (the model on meta, nothing
run)."""

from __future__ import annotations

import dataclasses
from typing import Any

from parallab.config.errors import ConfigError
from parallab.parallel import schedules
from parallab.parallel.activations import CONTEXTS
from parallab.parallel.grid import (Candidate, Space, expert_degrees, layouts,
                                    overrides_kept, powers_of_two_dividing)
from parallab.parallel.layout import Layout
from parallab.parallel.mesh import regather_problem

# the modes in order of what they recompute: none, the selective ones, full
CHECKPOINTING = ("none", *CONTEXTS, "full")
# what simulate decides beyond a layout's keys: the cluster, and its own keys
DECIDED = ("cluster=", "cluster.", "simulate.")


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
    """Every layout of parallel.world_size GPUs for the model (`facts`: simulate.Facts): the
    one grid's every product of powers of two (tp within a node; parallel/grid.py), by
    activation checkpointing, ep and sequence parallelism; those the model, the batch or
    the precision (float8 gathers without shards) cannot take carry their reason."""
    from parallab.precision import layout_problem

    global_batch = cfg.data.global_batch_size is not None
    experts = facts.mix.experts if facts.mix is not None else None
    space = Space(powers_of_two_dividing, max_tp=gpus_per_node, mixed=True,
                  ways=lambda pp, dp: _ways(pp, per_rank_batch(cfg, dp)[0] or 1, facts))
    found: list[Candidate] = []
    for layout in layouts(cfg.parallel.world_size, space):
        reason = facts.tp_problem(layout.tp) or per_rank_batch(cfg, layout.dp)[1] or \
            layout_problem(cfg.precision, layout.dp_shard)
        for ac in ("none",) if facts.checkpoint_problem else CHECKPOINTING:
            if layout.schedule and schedules.split_backward_clash(
                    layout.schedule, ac, cfg.trainer.compile):
                continue  # train refuses it
            for ep in expert_degrees(experts, layout.tp, layout.dp_shard):
                c = Candidate(dataclasses.replace(layout, checkpointing=ac, ep=ep),
                              global_batch=global_batch, cfg=cfg)
                c.reason = reason or facts.parts_problem(c.layout) or \
                    cfg.data.layout_problem(c.layout)
                found.append(c)
                if layout.tp > 1 and facts.takes_sequence_parallel and not c.reason \
                        and facts.sp_problem(layout.tp) is None:
                    found += _sequence_cut(c.layout, cfg, global_batch)
    return found


def _sequence_cut(layout: Layout, cfg, global_batch: bool) -> list[Candidate]:
    """`layout` with the sequence cut, its gathered inputs kept; and gathered again in
    backward where train takes it (mesh.regather_problem) and some blocks are not
    checkpointed (one that is keeps none anyway)."""
    again = (layout.checkpointing == "none" or cfg.trainer.activation_checkpointing_every > 1) \
        and regather_problem(True, layout.tp, cfg.trainer, cfg.precision) is None
    return [Candidate(dataclasses.replace(layout, sequence_parallel=True, regather=regather),
                      global_batch=global_batch, cfg=cfg)
            for regather in (False, True)[:1 + again]]


def _ways(pp: int, batch: int, facts) -> list[dict[str, Any]]:
    """How a rank's `batch` is cut: a pipeline's micro-batches (pp, 2pp, 4pp: at least one
    per part) by schedule and stages per rank (the schedule's own, and 4 for the
    interleaved ones), those torch's schedules take and the model has stages for (none
    where it has too few for pp parts: said once, in the notes); or accumulation's steps
    (1, 2, 4, 8)."""
    if pp == 1:
        return [{"accumulation": a, "batch_size": batch} for a in (1, 2, 4, 8)
                if batch % a == 0 and a <= batch]
    if facts.pipeline_problem(pp) is not None:
        return []
    found = []
    for name, schedule in schedules.SCHEDULES.items():
        default = schedules.stages_per_rank(name, None)
        for v in sorted({default, *(() if schedule.stages_per_rank else (4,))}):
            if facts.pipeline_problem(pp * v) is not None:
                continue
            found += [{"microbatches": m, "schedule": name, "stages_per_rank": v,
                       "batch_size": batch}
                      for m in (pp, 2 * pp, 4 * pp) if batch % m == 0 and
                      schedules.microbatches_problem(name, pp, v, m) is None]
    return found


def given(cfg, layout: Layout) -> Candidate:
    """The one layout the command gives (checked and resolved by its plan), with what its
    config fixes besides the degrees."""
    accumulation = cfg.trainer.accumulate_grad_batches
    return Candidate(dataclasses.replace(
        layout, accumulation=accumulation, batch_size=cfg.data.batch_size * accumulation,
        checkpointing=cfg.trainer.activation_checkpointing),
        global_batch=cfg.data.global_batch_size is not None, cfg=cfg)


def grown(c: Candidate, world_size: int) -> Candidate:
    """`c` on `world_size` GPUs: its tp, pp and batch per data-parallel rank kept, its
    data-parallel degrees grown (fsdp's shards, hsdp's and ddp's replicas). ConfigError
    where the GPUs do not split so."""
    layout = c.layout
    if world_size == layout.world_size:
        return c
    if world_size % (layout.tp * layout.pp):
        raise ConfigError(f"{world_size} GPUs do not split into tp={layout.tp} x "
                          f"pp={layout.pp}")
    dp = world_size // (layout.tp * layout.pp)
    shard = dp if layout.dp_replicate == 1 and layout.dp_shard > 1 else layout.dp_shard
    if dp % shard:
        raise ConfigError(f"{world_size} GPUs do not split into shard groups of {shard}")
    if shard * layout.tp % layout.ep:
        raise ConfigError(f"{world_size} GPUs do not carve ep={layout.ep} from "
                          f"{shard} shards x tp={layout.tp}")
    return Candidate(layout.regrown(dp // shard, shard), c.precision, c.global_batch,
                     cfg=c.cfg)


def user_overrides(overrides: list[str]) -> list[str]:
    """The user's overrides less those each candidate decides."""
    return overrides_kept(overrides, DECIDED)
