"""cluster=this: this machine's rates, for ranks that are processes sharing its cores.

Each op a trace records is run for real (Timer), its tensors made from their shapes: the
small matmuls, attention kernels and pointwise ops of a model a CPU trains take times that
no rate of a large matmul or a copy gives. Measured once and kept (~/.cache/parallab):
what DTensor's dispatch adds to an op and FSDP2's hooks to a unit (a CPU pays them on its
cores; a GPU mostly hides them behind its kernels), an eager op's own time in a training
step (the module call and autograd around it), a square matmul's FLOP/s and a large
copy's bytes per second (the rates where an op cannot be run from its shapes), and an
all-reduce's fixed cost and bus bandwidth between two local processes over gloo. A rank
of a job of n processes gets its share: its threads, slowed where the n ranks' threads
outnumber the cores, and 1/n of the memory's bandwidth while they all compute.
"""

from __future__ import annotations

import dataclasses
import json
import os
import platform
import time
from pathlib import Path

import torch

from parallab.config.schema import ClusterConfig, NcclLatency
from parallab.simulate.cluster import GBIT, Rates

CACHE = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "parallab"


def _timed(work, repeats: int = 5) -> float:
    work()  # first: allocation, kernel choice
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        work()
        times.append(time.perf_counter() - start)
    return min(times)  # the least: a shared machine only ever slows a run down


def matmul_flops(dtype: torch.dtype, threads: int, size: int = 768) -> float:
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        a = torch.randn(size, size, dtype=dtype)
        return 2 * size**3 / _timed(lambda: a @ a)
    finally:
        torch.set_num_threads(before)


