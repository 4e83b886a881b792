"""One job of a multirun: its outcome recorded for the sweep's summary (done, failed,
skipped, stopped), a job with complete metrics skipped when the sweep goes on, and the
command that continues a sweep a signal stopped."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Callable

from omegaconf import DictConfig

from parallab.config import naming
from parallab.invocation import Invocation, JobFailed, Stopped
from parallab.launching import in_place, relaunch, slurm
from parallab.observe import summary

log = logging.getLogger("parallab")


def run(dict_cfg: DictConfig, run_dir: Path, call: Invocation,
        train_job: Callable[[DictConfig, Invocation], float | None]) -> float | None:
    """One job of a multirun, trained by `train_job`: a failure is recorded for the summary
    and ends no other job; with sweep.skip_completed, a job whose dir holds complete metrics
    is not run again. A job stopped by a signal (saved, as a single run is) stops the
    sweep: the node is going."""
    from parallab import metrics

    before = summary.read_status(run_dir)  # a finished job's: what it trained
    if _main():
        (run_dir / summary.STATUS_FILE).unlink(missing_ok=True)
    if call.stopped_sweep:
        _record(run_dir, status="stopped")
        log.info("not run: the sweep was stopped; continue it with: %s", call.stopped_sweep)
        return None
    # a sweep SLURM requeued goes on where it stopped
    skip_completed = dict_cfg.sweep.skip_completed or slurm.restart_count() > 0
    trains = what_it_trains(cfg=dict_cfg)
    found, clash = finished_as(run_dir, before, trains) if skip_completed else (None, None)
    if clash is not None:
        log.error("job failed: %s", clash)
        _record(run_dir, **{**before, "status": "failed", "error": clash})
        return None
    if found is not None:  # ("as": the metrics are another job dir's, the summary reads them)
        _record(run_dir, status="skipped", trains=trains,
                **({"as": found.name} if found != run_dir else {}))
        figures = summary.read_metrics(found)  # None: advise's answer, which has no objective
        log.info("skipped: %s already holds %s", found,
                 "complete metrics" if figures else "advise's answer")
        return metrics.objective_of(figures, dict_cfg.objective) if figures else None
    if skip_completed and dict_cfg.trainer.resume is None:
        dict_cfg.trainer.resume = "auto"  # a job that did not finish continues (or starts)
    try:
        objective = train_job(dict_cfg, call)
        # done: the run's own record (completed, written by rank 0 as it ended) kept, what
        # it trained beside it
        _record(run_dir, **{**summary.read_status(run_dir), "trains": trains})
        return objective
    except Stopped as stopped:  # its record says so: the sweep stops at it
        if not stopped.said:
            log.error("%s", stopped)
        if _main():
            stopped.record(run_dir)
        call.stopped_by = stopped.signum
        call.stopped_sweep = continue_command(run_dir.parent, call)
        log.warning("the sweep stops here, its later jobs not run; continue it with: %s",
                    call.stopped_sweep)
    except Exception as error:  # noqa: BLE001 - any failure of one job is that job's result
        line = error.line if isinstance(error, JobFailed) else (
            f"{type(error).__name__}: {error}".splitlines()[0])
        failed(run_dir, line, error if isinstance(error, JobFailed) else line,
               traceback=not isinstance(error, JobFailed))
    return None


def failed(run_dir: Path, line: str, said: object = None, traceback: bool = False) -> None:
    """A job's failure, said and recorded for the summary (`line`: its record's words;
    `said`: the log's, if other): the sweep's other jobs run."""
    log.error("job failed: %s", line if said is None else said, exc_info=traceback)
    _record(run_dir, status="failed", error=line)


def _main() -> bool:
    """Whether this process keeps the job's record: the only one, or rank 0 of a sweep an
    external launcher runs in place (torchrun, mpirun, srun), whose every rank runs each
    job. Each rank had deleted and rewritten it, one merging the run's record read before
    rank 0 wrote it (dropping "completed"), another deleting what rank 0 had written."""
    ctx = in_place.current()
    return ctx is None or ctx.rank == 0


def _record(run_dir: Path, **fields) -> None:
    """The job's status.json, written by the process that keeps it (_main)."""
    if _main():
        summary.write_status(run_dir, **fields)


