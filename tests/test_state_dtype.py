"""precision.state_dtype=bfloat16: a rank keeps its weights, their gradients and the
optimizer's state in bfloat16 (Lightning's bf16-true), half of float32's bytes, and trains
under every layout as one device does; simulate prices what it keeps. Refused in one line
where the compute is not bfloat16."""

from __future__ import annotations

import pytest
import torch
from conftest import GPT_RUN, checked, scalars

from parallab.config.errors import ConfigError

BF16 = [*GPT_RUN, "trainer.max_steps=8", "precision=bf16", "optim=adamw", "model.dropout=0"]
KEPT = "precision.state_dtype=bfloat16"


@pytest.mark.parametrize("overrides,says", [
    ([KEPT], "precision.state_dtype=bfloat16 with precision=fp32: bfloat16 state is taken "
             "with precision=bf16 alone"),
    ([KEPT, "precision=amp"], "with precision=amp"),
    (["precision=bf16", "precision.state_dtype=float16"],
     "precision.state_dtype=float16 is not a dtype a rank keeps its weights and optimizer "
     "state in: use float32 or bfloat16"),
])
def test_a_state_dtype_the_precision_cannot_keep_is_one_line(overrides, says):
    with pytest.raises(ConfigError) as raised:
        checked(*GPT_RUN, *overrides)
    assert says in str(raised.value) and "\n" not in str(raised.value)


def test_the_model_and_its_optimizer_state_are_kept_in_bfloat16(train_here):
    """The weights saved, Adam's moments and the measured state: bfloat16, half of what the
    same run keeps in float32."""
    floats, _ = train_here(*BF16, name="float32")
    halves, run_dir = train_here(*BF16, KEPT, name="bfloat16")
    assert halves["state_memory_mb"] == pytest.approx(floats["state_memory_mb"] / 2, rel=1e-3)
    saved = torch.load(run_dir / "checkpoints" / "last.pt", weights_only=False)
    assert {t.dtype for t in saved["model"].values() if t.is_floating_point()} == \
        {torch.bfloat16}
    moments = [t for key, t in saved["optimizer"].items() if key.endswith(("exp_avg",
                                                                          "exp_avg_sq"))]
    assert moments and {t.dtype for t in moments} == {torch.bfloat16}
    # trained, not merely cast: the loss falls as float32's does, to bfloat16's rounding
    assert halves["train_loss"] == pytest.approx(floats["train_loss"], rel=1e-2)
    # scored as kept: evaluate.py had taken the key and scored float32 weights
    from parallab.commands import evaluate_in_process

    ckpt = run_dir / "checkpoints" / "last.pt"
    scored = evaluate_in_process([f"ckpt={ckpt}", "device=cpu", "precision=bf16", KEPT],
                                 run_dir / "scored")
    assert scored["eval_loss"] == halves["eval_loss"]
    # exported as kept (it had been widened to float32, twice the bytes)
    import safetensors.torch

    from parallab.commands import _export

    _export(run_dir / "checkpoints" / "last.pt", run_dir / "m.safetensors")
    written = safetensors.torch.load_file(str(run_dir / "m.safetensors"))
    assert {t.dtype for t in written.values()} == {torch.bfloat16}


