"""Every job of a sweep checked before the first one starts or is submitted, under each
launcher parallab runs sweeps with: `basic` (Hydra's default, a job at a time in this
process), `submitit_local` and `submitit_slurm` (submitit_slurm.py). A job refused by the
checks a config passes alone (checks/validate.check_config: its values, its layout's
degrees) ends the sweep in one line naming the job, exit status 2, where it was run or
submitted with the others and failed on its own, once its turn or its allocation came."""

# no `from __future__ import annotations`: Hydra's scan of its plugins runs this module
# under a name that is not in sys.modules, where a dataclass cannot read string annotations
import copy
from dataclasses import dataclass
from typing import Sequence

from hydra._internal.core_plugins.basic_launcher import BasicLauncher as HydraBasicLauncher
from hydra.core.config_store import ConfigStore
from hydra.core.utils import JobReturn, filter_overrides
from omegaconf import DictConfig, open_dict

from parallab.config.errors import ConfigError

try:  # Hydra imports every plugin module at its start: without the slurm extra, no launcher
    from hydra_plugins.hydra_submitit_launcher.config import LocalQueueConf
    from hydra_plugins.hydra_submitit_launcher.submitit_launcher import (
        LocalLauncher as SubmititLocalLauncher,
    )
except ImportError:
    LocalQueueConf = SubmititLocalLauncher = object  # type: ignore[assignment,misc]


def checked_job(launcher, overrides: Sequence[str], idx: int) -> DictConfig:
    """Job `idx`'s config, composed as `launcher` composes it, and checked (ConfigError
    naming the job)."""
    from parallab.checks import validate
    from parallab.config.hydra_app import typed_config

    cfg = launcher.hydra_context.config_loader.load_sweep_config(launcher.config,
                                                                  list(overrides))
    with open_dict(cfg):
        cfg.hydra.job.id = cfg.hydra.job.num = idx
    job = copy.deepcopy(cfg)  # as its task will get it (run_job): without Hydra's node
    with open_dict(job):
        del job["hydra"]
    try:
        typed = typed_config(job, list(overrides))
        # a simulation of parallel=auto: its values alone (auto is no layout a job trains)
        ranked = typed.parallel.name == "auto" and cfg.hydra.job.name == "simulate"
        if advising(launcher, typed):
            advise_checks(typed, list(overrides))
        else:
            (validate.check_values if ranked else validate.check_config)(typed)
    except ConfigError as error:
        raise ConfigError(f"{job_label(idx, overrides)}: {error}") from None
    return cfg


def advising(launcher, typed) -> bool:
    """Whether the job advises: advise.run=true in its config, or every job of `parallab
    advise` (its Invocation, which the app's task function carries: hydra_app)."""
    call = getattr(launcher.task_function, "invocation", None)
    return bool(typed.advise.run or getattr(call, "advising", False))


def advise_checks(typed, overrides: list[str]) -> None:
    """An advise job's checks, as its own run makes them before measuring anything: the
    values and advise's own request (advise.request_problem). Its parallel.world_size is the
    largest world size it measures (1 and each divisor), no layout of parallel=none's."""
    from parallab import advise
    from parallab.checks import validate
    from parallab.config.errors import refuse

    validate.check_values(typed)
    refuse(advise.request_problem(typed, overrides))


def job_label(idx: int, overrides: Sequence[str]) -> str:
    """A job as a refusal names it: its number and its own overrides."""
    return f"job #{idx} ({' '.join(filter_overrides(overrides))})"


def checked_jobs(launcher, job_overrides: Sequence[Sequence[str]], initial_job_idx: int) -> None:
    """Every job of the sweep checked, and the dirs they will write, before the first one
    runs or is submitted."""
    dirs: dict = {}
    for idx, overrides in enumerate(job_overrides, initial_job_idx):
        cfg = checked_job(launcher, overrides, idx)
        problem = dir_problem(cfg, job_label(idx, overrides), dirs)
        if problem:
            raise ConfigError(problem)


def dir_problem(cfg: DictConfig, label: str, dirs: dict) -> "str | None":
    """A job's dir another job of the sweep names too (`dirs`: those named so far), or one
    holding a run the job would neither continue nor replace. Each job had run into it and
    been refused there, after Hydra had written its own record over the finished run's."""
    from pathlib import Path

    from parallab.launching import slurm
    from parallab.training.rundir import held_run

    try:
        run_dir = Path(cfg.hydra.sweep.dir).absolute() / str(cfg.hydra.sweep.subdir)
    except Exception:  # noqa: BLE001 - a name only Hydra's job resolves: its own to check
        return None
    if run_dir in dirs:
        return (f"{label} and {dirs[run_dir]} would both write {run_dir}: give "
                "hydra.sweep.subdir a name that tells the jobs apart (its default names "
                "each by what it changes)")
    dirs[run_dir] = label
    t, held = cfg.trainer, held_run(run_dir)
    continued = cfg.sweep.skip_completed or t.resume is not None or t.overwrite or \
        slurm.restart_count() > 0  # (a sweep SLURM requeued goes on where it stopped)
    if held and not continued:
        return (f"{label}: {run_dir} already holds a run ({', '.join(held)}): continue the "
                "sweep with sweep.skip_completed=true, or give it a hydra.sweep.dir of its own")
    if held and cfg.sweep.skip_completed:  # a finished job of other overrides named alike
        from parallab import sweep_job
        from parallab.observe import summary

        trains = sweep_job.what_it_trains(cfg.hydra, cfg)
        _, clash = sweep_job.finished_as(run_dir, summary.read_status(run_dir), trains)
        return f"{label}: {clash}" if clash else None
    return None


class BasicLauncher(HydraBasicLauncher):
    """Hydra's basic launcher, every job checked before the first one runs (Hydra's
    composes each again as it comes to it: a few ms a job)."""

    def launch(self, job_overrides: Sequence[Sequence[str]],
               initial_job_idx: int) -> Sequence[JobReturn]:
        checked_jobs(self, job_overrides, initial_job_idx)
        return super().launch(job_overrides, initial_job_idx)


class LocalLauncher(SubmititLocalLauncher):  # type: ignore[misc,valid-type]
    """submitit's local launcher, every job checked before any is submitted."""

    def launch(self, job_overrides: Sequence[Sequence[str]],
               initial_job_idx: int) -> Sequence[JobReturn]:
        checked_jobs(self, job_overrides, initial_job_idx)
        return super().launch(job_overrides, initial_job_idx)


@dataclass
class BasicLauncherConf:
    _target_: str = "hydra_plugins.parallab_launchers.checked.BasicLauncher"


@dataclass
class CheckedLocalConf(LocalQueueConf):  # type: ignore[misc,valid-type]
    _target_: str = "hydra_plugins.parallab_launchers.checked.LocalLauncher"


def register() -> None:
    """These launchers in the place of Hydra's `basic` (the default) and submitit's
    `submitit_local` (with the slurm extra), as allocation.register does for
    submitit_slurm: after Hydra's scan of its plugins, which registers theirs."""
    from hydra.core.plugins import Plugins

    Plugins.instance()
    store = ConfigStore.instance()
    store.store(group="hydra/launcher", name="basic", node=BasicLauncherConf,
                provider="parallab")
    if SubmititLocalLauncher is not object:
        store.store(group="hydra/launcher", name="submitit_local", node=CheckedLocalConf,
                    provider="parallab")
