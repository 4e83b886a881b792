"""The grid `parallab advise` searches: the presets' layouts of the one grid
(parallel/grid.py) at each world size, x precision x activation checkpointing x gradient
accumulation, each checked as `python train.py` would check it, its memory predicted, and
pruned with a reason where it cannot run or is not needed."""

from __future__ import annotations

import dataclasses
import logging
import math
from typing import Any, Callable

from parallab.config.errors import ConfigError, first_line
from parallab.parallel.grid import Candidate, overrides_kept

log = logging.getLogger(__name__)
# the cost order of the memory savers: each next one trades more time for memory
SAVERS = {"none": 0.0, "selective": 0.5, "selective_alternate": 1.0, "full": 1.5}
# what advise decides beyond a layout's keys: every parallel key (a user's bucket size or
# plan is for one preset), the precisions it crosses; its own experiment
DECIDED = ("parallel.", "precision=", "experiment=advise")
KEPT = ("parallel.stages=", "parallel.threads_per_worker=")  # the model's and the machine's


def user_overrides(overrides: list[str]) -> list[str]:
    """The user's overrides less those advise decides per candidate."""
    return overrides_kept(overrides, DECIDED, KEPT)



def enumerate_grid(options, world_sizes: list[int], device_type: str,
                   experts: int | None = None, batch: int = 1) -> list[Candidate]:
    """The grid: the presets' layouts of the one grid (parallel/grid.py) that `options`
    name, by preset; for a model of `experts` experts a layer, the sharded layouts each also
    with every ep train takes of them (grid.expert_degrees, which simulate spans too); each
    by precision, activation checkpointing and accumulation, its data-parallel ranks
    splitting the global `batch` (data.global_batch_size, which its command keeps)."""
    from parallab.parallel import PLANS, grid

    names = options.layouts or list(PLANS)
    order = {name: i for i, name in enumerate(names)}  # the user's order of advise.layouts
    accumulations = [2**k for k in range(int(math.log2(options.max_accumulation)) + 1)]
    space = grid.Space(ways=lambda pp, dp: _ways(pp, options),
                       devices=device_type == "cuda")
    return [Candidate(dataclasses.replace(layout, ep=ep, checkpointing=ac,
                                          accumulation=accumulation,
                                          batch_size=max(1, batch // layout.dp)),
                      precision, global_batch=True)
            for n in world_sizes
            for layout in sorted((layout for layout in grid.layouts(n, space)
                                  if layout.preset in names),
                                 key=lambda layout: order[layout.preset])
            for ep in grid.expert_degrees(experts, layout.tp, layout.dp_shard)
            for precision in options.precisions for ac in options.activation_checkpointing
            for accumulation in accumulations]


def _ways(pp: int, options) -> list[dict[str, Any]]:
    """A pipeline's: every schedule asked for (the multi-stage ones at their own stages per
    rank) by each count of micro-batches asked for; the checks prune those the model has
    too few stages for, or whose micro-batches the schedule does not take."""
    from parallab.parallel import schedules

    if pp == 1:
        return [{}]
    return [{"schedule": name, "stages_per_rank": schedules.stages_per_rank(name, None),
             "microbatches": micro}
            for name in options.schedules or schedules.SCHEDULES
            for micro in options.microbatches]


def settle(candidates: list[Candidate], configure: Callable[[Candidate], Any],
           budget_of: Callable[[int], float], only_needed: bool) -> None:
    """Check each candidate as train.py would (a refusal prunes it) and predict its memory
    per rank (over the budget at its world size prunes it). Of candidates differing only in
    memory savers, cheapest first; with `only_needed`, once one fits the rest are not
    needed (checkpointing and accumulation never make a fitting step faster) and are
    neither checked nor predicted."""
    groups: dict[tuple, list[Candidate]] = {}
    for candidate in candidates:
        key = (dataclasses.replace(candidate.layout, checkpointing="none", accumulation=1),
               candidate.precision)
        groups.setdefault(key, []).append(candidate)
    batches: dict[int, Any] = {}
    for group in groups.values():
        fits = None
        for candidate in sorted(group, key=cost):
            if fits is not None and only_needed:
                candidate.reason = (f"not needed: {fits.label} fits (advise.only_needed="
                                    "false measures it)")
                continue
            try:
                candidate.cfg, candidate.resolved = configure(candidate)
            except ConfigError as error:
                candidate.reason = str(error)
                continue
            _predict(candidate, budget_of(candidate.world_size), batches)
            if candidate.reason is None and fits is None:
                fits = candidate


def cost(candidate: Candidate) -> float:
    """How much time its memory savers are expected to cost (0: none)."""
    layout = candidate.layout
    return SAVERS[layout.checkpointing] + math.log2(layout.accumulation)


def _predict(candidate: Candidate, budget_mb: float, batches: dict[int, Any]) -> None:
    """Memory per rank from fake tensors (memory.predict); the largest rank's where ranks
    differ (pipeline parts). `batches`: one real micro-batch by size, shared."""
    from parallab.advise import memory
    from parallab.checks import trial

    cfg = candidate.cfg
    size = cfg.data.batch_size
    if size not in batches:
        batches[size] = trial.one_batch(cfg, size)
    layout = candidate.resolved
    ranks = range(layout.world_size) if layout.cuts_model else [0]
    try:
        per_rank = [memory.predict(cfg, layout, batches[size], rank)
                    for rank in ranks]
    except Exception as error:  # noqa: BLE001 - a layout fake tensors cannot trace
        log.warning("%s: memory not predicted (%s)", candidate.label, first_line(error))
        return
    state, act = candidate.memory_mb = max(per_rank, key=sum)
    if state + act > budget_mb:
        candidate.reason = (f"predicted {state + act:,.1f} MB per rank (state {state:,.1f} + "
                            f"activations {act:,.1f}) > budget {budget_mb:,.1f} MB")
