"""Learning-rate schedules (the `scheduler` group), as torch's LambdaLR over the run's steps.

    constant  optim.lr throughout (the MNIST recipe), after the warmup if one is set
    cosine    linear warmup, then cosine decay to scheduler.min_lr_ratio x optim.lr
    linear    linear warmup, then linear decay to min_lr_ratio x optim.lr
    step      StepLR's schedule: x scheduler.gamma every scheduler.step_size steps
    wsd       warmup, stable, decay: optim.lr until the last scheduler.decay_steps, then
              linear decay to min_lr_ratio x optim.lr (for runs that may be continued)

Stepped once per optimizer step. Warmup rises as torchtitan's does: step k of W runs at
k / (W + 1) of the rate. A LambdaLR's state is its step count, so a checkpoint holding it
resumes to the same rates bit for bit (the multipliers are recomputed from it).
"""

from __future__ import annotations

import dataclasses
import logging
import math
from typing import Callable

import torch

from parallab.config.errors import ConfigError
from parallab.config.schema import SchedulerConfig

log = logging.getLogger(__name__)
NAMES = ("constant", "cosine", "linear", "step", "wsd")
# the keys only some schedules read: set under another (off the schema's default), ignored
ONLY_IN = {"min_lr_ratio": ("cosine", "linear", "wsd"), "step_size": ("step",),
           "gamma": ("step",), "decay_steps": ("wsd",)}


def problem(cfg) -> str | None:
    """None if the schedule's values make sense, else one line naming the key and the fix."""
    if cfg.name not in NAMES:
        return f"scheduler.name={cfg.name} is unknown: use scheduler={', '.join(NAMES)}"
    if not (math.isfinite(cfg.warmup_steps) and cfg.warmup_steps >= 0):
        return (f"scheduler.warmup_steps={cfg.warmup_steps} is out of range: give optimizer "
                "steps (>= 1) or a fraction of the run (< 1)")
    if cfg.warmup_steps > 1 and cfg.warmup_steps != int(cfg.warmup_steps):
        return (f"scheduler.warmup_steps={cfg.warmup_steps} is no whole number of optimizer "
                f"steps (it would be {int(cfg.warmup_steps)}): give steps (>= 1) or a fraction "
                "of the run (< 1)")
    if not 0 <= cfg.min_lr_ratio <= 1:
        return f"scheduler.min_lr_ratio={cfg.min_lr_ratio} is out of range: it must be in [0, 1]"
    if cfg.step_size < 1:
        return f"scheduler.step_size={cfg.step_size} is out of range: it must be >= 1"
    if not 0 < cfg.gamma <= 1:
        return f"scheduler.gamma={cfg.gamma} is out of range: it must be in (0, 1]"
    if not (math.isfinite(cfg.decay_steps) and cfg.decay_steps > 0):
        return (f"scheduler.decay_steps={cfg.decay_steps} is out of range: give optimizer "
                "steps (>= 1) or a fraction of the run (< 1)")
    return unread(cfg)


def unread(cfg) -> str | None:
    """A key set that this schedule does not read (scheduler.gamma under cosine), which would
    be ignored without a word."""
    defaults = {f.name: f.default for f in dataclasses.fields(SchedulerConfig)}
    for key, readers in ONLY_IN.items():
        if cfg.name not in readers and getattr(cfg, key) != defaults[key]:
            return (f"scheduler.{key}={getattr(cfg, key)} is read by scheduler="
                    f"{' or '.join(readers)}, and scheduler={cfg.name} ignores it: drop it "
                    "(or choose one that reads it)")
    return None


def steps_of(value: float, total: int) -> int:
    """A step count given as steps (>= 1) or as a fraction of the run (< 1)."""
    return round(value * total) if value < 1 else int(value)


def multiplier(cfg, total: int) -> Callable[[int], float]:
    """The factor on optim.lr at step s (0 = the first optimizer step) of `total`."""
    warmup = steps_of(cfg.warmup_steps, total)
    if warmup >= total:  # a constant rate would never be reached, a decay never start
        raise ConfigError(f"scheduler.warmup_steps={cfg.warmup_steps} is {warmup} steps, the "
                          f"whole run of {total}: leaves no step past the warmup; lower it")
    decay = steps_of(cfg.decay_steps, total) if cfg.name == "wsd" else total - warmup
    if decay > total - warmup:
        raise ConfigError(f"scheduler.decay_steps={cfg.decay_steps} is {decay} steps, more than "
                          f"the {total - warmup} after the warmup: lower it")
    low = cfg.min_lr_ratio

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / (warmup + 1)
        if cfg.name == "constant":
            return 1.0
        if cfg.name == "step":
            return cfg.gamma ** ((step - warmup) // cfg.step_size)
        progress = min(1.0, (step - (total - decay)) / decay) if step >= total - decay else 0.0
        if cfg.name == "cosine":
            return low + (1 - low) * 0.5 * (1 + math.cos(math.pi * progress))
        return low + (1 - low) * (1 - progress)  # linear, and wsd's decay

    return factor


def build(cfg, optimizer: torch.optim.Optimizer, total_steps: int
          ) -> torch.optim.lr_scheduler.LambdaLR | None:
    """The run's scheduler; None for a constant rate without warmup (the MNIST recipe's
    loop, without a scheduler step's cost)."""
    if cfg.name == "constant" and steps_of(cfg.warmup_steps, total_steps) == 0:
        return None
    return torch.optim.lr_scheduler.LambdaLR(optimizer, multiplier(cfg, total_steps))


def resume(scheduler, optimizer: torch.optim.Optimizer, state: dict, saved_total: int | None,
           total: int, step: int, say: bool) -> None:
    """A schedule continued at optimizer step `step` from its checkpoint's `state` in a run
    of `total` steps (it was `saved_total` long): each group's rate is the next step's by
    this run's schedule. A new length moves the rates, which can jump: said (where `say`),
    with both rates."""
    scheduler.load_state_dict(state)
    factor = scheduler.lr_lambdas[0](scheduler.last_epoch)
    if say and saved_total not in (None, total):
        log.warning("the run is %d steps long now, %d when saved: the schedule's rate at step "
                    "%d goes from %g to %g (its rates follow the new length)", total,
                    saved_total, step + 1, optimizer.param_groups[0]["lr"],
                    scheduler.base_lrs[0] * factor)
    for group, base, rate in zip(optimizer.param_groups, scheduler.base_lrs,
                                 scheduler.lr_lambdas):
        group["lr"] = base * rate(scheduler.last_epoch)


def respanned(cfg, optimizer: torch.optim.Optimizer, total_steps: int
              ) -> torch.optim.lr_scheduler.LambdaLR | None:
    """The run's scheduler over a new length, for a resumed run whose state it loads next:
    the optimizer's rates, as saved, left as they are (a new LambdaLR sets its first)."""
    rates = [group["lr"] for group in optimizer.param_groups]
    scheduler = build(cfg, optimizer, total_steps)
    for group, rate in zip(optimizer.param_groups, rates):
        group["lr"] = rate
    return scheduler
