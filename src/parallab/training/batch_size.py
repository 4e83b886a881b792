"""The global batch (its samples, its loss terms), and the batch-size finder: grow the
per-rank batch until just under the limit.

Doubles data.batch_size while the trial fits (no out-of-memory, under trainer.max_memory_mb)
and samples/s still improves by 5%. Trials run the runtime's trial step (Runtime.trial_step)
on each rank's own shard: under ddp the plain module, with no collective inside a trial, so
an out-of-memory on one rank cannot leave the others waiting in an all-reduce; under the
sharded layouts the module itself (its real memory), whose steps do gather across ranks;
under a pipeline the whole schedule, micro-batches and all. After each trial the ranks agree
on its outcome (all-reduce of the fit flag), so every rank takes the same decisions and the
same final size.
"""

from __future__ import annotations

import copy
import logging
import time
from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import nn

from parallab.batch import labels_of, rows
from parallab.data.loaders import ShardLoader
from parallab.launching.distributed import Dist
from parallab.observe.memory import peak_memory_mb, reset_peak_memory

log = logging.getLogger(__name__)
GAIN = 1.05  # a larger batch must be this much faster to be worth it
TIMED_STEPS = 3
Step = Callable[[Any], None]  # forward and backward of one batch


def global_batch_size(loader, cfg, runtime) -> int:
    """Samples per optimizer step, over all ranks (cfg: the trainer config)."""
    return loader.batch_size * cfg.accumulate_grad_batches * runtime.ranks.data.world_size


def loss_terms(batches: list[Any], loader, runtime, dist: Dist):
    """The global batch's loss terms (valid labels) per data-parallel rank: what each
    micro-batch's sum of `batches` is divided by; 0 where there are none (the step is
    skipped); None where the one batch of a one-rank step holds every label (its own mean is
    the step's: no counting, as a hand-written loop)."""
    # the training data's labels all count (the global count follows from shapes), and
    # the ranks reading different samples
    all_valid, world = loader.all_valid, runtime.ranks.data.world_size
    if len(batches) == 1 and world == 1 and all_valid:
        return None
    counts = [runtime.loss.count(labels_of(b)) for b in batches]
    n = counts[0] if len(counts) == 1 else sum(counts)
    if all_valid:  # every rank's shard of one split batched alike:
        n = n * world  # the global count follows from this rank's shapes
    elif world > 1:  # one all-reduce of a scalar; tp/pipeline ranks count alike
        n = dist.all_reduce_sum(torch.as_tensor(n, dtype=torch.float64, device=dist.device))
        n = n / runtime.ranks.readers
    if isinstance(n, torch.Tensor) and n.device.type == "cpu":
        n = n.item()  # free on the CPU: an exact skip of an empty step, a plain divisor
    if isinstance(n, torch.Tensor):  # on a GPU: no sync; an empty step's gradients are 0
        return n.clamp(min=1).float() / world
    return n / world


@dataclass
class Trial:
    batch_size: int
    fits: bool
    samples_per_sec: float = 0.0  # over all ranks
    peak_memory_mb: float = 0.0  # the largest on any rank
    verdict: str = ""


def _measure(step: Step, optimizer: torch.optim.Optimizer, loader: ShardLoader,
             dist: Dist) -> tuple[float, float]:
    """Local samples/s and peak memory of a few steps at this loader's batch size."""
    reset_peak_memory(dist.device)  # this trial's own peak (the CPU budget uses it too)
    batches = iter(loader)
    samples, start = 0, 0.0
    for index in range(1 + TIMED_STEPS):  # the first step warms up
        if index == 1:
            start = time.perf_counter()
        batch = next(batches)
        step(batch)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        samples += rows(batch) * (index > 0)
    if dist.device.type == "cuda":
        torch.cuda.synchronize(dist.device)
    return samples / (time.perf_counter() - start), peak_memory_mb(dist.device)


def _trial(batch_size: int, step: Step, optimizer: torch.optim.Optimizer,
           loader: ShardLoader, dist: Dist, max_memory_mb: float | None, readers: int) -> Trial:
    verdict, speed, memory = "", 0.0, 0.0
    shard = len(loader.sampler) if hasattr(loader, "sampler") else loader.per_rank
    if shard is not None and shard < batch_size * (1 + TIMED_STEPS):
        verdict = "shard too small"
    else:
        try:
            speed, memory = _measure(step, optimizer, loader.resized(batch_size), dist)
            if max_memory_mb is not None and memory > max_memory_mb:
                verdict = f"over trainer.max_memory_mb={max_memory_mb:g}"
        except torch.OutOfMemoryError:
            verdict = "out of memory"
            optimizer.zero_grad(set_to_none=True)
            if dist.device.type == "cuda":
                torch.cuda.empty_cache()
    # the ranks agree: fits only if it fits everywhere; speeds add up, memory is the worst
    outcome = torch.tensor([float(verdict == ""), speed, memory], dtype=torch.float64,
                           device=dist.device)
    fits = bool(dist.all_reduce_min(outcome[:1]).item())
    total_speed = dist.all_reduce_sum(outcome[1:2]).item() / readers
    worst_memory = dist.all_reduce_max(outcome[2:]).item()
    if not fits and not verdict:
        verdict = "does not fit on another rank"
    return Trial(batch_size, fits, total_speed, worst_memory, verdict)


def find_batch_size(module: nn.Module, optimizer: torch.optim.Optimizer, step: Step,
                    loader: ShardLoader, dist: Dist, max_memory_mb: float | None,
                    readers: int = 1, compiled: bool = False) -> tuple[int, list[Trial]]:
    """The best per-rank batch size from loader.batch_size upward, and the trials run
    (`step`: a batch's forward and backward through `module`, whose parameters `optimizer`
    steps; `readers`: ranks that read each batch, a tp group's or a pipeline's, so that
    samples/s counts a sample once). Model and optimizer are left as they were.

    compiled (trainer.compile): each trial, and then the run, compiles its own graph for its
    size. Otherwise torch.compile, seeing a second batch size, would make the batch
    dimension symbolic: every later trial, and the run itself, would measure and train a
    dynamic-shape graph rather than the static one a run at that size compiles."""
    saved = copy.deepcopy(module.state_dict()), copy.deepcopy(optimizer.state_dict())
    trials: list[Trial] = []
    best: Trial | None = None
    size = loader.batch_size
    while True:
        if compiled:  # the trial's warm-up step compiles for its size alone
            torch._dynamo.reset()
        trial = _trial(size, step, optimizer, loader, dist, max_memory_mb, readers)
        trials.append(trial)
        if not trial.fits:
            break
        if best is not None and trial.samples_per_sec < best.samples_per_sec * GAIN:
            trial.verdict = f"less than {GAIN - 1:.0%} faster"
            break
        trial.verdict = "fits"
        best, size = trial, size * 2
    module.load_state_dict(saved[0])
    optimizer.load_state_dict(saved[1])
    if compiled:  # and the run's first step for the size chosen
        torch._dynamo.reset()
    return (best.batch_size if best else loader.batch_size), trials


def table(trials: list[Trial], chosen: int) -> str:
    rows = ["| per-rank batch | samples/s | peak memory MB | outcome |", "|---|---|---|---|"]
    for t in trials:
        mark = " (chosen)" if t.batch_size == chosen and t.fits else ""
        rows.append(f"| {t.batch_size} | {t.samples_per_sec:,.0f} | {t.peak_memory_mb:,.0f} | "
                    f"{t.verdict}{mark} |")
    return "\n".join(rows)
