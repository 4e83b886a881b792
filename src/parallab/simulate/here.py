"""cluster=this: this machine's rates, measured once and kept (~/.cache/parallab), for
ranks that are processes sharing its cores.

Measured: a square matmul's FLOP/s in float32 and bfloat16 on one thread and on every
core; a large copy's bytes per second; an eager op's own time in a training step (its
dispatch, the module call and autograd around it: on a CPU it comes on top of the op's
work, which the same cores do); and an all-reduce's fixed cost and bus bandwidth between
two local processes over gloo. A rank of a job of n processes gets its share: its threads'
matmul rate, slowed where the n ranks' threads outnumber the cores, and 1/n of the
memory's bandwidth while they all compute.
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


def _all_reduce(rank: int, world: int, path: str, out) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{path}", rank=rank, world_size=world)
    small, large = torch.ones(1), torch.ones(16 * 2**20 // 4)
    latency = _timed(lambda: dist.all_reduce(small), 20)
    seconds = _timed(lambda: dist.all_reduce(large), 3)
    if rank == 0:
        out.put((latency, 2 * (world - 1) / world * large.numel() * 4 / seconds))
    dist.destroy_process_group()


def loopback() -> tuple[float, float]:
    """(seconds, bus bytes per second) of an all-reduce over gloo between two processes."""
    import tempfile

    import torch.multiprocessing as mp

    # spawned: a fork of a process running threads (torch's, gloo's) may hang
    context = mp.get_context("spawn")
    out = context.Queue()
    with tempfile.TemporaryDirectory() as folder:
        path = os.path.join(folder, "store")
        procs = [context.Process(target=_all_reduce, args=(r, 2, path, out)) for r in range(2)]
        for p in procs:
            p.start()
        found = out.get(timeout=120)
        for p in procs:
            p.join()
    return found


def measured() -> dict[str, float]:
    """This machine's figures, measured once (the cache keyed by machine and torch)."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    key = f"{platform.node()}-{cores}-{torch.__version__}"
    path = CACHE / "cluster_this.json"
    known = json.loads(path.read_text()) if path.is_file() else {}
    if key in known:
        return known[key]
    latency, bus = loopback()
    figures = {"cores": cores, "memory_bytes": _available_memory(),
               "fp32_1": matmul_flops(torch.float32, 1),
               "fp32_all": matmul_flops(torch.float32, cores),
               "bf16_1": matmul_flops(torch.bfloat16, 1),
               "bf16_all": matmul_flops(torch.bfloat16, cores),
               "copy": copy_bytes_per_s(), "op_s": op_seconds(),
               "latency_s": latency, "bus": bus}
    known[key] = figures
    CACHE.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(known, indent=2) + "\n")
    return figures


def _available_memory() -> float:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    return 8 * 2**30


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
    given = {k: getattr(cfg, k) for k in ("memory_gb", "hbm_gbps", "intra_node_gbps",
                                          "inter_node_gbps", "matmul_efficiency",
                                          "op_overhead_us") if getattr(cfg, k) is not None}
    base = Rates({"fp32": rate("fp32"), "tf32": rate("fp32"), "bf16": rate("bf16"),
                  "fp16": rate("bf16")}, 1.0, f["copy"] / n, f["bus"], f["bus"], n,
                 f["memory_bytes"] / n, f["op_s"] / share, nccl, overhead_adds=True)
    if not given:
        return base
    scaled = {"memory_gb": ("memory_bytes", 2**30), "hbm_gbps": ("hbm", GBIT),
              "intra_node_gbps": ("intra", GBIT), "inter_node_gbps": ("inter", GBIT),
              "matmul_efficiency": ("matmul_efficiency", 1), "op_overhead_us": ("op_overhead_s",
                                                                                1e-6)}
    return dataclasses.replace(base, **{scaled[k][0]: v * scaled[k][1] for k, v in given.items()})
