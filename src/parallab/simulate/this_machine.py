"""cluster=this: this machine's rates, for ranks that are processes sharing its cores.

Each op a trace records is run for real (Timer), its tensors made from their shapes: the
small matmuls, attention kernels and pointwise ops of a model a CPU trains take times that
no rate of a large matmul or a copy gives. Measured once and kept (~/.cache/parallab):
an eager op's own time in a training step (the module call and autograd around it), how
much longer ops take inside a step than alone (op_times.in_step), a square matmul's FLOP/s
and a large copy's bytes per second (the rates where an op cannot be run from its
shapes); and, once per rank count, what n processes over gloo cost one another
(rank_costs.py: each collective kind, FSDP2's hooks, DTensor's dispatch, a pipeline's
schedule, the slowing inside a step: a CPU pays them on its cores, where a GPU mostly
hides them behind its kernels). Each figure keeps when it was measured and how busy other
work kept the cores then: one measured busy (low rates, high overheads) is measured again
once the machine is idle, and cluster.remeasure=true measures them all again. A rank of a
job of n processes gets its share: its threads, slowed where the n ranks' threads outnumber
the cores, and 1/n of the memory's bandwidth while they all compute.
"""

from __future__ import annotations

import dataclasses
import datetime
import functools
import json
import logging
import os
import platform
import time
from pathlib import Path

import torch

from parallab.config.planning import ClusterConfig, NcclLatency
from parallab.simulate.cluster import GBIT, Rates
from parallab.simulate.op_times import Timer, fastest, in_step, ops_in

CACHE = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "parallab"
FILE = CACHE / "cluster_this.json"
# what is measured, and how: raised with any change to it here, in op_times.py or rank_costs.py,
# so that figures measured the former way are measured again, not served
FIGURES = 4
MOST_RANKS = 16
# of the cores' time, what other work may take while figures are measured: past it they
# come out low (2.4x lower rates, 4x the kernel overhead, seen under a test suite's load)
BUSY = 0.2

log = logging.getLogger("parallab")


def busy(seconds: float = 0.3) -> float:
    """The share of this machine's CPU time that other work took over `seconds`, this
    process asleep meanwhile (/proc/stat's counters; the load average per core without)."""
    def counters() -> tuple[int, int]:
        cpu = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
        return sum(cpu), cpu[3] + cpu[4]  # all, and idle + iowait

    try:
        total, idle = counters()
        time.sleep(seconds)
        total_after, idle_after = counters()
    except (OSError, ValueError, IndexError):
        return min(1.0, os.getloadavg()[0] / (os.cpu_count() or 1))
    return max(0.0, 1 - (idle_after - idle) / max(1, total_after - total))


def _stamp() -> dict:
    """When figures are measured, and how busy other work keeps the cores then."""
    share = busy()
    if share > BUSY:
        log.warning("cluster=this: other work takes %.0f%% of this machine's cores while its "
                    "rates are measured: they come out low, and are measured again once it "
                    "is idle (or with cluster.remeasure=true)", 100 * share)
    return {"at": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "busy": round(share, 3)}


@functools.cache  # once a process: each layout priced asks
def _idle() -> bool:
    return busy() <= BUSY


def _stale(figures: dict) -> bool:
    """Figures measured while the machine was busy, where it is idle now."""
    if figures.get("busy", 0.0) <= BUSY or not _idle():
        return False
    log.info("cluster=this: the figures kept from %s were measured with %.0f%% of the cores "
             "busy; the machine is idle now: measuring them again", figures.get("at", "?"),
             100 * figures["busy"])
    return True


def matmul_flops(dtype: torch.dtype, threads: int, size: int = 768) -> float:
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        a = torch.randn(size, size, dtype=dtype)
        return 2 * size**3 / fastest(lambda: a @ a)
    finally:
        torch.set_num_threads(before)


