"""Processes an external launcher started (torchrun, SLURM's srun, mpirun, submitit's local
tasks), each running the entrypoint itself: which launcher, recognised by the whole set of
variables it sets; torch's variables exported from its own before Hydra starts
(prepare_in_place); and the ranks' meeting at their master once the config is composed,
within parallel.rendezvous_timeout, where rank 0 hands every rank its start time so that all
of them name one run dir (meet_in_place, called from launching/start.py).
"""

from __future__ import annotations

import contextlib
import itertools
import os
import sys
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Iterator

from parallab.config.errors import ConfigError, OneLineError
from parallab.launching import slurm

RUN_TIME_ENV = "PARALLAB_RUN_TIME"
_RUN_TIME_KEY = "parallab/run_time"
_store = None  # the TCPStore the ranks met at, hosted by rank 0, reused by the process group
_prepared: InPlace | None = None  # what prepare_in_place found in this process


@dataclass(frozen=True)
class InPlace:
    """This process was started by an external launcher."""

    launcher: str  # torchrun | slurm | submitit | mpirun
    rank: int
    local_rank: int
    world_size: int
    local_world_size: int
    nodes: int | None = None  # where the launcher says (SLURM: nodes may hold unequal counts)

    @property
    def nnodes(self) -> int:
        return self.nodes or max(1, self.world_size // self.local_world_size)


def _int(name: str, default: int | None = None) -> int | None:
    value = os.environ.get(name)
    if value in (None, ""):
        return default
    try:
        return int(value)
    except ValueError:
        raise ConfigError(f"{name}={value!r} is not a whole number: a launcher sets it; "
                          f"unset it where none started this process") from None


# each launcher's variables, every one of which it sets for each process it starts: all of
# them mark it, never RANK or WORLD_SIZE alone, which a shell keeps once exported; SLURM's
# step is told by its task instead (slurm.in_job)
TORCHRUN = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK",
            "TORCHELASTIC_RUN_ID", "MASTER_ADDR", "MASTER_PORT")
SUBMITIT = ("SUBMITIT_LOCAL_NTASKS", "SUBMITIT_LOCAL_GLOBALID", "SUBMITIT_LOCAL_LOCALID",
            "SUBMITIT_LOCAL_JOB_ID")
OPEN_MPI = ("OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_LOCAL_RANK",
            "OMPI_COMM_WORLD_LOCAL_SIZE")
MPICH = ("PMI_SIZE", "PMI_RANK", "MPI_LOCALRANKID", "MPI_LOCALNRANKS")
# where a partial set is left, a run would read what no launcher set: the torch variables a
# process group reads (MASTER_ADDR and MASTER_PORT also choose parallab's own port) and the
# ranks of each launcher
PARTIAL = {"torchrun": TORCHRUN[:6], "submitit": SUBMITIT, "mpirun (Open MPI)": OPEN_MPI,
           "mpirun (MPICH)": MPICH[:2]}


def _complete(names: tuple[str, ...]) -> bool:
    return all(os.environ.get(name) not in (None, "") for name in names)


def detect() -> InPlace | None:
    """Which external launcher started this process, if any, recognised by the whole set
    of variables it sets; ConfigError where some of a launcher's variables are left without
    the rest, naming them."""
    if _complete(TORCHRUN):
        world = _int("WORLD_SIZE")
        return InPlace("torchrun", _int("RANK"), _int("LOCAL_RANK"), world,
                       _int("LOCAL_WORLD_SIZE"))
    if slurm.in_step() and (_int("SLURM_NTASKS") or 1) > 1:
        node = _int("SLURM_NODEID", 0)
        counts = slurm.tasks_per_node(os.environ.get("SLURM_STEP_TASKS_PER_NODE")
                                      or os.environ.get("SLURM_TASKS_PER_NODE", ""))
        world = _int("SLURM_NTASKS")
        return InPlace("slurm", _int("SLURM_PROCID"), _int("SLURM_LOCALID", 0), world,
                       counts[node] if node < len(counts) else world,
                       _int("SLURM_STEP_NUM_NODES") or len(counts) or 1)
    if _complete(SUBMITIT) and _int("SUBMITIT_LOCAL_NTASKS") > 1:  # submitit_local, tasks > 1
        world = _int("SUBMITIT_LOCAL_NTASKS")
        return InPlace("submitit", _int("SUBMITIT_LOCAL_GLOBALID"),
                       _int("SUBMITIT_LOCAL_LOCALID"), world, world)
    if _complete(OPEN_MPI):
        return InPlace("mpirun", _int("OMPI_COMM_WORLD_RANK"), _int("OMPI_COMM_WORLD_LOCAL_RANK"),
                       _int("OMPI_COMM_WORLD_SIZE"), _int("OMPI_COMM_WORLD_LOCAL_SIZE"))
    if _complete(MPICH) and _int("PMI_SIZE") > 1:
        return InPlace("mpirun", _int("PMI_RANK"), _int("MPI_LOCALRANKID"), _int("PMI_SIZE"),
                       _int("MPI_LOCALNRANKS"))
    _refuse_partial()
    return None


