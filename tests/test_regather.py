"""Sequence parallelism's gathered inputs gathered again in backward
(parallel.regather_in_backward): the same values as keeping them, in real gloo processes.
What a block keeps, traced: test_simulate_tp; advise's fake-tensor layout against
simulate's: test_simulate; the refusals: test_config_refusals."""

from __future__ import annotations

import pytest
import torch
from conftest import losses, read_metrics

from parallab.models.gpt import GPT
from parallab.training import checkpoint, weights

GPT_RUN = ["data=bytes", "data.eval_fraction=0.002", "model=gpt", "model.layers=2",
           "model.heads=4", "model.width=32", "model.context=32", "trainer.max_steps=6",
           "trainer.log_every_n_steps=1", "optim.lr=0.05",
           "trainer.checkpoint_every_n_steps=null", "trainer.save_best=false",
           "parallel.sequence_parallel=true", "data.batch_size=16"]
MB = 2**20


def final_weights(run_dir) -> dict[str, torch.Tensor]:
    model = GPT(layers=2, heads=4, width=32, context=32)
    return weights.model_from(checkpoint.latest(run_dir / "checkpoints"), model).state_dict()


def kept_and_again(train_here, *layout: str):
    """The run with its gathered inputs kept, and gathered again: (metrics, run dir) each."""
    return [train_here(*GPT_RUN, *layout, f"parallel.regather_in_backward={flag}", name=flag)
            for flag in ("false", "true")]


@pytest.mark.slow
@pytest.mark.distributed
def test_inputs_gathered_again_train_as_kept_ones(train_here):
    """tp 2: each split layer keeps its rank's slice of the sequence for backward and
    gathers it again there, the same values: the same losses and weights. A step
    all-gathers half a (B, T, C) activation 15 times where it kept them 10 (the 4 block
    inputs and the head's once more; the rest: the same 5 inputs in forward, the 4 output
    projections' and the embedding's gradients in backward)."""
    (kept, kept_dir), (again, again_dir) = kept_and_again(
        train_here, "parallel=tp", "parallel.world_size=2")
    assert losses(again_dir) == losses(kept_dir)
    expected, got = final_weights(kept_dir), final_weights(again_dir)
    for name in expected:
        torch.testing.assert_close(got[name], expected[name], rtol=0, atol=0)
    half = 16 * 32 * 32 * 4 / 2
    assert kept["comm_all_gather_mb"] * MB == pytest.approx(10 * half, rel=0.01)
    assert again["comm_all_gather_mb"] * MB == pytest.approx(15 * half, rel=0.01)


@pytest.mark.slow
@pytest.mark.distributed
def test_autocasts_copies_of_a_gathered_input_are_made_again_in_backward(train_here):
    """A pipeline's parts not sharded keep a float32 stream under bf16's autocast: what
    each split layer saves is autocast's bf16 copy of the gathered input, which is made
    again (gathered, cast) in backward. The same losses as keeping them, and more
    all-gathers a step."""
    (kept, kept_dir), (again, again_dir) = kept_and_again(
        train_here, "parallel=pipeline", "parallel.world_size=4", "parallel.pp=2",
        "parallel.tp=2", "parallel.schedule=gpipe", "precision=bf16")
    assert losses(again_dir) == losses(kept_dir)
    assert read_metrics(again_dir)["eval_loss"] == read_metrics(kept_dir)["eval_loss"]
    assert again["comm_all_gather_mb"] > kept["comm_all_gather_mb"]
