"""Measuring candidates: a few optimizer steps each, one after another in one job.

Candidates that share a world size run inside one launched job (or, at world size 1, in
the controlling process): the process group is made once, and each candidate builds its
own model, strategy (its own device mesh and groups), data and optimizer on it, as a
worker of `python train.py` with its settings would (run.build_trainer). Each writes a
TensorBoard run with its hparams into its own dir.
"""

from __future__ import annotations

import contextlib
import logging
import signal
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import torch

from parallab.config.errors import first_line
from parallab.launching import distributed
from parallab.launching.preemption import Preemption
from parallab.observe import loggers
from parallab.observe.comm import MB
from parallab.observe.loggers import RunLogger
from parallab.observe.memory import reset_peak_memory
from parallab.parallel import activations
from parallab.training import run

log = logging.getLogger(__name__)


class LossRecorder(RunLogger):
    """A RunLogger that also keeps every logged train loss, in step order."""

    def __init__(self, run_dir: str | Path, active: bool):
        super().__init__(run_dir, active)
        self.losses: list[float] = []

    def scalars(self, values: dict[str, float], step: int) -> None:
        if "train/loss" in values:
            self.losses.append(float(values["train/loss"]))
        super().scalars(values, step)


class ActivationProbe:
    """Counts, on the trainer's counted step, the bytes one micro-batch keeps for backward:
    the share of its micro-batches' activations a rank holds at once (1F1B: not all). Off in
    a training run: it keeps that step's activations until the step ends."""

    def __init__(self) -> None:
        self.bytes = 0.0

    @contextlib.contextmanager
    def counted_step(self, trainer, batches: list) -> Iterator[None]:
        with activations.saved_for_backward(trainer.model) as counted:
            yield
            self.bytes = counted.held(trainer.strategy.activation_share) / len(batches)


def _max_over_ranks(dist: distributed.Dist, value: float) -> float:
    return dist.all_reduce_max(torch.tensor([value], dtype=torch.float64,
                                            device=dist.device)).item()


def measure(spec: run.RunSpec, dist: distributed.Dist) -> dict[str, Any]:
    """Train the candidate `spec` for its trainer.max_steps on the job's group; its figures:
    losses, step time, samples/s, state and activation memory (the largest rank's), comm."""
    cfg, run_dir, overrides = spec.cfg, spec.run_dir, spec.overrides
    logger = LossRecorder(run_dir, active=dist.is_main)
    reset_peak_memory(dist.device)
    try:
        with Preemption() as preemption:
            logger.start(loggers.run_info(cfg, run_dir, overrides, None, dist.world_size))
            probe = ActivationProbe()
            trainer, lr = run.build_trainer(cfg, spec.layout, dist, logger, None, preemption,
                                            probe=probe)
            figures = trainer.fit(evaluate=False, report=False)  # the run's own steps
        if trainer.stopped:
            raise RuntimeError("stopped by a signal")
        state = _max_over_ranks(dist, figures["state_memory_mb"] or 0.0)
        act = _max_over_ranks(dist, probe.bytes / MB)
        figures.update(losses=logger.losses, state_mb=state, activation_mb=act,
                       measured_memory_mb=state + act, lr=lr, world_size=dist.world_size,
                       precision_dtype=trainer.precision.dtype_name,
                       peak_memory_mb=_max_over_ranks(dist, figures["peak_memory_mb"]))
        if dist.is_main:
            scalars = {k: v for k, v in figures.items() if k != "losses"}
            logger.finish(scalars, run.hparams(spec, figures),
                          trainer.step)
        return figures
    finally:
        logger.close()


def measure_all(jobs: list[run.RunSpec], dist: distributed.Dist) -> list[dict[str, Any]]:
    """Each candidate's run measured in turn; a candidate that fails is recorded with the
    first line of its error and the next one runs."""
    results = []
    for spec in jobs:  # their dirs made by the controller
        try:
            figures = measure(spec, dist)
        except Exception as error:  # noqa: BLE001 - a candidate's failure is its result
            if distributed.lost_a_peer(error):
                raise  # the job itself is broken: no further candidate can run
            log.warning("candidate %s failed: %s", spec.run_dir, first_line(error))
            figures = {"error": first_line(error)}
        results.append(figures)
    return results


