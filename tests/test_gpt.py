"""model=gpt on data=bytes: the transformer's shapes and causality, byte sequences, peak FLOP/s
for MFU, and a short real training run that learns."""

from __future__ import annotations

import math

import pytest
import torch
from conftest import GPT_RUN, losses, read_metrics, typed

from parallab.checks import validate
from parallab.data import bytetext
from parallab.data.bytetext import Bytes
from parallab.models.gpt import GPT, GptConfig, flops_per_token
from parallab.observe.mfu import peak_flops

SMALL = dict(layers=2, heads=2, width=32, context=16)


def small_model() -> GPT:
    torch.manual_seed(0)
    return GPT(**SMALL).eval()


def test_logits_per_position_for_any_length_up_to_context():
    model = small_model()
    for length in (1, 5, SMALL["context"]):
        tokens = torch.randint(256, (3, length))
        assert model(tokens).shape == (3, length, 256)


def test_changing_a_token_changes_no_earlier_logits():
    model = small_model()
    tokens = torch.randint(256, (2, SMALL["context"]))
    changed = tokens.clone()
    t = 9
    changed[:, t] = (changed[:, t] + 1) % 256
    before, after = model(tokens), model(changed)
    torch.testing.assert_close(before[:, :t], after[:, :t])
    assert not torch.allclose(before[:, t], after[:, t])


def test_stages_are_submodules_that_compose_to_forward():
    model = small_model()
    stages = model.stages()
    assert len(stages) == SMALL["layers"] + 2
    submodules = list(model.modules())
    assert all(any(stage is m for m in submodules) for stage in stages)
    # every parameter belongs to exactly one stage: no weight spans two (no tying)
    owned = [id(p) for stage in stages for p in stage.parameters()]
    assert sorted(owned) == sorted(id(p) for p in model.parameters())
    x = torch.randint(256, (2, 12))
    out = x
    for stage in stages:
        out = stage(out)
    torch.testing.assert_close(out, model(x))


def test_default_size_and_flops_estimate():
    model = GPT()
    cfg = GptConfig()  # GPT's defaults
    assert model.cfg == cfg
    params = sum(p.numel() for p in model.parameters())
    assert 3e6 < params < 4e6
    looked_up = sum(p.numel() for p in model.embed.parameters())  # embeddings: no matmul
    attention = 12 * cfg.layers * cfg.context * cfg.width
    assert flops_per_token(cfg) == 6 * (params - looked_up) + attention
    # the attention term follows the sequences actually trained on
    assert flops_per_token(cfg, 64) == 6 * (params - looked_up) + attention * 64 / cfg.context
    # nanoGPT's initialisation: residual projections scaled down by sqrt(2 layers)
    std = model.blocks[0].attn.proj.weight.std().item()
    assert std == pytest.approx(0.02 / math.sqrt(2 * cfg.layers), rel=0.1)


def test_byte_sequences_shift_by_one_and_hold_out_the_tail(tmp_path):
    (tmp_path / "b.txt").write_bytes(bytes(range(100, 150)))
    (tmp_path / "a.txt").write_bytes(bytes(range(0, 50)))
    (tmp_path / "notes.md").write_bytes(b"not read")
    cfg = Bytes(path=str(tmp_path), seq_len=8, eval_fraction=0.2)
    assert cfg.problem() is None
    train, test = cfg.make(seed=0)
    text = torch.tensor(list(range(0, 50)) + list(range(100, 150)))  # sorted: a.txt, b.txt
    assert train.inputs.dtype == torch.uint8 and train.targets.dtype == torch.int64
    assert train.inputs.shape == (9, 8) and test.inputs.shape == (2, 8)  # 80 | 20 bytes
    assert train.inputs.flatten().tolist() == text[:72].tolist()  # non-overlapping sequences
    assert train.targets.flatten().tolist() == text[1:73].tolist()
    assert test.inputs[0].tolist() == text[80:88].tolist()  # eval = the tail
    assert train.prepare(train.inputs[:2]).dtype == torch.int64


def test_shipped_text_is_public_domain_english_within_5_mb():
    files = bytetext.text_files(None)
    assert len(files) == 1 and files[0].stat().st_size <= 5_000_000
    head = files[0].read_text()[:100]
    assert "In the beginning God created the heaven and the earth." in head


