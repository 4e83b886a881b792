"""What a real training run needs: activation checkpointing under every layout,
the best checkpoint and early stopping (also across ranks and a resume). Schedules and the
batch-aware learning rate are test_schedule's."""

from __future__ import annotations

import pytest
import torch

from conftest import FAST, losses, read_metrics, scalars
from parallab import activations, checkpoint
from parallab.models.gpt import GPT
from parallab.testing import as_logged, textbook_volume

# a small gpt with dropout, every step logged: recomputation must redraw the same masks
GPT_RUN = ["data=bytes", "data.eval_fraction=0.002", "model=gpt", "model.layers=2",
           "model.heads=2", "model.width=32", "model.context=32", "model.dropout=0.1",
           "data.batch_size=8", "trainer.max_steps=20", "trainer.log_every_n_steps=1",
           "trainer.checkpoint_every_n_steps=null", "device=cpu"]


def test_checkpointing_keeps_fewer_activations():
    """full keeps each block's input only; selective also its matmul outputs."""
    kept = {}
    for mode in activations.MODES:
        torch.manual_seed(0)
        model = activations.apply(GPT(layers=2, width=64, heads=2, context=64), mode)
        tokens = torch.randint(0, 256, (4, 64))
        kept[mode] = activations.saved_bytes(model, lambda: model(tokens).sum())
    assert kept["full"] < 0.4 * kept["none"]
    assert kept["full"] < kept["selective"] < kept["none"]


def test_a_run_checkpoints_each_block_before_any_parallel_wrapper():
    """run.speed_up (what every worker applies) wraps gpt's blocks, so the layouts'
    equal-loss runs below do checkpoint."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper

    from parallab.config import TrainerConfig
    from parallab.run import speed_up

    for mode, wrapped in (("none", 0), ("full", 3), ("selective", 3)):
        model = speed_up(GPT(layers=3, width=32, heads=2, context=16),
                         TrainerConfig(activation_checkpointing=mode))
        assert sum(isinstance(m, CheckpointWrapper) for m in model.modules()) == wrapped


@pytest.mark.slow
@pytest.mark.parametrize("layout,modes", [
    ([], ["full", "selective"]),
    (["parallel=ddp", "parallel.world_size=2"], ["selective"]),
    (["parallel=fsdp", "parallel.world_size=2"], ["full"]),
    (["parallel=pipeline", "parallel.world_size=2"], ["full"]),
    (["trainer.compile=true", "model.layers=1"], ["selective"]),
], ids=["none", "ddp", "fsdp", "pipeline", "compile"])
def test_checkpointing_changes_no_loss(train_here, layout, modes):
    """The first 20 losses with and without it, under each layout (dropout on)."""
    runs = {mode: train_here(*GPT_RUN, *layout, f"trainer.activation_checkpointing={mode}",
                             name=mode) for mode in ["none", *modes]}
    metrics, run_dir = runs.pop("none")
    reference = losses(run_dir)
    assert len(reference) == 20
    for mode, (_, got) in runs.items():
        assert losses(got) == pytest.approx(reference, abs=1e-5), mode
    if layout[:1] in (["parallel=ddp"], ["parallel=fsdp"]):  # the run without it, on 2 ranks
        assert_textbook_volume(metrics, layout[0].removeprefix("parallel="))


def assert_textbook_volume(metrics, layout: str) -> None:
    """Bytes sent per step (comm.py) against the textbook: DDP all-reduces the gradients,
    2 (n-1)/n x P; FSDP gathers the parameters twice (forward, backward) and scatters the
    gradients once, 3 x P x (n-1)/n; n = 2 ranks."""
    params = 4 * sum(p.numel() for p in GPT(layers=2, heads=2, width=32, context=32,
                                            dropout=0.1).parameters())
    expected = {"ddp": textbook_volume(params, replicas=2),
                "fsdp": textbook_volume(params, shards=2)}[layout]
    for kind, volume in expected.items():
        if volume:  # the kinds the layout sends
            assert metrics[f"comm_{kind}_mb"] * 2**20 == pytest.approx(volume, rel=0.01), kind
    assert metrics["comm_mb_per_step"] * 2**20 == pytest.approx(sum(expected.values()), rel=0.01)


def test_checkpointed_weights_keep_their_names(train_here):
    metrics, run_dir = train_here(*GPT_RUN, "trainer.max_steps=3",
                                  "trainer.activation_checkpointing=full")
    state = torch.load(run_dir / "checkpoints" / "last.pt", weights_only=True)["model"]
    assert state.keys() == GPT(layers=2, heads=2, width=32, context=32).state_dict().keys()


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


def test_adamw_decays_weight_matrices_only():
    from parallab.config import AdamWConfig, SGDConfig
    from parallab.optim import build_optimizer

    model = GPT(layers=1, width=16, heads=2, context=8, vocab_size=32)
    optimizer = build_optimizer(AdamWConfig(lr=0.1, weight_decay=0.5), model)
    for p in model.parameters():
        p.grad = torch.zeros_like(p)  # the step is the decay alone
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    optimizer.step()
    for name, p in model.named_parameters():
        matrix = p.ndim == 2 and "embed" not in name
        expected = before[name] * (1 - 0.1 * 0.5) if matrix else before[name]
        torch.testing.assert_close(p.detach(), expected, msg=name)
    assert len(build_optimizer(SGDConfig(weight_decay=0.5), model).param_groups) == 1  # decay_all


@pytest.mark.slow
@pytest.mark.distributed
def test_tied_embeddings_share_the_head_and_train_under_fsdp(train_here):
    tied = GPT(layers=1, width=32, heads=2, context=32, tie_embeddings=True)
    untied = GPT(layers=1, width=32, heads=2, context=32)
    count = lambda model: sum(p.numel() for p in model.parameters())  # noqa: E731
    assert count(untied) - count(tied) == 256 * 32  # vocab x width
    assert tied.head.out.weight is tied.embed.tokens.weight
    run = [*GPT_RUN, "model.tie_embeddings=true", "model.dropout=0.0", "data.batch_size=16"]
    _, one = train_here(*run, name="one")
    _, fsdp = train_here(*run, "parallel=fsdp", "parallel.world_size=2", "data.batch_size=8",
                         name="fsdp")
    assert losses(fsdp) == pytest.approx(losses(one), rel=1e-4, abs=1e-5)
