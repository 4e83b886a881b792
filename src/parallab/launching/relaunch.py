"""The command that starts a run again as it was started: under the launcher that started it
in place (torchrun, mpirun), where a bare `python train.py ... trainer.resume=auto` would
resume it on one process (the resume command a stopped run prints)."""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

from parallab.launching.in_place import InPlace

RELAUNCHED = ("torchrun", "mpirun")  # SLURM requeues its job itself; submitit restarts it


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
    return _from_parent(entry, _parent_argv(), sys.argv) or _from_counts(entry, ctx)


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
