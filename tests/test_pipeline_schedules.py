"""The pipeline's schedules (torch.distributed.pipelining's): their idle share and held
activations as torch orders them, the stages they place on each rank, the micro-batch
counts they take."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from parallab.parallel import schedules
from parallab.parallel.schedules import SCHEDULES, activations_held, bubble

MULTI = [name for name, s in SCHEDULES.items() if s.multi]


def built(name: str, pp: int, v: int, m: int):
    """torch's schedule `name` of pp x v stages over m micro-batches, as built on any rank
    (its order is every rank's), its stages stand-ins: no process group is needed."""
    import torch.distributed.pipelining as pipelining

    stage = lambda: SimpleNamespace(group_rank=0, group_size=pp, num_stages=pp * v,  # noqa: E731
                                    submod=None)
    return getattr(pipelining, SCHEDULES[name].torch_class)(
        [stage() for _ in range(v)] if SCHEDULES[name].multi else stage(), m)


def timeline(name: str, pp: int, v: int, m: int) -> tuple[float, list[float]]:
    """torch's own order of the schedule on each rank, run with a forward, an input- and
    a weight-gradient each one unit (a full backward two), every action as soon as its rank
    is free and its inputs are there: the step's length over the busiest rank's work, and
    each rank's most micro-batches in flight (from a stage's forward to its backward's end,
    in units of the rank's v stages)."""
    from torch.distributed.pipelining.schedules import _ComputationType as C

    kind = {C.FORWARD: "F", C.FULL_BACKWARD: "B", C.BACKWARD_INPUT: "B",
            C.BACKWARD_WEIGHT: "W"}
    cost = {C.FORWARD: 1, C.FULL_BACKWARD: 2, C.BACKWARD_INPUT: 1, C.BACKWARD_WEIGHT: 1}
    ops = [[a for action in rank if action is not None
            for a in (action.sub_actions or [action])]
           for rank in built(name, pp, v, m).pipeline_order.values()]
    last, done, free, at = pp * v - 1, {}, [0] * pp, [0] * pp

    def needs(a) -> list:
        s, i = a.stage_index, a.microbatch_index
        if kind[a.computation_type] == "F":
            return [(s - 1, "F", i)] if s else []
        if kind[a.computation_type] == "W":
            return [(s, "B", i)]
        return [(s, "F", i)] + ([(s + 1, "B", i)] if s < last else [])

    while any(at[r] < len(ops[r]) for r in range(pp)):
        moved = False
        for r in range(pp):
            while at[r] < len(ops[r]) and all(d in done for d in needs(ops[r][at[r]])):
                a = ops[r][at[r]]
                free[r] = max([free[r]] + [done[d] for d in needs(a)]) + cost[a.computation_type]
                done[(a.stage_index, kind[a.computation_type], a.microbatch_index)] = free[r]
                at[r], moved = at[r] + 1, True
        assert moved, "torch's order deadlocks"
    held = []
    for rank in ops:
        flight = [0]
        for a in rank:
            step = {"F": 1, "W": -1}.get(kind[a.computation_type], 0)
            if a.computation_type == C.FULL_BACKWARD:
                step = -1
            flight.append(flight[-1] + step)
        held.append(max(flight) / v)
    return max(free) / (3 * v * m), held


GRID = [(name, pp, v, m) for name in MULTI for pp in (2, 3, 4)
        for v in ([2] if SCHEDULES[name].v_shape else [2, 3]) for m in range(1, 3 * pp + 1)
        if not schedules.microbatches_problem(name, pp, v, m)]


def test_each_schedules_idle_share_and_held_activations_are_torchs_own():
    """bubble() and activations_held() in closed form equal what torch's orders give, for
    every schedule of several stages per rank at the micro-batch counts each takes (fewer
    than pp too, where torch adds bubbles); gpipe's and 1f1b's are the textbook's."""
    for name, pp, v, m in GRID:
        ratio, held = timeline(name, pp, v, m)
        assert bubble(name, pp, v, m) == pytest.approx(ratio), (name, pp, v, m)
        assert [activations_held(name, pp, v, m, r) for r in range(pp)] == \
            pytest.approx(held), (name, pp, v, m)
        assert activations_held(name, pp, v, m) == max(held)
    assert bubble("interleaved_1f1b", 4, 2, 8) == 1 + 3 / 16  # (p - 1) / (v m)
    assert bubble("interleaved_zb", 4, 2, 8) == 1 + 3 / 48  # a third of that
    for name in ("gpipe", "1f1b"):
        assert bubble(name, 4, 1, 8) == 1 + 3 / 8
    assert activations_held("gpipe", 4, 1, 8) == 8
    assert [activations_held("1f1b", 4, 1, 8, r) for r in range(4)] == [4, 3, 2, 1]


def test_stages_are_placed_and_microbatches_taken_as_torch_does():
    from torch.distributed.pipelining._utils import generate_stage_to_rank_mapping

    for pp, v in ((2, 2), (4, 2), (3, 3)):
        for name, style in (("interleaved_1f1b", "loop"), ("zbv", "v")):
            if SCHEDULES[name].v_shape and v != 2:
                continue
            placed = generate_stage_to_rank_mapping(pp, pp * v, style)
            assert {s: r for r in range(pp)
                    for s in schedules.stages_of_rank(name, pp, v, r)} == placed
    for name, s in SCHEDULES.items():
        for pp in (2, 4):
            v = schedules.stages_per_rank(name, None)
            for m in range(1, 3 * pp + 2):
                try:
                    built(name, pp, v, m)
                    takes = True
                except ValueError:
                    takes = False
                assert takes == (schedules.microbatches_problem(name, pp, v, m) is None), \
                    (name, pp, m)