def _refuse_partial() -> None:
    """Some of a launcher's variables without the rest: left in the shell by an earlier
    `export`, or copied from a job. Read, they made a one-process run take a rank or a
    world size it did not launch (half the data, a loss divided by ranks that never ran)."""
    for launcher, names in PARTIAL.items():
        left = [name for name in names if name in os.environ]
        if left and len(left) < len(names):
            said = " ".join(f"{name}={os.environ[name]}" for name in left)
            raise ConfigError(f"{said} in the environment, but {launcher} did not start this "
                              f"process (it sets all of {', '.join(names)}): unset "
                              f"{' '.join(left)}, or start the run with {launcher.split()[0]}")


def current() -> InPlace | None:
    """The launcher that started this process (prepare_in_place's answer, once made)."""
    return _prepared or detect()


def _export_torch_env(ctx: InPlace) -> None:
    env = os.environ
    env.update(RANK=str(ctx.rank), LOCAL_RANK=str(ctx.local_rank),
               WORLD_SIZE=str(ctx.world_size), LOCAL_WORLD_SIZE=str(ctx.local_world_size))
    if ctx.launcher == "slurm":
        env.setdefault("MASTER_ADDR", slurm.master_host()[0])
        env.setdefault("MASTER_PORT", str(15000 + int(env.get("SLURM_JOB_ID", "0")) % 20000))
    if ctx.launcher == "submitit":  # one job id per job: a port per job
        env.setdefault("MASTER_PORT", str(15000 + int(env["SUBMITIT_LOCAL_JOB_ID"]) % 20000))
    env.setdefault("MASTER_ADDR", "127.0.0.1")
    env.setdefault("MASTER_PORT", "29500")


def prepare_in_place() -> InPlace | None:
    """Under an external launcher: torch's env variables, exported before Hydra starts (the
    ranks meet once the config is composed: meet_in_place). ConfigError where a
    launcher's variables are left partly set."""
    global _prepared
    if _prepared is not None:  # once per process (the exported variables read as torchrun's)
        return _prepared
    ctx = detect()
    if ctx is not None:
        _export_torch_env(ctx)
        _prepared = ctx
    return ctx


def _agent_hosts() -> bool:
    """torchrun's agent hosts the store its workers meet at."""
    return os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"


def meet_in_place(timeout_s: float) -> None:
    """The ranks a launcher started in place meet at their master, rank 0 hosting the store
    (torchrun's agent hosts it under torchrun), each within `timeout_s` or ending in one line
    that says why (meet); rank 0 hands every rank its start time there, so that all of them
    name one run dir (kept across torchrun's restarts). Called once the config is composed
    and before the run dir is named (launching/start.py), and at a job's start where that
    did not happen (take_store)."""
    global _store
    ctx = _prepared
    if ctx is None or _store is not None:
        return
    source = slurm.master_host()[1] if ctx.launcher == "slurm" else "MASTER_ADDR"
    store = meet(ctx, timeout_s, source)
    if RUN_TIME_ENV not in os.environ:
        if ctx.rank == 0 and not store.check([_RUN_TIME_KEY]):
            store.set(_RUN_TIME_KEY, datetime.now().isoformat())
        os.environ[RUN_TIME_ENV] = store.get(_RUN_TIME_KEY).decode()
    if not _agent_hosts():
        _store = store


