"""Learning-rate schedules: each one's shape, what TensorBoard shows, bad values.
Resuming to the uninterrupted run's rates bit for bit is test_resume's (its runs use cosine)."""

from __future__ import annotations

import math

import pytest
from conftest import FAST, scalars, typed

from parallab.config.schema import SchedulerConfig
from parallab.schedule import multiplier


def factors(total: int, **keys) -> list[float]:
    factor = multiplier(SchedulerConfig(**keys), total)
    return [factor(step) for step in range(total)]


def test_each_schedule_has_its_shape():
    assert factors(10) == [1.0] * 10  # constant: the MNIST recipe
    assert factors(8, warmup_steps=3)[:4] == [0.25, 0.5, 0.75, 1.0]  # k / (W + 1)

    cosine = factors(100, name="cosine", warmup_steps=10, min_lr_ratio=0.1)
    assert cosine[0] == pytest.approx(1 / 11) and cosine[10] == 1.0
    assert cosine[55] == pytest.approx(0.55)  # half way down from 1 to 0.1
    assert all(a > b for a, b in zip(cosine[10:], cosine[11:])) and cosine[-1] > 0.1

    linear = factors(100, name="linear", warmup_steps=0.1)  # a fraction: 10 steps
    assert linear[9] == pytest.approx(10 / 11) and linear[55] == pytest.approx(0.5)

    step = factors(100, name="step", step_size=30, gamma=0.5)
    assert (step[29], step[30], step[60], step[99]) == (1.0, 0.5, 0.25, 0.125)

    wsd = factors(100, name="wsd", warmup_steps=5, decay_steps=0.2, min_lr_ratio=0.0)
    assert wsd[5:81] == [1.0] * 76 and wsd[90] == pytest.approx(0.5)
    assert wsd[99] == pytest.approx(0.05)


def test_train_lr_shows_the_schedule(train_here):
    """32 steps of cosine after a 4-step warmup, as TensorBoard's train/lr reads them (the
    rate each step used), against the formula written out here."""
    _, run_dir = train_here(*FAST, "scheduler=cosine", "scheduler.warmup_steps=4",
                            "scheduler.min_lr_ratio=0.1", "trainer.log_every_n_steps=1")
    lr, total, warmup = 0.01, 32, 4
    expected = [lr * (k + 1) / (warmup + 1) if k < warmup else
                lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * (k - warmup) / (total - warmup))))
                for k in range(total)]
    logged = scalars(run_dir, "train/lr")
    assert [step for step, _ in logged] == list(range(1, total + 1))
    assert [value for _, value in logged] == pytest.approx(expected, rel=1e-6)


@pytest.mark.parametrize("scale,args,lr", [
    ("none", ["data.batch_size=128"], 0.01),
    ("linear", ["data.batch_size=32", "trainer.accumulate_grad_batches=4"], 0.02),  # 128 a step
    ("sqrt", ["data.batch_size=256"], 0.02)])
def test_the_learning_rate_follows_the_global_batch(train_here, scale, args, lr):
    """optim.lr=0.01 tuned at optim.base_batch_size=64, scaled to the run's global batch."""
    metrics, run_dir = train_here(*FAST, f"optim.scale_lr={scale}", *args,
                                  "trainer.log_every_n_steps=1", "trainer.max_steps=3")
    assert metrics["lr"] == pytest.approx(lr)
    assert [value for _, value in scalars(run_dir, "train/lr")] == pytest.approx([lr] * 3)



def test_a_resume_goes_on_at_the_rate_and_schedule_its_checkpoint_holds(train_here, caplog):
    """What the optimizer state holds wins on resume: a changed optim or scheduler key is
    refused in one line, a scaled rate at another global batch is the checkpoint's (and
    reported so), a new run length is said with the rate's jump."""
    from parallab.config.errors import ConfigError

    # 6 steps an epoch: resumed at an epoch's end, where another global batch may go on
    run = [*FAST, "data.train_size=768", "trainer.epochs=3", "optim.scale_lr=linear",
           "data.batch_size=128", "trainer.log_every_n_steps=1", "scheduler=cosine"]
    train_here(*run, "trainer.max_steps=6", name="run")
    for change, says in ((["optim.lr=0.001"], "optim.lr=0.001 differs from its 0.01: give "
                                           "optim.lr=0.01 as when it was saved"),
                         (["scheduler=linear"], "scheduler.name=linear differs from its cosine")):
        with pytest.raises(ConfigError, match=says):
            train_here(*run, "trainer.resume=auto", "trainer.max_steps=6", *change, name="run")
    resumed, run_dir = train_here(*[o for o in run if o != "data.batch_size=128"],
                                  "data.batch_size=64", "trainer.resume=auto",
                                  "trainer.max_steps=12", name="run")
    assert resumed["lr"] == pytest.approx(0.02)  # 0.01 x 128/64, as saved; not 0.01 x 64/64
    assert "resumed at the checkpoint's learning rate 0.02" in caplog.text
    assert "the run is 12 steps long now, 6 when saved" in caplog.text
    rates = [lr for _, lr in scalars(run_dir, "train/lr")]
    # steps 7-12: the cosine from 0.02 over the new 12 steps (not from 0.01, nor the old 6)
    factor = multiplier(typed(*run).scheduler, 12)
    assert rates[6:] == pytest.approx([0.02 * factor(k) for k in range(6, 12)], rel=1e-5)
