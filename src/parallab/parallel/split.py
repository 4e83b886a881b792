"""Where a model's stages are cut into parts (parallel.split), for model and pipeline
parallelism; which of them a pipeline's rank holds (Cut)."""

from __future__ import annotations

import itertools
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from parallab.config.errors import ConfigError
from parallab.parallel import schedules
from parallab.parallel import stages as stages_of


def parameter_counts(stages: list[nn.Module]) -> list[int]:
    return [sum(p.numel() for p in stage.parameters()) for stage in stages]


def even_cuts(sizes: list[int], parts: int) -> list[int]:
    """Start indices of parts 2..n, each part at least one stage, placed where the running
    parameter count comes closest to an even share."""
    total, cuts, start = sum(sizes), [], 0
    running = [sum(sizes[:i]) for i in range(len(sizes) + 1)]  # params before stage i
    for part in range(1, parts):
        share = part * total / parts
        last_allowed = len(sizes) - (parts - part)  # leave a stage for every later part
        best = min(range(start + 1, last_allowed + 1), key=lambda i: abs(running[i] - share))
        cuts.append(best)
        start = best
    return cuts


def check_cuts(cuts: list[int], stages: int, parts: int, said: str | None = None
               ) -> str | None:
    """None if `cuts` (parallel.split) cuts `stages` into `parts` non-empty parts (`said`:
    the keys that make that many)."""
    if len(cuts) != parts - 1:
        return (f"parallel.split={cuts} gives {len(cuts) + 1} parts but "
                f"{said or f'parallel.world_size={parts}'} makes {parts}: give {parts - 1} "
                "stage indices, or null to split evenly")
    if cuts != sorted(set(cuts)) or cuts[0] < 1 or cuts[-1] > stages - 1:
        return (f"parallel.split={cuts} must be increasing stage indices between 1 and "
                f"{stages - 1} (the model has {stages} stages), or null to split evenly")
    return None


def part_ranges(stages: list[nn.Module], parts: int, cuts: list[int] | None) -> list[range]:
    """The stage indices of each part."""
    cuts = cuts if cuts is not None else even_cuts(parameter_counts(stages), parts)
    bounds = [0, *cuts, len(stages)]
    return [range(a, b) for a, b in zip(bounds, bounds[1:])]


def check_parts(cfg, layout, stages: list[nn.Module] | None, parts: int | None = None,
                per_rank: int = 1, rank_of=None) -> None:
    """parallel=model/pipeline: the model has stages enough for `parts` (the layout's world
    size) parts, `per_rank` of them on each rank (a pipeline's stages_per_rank; `rank_of`:
    the rank holding each part), and parallel.split (if set) cuts them into that many; under
    parallel=model no parameter is shared by parts on different devices. ConfigError
    otherwise."""
    p = cfg.parallel
    parts = parts or layout.world_size
    if stages is None:
        raise ConfigError(f"parallel={p.name} cuts the model into parts at its stages, and "
                          "this model declares none: set parallel.stages to its submodules in "
                          "forward order (e.g. parallel.stages='[embed,\"blocks.*\",head]'), "
                          "give it a stages() method, or use parallel=ddp, fsdp, tp or "
                          "fsdp_tp, which need no cut")
    ranks = parts // per_rank
    said = _said(layout, ranks)
    making = f"{said} x parallel.stages_per_rank={per_rank}" if per_rank > 1 else said
    if ranks < 2:
        unit = "devices" if p.name == "model" else "ranks"  # (a V's 2 parts on 1 rank: no)
        raise ConfigError(f"{said}: parallel={p.name} needs at least 2 {unit}, each holding "
                          "its parts; use parallel=none (or ddp) for one")
    if parts > len(stages):
        if per_rank > 1:
            raise ConfigError(f"{making} is {parts} parts, more than the {len(stages)} stages "
                              f"of the model: make pp x stages_per_rank at most {len(stages)}")
        raise ConfigError(f"{said} is {parts} parts, more than the {len(stages)} stages of the "
                          f"model: make it at most {len(stages)} parts")
    if p.split is not None:
        problem = check_cuts(list(p.split), len(stages), parts, making)
        if problem:
            raise ConfigError(problem)
    # a pipeline's ranks each keep a copy of a parameter shared across them, their
    # gradients summed (parallel/tied.py); one process's devices cannot share one
    shared = None if rank_of else shared_across(stages, part_ranges(stages, parts, p.split))
    if shared:
        raise ConfigError(f"parallel={p.name} puts stages {shared[0]} and {shared[1]} on "
                          "different devices, but they share a parameter (tied weights, such "
                          "as model.tie_embeddings=true): untie them, or use parallel=pipeline "
                          "(its ranks keep a copy each), ddp or fsdp")


