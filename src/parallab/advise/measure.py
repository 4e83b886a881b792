"""Measuring candidates, advise's judge (simulate.Predict is the other: parallel/grid.py):
a few optimizer steps each, one after another in one job.

Candidates that share a world size run inside one launched job (or, at world size 1, in
the controlling process): the process group is made once, and each candidate builds its
own model, runtime (its own device mesh and groups), data and optimizer on it, as a
worker of `python train.py` with its settings would (build.build_trainer). Each writes a
TensorBoard run with its hparams into its own dir.
"""

from __future__ import annotations

import contextlib
import logging
import signal
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

import torch

from parallab.advise import parts
from parallab.advise.parts import max_over_ranks
from parallab.config.errors import OneLineError, first_line
from parallab.launching import distributed
from parallab.launching.preemption import Preemption
from parallab.launching.worker import as_started_afresh, leaving_failure, recorded_once
from parallab.observe import hparams, loggers
from parallab.observe.comm import MB
from parallab.observe.loggers import RunLogger
from parallab.observe.memory import reset_peak_memory
from parallab.observe.observer import StepObserver
from parallab.parallel import activations
from parallab.parallel.grid import Candidate
from parallab.training import build, run

log = logging.getLogger(__name__)


class Stopped(OneLineError):
    """A signal (Ctrl-C, SIGTERM) stopped a candidate's run: advise stops, as train does,
    instead of going on to the next candidate; exit status 128 + the signal's number."""

    def __init__(self, signum: int, run_dir: str | Path):
        super().__init__(f"parallab advise stopped by {signal.Signals(signum).name} while "
                         f"measuring {run_dir}: no further candidate is measured")
        self.status = 128 + signum


class LossRecorder(RunLogger):
    """A RunLogger that also keeps every logged train loss, in step order."""

    def __init__(self, run_dir: str | Path, active: bool):
        super().__init__(run_dir, active)
        self.losses: list[float] = []

    def scalars(self, values: dict[str, float], step: int) -> None:
        if "train/loss" in values:
            self.losses.append(float(values["train/loss"]))
        super().scalars(values, step)


class ActivationCounter(StepObserver):
    """Counts, on the trainer's counted step, the bytes one micro-batch keeps for backward:
    the share of its micro-batches' activations a rank holds at once (1F1B: not all). Off in
    a training run: it keeps that step's activations until the step ends."""

    def __init__(self) -> None:
        self.bytes = 0.0

    @contextlib.contextmanager
    def counting(self, trainer, batches: list) -> Iterator[None]:
        with activations.saved_for_backward(trainer.model) as counted:
            yield
            self.bytes = counted.held(trainer.runtime.activation_share) / len(batches)


def normalises_by_batch(model: torch.nn.Module) -> bool:
    """The model has BatchNorm: each forward normalises by its own rows' statistics."""
    return any(isinstance(m, torch.nn.modules.batchnorm._BatchNorm) for m in model.modules())


def measure(spec: run.RunSpec, dist: distributed.Dist) -> dict[str, Any]:
    """Train the candidate `spec` for its trainer.max_steps on the job's group; its figures:
    losses, step time, samples/s, state and activation memory (the largest rank's), comm."""
    cfg, run_dir, overrides = spec.cfg, spec.run_dir, spec.overrides
    logger = LossRecorder(run_dir, active=dist.is_main)
    reset_peak_memory(dist.device)
    try:
        with Preemption() as preemption:
            logger.start(loggers.run_info(cfg, run_dir, overrides, None, dist.world_size,
                                          spec.layout))
            counter = ActivationCounter()
            trainer, lr = build.build_trainer(cfg, spec.layout, dist, logger, None,
                                              preemption, observers=[counter])
            figures = trainer.fit(evaluate=False, report=False)  # the run's own steps
        if trainer.stopped:
            raise Stopped(preemption.signum, run_dir)
        state = max_over_ranks(dist, figures["state_memory_mb"] or 0.0)
        act = max_over_ranks(dist, counter.bytes / MB)
        figures.update(losses=logger.losses, state_mb=state, activation_mb=act,
                       measured_memory_mb=state + act, lr=lr, world_size=dist.world_size,
                       precision_dtype=trainer.precision.dtype_name,
                       peak_memory_mb=max_over_ranks(dist, figures["peak_memory_mb"]))
        if dist.is_main:
            scalars = {k: v for k, v in figures.items() if k != "losses"}
            logger.finish(scalars, hparams.of(spec.cfg, spec.overrides, figures),
                          trainer.step)
        # for the verdict, not the run's record: report.judge says why such a model differs
        return {**figures, "batchnorm": normalises_by_batch(trainer.model)}
    finally:
        logger.close()


def measure_all(jobs: list[run.RunSpec], dist: distributed.Dist) -> list[dict[str, Any]]:
    """Each candidate's run measured in turn; a candidate that fails is recorded with the
    first line of its error and the next one runs."""
    results = []
    for spec in jobs:  # their dirs made by the controller
        try:
            figures = measure(spec, dist)
        except Exception as error:  # noqa: BLE001 - a candidate's failure is its result
            if isinstance(error, Stopped) or distributed.lost_a_peer(error):
                raise  # the user stopped advise, or the job itself is broken
            log.warning("candidate %s failed: %s", spec.run_dir, first_line(error))
            figures = {"error": first_line(error)}
        results.append(figures)
    return results


