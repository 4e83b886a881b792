"""What one rank does: join the job, build data, model, runtime and optimizer (build.py),
train, and record how the run ended."""

from __future__ import annotations

import contextlib
import functools
import gc
import logging
import math
import os
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

import torch

from parallab.config import naming
from parallab.config.errors import refuse
from parallab.config.schema import Config
from parallab.launching import distributed, in_place, slurm
from parallab.launching.preemption import Preemption
from parallab.observe import hparams, loggers, summary
from parallab.observe.loggers import RunLogger
from parallab.observe.memory import peak_memory_mb, reset_peak_memory
from parallab.parallel.layout import Layout
from parallab.training import build, checkpoint
from parallab.training.trainer import Trainer

log = logging.getLogger(__name__)


@dataclass
class RunSpec:
    """Everything a worker needs, resolved and checked by the controlling process."""

    cfg: Config
    layout: Layout  # resolved once by the checks: degrees, plan, GPUs
    run_dir: str
    overrides: list[str] = field(default_factory=list)  # what the command line changed
    started: float = field(default_factory=time.time)
    controller: int = field(default_factory=os.getpid)  # the process the workers end with
    # how the user started it (the entry and Hydra's config flags), for the resume command
    command: list[str] = field(default_factory=lambda: ["python", "train.py"])
    sweep: str | None = None  # a multirun job's sweep dir (loggers group the sweep's runs)
    # a launched job's dir where a worker leaves its one-line error for the controller
    failures: str | None = None

    def resume_command(self) -> str:
        """The command that continues this run, as the user started it."""
        import shlex

        # the weights it started from are in its checkpoints now
        kept = [o for o in self.overrides if not o.startswith(
            ("hydra.run.dir=", "trainer.resume=", "trainer.init_from="))]
        return shlex.join([*self.command, *kept,
                           f"hydra.run.dir={naming.hydra_value(self.run_dir)}",
                           "trainer.resume=auto"])


def resume_path(resume: str | None, run_dir: str) -> Path | None:
    """trainer.resume as a file: `auto` is the newest checkpoint in the run dir, if any; a
    worker the elastic agent restarted, or a job SLURM requeued, resumes that way too."""
    if resume is None and in_place.restarted():
        resume = "auto"
    if resume != "auto":
        return Path(resume) if resume else None
    found = checkpoint.latest(Path(run_dir) / "checkpoints")
    if found is None:
        log.info("trainer.resume=auto: no checkpoint in %s yet, starting afresh", run_dir)
    return found


def resumed_rate(trainer: Trainer, lr: float, cfg: Config, main: bool) -> float:
    """The rate a resumed run goes on at: its checkpoint's (the optimizer state holds it;
    validate refused a changed optim key), said where optim.scale_lr at this run's global
    batch would give another."""
    # the rate the optimizer's schedule starts from: after a resume, the checkpoint's
    group = trainer.optimizer.param_groups[0]
    used = group.get("initial_lr", group["lr"])
    if main and not math.isclose(used, lr, rel_tol=1e-9):
        log.warning("resumed at the checkpoint's learning rate %g: optim.scale_lr=%s would "
                    "give %g at this run's global batch of %d, but the optimizer state goes on "
                    "at its own", used, cfg.optim.scale_lr, lr, trainer.global_batch_size)
    return used


def read_checkpoint(path: Path, runtime, model, optimizer) -> dict[str, Any]:
    """A checkpoint's whole state shaped as this rank holds the model under this layout,
    whichever layout and world size wrote it, read by its format (a sharded one resharded by
    DCP, a one-file one cut to this rank's part)."""
    model_state, optimizer_state = runtime.state_dict(model, optimizer)
    return checkpoint.read_state(path, {"model": model_state, "optimizer": optimizer_state})


@contextlib.contextmanager
def heap_frozen() -> Iterator[None]:
    """What exists before a run (the imports, torch's among them, and a launched worker's
    inherited from the fork server: about a million objects) left out of Python's garbage
    collection while it runs: a full collection walks the whole heap (a large part of a second, one
    at a worker's start, more in a long-lived process), while the run's own garbage is
    collected as before; put back after, unless frozen before."""
    frozen_before = gc.get_freeze_count()
    gc.freeze()
    try:
        yield
    finally:
        if not frozen_before:
            gc.unfreeze()


@heap_frozen()
def train(spec: RunSpec, store=None) -> dict[str, Any]:
    """Train on this rank; returns the run's final metrics (every rank gets the same)."""
    cfg = spec.cfg
    backend = cfg.backend.name if spec.layout.processes else None
    # in place: rank 0 hosts it (a one-process layout's ranks, if any, never meet)
    hosted = in_place.take_store(cfg.parallel.rendezvous_timeout) if backend else None
    dist = distributed.setup(cfg.device.value, backend, cfg.backend.timeout_s,
                             cfg.parallel.threads_per_worker, store=store or hosted)
    reset_peak_memory(dist.device)  # this run's own peak, not an earlier job's in the process
    logger = loggers.started(cfg, spec.run_dir, dist.is_main, spec.overrides, spec.sweep,
                             dist.world_size, spec.layout)
    log.info("rank %d/%d on %s, %d threads, optim.lr=%g, data.batch_size=%d", dist.rank,
             dist.world_size, dist.device, torch.get_num_threads(), cfg.optim.lr,
             cfg.data.batch_size)
    try:
        metrics = _fit(spec, dist, logger, backend)
    except BaseException as error:
        # no destroy_process_group here: with a peer gone it can block for good, and the
        # process is ending anyway
        logger.close("stopped" if isinstance(error, KeyboardInterrupt) else "failed")
        raise
    logger.close("stopped" if STOPPED in metrics else "finished")
    distributed.teardown()
    if hosted is not None:
        distributed.leave_together(hosted, dist)
    return metrics