def test_buffers_and_a_transformers_models_float32_modules_stay_float32():
    """Only the weights are kept in bfloat16: a rotary table, a router's balancing bias and
    DeepSeek-V3's router weight (its _keep_in_fp32_modules_strict) had been rounded too
    (cos error 0.22 at position 2048); a tied weight stays one, also on fake tensors."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    from parallab.precision import kept_in

    config = DeepseekV3Config(
        vocab_size=64, hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
        num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2, n_routed_experts=4,
        num_experts_per_tok=2, n_group=1, topk_group=1, first_k_dense_replace=1,
        q_lora_rank=16, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8,
        v_head_dim=8, tie_word_embeddings=True)
    model = kept_in(DeepseekV3ForCausalLM(config), torch.bfloat16)
    kept = {n for n, p in model.named_parameters() if p.dtype == torch.float32}
    assert kept == {"model.layers.1.mlp.gate.weight"}
    assert {b.dtype for b in model.buffers()} == {torch.float32}
    assert model.lm_head.weight is model.model.embed_tokens.weight
    with FakeTensorMode(allow_non_fake_inputs=True):  # (Module.to could not swap them)
        fake = torch.nn.Linear(4, 4)
    assert kept_in(fake, torch.bfloat16).weight.dtype == torch.bfloat16


def test_a_model_with_batch_norms_trains_their_weights_in_float32(train_here):
    """F.batch_norm takes a norm's weights in its running statistics' float32 alone: a
    convnet had failed its first step on every rank ('expected scalar type BFloat16')."""
    metrics, run_dir = train_here("model=convnet", "data=synthetic", "data.shape=[3,32,32]",
                                  "data.train_size=64", "data.eval_size=32",
                                  "trainer.max_steps=2", "device=cpu", "precision=bf16", KEPT,
                                  "optim=adamw", "optim.weight_decay=0")
    saved = torch.load(run_dir / "checkpoints" / "last.pt", weights_only=False)["model"]
    norms = {k: v.dtype for k, v in saved.items() if "norm" in k and v.is_floating_point()}
    assert metrics["steps"] == 2 and norms and set(norms.values()) == {torch.float32}
    assert saved["blocks.0.conv.weight"].dtype == saved["head.weight"].dtype == torch.bfloat16


def test_what_a_bfloat16_state_loses_is_said_before_launch(caplog):
    """AdamW's decay at lr 1e-3 and weight_decay 0.1 (1e-4 of a weight a step) and Adam's
    second-moment decay at beta 0.999 are under bfloat16's rounding: they never change the
    state, a run's weights bit-identical with and without decay. Said; float32 state, or
    a decay that moves a bfloat16 weight, says nothing."""
    checked(*BF16, KEPT, "optim.weight_decay=0.1")
    said = caplog.text
    assert "optim.weight_decay=0.1 at the peak rate 0.001 shrinks a weight by 1.0e-04 of " \
        "itself a step, under bfloat16's rounding" in said
    assert "optim.betas[1]=0.999: Adam's second moment, kept in bfloat16, is never lowered" \
        in said
    caplog.clear()
    checked(*BF16, KEPT, "optim.lr=0.1", "optim.weight_decay=0.1", "optim.betas=[0.9,0.99]")
    # the rate the run uses: optim.lr scaled to its global batch of 8 (8 x 5e-4 of a weight)
    checked(*BF16, KEPT, "optim.weight_decay=0.5", "optim.betas=[0.9,0.99]",
            "optim.scale_lr=linear", "optim.base_batch_size=1")
    checked(*BF16, "optim.weight_decay=0.1")
    assert "bfloat16's rounding" not in caplog.text


def test_a_resume_in_another_state_dtype_is_refused(train_here):
    """Its weights and optimizer state had been rounded to bfloat16 (or widened) without a
    word, a run of float32 state going on in bfloat16."""
    _, run_dir = train_here(*BF16, "trainer.max_steps=2")
    with pytest.raises(ConfigError, match=r"was saved keeping its weights and optimizer state "
                                          r"in float32: give precision.state_dtype=float32"):
        train_here(*BF16, KEPT, "trainer.max_steps=4", "trainer.resume=auto")
    metrics, _ = train_here(*BF16, "trainer.max_steps=4", "trainer.resume=auto")
    assert metrics["steps"] == 4


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize("layout", [
    ["parallel=ddp", "parallel.world_size=2", "data.batch_size=4"],  # float32_all_reduce
    ["parallel=ddp", "parallel.world_size=2", "data.batch_size=4",
     "precision.reduce_dtype=bfloat16"],  # DDP's own all-reduce, in the gradients' dtype
    ["parallel=fsdp", "parallel.world_size=2", "data.batch_size=4"],
    ["parallel=pipeline", "parallel.world_size=2", "parallel.microbatches=2"],
], ids=["ddp", "ddp-bf16-reduce", "fsdp", "pipeline"])
def test_each_layout_trains_a_bfloat16_state_as_one_device(train_here, layout):
    """Each step's loss is one device's to bfloat16's rounding (the reductions' order
    differs); the state a rank keeps is its share of one device's."""
    one, one_dir = train_here(*BF16, KEPT, name="one")
    ran, run_dir = train_here(*BF16, KEPT, *layout, name="layout")
    expected, got = scalars(one_dir, "train/loss"), scalars(run_dir, "train/loss")
    assert len(got) == 8 and [loss for _, loss in got] == pytest.approx(
        [loss for _, loss in expected], rel=1e-3)
    shares = 1 if layout[0] == "parallel=ddp" else 2
    assert ran["state_memory_mb"] == pytest.approx(one["state_memory_mb"] / shares, rel=0.1)


