"""Step time here, from the parts a launched job measured (the replay's check of each
candidate beside the simulation of it: parallab simulate's model, simulate/).

validate() predicts each candidate's step at its launched world size from the parts its
job measured (advise/parts.py): its compute share (its layout's own work over a one-rank
group; a pipeline's through its schedule, where ranks that share cores lend them in the
bubble), what its collectives and sends add to a replay of its step, and the loop's own
time between steps, timed in the run.
"""

from __future__ import annotations

from typing import Any, Callable


def pipeline_s(together_s: list[float], alone_s: list[float], ranks: int, micro: int,
               rate: Callable[[int], float], bubble: float | None = None) -> float:
    """A pipeline's compute from each rank's step (one per pipeline rank, each held by
    ranks / pp ranks), measured with every rank computing (`together_s`) and each rank
    alone (`alone_s`), replayed as its schedule runs them: each rank busy for `micro` slots
    (a slot: its work on one micro-batch), the ranks starting one after another so that
    each idles (bubble - 1) x micro slots in all (`bubble`: the schedule's,
    schedules.bubble; None: GPipe's and 1F1B's, pp - 1 slots). A stretch where every rank
    computes takes what they took together (ranks sharing cores, memory and caches); one
    the bubble leaves part-empty, their time alone at the speed `rate(busy ranks)` leaves
    a rank. With a device per rank, rate is 1 and this is about bubble x the slowest rank's
    step; where ranks share cores, a rank idle in the bubble lends its core to the busy
    ones."""
    pp = len(together_s)
    lag = 1.0 if bubble is None else (bubble - 1) * micro / (pp - 1)  # slots between starts
    edges = sorted({k * lag for k in range(pp)} | {k * lag + micro for k in range(pp)})
    total = 0.0
    for start, end in zip(edges, edges[1:]):
        busy = [k for k in range(pp) if k * lag <= start + 1e-9 < k * lag + micro]
        if len(busy) == pp:
            total += (end - start) * max(together_s) / micro
        elif busy:
            total += (end - start) * max(alone_s[k] for k in busy) / micro / \
                rate(ranks // pp * len(busy))
    return total


def cpu_rate(cores: int | None, threads: int) -> Callable[[int], float]:
    """The share of its own speed a rank of `threads` threads runs at while `busy` ranks
    compute on `cores` cores (None: a device per rank, always 1)."""
    return lambda busy: 1.0 if cores is None else min(1.0, cores / (busy * threads))


def validate(figures: dict[str, Any], cfg, layout, link, one_rank_step_s: float | None,
             devices: int) -> float | None:
    """This machine's step time at the candidate's world size n, from what its launched job
    measured (`link`: its cores and threads per rank; the figures: its compute share
    `share_s`, a pipeline's by part, together and alone `share_alone_s`; what its
    collectives and sends added to a replay of its step, `collectives_s`; the run's own
    `loop_time_ms`). A layout with a process per rank: its share (a pipeline's parts
    through its schedule, pipeline_s), what its collectives add, and the loop's own time
    between steps (its batch loaded, its loss logged: the meter's figure, timed in the
    run); one process driving n devices: world size 1's step shared by min(n, devices)
    devices (CPU ranks share one set of cores), and its bubble (None where that step was
    not measured)."""
    n = layout.world_size
    share = figures.get("share_s")
    if share is None or not layout.processes:
        return one_rank_step_s and one_rank_step_s / min(n, devices) * layout.bubble
    if layout.cuts_model:
        share = pipeline_s(share, figures.get("share_alone_s") or share, n,
                           cfg.parallel.microbatches, cpu_rate(link.cores, link.threads),
                           layout.bubble)
    return share + (figures.get("collectives_s") or 0.0) + \
        (figures.get("loop_time_ms") or 0.0) / 1e3