def finished_record(trainer: Trainer, run_dir: str, dist: distributed.Dist
                    ) -> dict[str, Any] | None:
    """A resumed run with nothing left to train, its checkpoint at its end (a finished run
    that SLURM requeued, or resumed as it was): its metrics.json, complete, kept as it was
    and returned, where training on would have written it again with the figures of no
    step (null). None where something is left, or rank 0 finds no complete record (the
    ranks agree: one all-reduce, on this path alone)."""
    from parallab.observe.summary import read_metrics

    if not (trainer.done() or trainer.epoch >= trainer.cfg.epochs):
        return None
    kept = read_metrics(Path(run_dir)) if dist.is_main else None
    found = dist.all_reduce_max(torch.tensor(float(kept is not None), device=dist.device))
    if not found.item():
        return None
    if dist.is_main:
        log.info("the run in %s had finished at step %d: nothing is left to train, and its "
                 "record (metrics.json) is kept as it was", run_dir, trainer.step)
    return kept or {}


STOPPED = "stopped_by"  # a stopped run's result: the signal's number (and "steps")


def _stopped(trainer: Trainer, preemption: Preemption, spec: RunSpec, main: bool
             ) -> dict[str, Any]:
    """A run a signal stopped: its one line (rank 0's), and its result for the controller."""
    signum = preemption.signum or signal.SIGTERM
    said = signal.Signals(signum).name
    if signum in preemption.requeue:
        line = (f"stopped by {said} (SLURM's warning before the time limit) at step "
                f"{trainer.step}, checkpoint saved: the job requeues itself and continues "
                "from here")
    elif trainer.step == 0:
        line = f"stopped by {said} before training began: nothing was trained or saved"
    else:
        saved = ("checkpoint saved" if trainer.step > trainer.first_step else
                 "nothing new to save")
        line = (f"stopped by {said} at step {trainer.step}, {saved}; "
                f"{'a requeue of this SLURM job continues it, or ' if slurm.in_job() else ''}"
                f"resume with: {spec.resume_command()}")
    if main:
        log.warning("%s", line)
    return {STOPPED: signum, "steps": trainer.step}


def _ended(trainer: Trainer, metrics: dict[str, Any], spec: RunSpec, logger: RunLogger,
           main: bool) -> None:
    trainer.checkpointer.save(trainer.state_dict(), "last")
    if main:
        logger.finish(metrics, hparams.of(spec.cfg, spec.overrides, metrics), trainer.step)
        summary.record_completed(spec.run_dir, trainer.step)  # no later stop changes it
        log.info("metrics: %s", {k: round(v, 4) if isinstance(v, float) else v
                                 for k, v in metrics.items()})


def _ended_hard(spec: RunSpec, signum: int) -> str:
    """A stop ended before it saved (a second signal, the watchdog): its record, and the end
    of its line (resume=auto starts afresh where nothing was saved yet)."""
    summary.record_stopped(spec.run_dir, signum, None)
    return f"; resume from the last checkpoint with: {spec.resume_command()}"


def _fit(spec: RunSpec, dist: distributed.Dist, logger: RunLogger,
         backend: str | None) -> dict[str, Any]:
    """Build model, data, optimizer and trainer on this rank, resume if asked, train, save."""
    cfg = spec.cfg
    # a launched worker's controller records a stop that ended it, and says how to resume
    # (cli); a process of its own, or rank 0 in place, does so itself
    recorded = dist.is_main and spec.failures is None
    with Preemption(slurm.requeue_signals(cfg.trainer.requeue_signal),
                    ended_hard=functools.partial(_ended_hard, spec) if recorded else None
                    ) as preemption:
        # a resumed run has its weights (its start's included) from its checkpoint
        resume_from = resume_path(cfg.trainer.resume, spec.run_dir)
        trainer, lr = build.build_trainer(cfg, spec.layout, dist, logger,
                                          Path(spec.run_dir) / "checkpoints", preemption,
                                          None if resume_from else cfg.trainer.init_from,
                                          resume_from=resume_from)
        if resume_from is not None:
            state = read_checkpoint(resume_from, trainer.runtime, trainer.model,
                                    trainer.optimizer)
            # a batch the workers chose (trainer.auto_batch_size) is checked here, others
            # before launch
            refuse(checkpoint.changed_batch(state, trainer.global_batch_size, resume_from))
            trainer.load_state_dict(state)
            log.info("resumed from %s at step %d%s", resume_from, trainer.step,
                     f" (SLURM job {slurm.job_name()}, restart {slurm.restart_count()})"
                     if slurm.restart_count() else "")
            lr = resumed_rate(trainer, lr, cfg, dist.is_main)
            kept = finished_record(trainer, spec.run_dir, dist)
            if kept is not None:
                if dist.is_main:
                    summary.record_completed(spec.run_dir, trainer.step)
                return kept
        start_mb = peak_memory_mb(dist.device)  # built (and loaded): before the first step
        metrics = trainer.fit()
        with preemption.busy():  # a signal's default had ended a rank in its last save
            if not trainer.stopped:
                metrics.update(lr=lr, wall_time_s=time.time() - spec.started,
                               start_memory_mb=start_mb, backend=backend or "none",
                               world_size=trainer.runtime.ranks.world_size,
                               precision_dtype=trainer.precision.dtype_name,
                               parallel=cfg.parallel.name)
                _ended(trainer, metrics, spec, logger, dist.is_main)
    if trainer.stopped:
        return _stopped(trainer, preemption, spec, dist.is_main)
    return metrics