def finished_as(run_dir: Path, before: dict, trains: list[str]) -> tuple[Path | None,
                                                                        str | None]:
    """Under sweep.skip_completed, the job dir whose complete metrics (or advise's answer)
    this job's are: its own, or another of the sweep dir's that trained the same overrides
    (a sweep given more values numbers its jobs anew: 0_..lr=0.01 became 1_..lr=0.01); else
    None. A line where its own dir holds a finished job of other overrides (another sweep's,
    named alike)."""
    if summary.finished(run_dir):
        was, now = before.get("trains", trains), trains
        if not any(o.startswith(COMPOSED) for o in was):  # recorded before the digest was
            now = _overrides(now)
        if was == now:
            return run_dir, None
        if _overrides(was) == _overrides(now):  # the same overrides, composed otherwise
            return None, (f"{run_dir} holds a finished job of these overrides composed from "
                          "other configs (another --config-dir or hydra.searchpath, or a "
                          "YAML changed since), which sweep.skip_completed would take for "
                          "this one: give this sweep a hydra.sweep.dir of its own")
        return None, (f"{run_dir} holds a finished job of other overrides ("
                      f"{' '.join(_overrides(was)) or 'none'}; here "
                      f"{' '.join(_overrides(now)) or 'none'}), which sweep.skip_completed "
                      "would take for this one: give this sweep a hydra.sweep.dir of its own")
    twins = (d for d in sorted(run_dir.parent.iterdir()) if d != run_dir and d.is_dir()
             and summary.read_status(d).get("trains") == trains)
    return next((d for d in twins if summary.finished(d)), None), None


def what_it_trains(hydra=None, cfg=None) -> list[str]:
    """This job's overrides (`hydra`: its Hydra config, the running job's where None) that
    say what it trains: all but those its dir's name leaves out
    (hydra.job.config.override_dirname.exclude_keys: where it logs, the terminal's progress
    bar, ...), bar `experiment`, which the name leaves out and which trains another run:
    two sweeps given one hydra.sweep.dir name their jobs alike. With the job's composed
    `cfg`, a digest of it too: the same overrides composed from a project's own model of the
    same name had been taken for the built-in's finished job."""
    from hydra.core.hydra_config import HydraConfig

    hydra = hydra or HydraConfig.get()
    ignored = set(hydra.job.config.override_dirname.exclude_keys) - {"experiment"}
    keys = {o: o.lstrip("+~").split("=", 1)[0] for o in hydra.overrides.task}
    said = sorted(o for o, key in keys.items()
                  if key not in ignored and not naming.where_it_logs(key))
    return said if cfg is None else [*said, f"{COMPOSED}{_digest(cfg, ignored)}"]


COMPOSED = "composed:"  # what_it_trains's digest of the job's config, not an override


def _overrides(trains: list[str]) -> list[str]:
    return [o for o in trains if not o.startswith(COMPOSED)]


def _digest(cfg, ignored: set[str]) -> str:
    """The job's config as it trains: less Hydra's own, where it logs, the sweep's keys
    and what the dir's name leaves out (resume, overwrite, the progress bar, the device)."""
    import hashlib
    import json

    from omegaconf import OmegaConf

    tree = OmegaConf.to_container(cfg, resolve=False)
    for key in ("hydra", "logger", "sweep", "objective", *ignored):
        head, _, leaf = key.partition(".")
        node = tree.get(head) if leaf else tree
        if isinstance(node, dict):
            node.pop(leaf or head, None)
    # keys sorted: those added with + (+model.config.x) come in the command line's order
    return hashlib.sha256(json.dumps(tree, sort_keys=True, default=str).encode()
                          ).hexdigest()[:12]


def continue_command(sweep_dir: Path, call: Invocation) -> str:
    """The multirun command as the user ran it, in its dir, finished jobs kept."""
    import shlex

    args = [a for a in call.argv[1:] if not a.startswith(("hydra.sweep.dir=",
                                                          "sweep.skip_completed="))]
    # under the launcher that started it in place: a bare command ran it on one process
    entry = relaunch.launched(call.entry()[:2], in_place.current())
    return shlex.join([*entry, *args,
                       f"hydra.sweep.dir={naming.hydra_value(str(sweep_dir))}",
                       "sweep.skip_completed=true"])