def _said(layout, parts: int) -> str:
    """The key that sets the number of parts: parallel.pp, where it is not the world size."""
    others = [f"parallel.{k}={getattr(layout, k)}" for k in ("dp_replicate", "dp_shard", "tp")
              if getattr(layout, k) > 1]
    if parts != layout.world_size and others:
        return (f"parallel.pp={parts} (parallel.world_size={layout.world_size} over "
                f"{' x '.join(others)})")
    return f"parallel.world_size={layout.world_size}"


def shared_across(stages: list[nn.Module], parts: list[range], rank_of=None
                  ) -> tuple[int, int] | None:
    """Two stage indices held by different ranks (`rank_of`: each part's; one part a rank
    where None) that hold the same parameter, or None."""
    rank_of = rank_of or (lambda part: part)
    rank = {index: rank_of(part) for part, indices in enumerate(parts) for index in indices}
    for held in stages_of.holders(stages).values():
        for index in held[1:]:
            if rank[index] != rank[held[0]]:
                return held[0], index
    return None


def keep_only(model: nn.Module, stages: list[nn.Module], keep,
              names: dict[int, str] | None = None) -> None:
    """Hold only the model's stages whose index is in `keep`, the modules of the others
    nn.Identity, names unchanged. `names` (each module's name by id, read from the whole
    model): to cut it again, a stage cut before coming back where it is kept."""
    names = names or {id(module): name for name, module in model.named_modules()}
    for index, stage in enumerate(stages):
        for module in stages_of.held(stage, names):
            parent, _, child = names[id(module)].rpartition(".")
            model.get_submodule(parent).register_module(
                child, module if index in keep else nn.Identity())


class Cut:
    """A pipeline's cut of `model` (whole, when made): its chain of stages in pp x v parts
    (the layout's; parallel.split's cut, or even), and the parts the pipeline's rank `rank`
    holds (where the schedule places them: schedules.stages_of_rank)."""

    def __init__(self, model: nn.Module, p, layout, rank: int):
        pp, v = layout.pp, layout.stages_per_rank
        self.stages = stages_of.chain(model, p.stages)
        self.names = {id(module): name for name, module in model.named_modules()}
        self.ranges = part_ranges(self.stages, pp * v, p.split)
        self.held = schedules.stages_of_rank(p.schedule, pp, v, rank)

    def keep(self, model: nn.Module, parts: list[int] | None = None) -> None:
        """Keep the stages of `parts` (the rank's where None), the others nn.Identity."""
        held = self.held if parts is None else parts
        keep_only(model, self.stages, {i for k in held for i in self.ranges[k]}, self.names)

    def parts(self, model: nn.Module) -> list[stages_of.Part]:
        """The Parts the rank holds, of its stages as `model` holds them now (wrapped by
        activation checkpointing since the cut, where it is on)."""
        stages = stages_of.refreshed(model, self.stages, self.names)
        return [stages_of.Part([stages[i] for i in self.ranges[k]], k == 0) for k in self.held]

    @torch.no_grad()
    def inputs(self, inputs: Any) -> list[tuple[tuple, dict]]:
        """The positional and keyword arguments each held part gets for `inputs` (the
        model's, for a micro-batch), by the parts before it, run here on the whole model."""
        kwargs = dict(inputs) if isinstance(inputs, Mapping) else {}
        args, received = (() if kwargs else (inputs,)), []
        for k in range(max(self.held) + 1):
            if k in self.held:
                received.append((args, kwargs))
            part = stages_of.Part([self.stages[i] for i in self.ranges[k]], k == 0)
            args = (part(*args, **kwargs),)
        return received


def refuse_shared_parts(layout, stages: list[nn.Module], ranges: list[range], rank_of
                        ) -> None:
    """FSDP2 shards each Part as a root of its own, and a parameter in one root only: two
    parts of one rank (`rank_of`: each part's) may not share one (a V's first and last,
    tied embeddings). Parts on different ranks keep a copy each (parallel/tied.py)."""
    part = {index: k for k, indices in enumerate(ranges) for index in indices}
    for held in stages_of.holders(stages).values():
        for a, b in itertools.combinations(held, 2):
            if part[a] != part[b] and rank_of(part[a]) == rank_of(part[b]):
                raise ConfigError(
                    f"parallel.dp_shard={layout.dp_shard} shards each of a rank's parts apart, "
                    f"but stages {a} and {b}, both on pipeline rank {rank_of(part[a])}, share "
                    "a parameter (tied weights): untie them, use parallel.dp_shard=1, or a "
                    "schedule that puts them on different ranks (interleaved_1f1b)")
