"""Ops run for real on this machine (cluster=this): each traced op alone, from its shapes
(Timer), and how much longer ops take inside a training step than alone (in_step).

An op run alone, again and again on the same tensors, finds them in the caches; inside a
step each op reads what an op a while before wrote, and the ranks of a job sharing the
cores compete for the caches and the memory. A small gpt's step (two blocks of width 128,
8 sequences of 64 tokens: the models a CPU trains) is recorded op by op and its ops timed
alone, then the step timed whole: their ratio, beyond each op's own time in a step
(this_machine.op_seconds), is what a traced op's time alone is multiplied by, measured for one
process and for each rank count (rank_costs.py).
"""

from __future__ import annotations

import statistics
import time

import torch


def _runs(work, repeats: int) -> list[float]:
    """The seconds of `repeats` runs of `work` after a first (allocation, kernel choice)."""
    work()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        work()
        times.append(time.perf_counter() - start)
    return times


def median_time(work, repeats: int) -> float:
    """The median of `repeats` runs after a first (a step waits as often as its ranks do,
    not only when they are lucky); where ranks time collectives, each runs the same count,
    so that they meet."""
    return statistics.median(_runs(work, repeats))


def ops_in(step, counted=lambda func, args: True) -> int:
    """The ops a dispatch mode sees `step` run (views among them) for which
    `counted(func, its flattened arguments)`."""
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_flatten

    class Count(TorchDispatchMode):
        ops = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if counted(func, tree_flatten((args, kwargs))[0]):
                Count.ops += 1
            return func(*args, **(kwargs or {}))

    with Count():
        step()
    return Count.ops


def fastest(work, repeats: int = 5) -> float:
    """The least of `repeats` runs after a first: a shared machine only ever slows one."""
    return min(_runs(work, repeats))


class Timer:
    """Each distinct op of a trace (ops.Op.replay) run for real here, with a rank's
    threads, once: its fastest run, times `slower` (in_step's ratio for the job's ranks).
    None for an op that cannot be run from its shapes alone."""

    def __init__(self, threads: int, slower: float = 1.0,
                 known: dict[str, float | None] | None = None):
        self.threads, self.slower = threads, slower
        self.known = {} if known is None else known  # shared by timers of one thread count

    def __call__(self, op) -> float | None:
        if op.replay is None:
            return None
        key = repr(op.replay)
        if key not in self.known:
            self.known[key] = self._time(*op.replay)
        found = self.known[key]
        return None if found is None else found * self.slower

    def _time(self, func, args, kwargs) -> float | None:
        from torch.utils._pytree import tree_map

        from parallab.simulate.ops import Spec

        def made(value):
            if not isinstance(value, Spec):
                return value
            size = 1 + sum((n - 1) * st for n, st in zip(value.shape, value.stride) if n)
            data = torch.randn(size).to(value.dtype) if value.dtype.is_floating_point else \
                torch.zeros(size, dtype=value.dtype)  # valid indices, no mask
            return data.as_strided(value.shape, value.stride)

        before = torch.get_num_threads()
        torch.set_num_threads(self.threads)
        try:
            real_args, real_kwargs = tree_map(made, args), tree_map(made, kwargs)
            with torch.no_grad():
                once = fastest(lambda: func(*real_args, **real_kwargs), 1)
                runs = max(1, min(50, int(2e-3 / max(once, 1e-7))))  # 2 ms of them at least
                return fastest(lambda: [func(*real_args, **real_kwargs) for _ in range(runs)],
                              2) / runs
        except Exception:  # noqa: BLE001 - an op its shapes alone cannot make again
            return None
        finally:
            torch.set_num_threads(before)


def reference_step():
    """A small gpt's training step (the module docstring's) and the replays of its ops as
    the trace records them (ops.Op.replay)."""
    from torch.nn import functional as F
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_map

    from parallab.models.gpt import GPT
    from parallab.simulate.ops import Op, _spec, moves_data

    model = GPT(vocab_size=256, context=64, layers=2, heads=4, width=128, dropout=0.0)
    tokens = torch.randint(0, 256, (8, 65))

    def step() -> None:
        logits = model(tokens[:, :-1])
        F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten()).backward()

    recorded: list[Op] = []

    class Record(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            if moves_data(func):
                recorded.append(Op("", "", "", 0.0, (), (), replay=(
                    func, tree_map(_spec, args), tree_map(_spec, kwargs))))
            return func(*args, **kwargs)

    with Record():
        step()
    return step, recorded


def in_step(threads: int, op_s: float, together=None) -> float:
    """How many times longer the reference step's ops take inside it than alone (at least
    1): its median step, less each op's own time in a step (`op_s`), over its ops timed
    alone with `threads`. `together(step)`: the step's median as the job's ranks run it
    all at once (rank_costs.py), where the ops alone are timed while the others wait."""
    step, recorded = reference_step()
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        alone = sum(Timer(threads)(op) or 0.0 for op in recorded)
        whole = together(step) if together is not None else median_time(step, 10)
    finally:
        torch.set_num_threads(before)
    return max(1.0, (whole - len(recorded) * op_s) / max(alone, 1e-9))
