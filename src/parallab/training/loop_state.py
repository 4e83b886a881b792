"""What a checkpoint holds of the training loop, and the loop put back from it: weights and
optimizer as the runtime holds them, each stateful part's own state by its name, the loop's
position and the data's. Apart from the loop itself, as Lightning's checkpoint connector
is from its Trainer: the loop reads top to bottom, this reads once a save or a resume."""

from __future__ import annotations

import math
from typing import Any

from parallab import data as data_of
from parallab import schedule
from parallab.training import checkpoint

# the loop is trainer.py's Trainer, read by its members (not imported: it imports this)
Trainer = Any


def state_of(trainer: Trainer) -> dict[str, Any]:
    """All a run needs to continue exactly."""
    t = trainer
    model_state, optimizer_state = t.runtime.state_dict(t.model, t.optimizer)
    parts = {"grad_scaler": t.precision, "monitor": t.evaluation,
             "scheduler": t.scheduler, "expert_load": t.expert_load}
    return {"model": model_state, "optimizer": optimizer_state,
            **{name: part.state_dict() if part is not None else None
               for name, part in parts.items()},
            **t.window.state_dict(),
            "step": t.step, "epoch": t.epoch, "epoch_step": t.epoch_step,
            "total_steps": t.total_steps, "global_batch_size": t.global_batch_size,
            "data": data_of.position(t.data.train)}


def _recounted(t: Trainer, saved_batch: int | None) -> None:
    """Resumed at another global batch than saved (at an epoch's end, or in data with a
    place of its own: checked before): the epochs left counted in steps of this one,
    bounded by trainer.max_steps, the schedule over that length."""
    here = t.global_batch_size
    if saved_batch in (None, here) or t.steps_per_epoch is None:
        return
    t.epoch_step = -(-t.epoch_step * saved_batch // here)  # the samples taken
    left = (t.cfg.epochs - t.epoch) * t.steps_per_epoch - t.epoch_step
    t.total_steps = min(t.step + left, t.cfg.max_steps or math.inf)
    if t.scheduler is not None:
        t.scheduler = schedule.respanned(t.scheduler_cfg, t.optimizer, t.total_steps)


def restore(t: Trainer, state: dict[str, Any]) -> None:
    """The loop put back where `state` (state_of's) left it."""
    t.runtime.load_state_dict(t.model, t.optimizer, state["model"], state["optimizer"])
    t.precision.load_state_dict(state["grad_scaler"])
    t.step, t.epoch, t.epoch_step = state["step"], state["epoch"], state["epoch_step"]
    _recounted(t, state.get("global_batch_size"))
    t.window.load_state_dict(state)
    data_of.restore_position(t.data.train, state.get("data"))  # its global sample
    t.evaluation.load_state_dict(state.get("monitor"))
    if t.expert_load is not None and state.get("expert_load"):  # the run's sums
        t.expert_load.load_state_dict(state["expert_load"])
    if t.scheduler is not None and state.get("scheduler"):  # its step count
        schedule.resume(t.scheduler, t.optimizer, state["scheduler"],
                        state.get("total_steps"), t.total_steps, t.step, t.dist.is_main)
    checkpoint.restore_rng(state, t.dist)
