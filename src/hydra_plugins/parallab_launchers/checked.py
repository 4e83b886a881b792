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
        validate.check_config(typed_config(job, list(overrides)))
    except ConfigError as error:
        raise ConfigError(f"{job_label(idx, overrides)}: {error}") from None
    return cfg


def job_label(idx: int, overrides: Sequence[str]) -> str:
    """A job as a refusal names it: its number and its own overrides."""
    return f"job #{idx} ({' '.join(filter_overrides(overrides))})"


def checked_jobs(launcher, job_overrides: Sequence[Sequence[str]], initial_job_idx: int) -> None:
    """Every job of the sweep checked, before the first one runs or is submitted."""
    for idx, overrides in enumerate(job_overrides, initial_job_idx):
        checked_job(launcher, overrides, idx)


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
