"""The pipeline's schedules as torch.distributed.pipelining runs them, in numbers: where each
puts its stages, which micro-batch counts it takes, how long its ranks idle and how many
micro-batches' activations a rank holds at once. Pure: no torch, so that a model of a
cluster can weigh the schedules without building one.

Its words are torch's: a stage here is a pipeline's part (torch's PipelineStage), not one
of the model's stages (docs/architecture.md's glossary).

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
    """A schedule as parallab knows it: its torch class and stages per rank, and in numbers
    its rules on micro-batches, its idle time and the activations its ranks hold (each
    schedule below gives its own; adding one is a class and a line in SCHEDULES)."""

    name: str
    torch_class: str  # in torch.distributed.pipelining
    stages_per_rank: int | None  # what it must have (None: any v >= 2, default 2)
    v_shape: bool = False  # stages placed in a V, else round-robin
    splits_backward: bool = False  # runs I and W apart (zero bubble): not compiled

    @property
    def multi(self) -> bool:
        """Several stages per rank (a multi-stage torch schedule)."""
        return self.stages_per_rank != 1

    def stages_of_rank(self, pp: int, v: int, rank: int) -> list[int]:
        if self.v_shape:
            return [rank, 2 * pp - 1 - rank]
        return [rank + k * pp for k in range(v)]

    def microbatches_rule(self, p: int, v: int, m: int) -> str | None:
        """The rule of its own a count m >= 1 breaks (None: it takes it)."""
        return None

    def idle(self, p: int, v: int, m: int) -> float:
        """The busiest rank's idle time, in units of a stage's forward (F = I = W)."""
        return 3 * (p - 1)  # F + B = 3 a micro-batch: (p - 1) slots waiting, each end

    def held(self, p: int, v: int, m: int, rank: int) -> float:
        """Micro-batches' activations (of all its stages) `rank` keeps at once."""
        return float(m)  # every forward before any backward

    def settled(self, p: int, v: int, m: int) -> list[float] | None:
        """For each stage of the first rank (the last to finish), in the model's order, the
        time from its last backward to the end of the step, in a stage's backwards (F = 1,
        B = 2): how long its replicas' gradient average runs beside the rest
        (parallel/replicas.py). None where the weight gradients are added by hand (the
        zero-bubble schedules' W), so that the average waits for the flush."""
        return None if self.splits_backward else [0.0] * v


class _OneFOneB(Schedule):
    def microbatches_rule(self, p, v, m):
        return f"1F1B needs at least as many micro-batches as stages ({p})" if m < p else None

    def held(self, p, v, m, rank):
        return float(min(p - rank, m))


class _Rounds(Schedule):
    """torch's interleaved schedules, which run their micro-batches in rounds of about pp."""

    def microbatches_rule(self, p, v, m):
        rounds = _rounds(p, m)
        if m % rounds:
            return (f"{self.name} runs them in max(1, microbatches // pp) = {rounds} "
                    f"rounds, so it needs a multiple of {rounds}")
        return None


