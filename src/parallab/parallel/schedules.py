"""The pipeline's schedules as torch.distributed.pipelining runs them, in numbers: where each
puts its stages, which micro-batch counts it takes, how long its ranks idle and how many
micro-batches' activations a rank holds at once. Pure: no torch, so that a model of a
cluster can weigh the schedules without building one.

A pipeline of `pp` ranks runs pp x v stages (v = parallel.stages_per_rank): one per rank
for gpipe and 1f1b, v round-robin per rank for the interleaved ones (rank r holds stages r,
r + pp, ...), two in a V for zbv and dualpipev (rank r holds r and 2pp - 1 - r, so the
first rank holds the first and the last stage).

The counts are torch's own: each schedule's order of forward (F), backward (B, or its
input-gradient half I and weight-gradient half W for the zero-bubble ones) per stage and
micro-batch, timed with F = I = W (a stage's full backward twice its forward, the zero
bubble papers' unit), checked against torch's orders in tests/test_pipeline_schedules.py.
"""

from __future__ import annotations

from dataclasses import dataclass

from parallab.config.errors import ConfigError


@dataclass(frozen=True)
class Schedule:
    name: str
    torch_class: str  # in torch.distributed.pipelining
    stages_per_rank: int | None  # what it must have (None: any v >= 2, default 2)
    v_shape: bool = False  # stages placed in a V, else round-robin
    splits_backward: bool = False  # runs I and W apart (zero bubble): not compiled

    @property
    def multi(self) -> bool:
        """Several stages per rank (a multi-stage torch schedule)."""
        return self.stages_per_rank != 1


SCHEDULES = {s.name: s for s in (
    Schedule("gpipe", "ScheduleGPipe", 1),
    Schedule("1f1b", "Schedule1F1B", 1),
    Schedule("interleaved_1f1b", "ScheduleInterleaved1F1B", None),
    Schedule("looped_bfs", "ScheduleLoopedBFS", None),
    Schedule("interleaved_zb", "ScheduleInterleavedZeroBubble", None, splits_backward=True),
    Schedule("zbv", "ScheduleZBVZeroBubble", 2, v_shape=True, splits_backward=True),
    Schedule("dualpipev", "ScheduleDualPipeV", 2, v_shape=True, splits_backward=True),
)}


def split_backward_clash(schedule: str, checkpointing: str, compile: bool) -> str | None:
    """What of a run a zero-bubble schedule cannot take: it runs each backward as an input-
    and a weight-gradient half, which torch does not do through a compiled stage
    ("compile"), nor through one checkpointed selectively (a `checkpointing` mode with a
    checkpoint policy, activations.CONTEXTS), which it recomputes for one backward only
    ("checkpointing"); None where nothing clashes."""
    from parallab.parallel.activations import CONTEXTS  # (torch's: imported when asked)

    if not SCHEDULES[schedule].splits_backward:
        return None
    if compile:
        return "compile"
    return "checkpointing" if checkpointing in CONTEXTS else None


def stages_per_rank(schedule: str, given: int | None) -> int:
    """v: `given` (parallel.stages_per_rank), or what the schedule needs where null."""
    if given is not None:
        return given
    known = SCHEDULES.get(schedule)  # (an unknown name is the checks' to refuse)
    return (known.stages_per_rank or 2) if known else 1


def stages_of_rank(schedule: str, pp: int, v: int, rank: int) -> list[int]:
    """The stage indices (of pp x v) the pipeline's `rank` holds, in the model's order."""
    if SCHEDULES[schedule].v_shape:
        return [rank, 2 * pp - 1 - rank]
    return [rank + k * pp for k in range(v)]


