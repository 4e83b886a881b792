"""trainer.fused_norms: a transformers model's written-out RMSNorms run as torch's
nn.RMSNorm (one kernel on a GPU, its input alone kept for backward), trained to the same
weights, loaded from and into checkpoints either way, and simulated as a GPU runs them."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import TINY_LLAMA

from parallab.cli import train_in_process
from parallab.training import checkpoint

QWEN3 = [*TINY_LLAMA, "model._target_=transformers.Qwen3ForCausalLM",
         "model.config._target_=transformers.Qwen3Config", "data=tokens", "data.seq_len=32",
         "data.batch_size=8", "device=cpu", "trainer.max_steps=3", "trainer.log_every_n_steps=1"]


def built(*overrides: str) -> torch.nn.Module:
    from conftest import typed

    from parallab import models

    cfg = typed(*QWEN3, *overrides)
    return models.build_model(models.check(cfg.model, cfg.data), cfg.trainer.fused_norms)


def test_llamas_norms_are_fused_and_gemmas_are_not():
    """Every RMSNorm of Llama's form (Qwen 3's blocks, its q and k norms over each head, the
    final one) becomes an nn.RMSNorm holding the same Parameter under the same name; Gemma's,
    which scales by 1 + weight, is not torch's rms_norm and stays."""
    from transformers.models.gemma.modeling_gemma import GemmaRMSNorm

    from parallab.models import norms

    written, fused = built(), built("trainer.fused_norms=true")
    names = [n for n, m in written.named_modules() if type(m).__name__ == "Qwen3RMSNorm"]
    assert len(names) == 2 * 4 + 1  # a block's two and its q and k norms; the final one
    kinds = {n: type(m) for n, m in fused.named_modules()}
    assert all(kinds[n] is norms.FusedRMSNorm for n in names)
    assert list(fused.state_dict()) == list(written.state_dict())
    assert not norms.fusable(GemmaRMSNorm(8, 1e-6))


class FlaggedRMSNorm(torch.nn.Module):
    """Llama's norm, or with a flag Gemma's (scaled by 1 + weight): one class, two forms."""

    def __init__(self, hidden_size: int, eps: float = 1e-6, plus_one: bool = False):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon, self.plus_one = eps, plus_one

    def forward(self, x):
        normed = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        return (1 + self.weight if self.plus_one else self.weight) * normed


def test_each_form_of_a_class_is_tried_and_a_model_built_on_meta_is_fused():
    """A flag that changes the form is tried apart; a model whose parameters are made on
    meta (as a sharded run starting from weights builds it) is fused as a real one is, its
    output in its input's dtype outside autocast."""
    from parallab.models import norms
    from parallab.training import weights

    assert norms.fusable(FlaggedRMSNorm(8)) and not norms.fusable(FlaggedRMSNorm(8, plus_one=True))
    norms._TRIED.clear()  # tried afresh, under the meta parameters
    with weights.parameters_on_meta():
        model = torch.nn.Sequential(FlaggedRMSNorm(8), torch.nn.Linear(8, 8))
        assert norms.fuse(model) == 1 and model[0].weight.is_meta
    norm = norms.FusedRMSNorm(8)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert norm(torch.ones(2, 8, dtype=torch.bfloat16)).dtype == torch.bfloat16


def test_the_trace_takes_rms_norm_as_torch_does():
    """Any normalized shape, any input's rank, keywords: the weight's gradient its shape."""
    from torch.nn import functional as F

    from parallab.simulate import on_a_device

    with on_a_device.norms():
        for shape, normed in (((3, 4, 8), (4, 8)), ((8,), (8,)), ((2, 5, 8), 8)):
            x = torch.ones(shape, requires_grad=True)
            weight = torch.ones(normed if isinstance(normed, tuple) else (normed,),
                                requires_grad=True)
            F.rms_norm(input=x, normalized_shape=normed, weight=weight, eps=1e-6).sum().backward()
            assert x.grad.shape == x.shape and weight.grad.shape == weight.shape


@pytest.mark.slow
@pytest.mark.distributed
def test_fused_norms_train_to_the_written_ones_weights_on_one_device_and_under_tp(tmp_path):
    """The same weights (to float rounding) as the written-out norms after 3 steps, on one
    device and under tp with the sequence cut (each nn.RMSNorm on its slice of the stream,
    the q and k norms replicated over the tp ranks); each run's checkpoint loads into the
    model built without them."""
    from parallab.training import weights

    def final(run_dir):
        return weights.model_from(checkpoint.latest(run_dir / "checkpoints"),
                                  built()).state_dict()

    train_in_process(QWEN3, tmp_path / "written")
    train_in_process([*QWEN3, "trainer.fused_norms=true"], tmp_path / "fused")
    train_in_process([*QWEN3, "trainer.fused_norms=true", "parallel=tp", "parallel.world_size=2",
                      "parallel.sequence_parallel=true"], tmp_path / "tp")
    expected = final(tmp_path / "written")
    assert any("norm" in n and not torch.all(expected[n] == 1) for n in expected)  # trained
    for run in ("fused", "tp"):
        got = final(tmp_path / run)
        for name in expected:
            torch.testing.assert_close(got[name], expected[name], rtol=1e-5, atol=1e-6)


def test_a_fused_norm_is_simulated_holding_its_input_alone(tmp_path):
    """Traced as a GPU runs torch's rms_norm: written out, each norm keeps its normed
    output for the weight's gradient (float32: autocast's residual stream is, so its
    .to(float32) is its input itself); fused, its input and a float a row. Less held by
    exactly those outputs, fewer memory-bound passes, and the command says the key."""
    from parallab.commands import simulate_in_process

    run = [*TINY_LLAMA, "parallel=fsdp", "parallel.world_size=8", "data.seq_len=256",
           "data.batch_size=4", "precision=bf16", "cluster=h100"]
    found = {}
    for fused in ("false", "true"):
        simulate_in_process([*run, f"trainer.fused_norms={fused}"], tmp_path / fused)
        found[fused] = json.loads((tmp_path / fused / "simulate.json").read_text())["layouts"][0]
    written, fused = found["false"], found["true"]
    # 2 blocks of 2 norms and the final one, width 64 over 4 x 256 tokens, 4 bytes a value
    saved_gb = 5 * 4 * 64 * 4 * 256 / 2**30
    held = written["memory_gb"]["activations"] - fused["memory_gb"]["activations"]
    assert held == pytest.approx(saved_gb, rel=0.02)
    assert fused["step_time_s"] < written["step_time_s"]
    assert "trainer.fused_norms=true" in fused["command"]
