"""The best checkpoint and early stopping, with evaluations by epoch or by step, across
ranks and across a resume."""

from __future__ import annotations

import pytest
import torch
from conftest import FAST, read_metrics, scalars

from parallab.testing import as_logged
from parallab.training import checkpoint

# eval each epoch of 8 steps; monitoring the falling eval loss as if higher were better
# makes every evaluation after the first a non-improvement: early stopping fires for sure
EPOCHS = [*FAST, "data.train_size=512", "trainer.epochs=6", "trainer.log_every_n_steps=4"]
NEVER_BETTER = ["trainer.monitor_mode=max", "trainer.early_stop_patience=2"]


def test_best_checkpoint_holds_the_best_evaluation(train_here):
    metrics, run_dir = train_here(*EPOCHS, "optim.lr=0.5", "trainer.monitor=eval_accuracy")
    accuracy = dict(scalars(run_dir, "eval/accuracy"))
    best_step = max(accuracy, key=lambda step: (accuracy[step], -step))  # the first of ties
    assert (as_logged(metrics["best_eval_accuracy"]), metrics["best_step"]) == (
        accuracy[best_step], best_step)
    best = torch.load(run_dir / "checkpoints" / "best.pt", weights_only=True)
    assert best["step"] == best_step and not metrics["stopped_early"]
    assert checkpoint.latest(run_dir / "checkpoints").name == "last.pt"  # resume skips best


def test_early_stopping_ends_the_run_and_says_so(train_here):
    metrics, run_dir = train_here(*EPOCHS, *NEVER_BETTER)
    assert metrics["stopped_early"] and metrics["steps"] == 3 * 8  # 1 best + 2 not better
    assert metrics["best_step"] == 8 and read_metrics(run_dir)["stopped_early"] is True
    assert as_logged(metrics["best_eval_loss"]) == dict(scalars(run_dir, "eval/loss"))[8]


def test_a_run_ending_at_its_length_with_stale_evaluations_did_not_stop_early(train_here):
    """Patience runs out at the last evaluation (step 24), where the run ends anyway."""
    metrics, _ = train_here(*EPOCHS, *NEVER_BETTER, "trainer.epochs=3")
    assert metrics["steps"] == 3 * 8 and metrics["stopped_early"] is False


def test_evaluations_by_step_pick_the_best_and_stop_early_across_a_resume(train_here):
    """Every 3 steps, mid-epoch: 3 best, 6 and 9 not better -> stopped at 9; a run cut at
    step 5 and resumed stops there too, its best the same."""
    run = [*EPOCHS, *NEVER_BETTER, "trainer.eval_every_n_steps=3"]
    whole, run_dir = train_here(*run, name="whole")
    assert [s for s, _ in scalars(run_dir, "eval/loss")] == [3, 6, 9]
    assert whole["stopped_early"] and (whole["steps"], whole["best_step"]) == (9, 3)
    assert torch.load(run_dir / "checkpoints" / "best.pt", weights_only=True)["step"] == 3
    train_here(*run, "trainer.max_steps=5", name="cut")
    resumed, _ = train_here(*run, "trainer.resume=auto", name="cut")
    assert resumed["stopped_early"] and (resumed["steps"], resumed["best_step"]) == (9, 3)
    assert resumed["eval_loss"] == pytest.approx(whole["eval_loss"], rel=1e-6)


def test_a_resume_monitoring_another_figure_starts_its_best_afresh(train_here):
    """Resumed with another trainer.monitor, the checkpoint's best (the eval loss) stood as
    the accuracy's: 2.3 'best accuracy', best.pt never updated; it starts afresh now."""
    train_here(*EPOCHS, "trainer.eval_every_n_steps=2", "trainer.max_steps=2")
    resumed, run_dir = train_here(*EPOCHS, "trainer.eval_every_n_steps=2",
                                  "trainer.max_steps=6", "trainer.resume=auto",
                                  "trainer.monitor=eval_accuracy")
    accuracy = dict(scalars(run_dir, "eval/accuracy"))
    assert resumed["best_eval_accuracy"] == pytest.approx(max(accuracy[4], accuracy[6]))
    assert resumed["best_step"] in (4, 6)


@pytest.mark.slow
@pytest.mark.distributed
def test_early_stopping_agrees_across_ranks_and_resumes(train_here):
    """Stopped by max_steps after the first evaluation and resumed, it stops where the
    uninterrupted run does (test above): after 2 more evaluations, the first one best."""
    ddp = [*EPOCHS, *NEVER_BETTER, "parallel=ddp", "parallel.world_size=2",
           "data.batch_size=32"]
    train_here(*ddp, "trainer.max_steps=8")
    metrics, run_dir = train_here(*ddp, "trainer.resume=auto")
    assert metrics["stopped_early"] and metrics["steps"] == 3 * 8
    assert metrics["best_step"] == 8
    assert as_logged(metrics["best_eval_loss"]) == dict(scalars(run_dir, "eval/loss"))[8]


def test_early_stopping_resumed_after_a_max_steps_stop_ends_where_it_would_have(train_here):
    """A run stopped by max_steps mid-epoch evaluates its last weights; that evaluation is
    off the schedule (every epoch), so the resumed run does not count it toward patience."""
    run = ["model=mlp", *FAST, "data.train_size=640", "trainer.epochs=10",
           "trainer.monitor=eval_accuracy", "trainer.monitor_mode=min",
           "trainer.early_stop_patience=2", "optim.lr=0.05"]
    whole, _ = train_here(*run, name="whole")
    train_here(*run, "trainer.max_steps=15", name="cut")
    resumed, _ = train_here(*run, "trainer.resume=auto", name="cut")
    assert whole["stopped_early"] and resumed["stopped_early"]
    assert resumed["steps"] == whole["steps"] == 30
    assert resumed["eval_loss"] == pytest.approx(whole["eval_loss"], rel=1e-6)