def test_seq_len_follows_model_context():
    cfg = typed("device=cpu", "model=gpt", "data=bytes", "model.context=64")
    data = cfg.data  # typed by its data set's own class
    assert isinstance(data, Bytes) and data.seq_len == 64 and data.input_shape == [64]
    assert validate.prepare(cfg, in_place=None)[0].data.num_classes == 256


@pytest.mark.parametrize("overrides,message", [
    (["model=gpt", "data=mnist"], "model=gpt predicts the next token"),
    (["model=gpt", "data=bytes", "data.seq_len=512"], "set model.context=512"),
    (["model=gpt", "data=bytes", "model.vocab_size=128"], "set model.vocab_size=256"),
    (["model=gpt", "data=bytes", "model.heads=3"], "model.heads=3"),
    (["model=gpt", "data=bytes", "data.eval_fraction=1.0"], "data.eval_fraction=1.0"),
    (["model=gpt", "data=bytes", "data.loader=dataloader"], "data.loader=memory"),
])
def test_mismatches_fail_in_one_line(overrides, message):
    with pytest.raises(validate.ConfigError) as error:
        validate.prepare(typed("device=cpu", *overrides), in_place=None)
    assert message in str(error.value) and "\n" not in str(error.value)


def test_peak_flops_are_dense_datasheet_figures():
    bf16, fp32 = torch.bfloat16, torch.float32
    assert peak_flops("NVIDIA H100 80GB HBM3", bf16) == pytest.approx(989.5e12)  # 1979 sparse
    assert peak_flops("NVIDIA H100 PCIe", torch.float16) == pytest.approx(756.5e12)
    assert peak_flops("NVIDIA H100 80GB HBM3", fp32) == pytest.approx(67e12)
    assert peak_flops("NVIDIA H100 80GB HBM3", fp32, tf32=True) == pytest.approx(494.5e12)
    assert peak_flops("NVIDIA H200", bf16) == peak_flops("NVIDIA H100 80GB HBM3", bf16)
    # whole names: A100 is not A10, L40S is not L4
    assert peak_flops("NVIDIA A100-SXM4-80GB", bf16) == pytest.approx(312e12)
    assert peak_flops("NVIDIA A10G", bf16) == pytest.approx(125e12)
    assert peak_flops("NVIDIA L4", bf16) == pytest.approx(121e12)
    assert peak_flops("NVIDIA L40S", bf16) == pytest.approx(366.5e12)
    # Volta: no bf16 tensor cores, and TF32 does not exist, so fp32 stays fp32
    assert peak_flops("Tesla V100-SXM2-16GB", bf16) is None
    assert peak_flops("Tesla V100-SXM2-16GB", fp32, tf32=True) == pytest.approx(15.7e12)
    for unknown in ("NVIDIA GeForce GTX 1080", "NVIDIA GeForce RTX 4090 Laptop GPU", "cpu"):
        assert peak_flops(unknown, bf16) is None
    assert peak_flops("NVIDIA H100 80GB HBM3", torch.int8) is None


def test_gpt_learns_bytes_in_30_steps(train_here):
    _, run_dir = train_here("model=gpt", "data=bytes", "model.layers=2", "model.width=64",
                            "model.context=64", "optim=adamw", "trainer.max_steps=30",
                            "trainer.log_every_n_steps=10", "device=cpu")
    metrics = read_metrics(run_dir)
    assert metrics["steps"] == 30
    assert metrics["eval_loss"] < 4.0 < math.log(256)  # uniform guessing scores 5.55
    assert metrics["eval_accuracy"] > 0.15
    # a language model's throughput in tokens: 64 next-byte targets per sample
    assert metrics["tokens_per_sec"] == pytest.approx(64 * metrics["samples_per_sec"])
    assert "mfu" not in metrics  # no known peak on a CPU: no figure rather than a wrong one


def test_missing_text_fails_before_training_naming_data_path(train_here, tmp_path):
    with pytest.raises(validate.ConfigError) as refused:
        train_here("model=gpt", "data=bytes", f"data.path={tmp_path}/none.txt", "device=cpu")
    said = str(refused.value)
    assert said.startswith(f"data.path={tmp_path}/none.txt") and "give a text file" in said
    assert "\n" not in said and not (tmp_path / "run" / "metrics.json").exists()


def test_adamw_decays_weight_matrices_only():
    from parallab.config.schema import AdamWConfig, SGDConfig
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
