"""The training jobs behind train.py, `parallab train` and `parallab advise` (the Hydra app
that runs them: config/hydra_app.py).

The Hydra process is the controller: it composes, checks and resolves the config once, then
either trains in this process (one device, or in place under torchrun/SLURM/mpirun) or
starts the workers with torch's elastic launcher. Workers never re-enter Hydra.
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import functools
import gc
import logging
import os
import signal
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterator, NoReturn

from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf

from parallab import sweep_job
from parallab.config import help
from parallab.config.errors import ConfigError, OneLineError, refuse
from parallab.config.hydra_app import (
    CONF_DIR,
    config_flags,
    hydra_app,
    run_app,
    typed_config,
)
from parallab.config.schema import register_configs
from parallab.invocation import Invocation, JobFailed, Stopped
from parallab.launching import forking, launch, relaunch, slurm, start
from parallab.launching.in_place import InPlace, prepare_in_place, restarted
from parallab.launching.preemption import ended_by_interrupt
from parallab.observe import summary

# torch and what needs it (the launched worker, the checks, the layouts, the run) are
# imported once a job has passed the schema: Hydra's refusals, the schema's, --cfg and shell
# completion answer without them (a third of the time; --help reads the model's class,
# which needs torch; tests/test_config.py checks that none of them loads it)
if TYPE_CHECKING:
    from parallab.training import run

log = logging.getLogger("parallab")
# at exit, everything left is frozen out of the interpreter's last garbage collections: they
# would walk the million objects of torch and the run (most of a command's end) only to
# free memory the process hands back anyway (atexit: never in a process that goes on)
atexit.register(gc.freeze)


def _fail(message: str, status: int) -> NoReturn:
    log.error(message)
    sys.exit(status)


def _train_and_report(spec: run.RunSpec, in_place: InPlace | None) -> dict[str, Any]:
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    from parallab.launching import worker
    from parallab.training import run

    p = spec.cfg.parallel
    try:
        if in_place is not None or not spec.layout.processes:
            metrics = run.train(spec)
        else:
            log.info("launching %d workers (parallel=%s, backend=%s) in %s",
                     spec.layout.world_size, p.name, spec.cfg.backend.name, spec.run_dir)
            with worker.one_line_failures() as failures:
                metrics = launch.elastic(
                    worker.main, (run.train, dataclasses.replace(spec, failures=failures)),
                    spec.layout.world_size, p.max_restarts,
                    launch.worker_env(spec.cfg, spec.layout),
                    slurm.requeue_signals(spec.cfg.trainer.requeue_signal),
                    worker.stop_file(failures))
    # the whole story in one line: a value found wrong once data is built, in this process
    # or as a worker left it (worker.LeftByWorker), ...
    except OneLineError as error:
        raise JobFailed(str(error), error.status) from None
    except ChildFailedError as error:
        if launch.stopped_by() is not None:  # ended unsaved: while starting, or stopped hard
            from parallab.training import checkpoint

            trained = checkpoint.latest(Path(spec.run_dir) / "checkpoints") is not None
            raise Stopped(launch.stopped_by(), None, said=False,
                          resume=spec.resume_command() if trained else None) from None
        raise worker_failure(error) from None
    return _ended(metrics, spec, in_place)


def _ended(metrics: dict[str, Any], spec: run.RunSpec,
           in_place: InPlace | None) -> dict[str, Any]:
    """The run's figures, or Stopped for a run a signal stopped; one that SLURM's
    time-limit warning stopped (every rank saved) is requeued instead: the process SLURM
    started as the job's first task requeues the job, and every task ends here with exit
    status 0 and no result (the submitit launcher waits for the requeued job's). Where
    SLURM refuses, one line with the command that continues the run."""
    from parallab.training import run

    if run.STOPPED not in metrics:
        return metrics
    if slurm.asked() is None:
        raise Stopped(metrics[run.STOPPED], metrics["steps"])
    if in_place is None or in_place.rank == 0:
        # said before asking: once SLURM takes the requeue it stops this job's tasks, this one
        # with them, and a line logged after scontrol returns may never be written
        log.warning("asking SLURM to requeue job %s: it continues this run from its "
                    "checkpoint when it starts again", slurm.job_name())
        refused = slurm.requeue()
        if refused is not None:
            raise JobFailed(f"SLURM did not requeue job {slurm.job_name()} ({refused}); its "
                            f"checkpoint is kept: continue the run with: "
                            f"{spec.resume_command()}", 1)
    raise SystemExit(0)


def worker_failure(error) -> JobFailed:
    """How a launched job ends when its first failing rank left no line of its own
    (worker.one_line_failures): the root cause's traceback, its last line the summary."""
    rank, failure = error.get_first_failure()
    reason = failure.message  # the error file's record, or a line about a signal
    reason = reason.get("message", "") if isinstance(reason, dict) else str(reason)
    reason = reason.strip().splitlines()[-1] if reason.strip() else (
        f"exit code {failure.exitcode}")
    return JobFailed(f"a worker failed, so the job was stopped:\n{error}", 1,
                     f"rank {rank}: {reason}")


def process_started() -> float:
    """When this process started, as time.time() tells time (Linux's /proc: its start in
    clock ticks since boot, against the uptime); elsewhere, now."""
    try:
        ticks = int(Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[19])
        uptime = float(Path("/proc/uptime").read_text().split()[0])
        return time.time() - (uptime - ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError):
        return time.time()


def _train_job(dict_cfg: DictConfig, call: Invocation) -> float | None:
    """One run: checked, its dir claimed, trained. Ctrl-C before its dir is claimed ends it
    as a refusal ends it (an earlier run's record put back); after, _claimed records it."""
    try:
        return _checked_and_trained(dict_cfg, call)
    except KeyboardInterrupt:
        call.restore()
        raise Stopped(signal.SIGINT, None, said=False) from None


def _checked_and_trained(dict_cfg: DictConfig, call: Invocation) -> float | None:
    hydra_cfg = HydraConfig.get()
    if restarted() and (finished := summary.read_metrics(Path(
            hydra_cfg.runtime.output_dir))) is not None:
        from parallab import metrics

        log.info("the run in %s had finished (its metrics.json is complete): this restart "
                 "of it leaves it as it was", hydra_cfg.runtime.output_dir)
        return metrics.objective_of(finished, dict_cfg.objective)
    if call.advising or dict_cfg.advise.run:
        from hydra import compose as hydra_compose

        overrides = list(hydra_cfg.overrides.task)
        _advise(dict_cfg, overrides, hydra_cfg.runtime.output_dir,
                lambda extra: hydra_compose(hydra_cfg.job.config_name, overrides=extra), call)
        return None
    in_place = prepare_in_place()  # again for launchers calling the app (submitit)
    # before this process loads torch (the data set's config class, the checks): the
    # workers' fork server loads it beside this process instead of after it
    forking.warm_up(dict_cfg, in_place is None and
                    getattr(OmegaConf.get_type(dict_cfg.parallel), "processes", False))
    from parallab.checks import validate
    from parallab.observe import loggers
    from parallab.training import run

    with call.refusing():
        refuse(loggers.chosen_problem(list(hydra_cfg.overrides.task),
                                      OmegaConf.to_container(dict_cfg.logger)))
        cfg, layout = validate.prepare(typed_config(dict_cfg, list(hydra_cfg.overrides.task)),
                                       in_place, hydra_cfg.runtime.output_dir)
    sweep = hydra_cfg.sweep.dir if hydra_cfg.mode == RunMode.MULTIRUN else None
    spec = run.RunSpec(cfg, layout, hydra_cfg.runtime.output_dir, list(hydra_cfg.overrides.task),
                       command=relaunch.launched(call.entry(), in_place), sweep=sweep)
    if sweep is None:  # a run's wall time is the command's, from its process's start
        spec.started = process_started()
    with _claimed(spec.run_dir, cfg, in_place, call):
        return _train_and_report(spec, in_place).get(objective(cfg))


def _advise(dict_cfg: DictConfig, overrides: list[str], run_dir: str, compose_with,
            call: Invocation) -> dict[str, Any]:
    """advise.run=true: parallab advise (advise/) in `run_dir`; `compose_with(overrides)`
    composes a candidate's config as this command composed its own."""
    from parallab import advise
    from parallab.checks import validate

    def configure(extra: list[str]):
        return validate.prepare(typed_config(compose_with(extra), extra), None)

    entry = " ".join(call.entry()[:2])
    try:
        with call.refusing():
            cfg = typed_config(dict_cfg, overrides)
            with _claimed(run_dir, cfg, None, call, command="parallab advise"):
                return advise.advise(cfg, overrides, run_dir, configure,
                                     [entry, *config_flags(call.argv[1:])])
    except OneLineError as error:  # a signal stopped it (advise/measure.py: Stopped), ...
        raise JobFailed(str(error), error.status) from None


@contextlib.contextmanager
def _claimed(run_dir: str, cfg, in_place: InPlace | None, call: Invocation,
             command: str | None = None) -> Iterator[None]:
    """The run dir for this run alone: a fresh run does not start over an earlier one's
    checkpoints or metrics (trainer.resume=auto continues it), and a second run started in
    the same dir while this one runs is refused at once (a lock file). `command`: one that
    is not training (advise, evaluate) starts only in a dir holding no run at all."""
    from parallab.training import rundir

    main = in_place is None or in_place.rank == 0
    # a launcher's restart or SLURM's requeue of this job continues it (run.resume_path),
    # deleting nothing
    resume = "auto" if restarted() else cfg.trainer.resume
    lock = rundir.lock(Path(run_dir)) if main else contextlib.nullcontext()
    # the lock taken first: a refused run touches nothing of a running one
    with call.refusing(), lock:
        if command is not None:
            rundir.check_unused(Path(run_dir), command, call.held_before())
        else:
            logged = _logged(cfg, Path(run_dir)) if cfg.trainer.overwrite else []
            rundir.check_fresh(Path(run_dir), resume, cfg.trainer.overwrite, delete=main,
                               logged=logged)
        if main:  # how an earlier start ended (stopped, failed) is not how this one will
            (Path(run_dir) / summary.STATUS_FILE).unlink(missing_ok=True)
        try:
            yield
        except (KeyboardInterrupt, Stopped) as error:  # its record says it was stopped
            stopped = error if isinstance(error, Stopped) else Stopped(signal.SIGINT, None,
                                                                       said=False)
            if main:
                stopped.record(run_dir)
            raise stopped from None


def _logged(cfg, run_dir: Path) -> list[str]:
    """The files trainer.overwrite=true deletes beside the replaced run's checkpoints: what
    this run's loggers write, and what the replaced run's wrote (its checkpoint's config
    says, where it names loggers this process can still find)."""
    from parallab.observe import loggers
    from parallab.training import rundir

    logged = loggers.files(cfg.logger)
    earlier = rundir.earlier_loggers(run_dir)
    with contextlib.suppress(ConfigError):  # a logger class of its own since removed
        logged += loggers.files(earlier) if earlier else []
    return logged


def objective(cfg) -> str:
    from parallab import metrics
    from parallab.loss import build_loss

    return metrics.objective(cfg, build_loss(cfg.loss))


def _train_task(dict_cfg: DictConfig, call: Invocation) -> float | None:
    hydra_cfg = HydraConfig.get()
    if hydra_cfg.mode == RunMode.MULTIRUN:
        return sweep_job.run(dict_cfg, Path(hydra_cfg.runtime.output_dir), call, _train_job)
    try:
        return _train_job(dict_cfg, call)
    except Stopped as stopped:
        if stopped.said:  # by the run, in its one line
            sys.exit(_stopped_status(stopped.status))
        _fail(str(stopped), _stopped_status(stopped.status))
    except JobFailed as error:
        _fail(str(error), error.status)


@functools.cache
def _register_configs() -> None:
    """parallab's schemas, its launchers that check every job of a sweep first, its Optuna
    sweeper that summarizes a sweep of no completed trial, and its submitit_slurm launcher
    where the plugin is installed: once a process (Hydra's ConfigStore keeps them; each
    compose of a process that composes many, a test suite's or advise's, stored them
    again)."""
    from hydra_plugins.parallab_launchers import checked, optuna_sweep

    register_configs()
    checked.register()
    optuna_sweep.register()
    try:
        from parallab.launching import allocation
    except ImportError:  # no hydra-submitit-launcher (the slurm extra): Hydra says so
        return
    allocation.register()


def train(argv: list[str] | None = None, advising: bool = False) -> None:
    """`python train.py [overrides]` (`parallab advise [overrides]`: advising); `argv`: the
    command line, its program first (sys.argv)."""
    with ended_by_interrupt():
        call = Invocation.read(argv or sys.argv, advising)
        try:
            prepare_in_place()
        except ConfigError as error:  # a launcher's variable unreadable, or left behind
            _fail(str(error), 2)
        launch.register_resolvers()
        help.register_resolver("advise" if advising else "train")
        _register_configs()
        try:
            run_app(hydra_app("config", _train_task, call), call)
        finally:
            if call.stopped_by is not None:  # a sweep a signal stopped, whatever its jobs did
                sys.exit(_stopped_status(128 + call.stopped_by))


def _stopped_status(status: int) -> int:
    """The exit status of a run a signal stopped, in this process: `status` (128 + the
    signal) on rank 0 and in a process of its own. Every other rank a launcher started in
    place ends with 0 once its part is saved: srun --kill-on-bad-exit, torchrun and mpirun
    end the whole job when one task ends with another status, and would end rank 0 before it
    says where the run stopped and records it. The job's status is rank 0's."""
    in_place = prepare_in_place()
    return status if in_place is None or in_place.rank == 0 else 0


def advise(argv: list[str] | None = None) -> None:
    """`parallab advise [overrides]`: as `parallab train advise.run=true [overrides]`."""
    train(argv, advising=True)


def compose(overrides: list[str], config_dir: str | Path | None = None,
            config_name: str = "config", return_hydra: bool = False) -> DictConfig:
    """conf/ composed with `overrides` as train.py composes it, a project's config dir's
    groups added (as --config-dir adds them), its options over built-ins of their names."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    from parallab.config.hydra_internals import one_store, users_first

    launch.register_resolvers()
    _register_configs()
    extra = [f"hydra.searchpath=[file://{Path(config_dir).resolve()}]"] if config_dir else []
    with users_first(), initialize_config_dir(config_dir=CONF_DIR, version_base=None), \
            one_store():
        return hydra_compose(config_name, overrides=[*overrides, *extra],
                             return_hydra_config=return_hydra)


def advise_in_process(overrides: list[str], run_dir: str | Path,
                      config_dir: str | Path | None = None) -> dict[str, Any]:
    """What `parallab advise OVERRIDES hydra.run.dir=RUN_DIR` does, in this process."""
    overrides = ["advise.run=true", *overrides]
    Path(run_dir).mkdir(parents=True, exist_ok=True)
    return _advise(compose(overrides, config_dir), overrides, str(run_dir),
                   lambda extra: compose(extra, config_dir), Invocation())


def train_in_process(overrides: list[str], run_dir: str | Path,
                     config_dir: str | Path | None = None) -> dict[str, Any]:
    """What `python train.py OVERRIDES hydra.run.dir=RUN_DIR` does, in this process and
    without Hydra's logging set-up (tests, notebooks): check, then train here or launch the
    workers. Returns the run's metrics; raises ConfigError or JobFailed."""
    from parallab.checks import validate
    from parallab.training import run

    in_place = prepare_in_place()
    cfg, layout = validate.prepare(typed_config(compose(overrides, config_dir), overrides),
                                   in_place, str(run_dir))
    problem = start.dir_problem("hydra.run.dir", run_dir)
    if problem is not None:
        raise ConfigError(problem)
    Path(run_dir).mkdir(parents=True, exist_ok=True)
    command = ["python", "train.py", *(["--config-dir", str(config_dir)] if config_dir else [])]
    with _claimed(str(run_dir), cfg, in_place, Invocation()):
        return _train_and_report(run.RunSpec(cfg, layout, str(run_dir), list(overrides),
                                             command=command), in_place)
