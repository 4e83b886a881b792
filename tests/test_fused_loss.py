"""loss=fused_cross_entropy: cross_entropy's loss and gradients a slice of rows at a time,
keeping only the logits for backward; trained to cross_entropy's weights, and simulated
holding less."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import TINY_LLAMA

from parallab.cli import train_in_process
from parallab.loss import CrossEntropy, FusedCrossEntropy, _FusedSum
from parallab.models.gpt import GPT as GPTModel
from parallab.training import checkpoint, weights


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("smoothing", [0.0, 0.1])
def test_the_fused_loss_is_cross_entropys_a_slice_at_a_time(monkeypatch, dtype, smoothing):
    """Its loss and gradient are cross_entropy's, ignored targets (-100) included, summed
    or averaged, with slices of 4 rows (the last one short); the gradient in the logits'
    dtype."""
    monkeypatch.setattr(_FusedSum, "SLICE_BYTES", 4 * 4 * 50)
    generator = torch.Generator().manual_seed(0)
    logits = (3 * torch.randn(3, 7, 50, generator=generator)).to(dtype).requires_grad_()
    targets = torch.randint(0, 50, (3, 7), generator=generator)
    targets[0, :3] = -100
    assert len(_FusedSum.slices(logits.flatten(0, 1))) == 6
    for reduction in ("mean", "sum"):
        expected = CrossEntropy(smoothing)._loss(logits, targets, reduction)
        got = FusedCrossEntropy(smoothing)._loss(logits, targets, reduction)
        (want,), (grad,) = (torch.autograd.grad(loss, logits) for loss in (expected, got))
        torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-5)
        assert grad.dtype == dtype
        # bf16: within a rounding of torch's own (its default tolerance for the dtype)
        tight = {"rtol": 1e-5, "atol": 1e-7} if dtype == torch.float32 else {}
        torch.testing.assert_close(grad, want, **tight)
        assert grad[0, :3].abs().sum() == 0


def saved_bytes(loss, logits: torch.Tensor, targets: torch.Tensor) -> int:
    """Bytes autograd keeps for the loss's backward, the logits' own storage apart."""
    kept = []

    def pack(tensor):
        if tensor.untyped_storage().data_ptr() != logits.untyped_storage().data_ptr():
            kept.append(tensor.numel() * tensor.element_size())
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss.total(logits, targets)
    return sum(kept)


def test_it_keeps_the_logits_alone_for_backward():
    """cross_entropy keeps a float32 log-probability a logit; the fused loss keeps the bf16
    logits it was given (nothing more than a few bytes a row)."""
    rows, classes = 64, 1000
    logits = torch.randn(rows, classes, dtype=torch.bfloat16, requires_grad=True)
    targets = torch.randint(0, classes, (rows,))
    assert saved_bytes(CrossEntropy(), logits, targets) >= 4 * rows * classes
    assert saved_bytes(FusedCrossEntropy(), logits, targets) <= 16 * rows


GPT = ["data=bytes", "data.eval_fraction=0.002", "model=gpt", "model.layers=2", "model.heads=2",
       "model.width=32", "model.context=32", "data.batch_size=8", "trainer.max_steps=4",
       "trainer.log_every_n_steps=1", "device=cpu", "optim.lr=0.05"]
LLAMA = [*TINY_LLAMA, "data=tokens", "data.seq_len=32", "data.batch_size=4", "device=cpu",
         "trainer.max_steps=3", "trainer.log_every_n_steps=1"]


@pytest.mark.parametrize("run", [GPT, LLAMA], ids=["gpt", "llama-dict-batch"])
def test_a_model_trains_to_cross_entropys_weights(tmp_path, run):
    """The same evaluation as cross_entropy's after a few steps, and (the gpt's) the same
    weights: a model of its own, and a transformers model whose dict batch carries its
    labels."""
    losses = ("cross_entropy", "fused_cross_entropy")
    found = {loss: train_in_process([*run, f"loss={loss}"], tmp_path / loss) for loss in losses}
    assert found["fused_cross_entropy"]["eval_loss"] == pytest.approx(
        found["cross_entropy"]["eval_loss"], rel=1e-5)
    if run is not GPT:
        return
    expected, got = (weights.model_from(checkpoint.latest(tmp_path / loss / "checkpoints"),
                                        GPTModel(layers=2, heads=2, width=32, context=32)
                                        ).state_dict() for loss in losses)
    for name in expected:
        torch.testing.assert_close(got[name], expected[name], rtol=1e-5, atol=1e-6)


def test_simulate_prices_it_holding_the_bf16_logits_alone(tmp_path):
    """Traced on a GPU's terms in bf16: cross_entropy keeps each logit's float32
    log-probability (4 bytes), the fused loss the bf16 logits (2). The command says the
    loss."""
    from parallab.commands import simulate_in_process

    run = [*TINY_LLAMA, "model.config.vocab_size=4096", "parallel=fsdp",
           "parallel.world_size=8", "data.seq_len=256", "data.batch_size=4",
           "precision=bf16", "cluster=h100"]
    found = {}
    for loss in ("cross_entropy", "fused_cross_entropy"):
        simulate_in_process([*run, f"loss={loss}"], tmp_path / loss)
        found[loss] = json.loads((tmp_path / loss / "simulate.json").read_text())["layouts"][0]
    plain, fused = found["cross_entropy"]["memory_gb"], found["fused_cross_entropy"]["memory_gb"]
    logits = 4 * 256 * 4096
    assert plain["activations"] - fused["activations"] == pytest.approx(
        2 * logits / 2**30, rel=0.02)
    assert sum(fused.values()) < sum(plain.values()) - 0.9 * 2 * logits / 2**30
    assert "loss=fused_cross_entropy" in found["fused_cross_entropy"]["command"]