@pytest.mark.parametrize("layout", ["fsdp", "ddp"])
def test_simulate_prices_a_bfloat16_state_at_half_its_bytes(layout):
    """The state a rank holds and the optimizer's traffic halve; the compute is the same
    step's. Under DDP autocast copies no weight kept in bfloat16 already (FSDP2 gathers
    them in bfloat16 either way)."""
    from test_simulate import GPT, configured

    from parallab.simulate import run

    def predicted(*overrides):
        return run.given(configured(*GPT, f"parallel={layout}", "parallel.world_size=8",
                                    "cluster=h100", "precision=bf16", *overrides))[0].prediction

    floats, halves = predicted(), predicted(KEPT)
    assert halves.memory["state"] == pytest.approx(floats.memory["state"] / 2)
    assert halves.parts["optimizer_s"] == pytest.approx(floats.parts["optimizer_s"] / 2)
    assert halves.parts["compute_s"] == pytest.approx(floats.parts["compute_s"])
    assert halves.memory["gathered"] == pytest.approx(floats.memory["gathered"])
    if layout == "fsdp":
        assert halves.memory["activations"] == pytest.approx(floats.memory["activations"])
    else:  # float32 weights' bfloat16 copies, saved for backward, are gone
        assert halves.memory["activations"] < floats.memory["activations"] * 0.99


@pytest.mark.slow
@pytest.mark.distributed
def test_a_float32_router_amid_bfloat16_weights_is_sharded_as_one_device_trains(train_here):
    """DeepSeek-V3's router weight, kept float32 amid bfloat16 weights, is a unit of its own
    under FSDP2 (which had failed: 'FSDP expects uniform original parameter dtype'), and
    the run follows one device's."""
    deepseek = ["model=deepseek_v3", "model.config.n_routed_experts=8",
                "model.config.n_group=4", "model.config.topk_group=2",
                "model.config.num_experts_per_tok=2", "model.config.num_hidden_layers=2",
                "model.config.first_k_dense_replace=1", "model.config.hidden_size=64",
                "model.config.intermediate_size=128", "model.config.moe_intermediate_size=32",
                "model.config.num_attention_heads=2", "model.config.num_key_value_heads=2",
                "model.config.q_lora_rank=32", "model.config.kv_lora_rank=16",
                "model.config.qk_nope_head_dim=16", "model.config.qk_rope_head_dim=16",
                "model.config.v_head_dim=16", "model.config.vocab_size=256", "data=tokens",
                "data.seq_len=32", "device=cpu", "trainer.max_steps=4", "precision=bf16",
                KEPT, "optim=adamw", "optim.weight_decay=0", "trainer.log_every_n_steps=1"]
    _, one = train_here(*deepseek, "data.batch_size=4", name="one")
    _, split = train_here(*deepseek, "data.batch_size=2", "parallel=fsdp",
                          "parallel.world_size=2", "parallel.ep=2", name="split")
    expected, got = scalars(one, "train/loss"), scalars(split, "train/loss")
    assert len(got) == 4 and [loss for _, loss in got] == pytest.approx(
        [loss for _, loss in expected], rel=1e-3)
