"""End to end through train.py and evaluate.py: real MNIST, metrics, TensorBoard, checkpoints."""

from __future__ import annotations

import gc
import logging

import pytest
import torch
from conftest import FAST, assert_ok, output, read_metrics, run_entry, scalars

METRIC_KEYS = {"train_loss", "eval_loss", "eval_accuracy", "samples_per_sec", "step_time_ms",
               "epoch_time_s", "wall_time_s", "world_size", "global_batch_size",
               "precision_dtype", "backend", "parallel", "peak_memory_mb", "steps",
               "state_memory_mb", "lr", "best_eval_loss", "best_step", "stopped_early",
               "comm_mb_per_step", "start_memory_mb", "loop_time_ms"}


# under xdist a module fixture runs once per worker: its tests share one worker
ON_THE_EPOCHS_WORKER = pytest.mark.xdist_group("mnist_epoch")


@pytest.fixture(scope="module")
def mnist_epoch(tmp_path_factory):
    """One epoch of the default experiment (the MNIST recipe on real MNIST)."""
    run_dir = tmp_path_factory.mktemp("mnist") / "run"
    result = run_entry("train.py", ["trainer.epochs=1"], run_dir, timeout=300)
    assert_ok(result)
    return result, run_dir


@pytest.mark.slow
@ON_THE_EPOCHS_WORKER
def test_one_mnist_epoch_reaches_93_percent(mnist_epoch):
    _, run_dir = mnist_epoch
    metrics = read_metrics(run_dir)
    assert set(metrics) == METRIC_KEYS
    assert metrics["eval_accuracy"] >= 0.93
    assert metrics["steps"] == 938 and metrics["global_batch_size"] == 64
    assert (metrics["world_size"], metrics["parallel"], metrics["backend"]) == (1, "none", "none")
    assert metrics["precision_dtype"] == "float32"
    assert metrics["samples_per_sec"] > 0 and metrics["train_loss"] < 1.5
    # the loop's own part of a step (loading, logging every 50th) is a small part of it
    assert 0 < metrics["loop_time_ms"] < metrics["step_time_ms"] / 2


@pytest.mark.slow
@ON_THE_EPOCHS_WORKER
def test_tensorboard_holds_the_run(mnist_epoch):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    _, run_dir = mnist_epoch
    loss = scalars(run_dir, "train/loss")
    assert [step for step, _ in loss][:3] == [50, 100, 150] and loss[-1][0] == 938
    assert loss[-1][1] < loss[0][1]
    accuracy = scalars(run_dir, "eval/accuracy")
    assert accuracy[-1][1] == pytest.approx(read_metrics(run_dir)["eval_accuracy"])
    for tag in ("train/lr", "train/samples_per_sec", "train/step_time_ms",
                "train/peak_memory_mb", "eval/loss", "final/samples_per_sec"):
        assert scalars(run_dir, tag), tag
    events = EventAccumulator(str(run_dir))
    events.Reload()
    assert "config/text_summary" in events.Tags()["tensors"]
    plugin = events.PluginTagToContent("hparams")
    assert "_hparams_/experiment" in plugin and "_hparams_/session_start_info" in plugin
    assert b"data.batch_size" in plugin["_hparams_/session_start_info"]


@pytest.mark.slow
@ON_THE_EPOCHS_WORKER
def test_progress_lines_reach_console_and_log_file(mnist_epoch):
    result, run_dir = mnist_epoch
    line = "epoch 1 step 100/938"
    assert line in output(result)  # not a terminal: plain lines instead of a bar
    assert line in (run_dir / "train.log").read_text()


@pytest.mark.slow
@ON_THE_EPOCHS_WORKER
def test_evaluate_py_scores_the_saved_checkpoint(mnist_epoch, tmp_path):
    _, run_dir = mnist_epoch
    ckpt = run_dir / "checkpoints" / "last.pt"
    state = torch.load(ckpt, weights_only=True)
    assert {"model", "optimizer", "step", "config"} <= set(state)
    result = run_entry("evaluate.py", [f"ckpt={ckpt}", "device=cpu"], tmp_path / "eval")
    assert_ok(result)
    evaluated = read_metrics(tmp_path / "eval")
    assert evaluated["eval_accuracy"] == read_metrics(run_dir)["eval_accuracy"]
    assert "accuracy" in output(result)


def test_evaluate_refuses_a_checkpoint_that_would_run_code(tmp_path):
    """In one line (a CheckpointError: evaluate.py's exit 2, as for any refusal)."""
    import fractions

    from parallab.commands import evaluate_in_process
    from parallab.training.checkpoint import CheckpointError

    ckpt = tmp_path / "evil.pt"  # unpickling an arbitrary class is how a checkpoint runs code
    torch.save({"model": fractions.Fraction(1, 3), "config": {"model": {"name": "mnist_cnn"}}},
               ckpt)
    with pytest.raises(CheckpointError, match="refusing to load"):
        evaluate_in_process([f"ckpt={ckpt}"], tmp_path / "eval")
    assert not (tmp_path / "eval").exists()