def loopback_gbps(dist: distributed.Dist, megabytes: int = 16, repeats: int = 5) -> float:
    """The job's all-reduce bus bandwidth in gigabits/s: 2(n-1)/n x the tensor per rank,
    as comm.py counts it, over the median time of `repeats` all-reduces."""
    import torch.distributed as torch_dist

    tensor = torch.ones(megabytes * MB // 4, device=dist.device)
    times = []
    for _ in range(repeats + 1):
        torch_dist.barrier()
        start = time.perf_counter()
        torch_dist.all_reduce(tensor)
        times.append(time.perf_counter() - start)
    n = dist.world_size
    sent = 2 * (n - 1) / n * tensor.numel() * 4
    return sent * 8 / statistics.median(times[1:]) / 1e9


def local_compute_s(cfg, dist: distributed.Dist, steps: int = 6) -> float:
    """One rank's share of a step's compute at this world size, as the ranks run it at once
    on cores they share: the world-size-1 model of `cfg` on global batch / n rows, forward,
    backward and the optimizer, nothing communicated; the median of `steps` steps, the
    slowest rank's. The step-time model's compute term (scaling.validate): on a CPU the
    ranks' threads, not the FLOPs, decide it."""
    from parallab import batch as batches
    from parallab.checks import trial
    from parallab.loss import build_loss
    from parallab.models import build_model
    from parallab.optim import build_optimizer

    torch.manual_seed(cfg.seed)
    model = build_model(cfg.model).to(dist.device)
    loss = build_loss(cfg.loss).bind(model)
    optimizer = build_optimizer(cfg.optim, model)
    rows = max(1, cfg.data.global_batch_size // dist.world_size)
    batch = batches.apply(trial.one_batch(cfg, rows), lambda t: t.to(dist.device))
    times = []
    for _ in range(steps + 2):  # the first two: allocation and kernel choice
        start = time.perf_counter()
        loss.step_loss(model, batch, None)[1].backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - start)
    return _max_over_ranks(dist, statistics.median(times[2:]))


def loopback_latency_s(dist: distributed.Dist, repeats: int = 30) -> float:
    """The fixed cost of one collective in this job, whatever it carries: the median time
    of an all-reduce of one number, the slowest rank's. (Timed between bits of compute
    instead, where a waiting rank gives up its core, it measured ten times more here, and
    predicted fsdp and tp no better and pipelines worse: bench/bench_advise.py --step-time.)"""
    import torch.distributed as torch_dist

    tensor = torch.ones(1, device=dist.device)
    times = []
    for _ in range(repeats + 3):
        start = time.perf_counter()
        torch_dist.all_reduce(tensor)
        times.append(time.perf_counter() - start)
    return _max_over_ranks(dist, statistics.median(times[3:]))


@dataclass
class Job:
    """The candidates of one world size, for a launched job's workers."""

    jobs: list[run.RunSpec]
    device: str
    backend: str
    timeout_s: float
    threads_per_worker: int | None


def worker(job: Job) -> dict[str, Any]:
    """A launched worker: join the group once, measure every candidate, then the group's
    bandwidth, per-collective latency and a rank's share of the compute (for the step-time
    prediction)."""
    signal.signal(signal.SIGTERM, signal.SIG_DFL)  # the fork server's SIG_IGN (launching/launch.py)
    logging.basicConfig(level=logging.WARNING)
    dist = distributed.setup(job.device, job.backend, job.timeout_s, job.threads_per_worker,
                             store=distributed.attempt_store(job.timeout_s))
    results = measure_all(job.jobs, dist)
    bandwidth, latency = loopback_gbps(dist), loopback_latency_s(dist)
    compute = local_compute_s(job.jobs[0].cfg, dist)
    distributed.teardown()
    return {"results": results, "bandwidth_gbps": bandwidth, "latency_s": latency,
            "compute_s": compute}