def _rounds(pp: int, microbatches: int) -> int:
    """torch's interleaved schedules run their micro-batches in rounds of about pp."""
    return max(1, microbatches // pp)


def microbatches_problem(schedule: str, pp: int, v: int, microbatches: int) -> str | None:
    """What torch's schedule refuses of this micro-batch count (None: it takes it), as the
    rule it breaks; its own ValueError would come only on a rank, after launch."""
    m = microbatches
    if m < 1:
        return "it must be >= 1"
    if schedule == "1f1b" and m < pp:
        return f"1F1B needs at least as many micro-batches as stages ({pp})"
    if schedule == "dualpipev" and m < pp * v:
        return f"DualPipeV needs at least as many micro-batches as stages ({pp * v})"
    if schedule in ("interleaved_1f1b", "interleaved_zb") and m % _rounds(pp, m):
        return (f"{schedule} runs them in max(1, microbatches // pp) = {_rounds(pp, m)} "
                f"rounds, so it needs a multiple of {_rounds(pp, m)}")
    return None


def bubble(schedule: str, pp: int, stages_per_rank: int, microbatches: int) -> float:
    """A step's compute time relative to the same work without idle ranks, 1 + idle / busy
    of the busiest rank: (pp - 1) / m for gpipe and 1f1b, (pp - 1) / (v m) interleaved (with
    a further wait between a rank's stages where m < pp), a third of that zero-bubble (W
    fills the rest), and zbv's and dualpipev's own counts."""
    p, v, m = pp, stages_per_rank, microbatches
    short = max(0, p - m)  # ranks the first micro-batch's wave leaves idle at each turn
    if schedule in ("gpipe", "1f1b"):
        idle = 3 * (p - 1)  # in units of a stage's forward: F + B = 3 per micro-batch
    elif schedule in ("interleaved_1f1b", "looped_bfs"):
        idle = 3 * ((p - 1) + (v - 1) * short)
    elif schedule == "interleaved_zb":  # torch's ZB1P, with its bubbles added where m < pp
        idle = (p - 1) + v * short + (2 * v - 2) * max(0.0, p / 2 - m)
    elif schedule == "zbv":
        idle = max(p - 1, 2 * (2 * p - 1 - m))
    elif schedule == "dualpipev":
        idle = p - 1
    else:
        raise ValueError(f"unknown schedule {schedule}")
    return 1 + idle / (3 * v * m)


def activations_held(schedule: str, pp: int, stages_per_rank: int, microbatches: int,
                     rank: int | None = None) -> float:
    """How many micro-batches' activations (of all the stages a rank holds) the pipeline's
    `rank` keeps at once, from a stage's forward of a micro-batch to its backward's end
    (its W for the zero-bubble ones); None: the most loaded rank's."""
    p, v, m = pp, stages_per_rank, microbatches
    if rank is None:
        return max(activations_held(schedule, p, v, m, r) for r in range(p))
    per_round = m // _rounds(p, m)
    if schedule in ("gpipe", "looped_bfs"):  # every forward before any backward
        return float(m)
    if schedule == "1f1b":
        return float(min(p - rank, m))
    if schedule == "interleaved_1f1b":  # its warm-up forwards, then one more
        return min(m * v, (v - 1) * per_round + 2 * (p - 1 - rank) + 1) / v
    if schedule == "interleaved_zb":  # W deferred: every rank as loaded as the first
        return min(m * v, (v - 1) * per_round + p) / v
    if schedule == "zbv":
        return min(2 * m, m + 1 + rank, 2 * p) / 2
    if schedule == "dualpipev":
        return (2 * p + 1) / 2
    raise ValueError(f"unknown schedule {schedule}")


def rank_of(schedule: str, pp: int, v: int, part: int) -> int:
    """The pipeline rank holding `part` under `schedule` (pp ranks, v parts each)."""
    return next(r for r in range(pp) if part in stages_of_rank(schedule, pp, v, r))


def check(p) -> None:
    """parallel.schedule is torch's, and parallel.stages_per_rank what it can take."""
    if p.schedule not in SCHEDULES:
        raise ConfigError(f"parallel.schedule={p.schedule} is unknown: use one of "
                          f"{', '.join(SCHEDULES)}")
    need, v = SCHEDULES[p.schedule].stages_per_rank, p.stages_per_rank
    several = [name for name, s in SCHEDULES.items() if s.multi]
    if v is None or v == need:
        return
    if need == 1:
        raise ConfigError(f"parallel.stages_per_rank={v} with parallel.schedule={p.schedule}, "
                          "which runs one stage per rank: drop it (null), or use a schedule "
                          f"of several stages per rank ({', '.join(several)})")
    if need is not None:
        raise ConfigError(f"parallel.stages_per_rank={v} with parallel.schedule={p.schedule}, "
                          f"whose V holds exactly {need} stages per rank: set it to {need} "
                          "(or null)")
    if v < 2:
        raise ConfigError(f"parallel.stages_per_rank={v} with parallel.schedule={p.schedule}, "
                          "which interleaves several stages per rank: set 2 or more (null: 2), "
                          "or use parallel.schedule=1f1b")


def check_microbatches(cfg, layout) -> None:
    """parallel.microbatches: as torch's schedule takes them over the layout's pipeline, and
    data.batch_size cut into that many equal micro-batches."""
    p, d = cfg.parallel, cfg.data
    pp, v = layout.pp, layout.stages_per_rank
    problem = microbatches_problem(p.schedule, pp, v, p.microbatches)
    if problem:
        fits = [m for m in range(1, 4 * pp * v + 1)
                if not microbatches_problem(p.schedule, pp, v, m)]
        near = sorted(fits, key=lambda m: (abs(m - p.microbatches), m))[:2]
        raise ConfigError(f"parallel.microbatches={p.microbatches} does not suit "
                          f"parallel.schedule={p.schedule} at parallel.pp={pp}: {problem}; use "
                          f"parallel.microbatches={' or '.join(map(str, sorted(near)))}")
    if d.batch_size % p.microbatches:
        # the key the user set: a global batch is per rank x the rest
        unit = p.microbatches * (d.global_batch_size // d.batch_size
                                 if d.global_batch_size else 1)
        raise ConfigError(f"{d.batch_said()} does not split into "
                          f"parallel.microbatches={p.microbatches} equal micro-batches: "
                          f"use a multiple of {unit}")
