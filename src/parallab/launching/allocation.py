"""The SLURM allocation each job of a sweep needs, for `hydra/launcher=submitit_slurm`.

hydra-submitit-launcher submits a sweep as one job array, every job with the same
allocation; a sweep over `parallel.world_size` needs as many SLURM tasks as ranks (ranks run
in place, one per task), on as many nodes as the ranks need, with a GPU per rank on CUDA.
Jobs of different sizes cannot share an array, so parallab's launcher (the Hydra plugin in
hydra_plugins/parallab_launchers/, where Hydra requires plugins to be) groups the sweep's jobs
by the allocation computed here and submits one array per group. It takes the plugin's
`submitit_slurm` name, the one users already type; `nodes` and `tasks_per_node` left null
are sized from the partition (`sinfo`), keys the user sets win.
"""

from __future__ import annotations

import logging
import math
import re
import shutil
import subprocess
from dataclasses import dataclass
from typing import Any, Optional

from hydra.core.config_store import ConfigStore
from omegaconf import DictConfig

from parallab.config.errors import ConfigError

log = logging.getLogger(__name__)


def register() -> None:
    """This launcher's config in the place of the plugin's `submitit_slurm`. Hydra's scan of
    its plugins runs their modules, registering theirs, whenever it first happens: it is
    made to happen here, once, so that this registration comes after it and stays. (The
    plugin is the slurm extra's: imported here, so that simulate's sbatch lines can take
    this module's rule without it.)"""
    from hydra.core.plugins import Plugins
    from hydra_plugins.hydra_submitit_launcher.config import SlurmQueueConf

    @dataclass
    class AllocatingSlurmConf(SlurmQueueConf):
        _target_: str = "hydra_plugins.parallab_launchers.submitit_slurm.SlurmLauncher"
        # null: as many nodes as the job's ranks need, each holding what a node of the
        # partition holds (its GPUs on CUDA, else its CPUs); set, either wins
        nodes: Optional[int] = None  # type: ignore[assignment]
        tasks_per_node: Optional[int] = None  # type: ignore[assignment]

    Plugins.instance()
    ConfigStore.instance().store(group="hydra/launcher", name="submitit_slurm",
                                 node=AllocatingSlurmConf, provider="parallab")


@dataclass(frozen=True)
class Partition:
    """What a node of the partition holds (the smallest kind of node in it) and how many."""

    name: str
    cpus: int
    gpus: int
    nodes: int

    @classmethod
    def read(cls, name: str | None) -> "Partition":
        """The partition `name` (None: the cluster's default) as sinfo reports it."""
        sinfo = shutil.which("sinfo")
        if sinfo is None:
            raise ConfigError("hydra/launcher=submitit_slurm: SLURM's sinfo is not on PATH: run "
                              "the sweep where SLURM's commands are (a login node)")
        result = subprocess.run([sinfo, "-h", "-o", "%P|%c|%G|%D"], capture_output=True,
                                text=True, timeout=60)
        rows = [line.split("|") for line in result.stdout.splitlines() if line.count("|") == 3]
        if result.returncode != 0 or not rows:
            raise ConfigError(f"hydra/launcher=submitit_slurm: sinfo found no partition "
                              f"({(result.stderr or result.stdout).strip()[:200]})")
        default = next((r[0].rstrip("*") for r in rows if r[0].endswith("*")), rows[0][0])
        wanted = name or default
        mine = [r for r in rows if r[0].rstrip("*") == wanted]
        if not mine:
            known = sorted({r[0].rstrip("*") for r in rows})
            raise ConfigError(f"hydra.launcher.partition={wanted}: no such partition (this "
                              f"cluster has {', '.join(known)})")
        return cls(wanted, min(int(r[1].rstrip("+")) for r in mine),
                   min(_gpus(r[2]) for r in mine), sum(int(r[3]) for r in mine))


def _gpus(gres: str) -> int:
    """GPUs per node from sinfo's %G: 'gpu:4', 'gpu:a100:8(S:0-1)', '(null)'."""
    match = re.search(r"gpu(?::[^:,(]+)?:(\d+)", gres)
    return int(match[1]) if match else 0


@dataclass(frozen=True)
class Allocation:
    nodes: int
    tasks_per_node: int
    gpus_per_node: int | None

    def describe(self) -> str:
        gpus = f", {self.gpus_per_node} GPUs each" if self.gpus_per_node else ""
        return f"{self.nodes} node(s) x {self.tasks_per_node} task(s){gpus}"


def allocation(cfg: DictConfig, launcher: dict[str, Any], partition: Partition,
               job: str, plan) -> Allocation:
    """The allocation job `cfg` needs: a task per rank for the layouts that run processes
    (in place, across nodes where one node cannot hold them), one task with every device for
    the others; ConfigError where the keys set contradict it or the partition cannot hold it.
    `plan`: the job's layout (parallel.PLANS[cfg.parallel.name]), handed down by the
    launcher: whether it runs a process per rank, and its default_world_size, the one the
    checks give the job where parallel.world_size is null."""
    p = cfg.parallel
    device = getattr(cfg.device, "value", cfg.device)  # the Device enum, or its name
    cuda = device == "cuda" or (device == "auto" and partition.gpus > 0)
    held = partition.gpus if cuda else partition.cpus // (launcher.get("cpus_per_task") or 1)
    # the GPUs the job's checks will see: a node's, for a process per GPU; a one-process
    # job is given the GPUs its world size asks for, so its default counts none
    world = p.world_size or plan.default_world_size(held if cuda and plan.processes else 0)
    gpus = launcher.get("gpus_per_node")
    if not plan.processes:  # one process drives every device
        needed = Allocation(1, 1, gpus or (world if cuda else None))
    else:
        needed = spread(world, launcher.get("nodes"), launcher.get("tasks_per_node"), held, job)
        needed = Allocation(needed.nodes, needed.tasks_per_node,
                            gpus or (needed.tasks_per_node if cuda else None))
    if needed.nodes > partition.nodes or (cuda and (needed.gpus_per_node or 0) > partition.gpus):
        raise ConfigError(f"{job} needs {needed.describe()}, but a node of partition "
                          f"{partition.name} holds {partition.cpus} CPUs and {partition.gpus} "
                          f"GPUs, and it has {partition.nodes} node(s): lower "
                          "parallel.world_size, or choose hydra.launcher.partition")
    if needed.tasks_per_node > held and plan.processes:
        raise ConfigError(f"{job}: hydra.launcher.tasks_per_node={needed.tasks_per_node} is "
                          f"more ranks than a node of partition {partition.name} holds "
                          f"({held}): set at most {held}, or leave it out")
    return needed


def spread(world: int, nodes: int | None, per_node: int | None, held: int,
           job: str) -> Allocation:
    """`world` ranks over nodes: as the keys set say, else as few nodes as hold them, the
    same number on each (the rule simulate's sbatch lines print too)."""
    if nodes is not None and per_node is not None:
        if nodes * per_node != world:
            raise ConfigError(f"{job}: parallel.world_size={world}, but hydra.launcher.nodes="
                              f"{nodes} x tasks_per_node={per_node} start {nodes * per_node} "
                              "tasks: set the launcher's keys to make world_size tasks, or "
                              "leave them out (the launcher sizes each job)")
        return Allocation(nodes, per_node, None)
    if nodes is None:
        nodes = math.ceil(world / max(1, per_node or min(world, held)))
    if world % nodes:
        raise ConfigError(f"{job}: parallel.world_size={world} does not split evenly over the "
                          f"{nodes} nodes it needs: use a multiple of {nodes}")
    return Allocation(nodes, world // nodes, None)