class _Interleaved1F1B(_Rounds):
    def idle(self, p, v, m):
        return 3 * ((p - 1) + (v - 1) * max(0, p - m))  # a wait between stages where m < p

    def held(self, p, v, m, rank):  # its warm-up forwards, then one more
        return min(m * v, (v - 1) * (m // _rounds(p, m)) + 2 * (p - 1 - rank) + 1) / v

    def settled(self, p, v, m):  # the last round's backwards, a round's (>= p) a stage
        return [float(k * max(p, m // _rounds(p, m))) for k in range(v)]


class _LoopedBFS(Schedule):
    def idle(self, p, v, m):
        return 3 * ((p - 1) + (v - 1) * max(0, p - m))

    def settled(self, p, v, m):  # each stage's backwards all together, the later first
        return [float(k * max(p, m)) for k in range(v)]


class _InterleavedZB(_Rounds):
    def idle(self, p, v, m):  # torch's ZB1P: a third of 1F1B's, its bubbles where m < pp
        return (p - 1) + v * max(0, p - m) + (2 * v - 2) * max(0.0, p / 2 - m)

    def held(self, p, v, m, rank):  # W deferred: every rank as loaded as the first
        return min(m * v, (v - 1) * (m // _rounds(p, m)) + p) / v


class _ZBV(Schedule):
    def idle(self, p, v, m):
        return max(p - 1, 2 * (2 * p - 1 - m))

    def held(self, p, v, m, rank):
        return min(2 * m, m + 1 + rank, 2 * p) / 2


class _DualPipeV(Schedule):
    def microbatches_rule(self, p, v, m):
        if m < p * v:
            return f"DualPipeV needs at least as many micro-batches as stages ({p * v})"
        return None

    def idle(self, p, v, m):
        return p - 1

    def held(self, p, v, m, rank):
        return (2 * p + 1) / 2


SCHEDULES = {s.name: s for s in (
    Schedule("gpipe", "ScheduleGPipe", 1),
    _OneFOneB("1f1b", "Schedule1F1B", 1),
    _Interleaved1F1B("interleaved_1f1b", "ScheduleInterleaved1F1B", None),
    _LoopedBFS("looped_bfs", "ScheduleLoopedBFS", None),
    _InterleavedZB("interleaved_zb", "ScheduleInterleavedZeroBubble", None,
                   splits_backward=True),
    _ZBV("zbv", "ScheduleZBVZeroBubble", 2, v_shape=True, splits_backward=True),
    _DualPipeV("dualpipev", "ScheduleDualPipeV", 2, v_shape=True, splits_backward=True),
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


def refuse_split_backward(cfg) -> None:
    """The zero-bubble schedules run each backward in an input- and a weight-gradient half,
    which torch does not do through a compiled stage, nor through one checkpointed
    selectively (it recomputes such a region for one backward only)."""
    p, t = cfg.parallel, cfg.trainer
    clash = split_backward_clash(p.schedule, t.activation_checkpointing, t.compile)
    if clash == "compile":
        raise ConfigError(f"trainer.compile=true with parallel.schedule={p.schedule}: it "
                          "splits each backward into input and weight halves, which torch "
                          "does not do for compiled stages: set trainer.compile=false, or "
                          "use parallel.schedule=interleaved_1f1b")
    if clash == "checkpointing":
        raise ConfigError(f"trainer.activation_checkpointing={t.activation_checkpointing} with "
                          f"parallel.schedule={p.schedule}: it splits each backward into input "
                          "and weight halves, and torch recomputes a selectively checkpointed "
                          "stage for one backward only: use full (or none), or "
                          "parallel.schedule=interleaved_1f1b")


def stages_per_rank(schedule: str, given: int | None) -> int:
    """v: `given` (parallel.stages_per_rank), or what the schedule needs where null."""
    if given is not None:
        return given
    known = SCHEDULES.get(schedule)  # (an unknown name is the checks' to refuse)
    return (known.stages_per_rank or 2) if known else 1


def stages_of_rank(schedule: str, pp: int, v: int, rank: int) -> list[int]:
    """The stage indices (of pp x v) the pipeline's `rank` holds, in the model's order."""
    return SCHEDULES[schedule].stages_of_rank(pp, v, rank)


def _rounds(pp: int, microbatches: int) -> int:
    """torch's interleaved schedules run their micro-batches in rounds of about pp."""
    return max(1, microbatches // pp)


def microbatches_problem(schedule: str, pp: int, v: int, microbatches: int) -> str | None:
    """What torch's schedule refuses of this micro-batch count (None: it takes it), as the
    rule it breaks; its own ValueError would come only on a rank, after launch."""
    if microbatches < 1:
        return "it must be >= 1"
    return SCHEDULES[schedule].microbatches_rule(pp, v, microbatches)


def bubble(schedule: str, pp: int, stages_per_rank: int, microbatches: int) -> float:
    """A step's compute time relative to the same work without idle ranks, 1 + idle / busy
    of the busiest rank: (pp - 1) / m for gpipe and 1f1b, (pp - 1) / (v m) interleaved (with
    a further wait between a rank's stages where m < pp), a third of that zero-bubble (W
    fills the rest), and zbv's and dualpipev's own counts."""
    v, m = stages_per_rank, microbatches
    return 1 + SCHEDULES[schedule].idle(pp, v, m) / (3 * v * m)


def activations_held(schedule: str, pp: int, stages_per_rank: int, microbatches: int,
                     rank: int | None = None) -> float:
    """How many micro-batches' activations (of all the stages a rank holds) the pipeline's
    `rank` keeps at once, from a stage's forward of a micro-batch to its backward's end
    (its W for the zero-bubble ones); None: the most loaded rank's."""
    ranks = range(pp) if rank is None else [rank]
    return max(SCHEDULES[schedule].held(pp, stages_per_rank, microbatches, r) for r in ranks)


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
        fits = [m for m in range(1, max(4 * pp * v, d.batch_size) + 1)
                if not microbatches_problem(p.schedule, pp, v, m)]
        # those that also cut the batch evenly (the next check's rule); where none does, the
        # nearest the schedule takes, with a batch it cuts (it had named counts that did not)
        splitting = [m for m in fits if d.batch_size % m == 0]
        near = sorted(splitting or fits, key=lambda m: (abs(m - p.microbatches), m))[:2]
        fix = f"parallel.microbatches={' or '.join(map(str, sorted(near)))}" if splitting \
            else (f"parallel.microbatches={near[0]} with a batch per rank it splits (a multiple "
                  f"of {near[0]}; {d.batch_said()} splits into none the schedule takes)")
        raise ConfigError(f"parallel.microbatches={p.microbatches} does not suit "
                          f"parallel.schedule={p.schedule} at parallel.pp={pp}: {problem}; use "
                          f"{fix}")
    if d.batch_size % p.microbatches:
        # the key the user set: a global batch is per rank x the rest
        unit = p.microbatches * (d.global_batch_size // d.batch_size
                                 if d.global_batch_size else 1)
        # or the counts near it that the schedule takes and the batch splits into
        fits = [m for m in range(1, d.batch_size + 1) if d.batch_size % m == 0
                and not microbatches_problem(p.schedule, pp, v, m)]
        near = sorted(sorted(fits, key=lambda m: (abs(m - p.microbatches), m))[:2])
        raise ConfigError(f"{d.batch_said()} does not split into "
                          f"parallel.microbatches={p.microbatches} equal micro-batches: "
                          f"use a multiple of {unit}" + (
                              f", or parallel.microbatches={' or '.join(map(str, near))}"
                              if near else ""))