@dataclass
class Job:
    """The candidates of one world size, for a launched job's workers."""

    jobs: list[run.RunSpec]
    device: str
    backend: str
    timeout_s: float
    threads_per_worker: int | None
    failures: str | None = None  # where a rank leaves its one-line error (Stopped)


def _step_parts(spec: run.RunSpec, dist: distributed.Dist, figures: dict[str, Any],
                groups: dict[int, Any]) -> dict[str, Any]:
    """The candidate's compute share and what its collectives add (advise/parts.py); none
    where they cannot be measured: the candidate ran, only its check here is missing."""
    try:
        share = parts.share_s(spec, dist, groups[1])
        busy = share["share_s"]
        return {**share, "collectives_s": parts.collectives_s(
            dist, figures, max(busy) if isinstance(busy, list) else busy, groups,
            spec.layout.plan.overlapped_kinds(spec.layout))}
    except Exception as error:  # noqa: BLE001 - the check is optional, the run is not
        if distributed.lost_a_peer(error):
            raise
        log.warning("candidate %s: its step's parts not measured: %s", spec.run_dir,
                    first_line(error))
        return {}


def worker(job: Job) -> dict[str, Any]:
    """A launched worker: join the group once, measure every candidate and, right after
    each (the same machine load), the parts of its step for the step-time check (its
    compute share, what its collectives add: advise/parts.py); then the cores its ranks
    share. This machine's collectives themselves are simulate's to measure, once
    (cluster=this: simulate/rank_costs.py), not each job's."""
    import torch.distributed as torch_dist

    as_started_afresh()
    logging.basicConfig(level=logging.WARNING)
    with recorded_once():
        dist = distributed.setup(job.device, job.backend, job.timeout_s,
                                 job.threads_per_worker,
                                 store=distributed.attempt_store(job.timeout_s))
        groups = {dist.world_size: None, 1: torch_dist.new_subgroups(group_size=1)[0]}
        results = []
        with leaving_failure(job.failures):  # a signal: advise ends in one line
            for spec in job.jobs:
                figures = measure_all([spec], dist)[0]
                if "error" not in figures:
                    figures.update(_step_parts(spec, dist, figures, groups))
                results.append(figures)
        threads = torch.get_num_threads()
        distributed.teardown()
    return {"results": results, "threads": threads,
            "cores": distributed.cpu_cores() if dist.device.type == "cpu" else None}


@dataclass
class Link:
    """What a launched job found besides its candidates, for the step-time model."""

    cores: int | None  # the cores its ranks share (None: a device per rank)
    threads: int  # a rank's intra-op threads


@dataclass
class Measure:
    """advise's judge: each candidate left (no reason) run here, one job per world size
    (world size 1: in this process), each launched one with its step's parts
    (advise/parts.py); its figures its run's, a failed one's error its reason. `links`:
    the cores and threads each launched job's ranks had, by world size; `run_dir`: where
    each candidate's run writes (candidates/NN_label)."""

    run_dir: Path
    links: dict[int, Link] = field(default_factory=dict)

    def judge(self, candidates: list[Candidate]) -> None:
        import yaml

        todo = sorted((c for c in candidates if c.reason is None),
                      key=lambda c: c.world_size)  # measured by world size: numbered so
        number = {id(c): i for i, c in enumerate(todo)}  # one numbering over every size
        for n in sorted({c.world_size for c in todo}):
            group = [c for c in todo if c.world_size == n]
            jobs = [run.RunSpec(c.cfg, c.resolved, str(
                self.run_dir / "candidates" / f"{number[id(c)]:02d}_{_dirname(c)}"),
                c.overrides) for c in group]
            for spec, c in zip(jobs, group):  # what the candidate was, to rerun
                Path(spec.run_dir).mkdir(parents=True, exist_ok=True)
                (Path(spec.run_dir) / "overrides.yaml").write_text(
                    yaml.safe_dump({"layout": c.label, "overrides": spec.overrides}))
            cfg = group[0].cfg
            log.info("advise: measuring %d candidate(s) at world size %d", len(group), n)
            if n == 1:
                dist = distributed.setup(cfg.device.value, None, cfg.backend.timeout_s,
                                         cfg.parallel.threads_per_worker)
                results = measure_all(jobs, dist)
            else:
                answer = _launched(jobs, n, cfg, group[0].resolved)
                results = answer["results"]
                self.links[n] = Link(answer["cores"], answer["threads"])
            for candidate, figures in zip(group, results):
                candidate.figures = figures
                candidate.reason = figures.get("error")


def _launched(jobs: list[run.RunSpec], n: int, cfg, layout) -> dict[str, Any]:
    """The candidates `jobs` (run specs) measured by `n` launched workers (`cfg`, `layout`:
    the first's config and layout); a rank's one-line error (a signal stopped it: Stopped)
    is raised here as that line."""
    from parallab.launching import launch, worker as workers

    with workers.one_line_failures() as failures:
        job = Job(jobs, cfg.device.value, cfg.backend.name, cfg.backend.timeout_s,
                  cfg.parallel.threads_per_worker, failures)
        return launch.elastic(worker, (job,), n, 0, launch.worker_env(cfg, layout))


def _dirname(candidate: Candidate) -> str:
    return "".join(ch if ch.isalnum() or ch in "=.-" else "_" for ch in candidate.label)
