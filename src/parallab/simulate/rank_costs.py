"""cluster=this at n ranks: what this machine's processes cost one another, measured once
by n processes over gloo, as a job of n ranks runs (each with its share of the cores).

A CPU's ranks run their collectives, FSDP2's hooks, DTensor's dispatch and a pipeline's
schedule on the cores that compute, and each waits for the others to be scheduled: costs a
GPU hides behind its kernels, which here grow with the ranks sharing the cores. So each is
measured at the job's own rank count, and its median taken (a step waits as often as the
ranks do, not only when they are lucky):
- each collective kind (all_reduce, all_gather, reduce_scatter): its fixed cost (a tiny
  tensor amid compute) and its bus bytes per second (a 2 MiB one, fixed cost and all: a
  difference of two medians this noisy can come out at any rate), as comm.py counts the
  bytes a rank sends; a send's bytes per second (p2p: its fixed cost is the stage's);
- how much longer ops take inside a step than alone while every rank runs one
  (op_times.in_step);
- what FSDP2 adds to a unit's forward and backward and DTensor to an op, beyond the
  collectives they call (counted by comm.py's CommCounter) at their back-to-back costs, and
  what a pipeline's schedule adds to a micro-batch's pass through a stage, its sends'
  fixed costs with it.
"""

from __future__ import annotations

import datetime
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time

import torch

from parallab.simulate import op_times
from parallab.simulate.op_times import median_time

KINDS = ("all_reduce", "all_gather", "reduce_scatter", "p2p")
WHOLE = 2 * 2**20 // 4  # a large collective's elements (2 MiB of float32)


def _pair(rank: int, world: int):
    """(peer, sends first) of a rank's pair (0-1, 2-3, ...); None for an odd one out."""
    peer = rank ^ 1
    return None if peer >= world else (peer, rank % 2 == 0)


