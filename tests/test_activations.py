"""Activation checkpointing: fewer activations kept, each block wrapped before any parallel
wrapper, the same losses with and without it under every layout (compile included), and
the weights' names unchanged."""

from __future__ import annotations

import pytest
import torch
from conftest import GPT_RUN, losses

from parallab.models.gpt import GPT
from parallab.parallel import activations
from parallab.testing import textbook_volume


def test_checkpointing_keeps_fewer_activations():
    """full keeps each block's input only; selective also its matmul outputs,
    selective_alternate every second Linear's; checkpointing every second block keeps
    what the two kinds of block keep, half and half."""
    kept = {}
    for mode, every in [(mode, 1) for mode in activations.MODES] + [("full", 2)]:
        torch.manual_seed(0)
        model = activations.apply(GPT(layers=2, width=64, heads=2, context=64), mode,
                                  every=every)
        tokens = torch.randint(0, 256, (4, 64))
        kept[mode, every] = activations.saved_bytes(model, lambda: model(tokens).sum())
    none, full = kept["none", 1], kept["full", 1]
    assert full < 0.4 * none
    assert full < kept["selective_alternate", 1] < kept["selective", 1] < none
    assert kept["full", 2] == pytest.approx((none + full) / 2, rel=0.05)


def test_a_run_checkpoints_each_block_before_any_parallel_wrapper():
    """parallelize.speed_up (what every worker applies) wraps gpt's blocks, so the layouts'
    equal-loss runs below do checkpoint."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
        CheckpointWrapper,
    )

    from parallab.config.schema import TrainerConfig
    from parallab.parallel.parallelize import speed_up

    for mode, every, wrapped in (("none", 1, 0), ("full", 1, 3), ("selective", 1, 3),
                                 ("full", 2, 2), ("selective_alternate", 3, 1)):
        model = speed_up(GPT(layers=3, width=32, heads=2, context=16),
                         TrainerConfig(activation_checkpointing=mode,
                                       activation_checkpointing_every=every))
        assert sum(isinstance(m, CheckpointWrapper) for m in model.modules()) == wrapped


def test_a_run_compiles_with_the_backend_it_names():
    """trainer.compile_backend reaches torch.compile (a backend registered as a user would)."""
    from parallab.config.schema import TrainerConfig
    from parallab.parallel.parallelize import speed_up

    graphs = []

    @torch._dynamo.register_backend(name="recording_for_a_test")
    def recording(graph, inputs):
        graphs.append(graph)
        return graph.forward

    model = speed_up(GPT(layers=1, width=32, heads=2, context=16),
                     TrainerConfig(compile=True, compile_backend="recording_for_a_test"))
    model(torch.randint(0, 256, (2, 16)))
    assert graphs
    torch._dynamo.reset()


@pytest.mark.slow
@pytest.mark.parametrize("layout,modes", [
    ([], ["full", "selective", "selective_alternate"]),
    (["parallel=ddp", "parallel.world_size=2"], ["selective"]),
    (["parallel=fsdp", "parallel.world_size=2"], ["full"]),
    (["parallel=pipeline", "parallel.world_size=2"], ["full"]),
], ids=["none", "ddp", "fsdp", "pipeline"])
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


@pytest.mark.slow
def test_compiled_checkpointing_changes_no_loss(train_here, monkeypatch):
    """Compiled with selective checkpointing, dropout on: one device's eager losses. Inductor
    draws its random numbers as eager does here (fallback_random), so both runs draw the
    same masks, and a recomputation that drew others would show (without it the two part by
    5e-3); one compiled run, not two. Its C++ kernels are built without SIMD variants (a
    third less compiling here): the masks, not the vector code, are the point."""
    import torch._inductor.config

    monkeypatch.setattr(torch._inductor.config, "fallback_random", True)
    monkeypatch.setattr(torch._inductor.config.cpp, "vec_isa_ok", False)
    _, eager = train_here(*GPT_RUN, "model.layers=1", name="eager")
    _, compiled = train_here(*GPT_RUN, "model.layers=1", "trainer.compile=true",
                             "trainer.activation_checkpointing=selective", name="compiled")
    assert losses(compiled) == pytest.approx(losses(eager), abs=1e-5)


def assert_textbook_volume(metrics, layout: str) -> None:
    """Bytes sent per step (comm.py) against the textbook: DDP all-reduces the gradients,
    2 (n-1)/n x P; FSDP gathers the parameters twice (forward, backward) and scatters the
    gradients once, 3 x P x (n-1)/n; n = 2 ranks."""
    params = 4 * sum(p.numel() for p in GPT(layers=2, heads=2, width=32, context=32,
                                            dropout=0.1).parameters())
    expected = {"ddp": textbook_volume(params, replicas=2),
                "fsdp": textbook_volume(params, shards=2)}[layout]
    for kind, volume in expected.items():
        if volume:  # the kinds the layout sends: the gradients alone (parallab's data say
            # each rank's count of loss terms by their shapes: no collective of their own)
            assert metrics[f"comm_{kind}_mb"] * 2**20 == pytest.approx(volume, rel=1e-6), kind
    assert metrics["comm_mb_per_step"] * 2**20 == pytest.approx(sum(expected.values()), rel=0.01)


def test_checkpointed_weights_keep_their_names(train_here):
    metrics, run_dir = train_here(*GPT_RUN, "trainer.max_steps=3",
                                  "trainer.activation_checkpointing=full")
    state = torch.load(run_dir / "checkpoints" / "last.pt", weights_only=True)["model"]
    assert state.keys() == GPT(layers=2, heads=2, width=32, context=32).state_dict().keys()