def copy_bytes_per_s(megabytes: int = 128) -> float:
    a = torch.empty(megabytes * 2**20 // 4)
    b = torch.empty_like(a)
    return 2 * a.numel() * 4 / fastest(lambda: b.copy_(a))


def op_seconds() -> float:
    """An eager op's own time in a training step: a gpt so small its ops compute nothing,
    its forward and backward timed and shared among the ops a dispatch mode counts (the
    module calls and autograd's bookkeeping around each op included)."""
    from parallab.models.gpt import GPT

    model = GPT(vocab_size=8, context=8, layers=2, heads=1, width=8)
    tokens = torch.zeros(1, 8, dtype=torch.long)

    def step() -> None:
        model(tokens).sum().backward()

    ops = ops_in(step)
    return fastest(step, 20) / ops


@functools.cache  # read once a process: rates() asks it for every layout it prices
def measured(again: bool = False) -> dict[str, float]:
    """This machine's figures, measured once (the cache keyed by machine and torch), and
    `again` where asked, or where they were measured busy and the machine is idle now;
    together_at adds each rank count's to the same dict as it measures them."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    key = _key(cores)
    known = _known()
    if key in known and not again and not _stale(known[key]):
        return known[key]
    stamp = _stamp()
    before = torch.get_num_threads()
    torch.set_num_threads(cores)  # as a process alone here runs them
    try:
        op_s = op_seconds()
    finally:
        torch.set_num_threads(before)
    figures = {"cores": cores, "memory_bytes": _available_memory(),
               "in_step": in_step(cores, op_s),
               "fp32_1": matmul_flops(torch.float32, 1),
               "fp32_all": matmul_flops(torch.float32, cores),
               "bf16_1": matmul_flops(torch.bfloat16, 1),
               "bf16_all": matmul_flops(torch.bfloat16, cores),
               "copy": copy_bytes_per_s(), "op_s": op_s, "ranks": {}, **stamp}
    _keep(known, key, figures)
    return figures


def together_at(figures: dict, world: int) -> dict:
    """What `world` ranks here cost one another (rank_costs.py), measured once per rank
    count and kept with this machine's other figures. Past twice the cores, or 16 ranks (a
    plot's counts, not a job one runs here), the figures of the largest count measured
    stand for them: each count measured starts that many processes importing torch."""
    from parallab.simulate import rank_costs

    world = _counted(figures, world)
    kept = figures["ranks"].get(str(world))
    if kept is None or _stale(kept):
        # an op's own time as a rank sharing the cores pays it (rates() charges it so), so
        # that in_step's ratio does not count that slowing a second time
        op_s = figures["op_s"] / _share(figures, world)
        stamp = _stamp()
        figures["ranks"][str(world)] = {**rank_costs.measure(world, _threads(figures, world),
                                                           op_s), **stamp}
        known, key = _known(), _key(figures["cores"])
        # the rank counts another process kept meanwhile stay beside this one's
        figures["ranks"] = {**known.get(key, {}).get("ranks", {}), **figures["ranks"]}
        _keep(known, key, figures)
    return figures["ranks"][str(world)]


def when(cfg: ClusterConfig, world_size: int) -> dict:
    """When the figures a job of `world_size` ranks is priced with were measured (the
    earlier, where its rank count's came later), and the most other work took then."""
    f = measured(cfg.remeasure)
    both = [f, together_at(f, world_size)] if world_size > 1 else [f]
    return {"at": min(x.get("at", "?") for x in both),
            "busy": max(x.get("busy", 0.0) for x in both)}


def _counted(figures: dict, world: int) -> int:
    """The rank count whose figures together_at measures for `world` ranks."""
    return min(world, 2 * figures["cores"], MOST_RANKS)


def _key(cores: int) -> str:
    return f"{platform.node()}-{cores}-{torch.__version__}-v{FIGURES}"


def _threads(figures: dict, world: int) -> int:
    return max(1, figures["cores"] // max(1, world))


def _share(figures: dict, world: int) -> float:
    """Of its threads' speed, what a rank gets while all `world` ranks compute."""
    return min(1.0, figures["cores"] / (max(1, world) * _threads(figures, world)))


def _known() -> dict:
    return json.loads(FILE.read_text()) if FILE.is_file() else {}


def _keep(known: dict, key: str, figures: dict) -> None:
    known[key] = figures
    CACHE.mkdir(parents=True, exist_ok=True)
    written = FILE.with_suffix(f".{os.getpid()}.tmp")  # whole or not at all, for any reader
    written.write_text(json.dumps(known, indent=2) + "\n")
    os.replace(written, FILE)


def _available_memory() -> float:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    return 8 * 2**30


ALONE = {"links": {}, "fsdp_unit_s": 0.0, "dtensor_op_s": 0.0, "stage_s": 0.0}  # one rank
_TIMES: dict[int, dict] = {}  # each op's own time by a rank's threads, once a process


def rates(cfg: ClusterConfig, world_size: int) -> Rates:
    """A rank's rates in a job of `world_size` processes here (threads: cores / ranks, as
    parallel.threads_per_worker=null gives them); the YAML's figures where it gives any."""
    f = measured(cfg.remeasure)
    cores, n = f["cores"], max(1, world_size)
    threads, share = _threads(f, n), _share(f, n)
    ranks = together_at(f, n) if n > 1 else {**ALONE, "in_step": f["in_step"]}
    # past the counts together_at measures, more ranks share the cores than its in_step
    # saw: an op run for real slows by that too, as the rates below do (share)
    slower = ranks["in_step"] * _share(f, _counted(f, n)) / share

    def rate(kind: str) -> float:
        one, every = f[f"{kind}_1"], f[f"{kind}_all"]
        per_thread = one + (every - one) * (threads - 1) / max(1, cores - 1)
        return per_thread * share

    links = {kind: tuple(figures) for kind, figures in ranks["links"].items()}
    bus = links.get("all_reduce", (0.0, f["copy"]))[1]  # the links' rate, where asked
    scaled = {"memory_gb": ("memory_bytes", 2**30), "hbm_gbps": ("hbm", GBIT),
              "gpus_per_node": ("gpus_per_node", 1), "intra_node_gbps": ("intra", GBIT),
              "inter_node_gbps": ("inter", GBIT), "matmul_efficiency": ("matmul_efficiency", 1),
              "op_overhead_us": ("op_overhead_s", 1e-6)}  # the YAML's keys as Rates holds them
    given = {k: getattr(cfg, k) for k in scaled if getattr(cfg, k) is not None}
    base = Rates({"fp32": rate("fp32"), "tf32": rate("fp32"), "bf16": rate("bf16"),
                  "fp16": rate("bf16")}, 1.0, f["copy"] / n, bus, bus, n,
                 f["memory_bytes"] / n, f["op_s"] / share, NcclLatency(*[0.0] * 6),
                 overhead_adds=True, dtensor_op_s=ranks["dtensor_op_s"],
                 fsdp_unit_s=ranks["fsdp_unit_s"], stage_s=ranks["stage_s"], links=links,
                 timed=Timer(threads, slower, _TIMES.setdefault(threads, {})))
    return dataclasses.replace(base, **{scaled[k][0]: v * scaled[k][1] for k, v in given.items()})
