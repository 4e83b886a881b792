"""Starting the workers: PyTorch's elastic launcher, or in place under torchrun/SLURM/mpirun.

Under an external launcher every process runs the entrypoint itself. Before Hydra starts,
`prepare_in_place()` translates SLURM's and MPI's variables into torch's (RANK, WORLD_SIZE,
LOCAL_RANK, MASTER_ADDR, ...) and has rank 0 hand every rank its start time, so that all of
them resolve the same Hydra run dir (`${run_time:...}` in conf/config.yaml).
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import tempfile
import threading
import uuid
from dataclasses import dataclass
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any, Callable, Iterator

from omegaconf import OmegaConf

from parallab.config import naming
from parallab.config.errors import ConfigError, OneLineError, environment_set
from parallab.launching import slurm
from parallab.launching.forking import (AGENT_SIGNALS, kept_running, ready,
                                        server_env)

log = logging.getLogger(__name__)

RUN_TIME_ENV = "PARALLAB_RUN_TIME"
_RUN_TIME_KEY = "parallab/run_time"
_store = None  # the TCPStore opened before Hydra under mpirun, reused by the process group
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


def detect() -> InPlace | None:
    """Which external launcher started this process, if any."""
    if _int("WORLD_SIZE") is not None and _int("RANK") is not None and "LOCAL_RANK" in os.environ:
        world = _int("WORLD_SIZE")
        return InPlace("torchrun", _int("RANK"), _int("LOCAL_RANK"), world,
                       _int("LOCAL_WORLD_SIZE", world))
    if slurm.in_step() and (_int("SLURM_NTASKS") or 1) > 1:
        node = _int("SLURM_NODEID", 0)
        counts = slurm.tasks_per_node(os.environ.get("SLURM_STEP_TASKS_PER_NODE")
                                      or os.environ.get("SLURM_TASKS_PER_NODE", ""))
        world = _int("SLURM_NTASKS")
        return InPlace("slurm", _int("SLURM_PROCID"), _int("SLURM_LOCALID", 0), world,
                       counts[node] if node < len(counts) else world,
                       _int("SLURM_STEP_NUM_NODES") or len(counts) or 1)
    if (_int("SUBMITIT_LOCAL_NTASKS") or 1) > 1:  # hydra/launcher=submitit_local, tasks > 1
        world = _int("SUBMITIT_LOCAL_NTASKS")
        return InPlace("submitit", _int("SUBMITIT_LOCAL_GLOBALID"),
                       _int("SUBMITIT_LOCAL_LOCALID", 0), world, world)
    if _int("OMPI_COMM_WORLD_SIZE") is not None:
        world = _int("OMPI_COMM_WORLD_SIZE")
        return InPlace("mpirun", _int("OMPI_COMM_WORLD_RANK"),
                       _int("OMPI_COMM_WORLD_LOCAL_RANK", 0), world,
                       _int("OMPI_COMM_WORLD_LOCAL_SIZE", world))
    if (_int("PMI_SIZE") or 1) > 1:
        world = _int("PMI_SIZE")
        return InPlace("mpirun", _int("PMI_RANK"), _int("MPI_LOCALRANKID", 0), world,
                       _int("MPI_LOCALNRANKS", world))
    return None


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


def _open_store(ctx: InPlace):
    from torch.distributed import TCPStore

    host, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":  # torchrun hosts one already
        return TCPStore(host, port, is_master=False, timeout=timedelta(minutes=5))
    return TCPStore(host, port, ctx.world_size, is_master=ctx.rank == 0,
                    timeout=timedelta(minutes=5), wait_for_workers=False)


def prepare_in_place() -> InPlace | None:
    """Under an external launcher: torch's env variables, and one run time for all ranks
    (under SLURM the run dir is named by the job instead: slurm.run_name)."""
    global _store, _prepared
    if _prepared is not None:  # once per process (the exported variables read as torchrun's)
        return _prepared
    ctx = detect()
    if ctx is None or RUN_TIME_ENV in os.environ:
        return ctx
    _export_torch_env(ctx)
    _prepared = ctx
    if ctx.launcher == "slurm":
        return ctx
    store = _open_store(ctx)
    if ctx.rank == 0 and not store.check([_RUN_TIME_KEY]):  # kept across elastic restarts
        store.set(_RUN_TIME_KEY, datetime.now().isoformat())
    os.environ[RUN_TIME_ENV] = store.get(_RUN_TIME_KEY).decode()
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        _store = store
    return ctx


def take_store(rendezvous_timeout_s: float):
    """The store the process group meets at, hosted by rank 0, for a job started in place
    (None under torchrun, whose agent hosts one): the one prepare_in_place opened, or one
    opened now under SLURM, where every rank reaches rank 0 within `rendezvous_timeout_s`
    or ends with one line that says why."""
    global _store
    store, _store = _store, None
    ctx = _prepared
    if store is None and ctx is not None and ctx.launcher == "slurm":
        store = meet(ctx, rendezvous_timeout_s, slurm.master_host()[1])
    return store


def meet(ctx: InPlace, timeout_s: float, source: str):
    """The TCPStore at MASTER_ADDR:MASTER_PORT, rank 0 hosting it until every rank has
    joined: a host that does not resolve ends the rank at once, a master not reached (or
    ranks that never come) within `timeout_s` ends it then, each in one line naming the host
    and what to set; `source`: where MASTER_ADDR came from."""
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
    try:
        return TCPStore(host, port, ctx.world_size, is_master=ctx.rank == 0,
                        timeout=timedelta(seconds=timeout_s), wait_for_workers=True)
    except DistError as error:
        waited = (f"not every rank reached it ({str(error).strip().splitlines()[0]})"
                  if ctx.rank == 0 else "it could not be reached")
        raise OneLineError(f"rank {ctx.rank}: {named}, port {port}: {waited} within "
                           f"parallel.rendezvous_timeout={timeout_s:g} s: check that every "
                           "rank started and that the port is open between the nodes (or "
                           "set MASTER_PORT)") from None


def restarted() -> bool:
    """This run was started again: the elastic agent restarted its workers, or SLURM
    requeued its job. It continues from its checkpoint (trainer.resume=auto)."""
    elastic_restarts = int(os.environ.get("TORCHELASTIC_RESTART_COUNT") or 0)
    return elastic_restarts > 0 or slurm.restart_count() > 0


def _run_time(pattern: str) -> str:
    stamp = os.environ.get(RUN_TIME_ENV)
    moment = datetime.fromisoformat(stamp) if stamp else datetime.now()
    return moment.strftime(pattern)


def _rank() -> int:
    """This process's rank, from whichever launcher started it: Hydra configures the log
    files before the app exports RANK (submitit calls the app in a fresh process)."""
    ctx = detect()
    return ctx.rank if ctx is not None else 0


def _rank_suffix() -> str:
    return naming.rank_suffix(_rank())


def _rank_zero(value: Any, otherwise: Any = None) -> Any:
    return value if _rank() == 0 else otherwise


def _run_name() -> str:
    """The default run dir's name: by the SLURM job (stable across a requeue) inside one,
    else by the date and time the run started."""
    return slurm.run_name() if slurm.in_job() else _run_time("%Y-%m-%d/%H-%M-%S")


def register_resolvers() -> None:
    """Resolvers conf/config.yaml uses so that every rank shares one run dir and log names
    (cached: the submitit launcher's jobs reuse the sweep dir their submitter resolved)."""
    OmegaConf.register_new_resolver("run_time", _run_time, use_cache=True, replace=True)
    OmegaConf.register_new_resolver("run_name", _run_name, use_cache=True, replace=True)
    OmegaConf.register_new_resolver("job_dir", naming.job_dir, replace=True)
    OmegaConf.register_new_resolver("rank_suffix", _rank_suffix, replace=True)
    OmegaConf.register_new_resolver("rank_zero", _rank_zero, replace=True)


def worker_env(cfg) -> dict[str, str]:
    """The environment of the workers a job of `cfg` starts: their threads, gloo on
    loopback (the built-in launcher starts one node), and what their fork server imports."""
    from parallab.launching.distributed import threads_for

    p = cfg.parallel
    threads = threads_for(p.world_size // p.nnodes, p.threads_per_worker)
    return {"OMP_NUM_THREADS": str(threads), **server_env(cfg)}


def master_port_problem() -> str | None:
    """MASTER_PORT, where the user set it for parallab's own launcher (its agent's store
    listens there): not a port number, or one in use on this machine, which ended the
    launch in a traceback once its workers had been announced."""
    import socket

    from parallab.launching import rendezvous

    value = os.environ.get("MASTER_PORT")
    if not value:
        return None
    unset = "unset it (each job then gets a free port)"
    if not value.isdigit() or not 0 < int(value) < 65536:
        return f"MASTER_PORT={value} is not a port number: {unset} or set one of 1-65535"
    with socket.socket() as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the store binds
        try:
            probe.bind((rendezvous.HOST, int(value)))
        except OSError:
            return f"MASTER_PORT={value} is in use on this machine: {unset} or set a free one"
    return None


def launch_config(config_class, world_size: int, max_restarts: int, logs: str | None = None):
    """torch's LaunchConfig for world_size workers on this machine, its agent's per-attempt
    dirs (the workers' error files) under `logs` (None: torch's default, a new
    /tmp/torchelastic_* dir a launch, which nothing removes). Fields newer torch releases
    added (the shutdown's grace, the signals the agent handles) are set where
    `config_class` has them: torch 2.11's takes neither."""
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs

    from parallab.launching import rendezvous

    port = os.environ.get("MASTER_PORT") or 0  # 0: a free port per job
    newer = {
        "shutdown_timeout": 30,  # a stopping worker's time to save before SIGKILL
        # not SIGINT/SIGTERM: torch's agent would turn them into an exception that stops
        # the workers before they save; _forwarding_stop_signals passes them on instead
        "signals_to_handle": AGENT_SIGNALS,
    }
    fields = config_class.__dataclass_fields__
    return config_class(
        min_nodes=1,
        max_nodes=1,
        nproc_per_node=world_size,
        run_id=f"parallab-{uuid.uuid4().hex[:12]}",
        rdzv_backend=rendezvous.register(),
        rdzv_endpoint=f"{rendezvous.HOST}:{port}",
        local_addr=rendezvous.HOST,
        max_restarts=max_restarts,
        monitor_interval=0.1,
        start_method="forkserver" if ready() else "spawn",
        logs_specs=DefaultLogsSpecs(log_dir=logs),
        **{key: value for key, value in newer.items() if key in fields},
    )


def elastic(entrypoint: Callable, args: tuple, world_size: int, max_restarts: int,
            worker_env: dict[str, str], requeue: tuple[int, ...] = ()) -> Any:
    """Run `entrypoint(*args)` in world_size workers on this machine; rank 0's result.
    `requeue`: the signals that stop them to requeue a SLURM job.

    The rendezvous listens on loopback only (more nodes go through torchrun/SLURM/mpirun).
    """
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    # the controlling process reports a failure once, with the root cause's traceback
    logging.getLogger("torch.distributed.elastic").setLevel(logging.CRITICAL)
    # the agent hands its own environment to the workers; its dirs go with the launch (a
    # failure's error file is read into the exception it raises)
    with tempfile.TemporaryDirectory(prefix="parallab-launch-") as logs, \
            environment_set(worker_env), _forwarding_stop_signals(requeue), kept_running():
        config = launch_config(LaunchConfig, world_size, max_restarts, logs)
        results = elastic_launch(config, entrypoint)(*args)
    return results[0]


def _workers() -> list[int]:
    """This process's children and their children (Linux /proc; none found elsewhere): the
    workers, forked by the fork server or spawned by the agent."""
    parents: dict[int, int] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()  # after "(comm)": state ppid
        except (OSError, IndexError):
            continue
        parents[int(stat.parent.name)] = int(fields[1])
    children = {pid for pid, parent in parents.items() if parent == os.getpid()}
    return sorted(children | {pid for pid, parent in parents.items() if parent in children})


@contextlib.contextmanager
def _forwarding_stop_signals(requeue: tuple[int, ...] = ()) -> Iterator[None]:
    """While the workers run, a SIGINT or SIGTERM to this process is passed on to them: they
    save at the next step the ranks agree on and end normally, and the job ends with them.
    Ctrl-C signals the whole group, so the workers see it twice, at once, and count it once
    (preemption.SAME_REQUEST_S); a scheduler that signals this process alone reaches them
    too. A later signal reaches them again and stops them at once. `requeue`: SLURM's
    time-limit warning, passed on alike and noted, so that this process requeues the job
    once the workers have saved."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def forward(signum: int, frame: object) -> None:
        if signum in requeue:
            slurm.note(signum)
        for pid in _workers():  # the fork server and the resource tracker ignore both
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signum)

    # torch's agent installs its own SIGHUP/SIGQUIT handlers and leaves them: put ours back
    previous = {signum: signal.getsignal(signum) for signum in (signal.SIGHUP, signal.SIGQUIT)}
    previous.update({signum: signal.signal(signum, forward) for signum in (
        signal.SIGINT, signal.SIGTERM, *requeue)})
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
