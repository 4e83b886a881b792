"""`hydra/launcher=submitit_slurm`: Hydra's submitit launcher with each job given the
allocation its own layout needs (parallab/launching/allocation.py), one job array per
allocation, every array submitted before the launcher waits for any."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Sequence

from hydra.core.singleton import Singleton
from hydra.core.utils import JobReturn, run_job
from omegaconf import DictConfig, OmegaConf, open_dict

from parallab.observe.summary import read_metrics

try:  # Hydra imports every plugin module at its start: without the slurm extra, no launcher
    from hydra_plugins.hydra_submitit_launcher.config import BaseQueueConf
    from hydra_plugins.hydra_submitit_launcher.submitit_launcher import (
        SlurmLauncher as SubmititSlurmLauncher,
    )

    from hydra_plugins.parallab_launchers.checked import checked_job, job_label
    from parallab.launching.allocation import Allocation, Partition, allocation
except ImportError:
    SubmititSlurmLauncher = object  # type: ignore[assignment,misc]

log = logging.getLogger(__name__)


def plan_of(cfg: DictConfig, job: str):
    """The layout of job `cfg` (parallel.PLANS), handed to the allocation: it sizes the job
    by the layout's default world size, the checks' own, rather than by a rule of its own."""
    from parallab.config.errors import ConfigError
    from parallab.parallel import PLANS

    plan = PLANS.get(cfg.parallel.name)
    if plan is None:
        raise ConfigError(f"{job}: parallel={cfg.parallel.name} is unknown: use one of "
                          f"{', '.join(PLANS)}")
    return plan


class SlurmLauncher(SubmititSlurmLauncher):  # type: ignore[misc,valid-type]
    def launch(self, job_overrides: Sequence[Sequence[str]],
               initial_job_idx: int) -> Sequence[JobReturn]:
        """Each job checked and given its allocation first (a job the checks refuse, or no
        partition holds, ends the sweep before anything is submitted), then one array per
        allocation; with sweep.skip_completed, a job whose dir holds complete metrics is not
        submitted but recorded here, as skipped; then every job's result, in the sweep's
        order."""
        assert self.config is not None and self.hydra_context is not None
        with open_dict(self.config):  # every job writes where the submitter resolved
            self.config.hydra.sweep.dir = str(self.config.hydra.sweep.dir)
        partition = Partition.read(self.params.get("partition"))
        groups: dict[Allocation, list[tuple[int, list[str]]]] = {}
        completed: list[DictConfig] = []
        for idx, overrides in enumerate(job_overrides, initial_job_idx):
            cfg = checked_job(self, overrides, idx)  # each job before any is submitted
            with open_dict(cfg):
                cfg.hydra.job.id = f"completed_{idx}"
            if cfg.sweep.skip_completed and read_metrics(Path(cfg.hydra.sweep.dir) / str(
                    cfg.hydra.sweep.subdir)) is not None:
                completed.append(cfg)
                continue
            job = job_label(idx, overrides)
            needed = allocation(cfg, self.params, partition, job, plan_of(cfg, job))
            groups.setdefault(needed, []).append((idx, list(overrides)))
        submitted = self._submit(groups) if groups else {}
        returns = {cfg.hydra.job.num: run_job(hydra_context=self.hydra_context,
                                              task_function=self.task_function, config=cfg,
                                              job_dir_key="hydra.sweep.dir",
                                              job_subdir_key="hydra.sweep.subdir")
                   for cfg in completed}  # the task records them as skipped, at once
        returns.update({idx: job.results()[0] for idx, job in submitted.items()})
        return [returns[idx] for idx in sorted(returns)]

    def _submit(self, groups: dict[Allocation, list[tuple[int, list[str]]]]) -> dict:
        """One job array per allocation; submitit's job of each sweep job by its number."""
        executor = self._executor()
        submitted = {}
        for needed, jobs in groups.items():
            executor.update_parameters(nodes=needed.nodes, tasks_per_node=needed.tasks_per_node,
                                       gpus_per_node=needed.gpus_per_node)
            log.info("submitting jobs %s on %s each", ", ".join(f"#{i}" for i, _ in jobs),
                     needed.describe())
            arguments = [(overrides, "hydra.sweep.dir", idx, f"job_id_for_{idx}",
                          Singleton.get_state()) for idx, overrides in jobs]
            submitted.update(zip([idx for idx, _ in jobs],
                                 executor.map_array(self, *zip(*arguments))))
        return submitted

    def _executor(self):
        """submitit's executor with the launcher's keys, as the plugin builds it."""
        import submitit

        params = dict(self.params)
        executor = submitit.AutoExecutor(cluster=self._EXECUTOR, folder=params.pop(
            "submitit_folder"), **{f"{self._EXECUTOR}_max_num_timeout": params.pop(
                "max_num_timeout")})
        shared = set(OmegaConf.structured(BaseQueueConf).keys())
        executor.update_parameters(**{key if key in shared else f"{self._EXECUTOR}_{key}": value
                                      for key, value in params.items() if value is not None})
        log.info("Submitit '%s' sweep output dir : %s", self._EXECUTOR,
                 self.config.hydra.sweep.dir)
        return executor