def copy_bytes_per_s(megabytes: int = 128) -> float:
    a = torch.empty(megabytes * 2**20 // 4)
    b = torch.empty_like(a)
    return 2 * a.numel() * 4 / _timed(lambda: b.copy_(a))


def op_seconds() -> float:
    """An eager op's own time in a training step: a gpt so small its ops compute nothing,
    its forward and backward timed and shared among the ops a dispatch mode counts (the
    module calls and autograd's bookkeeping around each op included)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from parallab.models.gpt import GPT

    class Count(TorchDispatchMode):
        ops = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            Count.ops += 1
            return func(*args, **(kwargs or {}))

    model = GPT(vocab_size=8, context=8, layers=2, heads=1, width=8)
    tokens = torch.zeros(1, 8, dtype=torch.long)

    def step() -> None:
        model(tokens).sum().backward()

    with Count():
        step()
    return _timed(step, 20) / Count.ops


def framework_seconds() -> tuple[float, float]:
    """(what DTensor's dispatch adds to an op, what FSDP2's hooks add to a unit's forward
    and backward), over a one-rank group: a small Linear's step timed plain, split by tensor
    parallel's plan and sharded, the difference shared among its ops or its one unit."""
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module

    from parallab.simulate.trace import fake_group

    x = torch.randn(4, 16)

    def step(model: nn.Module) -> float:
        return _timed(lambda: model(x).sum().backward(), 20)

    with fake_group(1):
        mesh = init_device_mesh("cpu", (1,))
        plain = step(nn.Linear(16, 16))
        split = step(parallelize_module(nn.Linear(16, 16), mesh, ColwiseParallel()))
        sharded = step(fully_shard(nn.Linear(16, 16), mesh=mesh))
    ops = 6  # a linear's forward and backward as DTensor dispatches them: mm, t, sum, ...
    return max(0.0, split - plain) / ops, max(0.0, sharded - plain)


def _all_reduce(rank: int, world: int, path: str) -> None:
    """One of the processes loopback() starts: rank 0 prints the figures."""
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{path}", rank=rank, world_size=world)
    small, large = torch.ones(1), torch.ones(16 * 2**20 // 4)
    latency = _timed(lambda: dist.all_reduce(small), 20)
    seconds = _timed(lambda: dist.all_reduce(large), 3)
    if rank == 0:
        print(json.dumps([latency, 2 * (world - 1) / world * large.numel() * 4 / seconds]))
    dist.destroy_process_group()


def loopback() -> tuple[float, float]:
    """(seconds, bus bytes per second) of an all-reduce over gloo between two processes of
    this module's own (`python -m`: no caller's main module run again in them, as
    multiprocessing's spawn would)."""
    import subprocess
    import sys
    import tempfile

    with tempfile.TemporaryDirectory() as folder:
        path = os.path.join(folder, "store")
        procs = [subprocess.Popen([sys.executable, "-m", __name__, str(rank), path],
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
                 for rank in range(2)]
        try:
            said = [p.communicate(timeout=120) for p in procs]
        finally:
            for p in procs:  # none left behind, whatever happened
                p.kill()
    lines = said[0][0].strip().splitlines()
    if not lines:
        why = (said[0][1].strip().splitlines() or ["no figure"])[-1]
        raise RuntimeError(f"the all-reduce between two local processes was not measured: {why}")
    latency, bus = json.loads(lines[-1])
    return latency, bus


def measured() -> dict[str, float]:
    """This machine's figures, measured once (the cache keyed by machine and torch)."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    key = f"{platform.node()}-{cores}-{torch.__version__}"
    path = CACHE / "cluster_this.json"
    known = json.loads(path.read_text()) if path.is_file() else {}
    if key in known:
        return known[key]
    latency, bus = loopback()
    before = torch.get_num_threads()
    torch.set_num_threads(cores)  # as a process alone here runs them
    try:
        dtensor_op_s, fsdp_unit_s = framework_seconds()
        op_s = op_seconds()
    finally:
        torch.set_num_threads(before)
    figures = {"dtensor_op_s": dtensor_op_s, "fsdp_unit_s": fsdp_unit_s, "cores": cores,
               "memory_bytes": _available_memory(),
               "fp32_1": matmul_flops(torch.float32, 1),
               "fp32_all": matmul_flops(torch.float32, cores),
               "bf16_1": matmul_flops(torch.bfloat16, 1),
               "bf16_all": matmul_flops(torch.bfloat16, cores),
               "copy": copy_bytes_per_s(), "op_s": op_s,
               "latency_s": latency, "bus": bus}
    known[key] = figures
    CACHE.mkdir(parents=True, exist_ok=True)
    written = path.with_suffix(f".{os.getpid()}.tmp")  # whole or not at all, for any reader
    written.write_text(json.dumps(known, indent=2) + "\n")
    os.replace(written, path)
    return figures


def _available_memory() -> float:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    return 8 * 2**30


class Timer:
    """Each distinct op of a trace (ops.Op.replay) run for real here, with a rank's
    threads, once: its fastest run; a rank sharing its cores with the others is slowed by
    their share. None for an op that cannot be run from its shapes alone."""

    def __init__(self, threads: int, share: float):
        self.threads, self.share = threads, share
        self.known: dict[str, float | None] = {}

    def __call__(self, op) -> float | None:
        if op.replay is None:
            return None
        key = repr(op.replay)
        if key not in self.known:
            self.known[key] = self._time(*op.replay)
        found = self.known[key]
        return None if found is None else found / self.share

    def _time(self, func, args, kwargs) -> float | None:
        from torch.utils._pytree import tree_map

        from parallab.simulate.ops import Spec

        def made(value):
            if not isinstance(value, Spec):
                return value
            size = 1 + sum((n - 1) * st for n, st in zip(value.shape, value.stride) if n)
            data = torch.randn(size).to(value.dtype) if value.dtype.is_floating_point else \
                torch.zeros(size, dtype=value.dtype)  # valid indices, no mask
            return data.as_strided(value.shape, value.stride)

        before = torch.get_num_threads()
        torch.set_num_threads(self.threads)
        try:
            real_args, real_kwargs = tree_map(made, args), tree_map(made, kwargs)
            with torch.no_grad():
                once = _timed(lambda: func(*real_args, **real_kwargs), 1)
                runs = max(1, min(50, int(2e-3 / max(once, 1e-7))))  # 2 ms of them at least
                return _timed(lambda: [func(*real_args, **real_kwargs) for _ in range(runs)],
                              2) / runs
        except Exception:  # noqa: BLE001 - an op its shapes alone cannot make again
            return None
        finally:
            torch.set_num_threads(before)


_TIMERS: dict[tuple[int, float], Timer] = {}  # one a rank's threads and share, per process


def rates(cfg: ClusterConfig, world_size: int) -> Rates:
    """A rank's rates in a job of `world_size` processes here (threads: cores / ranks, as
    parallel.threads_per_worker=null gives them); the YAML's figures where it gives any."""
    f = measured()
    cores, n = f["cores"], max(1, world_size)
    threads = max(1, cores // n)
    share = min(1.0, cores / (n * threads))  # of its threads' speed, while all ranks compute

    def rate(kind: str) -> float:
        one, every = f[f"{kind}_1"], f[f"{kind}_all"]
        per_thread = one + (every - one) * (threads - 1) / max(1, cores - 1)
        return per_thread * share

    nccl = NcclLatency(f["latency_s"] * 1e6, 0.0, 0.0, f["latency_s"] * 1e6, 0.0, 0.0)
    scaled = {"memory_gb": ("memory_bytes", 2**30), "hbm_gbps": ("hbm", GBIT),
              "gpus_per_node": ("gpus_per_node", 1), "intra_node_gbps": ("intra", GBIT),
              "inter_node_gbps": ("inter", GBIT), "matmul_efficiency": ("matmul_efficiency", 1),
              "op_overhead_us": ("op_overhead_s", 1e-6)}  # the YAML's keys as Rates holds them
    given = {k: getattr(cfg, k) for k in scaled if getattr(cfg, k) is not None}
    base = Rates({"fp32": rate("fp32"), "tf32": rate("fp32"), "bf16": rate("bf16"),
                  "fp16": rate("bf16")}, 1.0, f["copy"] / n, f["bus"], f["bus"], n,
                 f["memory_bytes"] / n, f["op_s"] / share, nccl, overhead_adds=True,
                 dtensor_op_s=f["dtensor_op_s"] / share, fsdp_unit_s=f["fsdp_unit_s"] / share,
                 timed=_TIMERS.setdefault((threads, share), Timer(threads, share)))
    return dataclasses.replace(base, **{scaled[k][0]: v * scaled[k][1] for k, v in given.items()})


if __name__ == "__main__":  # a rank of loopback()
    import sys

    _all_reduce(int(sys.argv[1]), 2, sys.argv[2])
