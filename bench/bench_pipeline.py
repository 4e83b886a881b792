"""Every pipeline schedule on the gpt model: step time, each rank's idle share of the step
against the schedule's own count (parallel/schedules.py), and the activations each rank
holds at its peak.

    python bench/bench_pipeline.py [--pp 2 4] [--microbatches 4 8] [--steps 8] [-- overrides]

Each setting runs pp ranks (gloo, spawned here) through parallab's pipeline as a run lays
it out (the checks, parallelize, the runtime's step), a real batch of data=bytes each
step. On each rank, the time inside torch's stage computations (a forward, a backward or
its halves) is its busy time; the rest of the step it waits (its share of the step: idle).
The memory a step holds at its peak: the rank's resident memory above its level at the
step's start, sampled every millisecond (the activations, and the gradients they flow
into, alike for every schedule). The ranks share this machine's cores: read the ratios
(idle against the formula, one schedule's memory against another's), not the times.
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import time

import torch
import torch.multiprocessing as mp

from parallab.parallel.schedules import (SCHEDULES, bubble, microbatches_problem,
                                         stages_per_rank)
from parallab.testing import free_port

RUN = ["model=gpt", "data=bytes", "device=cpu", "model.layers=8", "model.width=256",
       "model.heads=4", "model.context=128", "model.dropout=0.0", "data.batch_size=32",
       "parallel=pipeline"]


class PeakRSS:
    """The most resident memory of this process above its level at start(), sampled every
    millisecond by a thread: the tensors a step allocates (activations, the gradients they
    flow into), each returned to the system when freed (mmap for all but small ones:
    MALLOC_MMAP_THRESHOLD_, set for the ranks)."""

    PAGE = os.sysconf("SC_PAGE_SIZE")

    def __init__(self) -> None:
        self.base = self.peak = 0
        self.running = False

    @classmethod
    def resident(cls) -> int:
        with open("/proc/self/statm") as statm:
            return int(statm.read().split()[1]) * cls.PAGE

    def start(self) -> None:
        import threading

        self.base = self.peak = self.resident()
        self.running = True
        self.thread = threading.Thread(target=self._sample, daemon=True)
        self.thread.start()

    def _sample(self) -> None:
        while self.running:
            self.peak = max(self.peak, self.resident())
            time.sleep(0.001)

    def stop(self) -> float:
        """MB above the start."""
        self.running = False
        self.thread.join()
        return (self.peak - self.base) / 2**20


def timed_stages() -> list[float]:
    """Time spent in torch's stage computations, added up in the list returned."""
    from torch.distributed.pipelining.stage import _PipelineStageBase

    busy = [0.0]
    for name in ("forward_one_chunk", "backward_one_chunk", "backward_weight_one_chunk"):
        original = getattr(_PipelineStageBase, name)

        def timed(self, *args, _original=original, **kwargs):
            start = time.perf_counter()
            try:
                return _original(self, *args, **kwargs)
            finally:
                busy[0] += time.perf_counter() - start
        setattr(_PipelineStageBase, name, timed)
    return busy


def rank_main(rank: int, world: int, port: int, cfg, layout, steps: int, out) -> None:
    from parallab.checks import trial
    from parallab.launching import distributed
    from parallab.loss import build_loss
    from parallab.models import build_model
    from parallab.optim import build_optimizer
    from parallab.parallel.parallelize import parallelize
    from parallab.precision import Precision

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(world))
    dist = distributed.setup("cpu", "gloo", 120, None)
    busy = timed_stages()
    torch.manual_seed(cfg.seed)
    model = build_model(cfg.model)
    precision = Precision(cfg.precision, dist.device, sharded=layout.sharded)
    model = precision.convert(model)  # as build.build_trainer: before the runtime records it
    runtime = layout.plan.runtime(cfg.parallel, layout, dist, precision,
                                  build_loss(cfg.loss).bind(model), model)
    model = parallelize(model, runtime, cfg.trainer, cfg.parallel.stages)
    optimizer = build_optimizer(cfg.optim, model)
    batch = trial.one_batch(cfg, cfg.data.batch_size)
    times, busies, peaks = [], [], []
    for step in range(steps + 2):  # the first two: shapes inferred, allocations
        gc.collect()
        torch.distributed.barrier()
        rss = PeakRSS()
        rss.start()
        busy[0], start = 0.0, time.perf_counter()
        runtime.forward_backward(model, batch, None)
        torch.distributed.barrier()
        elapsed = time.perf_counter() - start
        if step >= 2:
            times.append(elapsed)
            busies.append(busy[0])
            peaks.append(rss.stop())
        else:
            rss.stop()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    figures = torch.tensor([statistics.median(times), statistics.median(busies),
                            statistics.median(peaks)], dtype=torch.float64)
    gathered = [torch.zeros_like(figures) for _ in range(world)]
    torch.distributed.all_gather(gathered, figures)
    if rank == 0:
        out.put([g.tolist() for g in gathered])
    distributed.teardown()


def measure(pp: int, schedule: str, micro: int, steps: int, extra: list[str]) -> list:
    """[step s, busy s, peak activation MB] of each of the pp ranks."""
    from parallab.cli import compose
    from parallab.config.hydra_app import typed_config
    from parallab.checks import validate

    overrides = [*RUN, f"parallel.world_size={pp}", f"parallel.schedule={schedule}",
                 f"parallel.microbatches={micro}", *extra]
    cfg, layout = validate.prepare(typed_config(compose(overrides), overrides), None)
    os.environ["MALLOC_MMAP_THRESHOLD_"] = "65536"  # freed tensors leave the resident set
    out = mp.get_context("spawn").SimpleQueue()
    mp.start_processes(rank_main, args=(pp, free_port(), cfg, layout, steps, out),
                       nprocs=pp, start_method="spawn")
    return out.get()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--pp", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--microbatches", type=int, nargs="+", default=[4, 8])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("extra", nargs="*", help="more overrides")
    args = parser.parse_args()
    rows = []
    for pp in args.pp:
        for micro in args.microbatches:
            for name in SCHEDULES:
                v = stages_per_rank(name, None)
                if microbatches_problem(name, pp, v, micro):
                    continue
                ranks = measure(pp, name, micro, args.steps, args.extra)
                step = max(r[0] for r in ranks)
                idle = [1 - r[1] / step for r in ranks]
                formula = 1 - 1 / bubble(name, pp, v, micro)
                rows.append((name, pp, v, micro, step * 1e3, idle, formula,
                             [r[2] for r in ranks]))
                print(f"{name} pp={pp} m={micro}: {step * 1e3:.0f} ms, idle "
                      f"{' '.join(f'{i:.2f}' for i in idle)} (formula {formula:.2f})",
                      flush=True)
    print(f"\ngpt ({' '.join(RUN[3:8])}), data.batch_size=32, {' '.join(args.extra)}\n")
    print("| schedule | pp | v | micro-batches | step ms | idle share per rank (measured) "
          "| formula | a step's peak MB per rank |")
    print("|---|---|---|---|---|---|---|---|")
    for name, pp, v, micro, ms, idle, formula, peak in rows:
        print(f"| {name} | {pp} | {v} | {micro} | {ms:.0f} | "
              f"{' '.join(f'{i:.2f}' for i in idle)} | {formula:.2f} | "
              f"{' '.join(f'{p:.1f}' for p in peak)} |")


if __name__ == "__main__":
    main()
