"""The command that starts a run again as it was started: under the launcher that started it
in place (torchrun, mpirun, srun), where a bare `python train.py ... trainer.resume=auto`
would resume it on one process (the resume command a stopped run prints)."""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

from parallab.launching.in_place import InPlace

# submitit restarts its own tasks (its SLURM jobs' too: SUBMITIT_EXECUTOR, below)
RELAUNCHED = ("torchrun", "mpirun", "slurm")


def launched(entry: list[str], ctx: InPlace | None) -> list[str]:
    """`entry` (`python train.py` or `parallab train`, with its config flags) as the
    launcher that started this process (`ctx`) starts it; `entry` itself where none did.

    The launcher's own command line (its parent's, on Linux) is used where it is verifiably
    the one that started this process: it holds what its variables do not (torchrun's
    rendezvous endpoint, --standalone, a log dir; mpirun's hosts and flags). Where it cannot
    be read or is not the launcher (a wrapper script between them, a remote node's daemon,
    /proc hidden), the counts the launcher's variables give, which every rank holds."""
    if ctx is None or ctx.launcher not in RELAUNCHED:
        return entry
    if ctx.launcher == "slurm":
        # a task's parent is slurmstepd (`slurmstepd: [JOB.STEP]`), and srun itself runs
        # elsewhere, often on another node: its command line is nowhere to read, its
        # options are in the variables it gives every task
        if os.environ.get("SUBMITIT_EXECUTOR"):  # submitit's sbatch ran this srun step
            return entry
        return srun_command(entry, ctx, os.environ)
    return _from_parent(entry, _parent_argv(), sys.argv) or _from_counts(entry, ctx)


# srun's options that it hands each task in a variable of its own (SLURM_NTASKS_PER_NODE
# only where the step or its job was given it), kept where set
SRUN_OPTIONS = (("SLURM_NTASKS_PER_NODE", "--ntasks-per-node"),
                ("SLURM_CPUS_PER_TASK", "--cpus-per-task"),
                ("SLURM_GPUS_PER_NODE", "--gpus-per-node"),
                ("SLURM_GPUS_PER_TASK", "--gpus-per-task"),
                ("SLURM_GPUS", "--gpus"))


def srun_command(entry: list[str], ctx: InPlace, env) -> list[str]:
    """`entry` as srun starts it, from what SLURM told this task (`env`): the step's tasks
    and nodes, and the options among SRUN_OPTIONS it was given. Flags no variable carries
    (--kill-on-bad-exit, a partition given on the command line) the user adds as before."""
    options = [f"--ntasks={ctx.world_size}", f"--nodes={ctx.nnodes}"]
    options += [f"{flag}={env[name]}" for name, flag in SRUN_OPTIONS if env.get(name)]
    return ["srun", *options, *entry]


def _parent_argv() -> list[str]:
    try:
        raw = Path(f"/proc/{os.getppid()}/cmdline").read_bytes()
    except OSError:
        return []
    return raw.decode(errors="replace").split("\0")[:-1]


def _from_parent(entry: list[str], parent: list[str], own: list[str]) -> list[str] | None:
    """The launcher's command (`parent`), where it ends with this process's own (`own`,
    its program and arguments, as torchrun and mpirun pass them on): what precedes the
    program there, then the program as the user named it and `entry`'s flags."""
    at = len(parent) - len(own)
    if at < 1 or parent[at + 1:] != own[1:] or \
            Path(parent[at]).name != Path(own[0]).name or not _a_launcher(parent[:at]):
        return None
    launcher = parent[:at]
    # torchrun's script runs under its interpreter: the user typed `torchrun`
    if len(launcher) > 1 and Path(launcher[1]).name == "torchrun" and \
            Path(launcher[0]).name.startswith("python"):
        launcher = [_as_typed(launcher[1]), *launcher[2:]]
    # the program's own words in `entry`: `python train.py`, or `parallab` (of `train`)
    return [*launcher, parent[at], *entry[2 if entry[0] == "python" else 1:]]


# what started a rank in place: a wrapper script between them is not it (its command
# dropped, the resume would run on one process)
LAUNCHERS = ("torchrun", "mpirun", "mpiexec", "orterun", "prterun")


def _a_launcher(words: list[str]) -> bool:
    """`words` start a launcher: its program, or a Python running it (torchrun's script,
    `-m torch.distributed.run`)."""
    names = [Path(w).name for w in words[:3]]
    return bool(names) and (names[0] in LAUNCHERS or names[0].startswith("python") and (
        names[1:2] and names[1] in LAUNCHERS or names[1:3] == ["-m", "torch.distributed.run"]))


def _as_typed(path: str) -> str:
    """A program by its name where the PATH finds the same one."""
    name = Path(path).name
    found = shutil.which(name)
    return name if found and Path(found).resolve() == Path(path).resolve() else path


def _from_counts(entry: list[str], ctx: InPlace) -> list[str]:
    """The launcher's command from the counts it gave this process. torchrun's rendezvous
    across nodes (its endpoint) is not among them: the command names the nodes, and the
    user adds it as before."""
    if ctx.launcher == "mpirun":
        return ["mpirun", "-np", str(ctx.world_size), *entry]
    nodes = ["--standalone"] if ctx.nnodes == 1 else [f"--nnodes={ctx.nnodes}"]
    # torchrun runs a script under Python itself; a command (parallab) with --no-python
    program = entry[1:] if entry[0] == "python" else ["--no-python", *entry]
    return ["torchrun", *nodes, f"--nproc-per-node={ctx.local_world_size}", *program]
