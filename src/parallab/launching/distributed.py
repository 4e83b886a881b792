"""The process's place in the job: rank, device, threads, and the process group.

With in_place.py, the only module that reads RANK, LOCAL_RANK, WORLD_SIZE and friends;
everything else receives a `Dist` and asks it.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Iterator

import torch
import torch.distributed as dist

from parallab.config.errors import ConfigError, quieted

# how a peer's end shows on the ranks still running (gloo raises a plain RuntimeError)
PEER_GONE = ("Connection reset by peer", "Connection closed by peer", "Broken pipe")
PEER_FAILURE_GRACE_S = 1.0  # ten of the launcher agent's monitor intervals


def lost_a_peer(error: BaseException) -> bool:
    """The error is this rank's view of another rank's failure: a collective or the store
    failed (torch's DistError), or a connection to a peer broke."""
    return isinstance(error, dist.DistError) or any(m in str(error) for m in PEER_GONE)


@dataclass(frozen=True)
class Dist:
    rank: int
    local_rank: int
    world_size: int
    local_world_size: int
    device: torch.device
    backend: str | None  # None: no process group in this job

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def all_reduce_sum(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum `tensor` over all ranks in place (a no-op without a process group)."""
        return self._all_reduce(tensor, dist.ReduceOp.SUM)

    def all_reduce_min(self, tensor: torch.Tensor) -> torch.Tensor:
        return self._all_reduce(tensor, dist.ReduceOp.MIN)

    def all_reduce_max(self, tensor: torch.Tensor) -> torch.Tensor:
        return self._all_reduce(tensor, dist.ReduceOp.MAX)

    def _all_reduce(self, tensor: torch.Tensor, op) -> torch.Tensor:
        if self.backend is not None and self.world_size > 1:
            dist.all_reduce(tensor, op=op)
        return tensor


def rank_from_env() -> int:
    return int(os.environ.get("RANK", 0))


def restart_count() -> int:
    """How many times the elastic agent has restarted this worker group."""
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0))


def gpu_index(local_rank: int, local_world_size: int, visible: int) -> int:
    """The CUDA device a rank takes among the `visible` ones its launcher left it. Under
    SLURM with --gpus-per-node every task of a node sees all of the node's GPUs and takes
    its own by its local rank; with --gpus-per-task=1 (or --gpu-bind) each sees only its
    own, device 0."""
    if visible >= local_world_size:
        return local_rank
    if visible == 1:
        return 0
    raise ConfigError(f"{local_world_size} ranks on this node see {visible} GPUs "
                      f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', '')}): "
                      "give each rank one GPU (srun --gpus-per-task=1) or the node's GPUs to "
                      "all (--gpus-per-node=N with --ntasks-per-node=N)")


def cpu_cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def threads_for(local_workers: int, threads_per_worker: int | None) -> int:
    """Intra-op threads per worker: as configured, else the cores shared out, at least one."""
    return threads_per_worker or max(1, cpu_cores() // local_workers)


def setup(device_type: str, backend: str | None, timeout_s: float,
          threads_per_worker: int | None, store: dist.Store | None = None) -> Dist:
    """Join the job described by the environment; without a `backend`, one process, rank 0
    of 1, whatever RANK or WORLD_SIZE a shell left set: a one-process layout reads no rank
    or world size, which only a launcher of several processes sets.

    `store` is one the launcher already opened at MASTER_ADDR:MASTER_PORT (SLURM, mpirun);
    without it the group rendezvouses by env://, which under torchrun uses the agent's store.
    """
    env = os.environ if backend is not None else {}
    rank = int(env.get("RANK", 0))
    world_size = int(env.get("WORLD_SIZE", 1))
    local_rank = int(env.get("LOCAL_RANK", 0))
    local_world_size = int(env.get("LOCAL_WORLD_SIZE", 1))

    if device_type == "cuda":  # the rank's own GPU among those its launcher left visible
        device = torch.device("cuda", gpu_index(local_rank, local_world_size,
                                                torch.cuda.device_count()))
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    torch.set_num_threads(threads_for(local_world_size, threads_per_worker))

    if backend is not None:
        dist.init_process_group(
            backend=backend,
            init_method=None if store else "env://",
            store=store,
            rank=rank,
            world_size=world_size,
            timeout=timedelta(seconds=timeout_s),
            device_id=device if backend == "nccl" else None,
        )
    return Dist(rank, local_rank, world_size, local_world_size, device, backend)


def attempt_store(timeout_s: float) -> dist.Store:
    """For a worker of parallab's own elastic launch: the agent's store, keyed by attempt.

    The agent's store outlives a restart and torch's env:// rendezvous adds no per-attempt
    prefix, so a restarted group could read the previous attempt's gloo addresses and fail
    with "Connection refused"; each attempt gets its own key space here.
    """
    env = os.environ
    agent_store = dist.TCPStore(env["MASTER_ADDR"], int(env["MASTER_PORT"]), is_master=False,
                                timeout=timedelta(seconds=timeout_s))
    return dist.PrefixStore(f"parallab/attempt_{restart_count()}", agent_store)


def leave_together(store: dist.Store, job: Dist, timeout_s: float = 60.0) -> None:
    """Rank 0 hosts the store under SLURM/mpirun: it exits once every peer is done with it
    (a peer whose store vanished under it aborted: "terminate called without an active
    exception")."""
    left = store.add("parallab/left", 1)
    deadline = time.monotonic() + timeout_s
    while job.is_main and left < job.world_size and time.monotonic() < deadline:
        time.sleep(0.05)
        left = store.add("parallab/left", 0)


def teardown() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def interfaces_problem(variable: str) -> str | None:
    """What is wrong with the network interfaces `variable` names (a comma-separated list,
    as gloo reads GLOO_SOCKET_IFNAME), if this machine lacks one: launched, every rank
    would fail to connect, each with its traceback."""
    import socket

    named = [n for n in os.environ.get(variable, "").split(",") if n]
    present = sorted(name for _, name in socket.if_nameindex())
    missing = [n for n in named if n not in present]
    if missing:
        return (f"{variable}={os.environ[variable]} names no interface of this machine "
                f"({', '.join(missing)}; it has {', '.join(present)}): unset it or name one "
                "of those")
    return None


@contextlib.contextmanager
def fake_group(world_size: int, rank: int = 0) -> Iterator[None]:
    """torch's fake process group as the default group, `rank` of `world_size`: collectives
    return at once, so that a layout of any size is built and run on fake tensors in this
    process (advise's memory, simulate's trace). An outer group (a test's) is left as it
    is; the layouts' start-up lines of real runs are not said."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        yield
        return
    hook = sys.excepthook  # which init_process_group wraps, to prefix a rank, for good
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    try:
        with quieted("parallab.parallel", logging.WARNING):
            yield
    finally:
        dist.destroy_process_group()
        sys.excepthook = hook