def _collective(kind: str, elements: int, rank: int, world: int):
    """A call of `kind` over `elements` float32 (the whole tensor: what is all-reduced,
    gathered into, scattered from or sent), and the bus bytes it sends per rank."""
    import torch.distributed as dist

    whole = torch.ones(elements // world * world)
    part = torch.ones(whole.numel() // world)
    n, size = world, whole.numel() * 4
    if kind == "all_reduce":
        return (lambda: dist.all_reduce(whole)), 2 * (n - 1) / n * size
    if kind == "all_gather":
        return (lambda: dist.all_gather_into_tensor(whole, part)), (n - 1) / n * size
    if kind == "reduce_scatter":
        return (lambda: dist.reduce_scatter_tensor(part, whole)), (n - 1) / n * size
    pair = _pair(rank, world)

    def exchange() -> None:  # there and back: a send's time is half of it
        if pair is None:
            return
        peer, first = pair
        for sending in (first, not first):
            (dist.send if sending else dist.recv)(whole, peer)
    return exchange, 2 * size


def _compute():
    """A piece of a step's compute between two collectives (a few matmuls)."""
    a = torch.randn(256, 256)
    return lambda: [a @ a for _ in range(4)]


def links(rank: int, world: int) -> tuple[dict[str, list[float]], dict[str, float]]:
    """Each kind's [fixed seconds, bus bytes per second], and its fixed seconds back to
    back. The fixed cost is a tiny collective's amid compute, as a step calls it: what
    (compute, collective) takes beyond the compute alone, several times its cost back to
    back here (docs/benchmarks.md: a tiny all-reduce 2.2 ms amid 1.3 ms of matmuls, 0.4 ms
    back to back, at 2 ranks; a rank wakes to its peers' messages, and they to its own, as each is
    scheduled). A send's fixed cost is left to the stage's (stage_s), whose schedule posts
    it."""
    found, back_to_back = {}, {}
    compute = _compute()
    alone = median_time(compute, 20)
    for kind in KINDS:
        large, large_bytes = _collective(kind, WHOLE, rank, world)
        rate = large_bytes / max(1e-9, median_time(large, 5))
        if kind == "p2p":  # there and back
            found[kind] = [0.0, rate]
            continue
        small, _ = _collective(kind, 64 * world, rank, world)
        back_to_back[kind] = median_time(small, 20)
        amid = median_time(lambda small=small: (compute(), small()), 20) - alone
        found[kind] = [max(back_to_back[kind], amid), rate]
    return found, back_to_back


def _counted(step) -> dict[str, int]:
    from parallab.observe.comm import CommCounter

    with CommCounter() as counter:
        step()
    return dict(counter.calls)


def _beyond(step, plain, fixed: dict[str, float], repeats: int) -> float:
    """What `step` takes beyond the `plain` step and its collectives' fixed costs (back to
    back: its tiny layers leave nothing between them): the median of the two timed in
    turns, so that a machine slowing down meanwhile slows both."""
    calls = _counted(step)
    step(), plain()
    spent = []
    for _ in range(repeats):
        start = time.perf_counter()
        step()
        middle = time.perf_counter()
        plain()
        spent.append((middle - start) - (time.perf_counter() - middle))
    return max(0.0, statistics.median(spent) - sum(fixed[kind] * count for kind, count
                                                   in calls.items() if kind in fixed))


def framework(rank: int, world: int, fixed: dict[str, float]) -> dict[str, float]:
    """fsdp_unit_s, dtensor_op_s and stage_s (module docstring) on two small Linears."""
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel,
                                                   parallelize_module)

    # a width each rank's share of divides: DTensor cannot propagate a matmul over uneven
    # shards (3 ranks of 16 had ended cluster=this at 3 GPUs in a traceback)
    width = math.lcm(16, world)
    x = torch.randn(4, width)

    def pair() -> nn.Module:
        return nn.Sequential(nn.Linear(width, width), nn.Linear(width, width))

    def stepper(model: nn.Module):
        return lambda: model(x).sum().backward()

    mesh = init_device_mesh("cpu", (world,))
    plain = stepper(pair())
    sharded = pair()
    for layer in sharded:
        fully_shard(layer, mesh=mesh)
    fully_shard(sharded, mesh=mesh)  # the root unit, as a model's
    fsdp = _beyond(stepper(sharded), plain, fixed, 20) / (len(sharded) + 1)  # its units
    split = parallelize_module(pair(), mesh, {"0": ColwiseParallel(), "1": RowwiseParallel()})
    dtensor = _beyond(stepper(split), plain, fixed, 20) / _dtensor_ops(stepper(split))
    return {"fsdp_unit_s": fsdp, "dtensor_op_s": dtensor, "stage_s": _stage(rank, world)}


def _dtensor_ops(step) -> int:
    """The ops of `step` dispatched with a DTensor among their inputs (as the trace counts
    them: ops.Op.dtensor)."""
    from torch.distributed.tensor import DTensor

    from parallab.simulate.ops import moves_data

    return max(1, op_times.ops_in(step, lambda func, args: moves_data(func) and any(
        isinstance(a, DTensor) for a in args)))


def _stage(rank: int, world: int) -> float:
    """What GPipe's schedule adds to a micro-batch's forward and backward on a stage of a
    two-stage pipeline (pairs of ranks), its two sends' fixed costs with it, beyond its
    compute: the slope over 2 to 8 micro-batches."""
    import torch.distributed as dist
    from torch import nn
    from torch.distributed.pipelining import PipelineStage, ScheduleGPipe

    groups = [dist.new_group([r, r + 1]) for r in range(0, world - 1, 2)]  # every rank makes each
    pair = _pair(rank, world)
    if pair is None:  # the odd one out: no pipeline of its own
        return 0.0
    # a stage that computes something, so that its sends meet it as a step's do
    stage, layer = rank % 2, nn.Sequential(*[nn.Linear(256, 256) for _ in range(4)])
    x = torch.randn(4, 256)
    slopes, counts = [], (2, 8)
    for m in counts:
        schedule = ScheduleGPipe(PipelineStage(layer, stage, 2, torch.device("cpu"),
                                               group=groups[rank // 2]),
                                 m, loss_fn=lambda out, target: out.sum())
        batch = torch.randn(4 * m, 256)

        def step(schedule=schedule, batch=batch) -> None:
            if stage == 0:
                schedule.step(batch)
            else:
                schedule.step(target=batch, losses=[])
        alone = median_time(lambda m=m: [layer(x).sum().backward() for _ in range(m)], 10)
        slopes.append(median_time(step, 10) - alone)
    return max(0.0, (slopes[1] - slopes[0]) / (counts[1] - counts[0]))


def slower(rank: int, threads: int, op_s: float) -> float:
    """op_times.in_step for the job's ranks: the reference step's ops timed alone by rank 0
    while the others wait, then its step run by every rank at once."""
    import torch.distributed as dist

    def together(step) -> float:
        dist.barrier()  # rank 0 alone is done: all at once from here
        return median_time(step, 10)

    if rank == 0:
        return op_times.in_step(threads, op_s, together)
    step, _ = op_times.reference_step()  # made before rank 0 starts timing the whole step
    dist.barrier()
    median_time(step, 10)
    return 0.0


def _job(rank: int, world: int, path: str, threads: int, op_s: float) -> None:
    """One of the processes measure() starts: rank 0 prints the figures."""
    import torch.distributed as dist

    torch.set_num_threads(threads)
    # a rank that failed ends the others in a minute, not gloo's half hour
    dist.init_process_group("gloo", init_method=f"file://{path}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=60))
    found, back_to_back = links(rank, world)
    figures = {"links": found, **framework(rank, world, back_to_back),
               "in_step": slower(rank, threads, op_s)}
    if rank == 0:
        print(json.dumps(figures))
    dist.destroy_process_group()


def measure(world: int, threads: int, op_s: float) -> dict:
    """The figures of `world` processes of this module's own (`python -m`: no caller's main
    module run again in them, as multiprocessing's spawn would), each with `threads`;
    `op_s`: an eager op's own time in a step (this_machine.op_seconds)."""
    with tempfile.TemporaryDirectory() as folder:
        path = os.path.join(folder, "store")
        env = {**os.environ, "PYTHONWARNINGS": "ignore"}
        procs = [subprocess.Popen([sys.executable, "-m", __name__, str(rank), str(world), path,
                                   str(threads), str(op_s)], stdout=subprocess.PIPE,
                                  stderr=subprocess.PIPE, text=True, env=env)
                 for rank in range(world)]
        try:
            said = [p.communicate(timeout=300) for p in procs]
        except subprocess.TimeoutExpired:
            said = [("", "timed out after 300 s")]
        finally:
            for p in procs:  # none left behind, whatever happened
                p.kill()
                p.wait()
    lines = said[0][0].strip().splitlines()
    if not lines:
        why = next((s[1].strip().splitlines()[-1] for s in said if s[1].strip()), "no figure")
        raise RuntimeError(f"{world} local processes over gloo were not measured: {why}")
    return json.loads(lines[-1])


if __name__ == "__main__":  # a rank of measure()
    _job(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], int(sys.argv[4]), float(sys.argv[5]))