def test_evaluate_names_a_missing_checkpoint(tmp_path):
    from parallab.commands import evaluate_in_process
    from parallab.training.checkpoint import CheckpointError

    with pytest.raises(CheckpointError, match=f"ckpt={tmp_path}/none.pt: no such file"):
        evaluate_in_process([f"ckpt={tmp_path}/none.pt"], tmp_path / "eval")


@pytest.mark.slow
def test_same_seed_gives_the_same_loss_curve_bit_for_bit(train, train_here):
    args = [*FAST, "trainer.log_every_n_steps=1", "trainer.max_steps=25"]
    # one run in a fresh interpreter, the rest in this one: the curve does not depend on
    # the process that trains it
    first, dir1 = train(*args, name="a")
    assert_ok(first)
    _, dir2 = train_here(*args, name="b")
    assert scalars(dir1, "train/loss") == scalars(dir2, "train/loss")
    _, dir3 = train_here(*args, "seed=7", name="c")
    assert scalars(dir1, "train/loss") != scalars(dir3, "train/loss")
    # the heap a run leaves out of garbage collection while it trains is put back after:
    # a process that goes on (this one, a notebook) still collects it
    assert gc.get_freeze_count() == 0


@pytest.mark.slow
def test_each_optimizer_trains(train_here):
    for optim in ("sgd", "adam", "adamw"):
        _, run_dir = train_here(*FAST, f"optim={optim}", name=optim)
        loss = [value for _, value in scalars(run_dir, "train/loss")]
        assert loss[-1] < loss[0], optim



@pytest.mark.parametrize("name", ["sgd", "adam", "adamw"])
def test_optimizer_implementations_take_the_same_steps(name):
    """optim.implementation picks torch's kernels, not the update: auto is foreach on CPU."""
    from torch import nn

    from parallab.config.schema import SCHEMAS
    from parallab.optim import IMPLEMENTATIONS, build_optimizer

    inputs = torch.randn(8, 4, generator=torch.Generator().manual_seed(1))
    weights = {}
    for implementation in IMPLEMENTATIONS:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3))
        cfg = SCHEMAS["optim"][name](implementation=implementation)
        optimizer = build_optimizer(cfg, model)
        for _ in range(5):
            optimizer.zero_grad()
            model(inputs).pow(2).mean().backward()
            optimizer.step()
        weights[implementation] = torch.cat([p.detach().flatten() for p in model.parameters()])
        if implementation == "auto":
            assert optimizer.defaults["foreach"] and not optimizer.defaults["fused"]
    for implementation, flat in weights.items():
        torch.testing.assert_close(flat, weights["for_loop"], msg=implementation)

@pytest.mark.slow
def test_dataloader_path_trains_mnist(train_here):
    _, run_dir = train_here("data.loader=dataloader", "data.num_workers=1",
                            "data.persistent_workers=true", "optim=adam", "trainer.max_steps=60",
                            "trainer.log_every_n_steps=20")
    metrics = read_metrics(run_dir)
    assert metrics["steps"] == 60 and metrics["eval_accuracy"] > 0.5


@pytest.mark.slow
def test_dp_on_cpu_says_it_runs_on_one_device(train_here, caplog):
    _, run_dir = train_here(*FAST, "parallel=dp", "trainer.max_steps=10")
    # a warning: what train.py's logging shows on the console and in train.log
    assert any(r.levelno == logging.WARNING and "parallel=dp on CPU runs on one device"
               in r.getMessage() for r in caplog.records)
    metrics = read_metrics(run_dir)
    assert (metrics["parallel"], metrics["world_size"], metrics["steps"]) == ("dp", 1, 10)


@pytest.mark.slow
def test_final_metrics_score_the_final_weights(train_here):
    _, run_dir = train_here(*FAST, "trainer.epochs=3", "trainer.eval_every_n_epochs=2",
                            "data.train_size=640")
    evaluated_at = [step for step, _ in scalars(run_dir, "eval/accuracy")]
    assert evaluated_at == [20, 30]  # after epoch 2, then the last epoch's weights
    assert read_metrics(run_dir)["eval_accuracy"] == pytest.approx(
        scalars(run_dir, "eval/accuracy")[-1][1])


@pytest.mark.slow
def test_progress_bar_replaces_console_lines_but_not_the_log_file(train):
    result, run_dir = train(*FAST, "trainer.progress_bar=true", "trainer.max_steps=20")
    assert_ok(result)
    assert "20/20" in result.stderr and "step/s" in result.stderr  # tqdm's bar
    assert "epoch 1 step 20/20" not in output(result)
    assert "epoch 1 step 20/20" in (run_dir / "train.log").read_text()


def test_a_run_cut_by_max_steps_numbers_its_evaluation_by_step_and_says_why_timing_is_null(
        train_here, caplog):
    caplog.set_level(logging.INFO)
    metrics, _ = train_here(*FAST, "trainer.max_steps=3")
    assert metrics["samples_per_sec"] is None and metrics["step_time_ms"] is None
    assert metrics["loop_time_ms"] is None
    said = [r.getMessage() for r in caplog.records]
    assert any(m.startswith("step 3: eval_loss") for m in said), said
    assert not any(m.startswith("epoch 0:") for m in said)
    assert any("all within trainer.timing_skip_steps=5" in m for m in said)
