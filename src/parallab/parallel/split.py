"""Where a model's stages are cut into parts (parallel.split), for model and pipeline parallelism."""

from __future__ import annotations

from torch import nn

from parallab.config.errors import ConfigError
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


def check_cuts(cuts: list[int], stages: int, parts: int) -> str | None:
    """None if `cuts` (parallel.split) cuts `stages` into `parts` non-empty parts."""
    if len(cuts) != parts - 1:
        return (f"parallel.split={cuts} gives {len(cuts) + 1} parts but parallel.world_size="
                f"{parts}: give {parts - 1} stage indices, or null to split evenly")
    if cuts != sorted(set(cuts)) or cuts[0] < 1 or cuts[-1] > stages - 1:
        return (f"parallel.split={cuts} must be increasing stage indices between 1 and "
                f"{stages - 1} (the model has {stages} stages), or null to split evenly")
    return None


def part_ranges(stages: list[nn.Module], parts: int, cuts: list[int] | None) -> list[range]:
    """The stage indices of each part."""
    cuts = cuts if cuts is not None else even_cuts(parameter_counts(stages), parts)
    bounds = [0, *cuts, len(stages)]
    return [range(a, b) for a, b in zip(bounds, bounds[1:])]


def check_parts(cfg, stages: list[nn.Module] | None, parts: int | None = None) -> None:
    """parallel=model/pipeline: the model has stages enough for `parts` (parallel.world_size)
    parts, and parallel.split (if set) cuts them into that many. ConfigError otherwise."""
    p = cfg.parallel
    parts = parts or p.world_size
    if stages is None:
        raise ConfigError(f"parallel={p.name} cuts the model into parts at its stages, and "
                          "this model declares none: set parallel.stages to its submodules in "
                          "forward order (e.g. parallel.stages='[embed,\"blocks.*\",head]'), "
                          "give it a stages() method, or use parallel=ddp, fsdp, tp or "
                          "fsdp_tp, which need no cut")
    # the key that sets the number of parts: parallel.pp, where it is not the world size
    others = [f"parallel.{k}={getattr(p, k)}" for k in ("dp_replicate", "dp_shard", "tp")
              if (getattr(p, k, None) or 1) > 1]
    said = (f"parallel.pp={parts} (parallel.world_size={p.world_size} over "
            f"{' x '.join(others)})" if parts != p.world_size and others
            else f"parallel.world_size={p.world_size}")
    if parts < 2:
        raise ConfigError(f"{said}: parallel={p.name} needs at least 2 parts; use "
                          "parallel=none (or ddp) for one")
    if parts > len(stages):
        raise ConfigError(f"{said} is {parts} parts, more than the {len(stages)} stages of the "
                          f"model: make it at most {len(stages)} parts")
    if p.split is not None:
        problem = check_cuts(list(p.split), len(stages), parts)
        if problem:
            raise ConfigError(problem)
    shared = shared_across(stages, part_ranges(stages, parts, p.split))
    if shared:
        raise ConfigError(f"parallel={p.name} puts stages {shared[0]} and {shared[1]} on "
                          "different parts, but they share a parameter (tied weights, such as "
                          "model.tie_embeddings=true): untie them, or use parallel=ddp or fsdp")


def shared_across(stages: list[nn.Module], parts: list[range]) -> tuple[int, int] | None:
    """Two stage indices in different parts that hold the same parameter, or None."""
    part_of = {index: part for part, indices in enumerate(parts) for index in indices}
    for held in stages_of.holders(stages).values():
        for index in held[1:]:
            if part_of[index] != part_of[held[0]]:
                return held[0], index
    return None