def take_store(rendezvous_timeout_s: float):
    """The store the process group meets at, for a job started in place (None for a job not
    started in place): hosted by rank 0, the one the ranks met at or one they meet at now (a
    sweep's later jobs); under torchrun, the agent's, in a key space of this job's own."""
    global _store
    if _prepared is not None and _agent_hosts():
        return _job_space(meet(_prepared, rendezvous_timeout_s, "MASTER_ADDR"))
    if _prepared is not None:
        meet_in_place(rendezvous_timeout_s)
    store, _store = _store, None
    return store


_jobs = itertools.count()  # the jobs this process has run in place (a sweep's, in turn)


def _job_space(agent_store):
    """torch's env:// meets at torchrun's agent's store with a key space per restart, not
    per job: a sweep's second job would read the first's gloo addresses and wait on them
    till the backend's timeout. Every rank runs a sweep's jobs in the same order."""
    from torch.distributed import PrefixStore

    restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    return PrefixStore(f"parallab/attempt_{restart}/job_{next(_jobs)}", agent_store)


def meet(ctx: InPlace, timeout_s: float, source: str):
    """The TCPStore at MASTER_ADDR:MASTER_PORT, rank 0 hosting it until every rank has
    joined (a client of torchrun's agent's): a host that does not resolve ends the rank at
    once, a master not reached (or ranks that never come) within `timeout_s` ends it then,
    each in one line naming the host and what to set; `source`: where MASTER_ADDR came from."""
    import socket

    from torch.distributed import DistError, TCPStore

    host, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    named = f"the master {host}" + ("" if source == "MASTER_ADDR" else
                                    f" (the first host of {source}={os.environ[source]})")
    try:
        socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror as error:
        raise ConfigError(f"rank {ctx.rank}: {named} does not resolve on this node "
                          f"({error.strerror}): make the nodes' names resolve, or set "
                          "MASTER_ADDR to rank 0's address") from None
    hosting = ctx.rank == 0 and not _agent_hosts()
    timeout = timedelta(seconds=timeout_s)
    try:
        if not hosting:
            _reach(host, port, timeout_s)
        with _c10d_quieted():
            if _agent_hosts():  # its store counts no workers
                return TCPStore(host, port, is_master=False, timeout=timeout)
            return TCPStore(host, port, ctx.world_size, is_master=hosting, timeout=timeout,
                            wait_for_workers=True)
    except (DistError, TimeoutError) as error:
        waited = (f"not every rank reached it ({str(error).strip().splitlines()[0]})"
                  if hosting else "it could not be reached")
        raise OneLineError(f"rank {ctx.rank}: {named}, port {port}: {waited} within "
                           f"parallel.rendezvous_timeout={timeout_s:g} s: check that every "
                           "rank started and that the port is open between the nodes (or "
                           "set MASTER_PORT)") from None


def _reach(host: str, port: int, timeout_s: float) -> None:
    """Wait until the master's port takes a connection, within `timeout_s` (TimeoutError
    then): a client TCPStore given that timeout retried for twice as long before it said so."""
    import socket
    import time

    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with socket.create_connection((host, port), timeout=max(0.1, min(
                    5.0, deadline - time.monotonic()))):
                return
        except OSError:
            if time.monotonic() >= deadline:
                raise TimeoutError(f"{host}:{port} refused or did not answer") from None
            time.sleep(min(0.2, max(0.0, deadline - time.monotonic())))


@contextlib.contextmanager
def _c10d_quieted() -> Iterator[None]:
    """The process's stderr (its file descriptor) sent to /dev/null: c10d's C++ logs each
    retry of a connection, with a stack of frames, dozens of lines before the one that says
    why the rank ends."""
    sys.stderr.flush()
    saved = os.dup(2)
    with open(os.devnull, "w") as devnull:
        os.dup2(devnull.fileno(), 2)
    try:
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


def restarted() -> bool:
    """This run was started again: torchrun's agent (or parallab's own, in a worker)
    restarted its workers, or SLURM requeued its job. It continues from its checkpoint
    (trainer.resume=auto). A restart count left in a shell is no restart: a process no
    agent started, a controller that launches its own workers among them, ignores it."""
    ctx = current()
    elastic = ctx is not None and ctx.launcher == "torchrun" and int(
        os.environ.get("TORCHELASTIC_RESTART_COUNT") or 0) > 0
    return elastic or slurm.restart_count() > 0
