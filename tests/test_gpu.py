"""The CUDA paths, on a GPU: precisions, TF32, compile, NCCL, the one-process layouts on one
GPU, pinned loading, the batch-size finder meeting CUDA's out-of-memory, checkpoints moved
to the CPU, MFU, float8 and the memory snapshot. Skipped without CUDA (`pytest -m gpu`)."""

from __future__ import annotations

import logging
import pickle

import pytest
import torch
from conftest import FAST, losses
from torch import nn

from parallab.config.schema import PrecisionConfig
from parallab.precision import FP8_CAPABILITY, Precision

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

GPU = [*[a for a in FAST if a != "device=cpu"], "device=cuda"]
# a language model, so that tokens/s and MFU are reported; widths float8 can take
GPT = ["model=gpt", "data=bytes", "data.eval_fraction=0.01", "model.layers=2",
       "model.width=256", "model.heads=4", "model.context=256", "data.batch_size=16",
       "trainer.max_steps=30", "trainer.log_every_n_steps=5", "device=cuda",
       "optim=adamw", "optim.lr=1e-3"]


def falls(run_dir) -> bool:
    loss = losses(run_dir)
    return len(loss) > 1 and loss[-1] < loss[0]


@pytest.mark.parametrize("mode,dtype", [("fp32", "float32"), ("amp", "float16"),
                                        ("bf16", "bfloat16"), ("fp16", "float16")])
def test_each_precision_trains_on_cuda(train_here, mode, dtype):
    metrics, run_dir = train_here(*GPU, f"precision={mode}", "trainer.max_steps=30")
    assert metrics["precision_dtype"] == dtype and metrics["backend"] == "none"
    assert falls(run_dir)


def test_an_inf_gradient_under_amp_skips_the_step_and_lowers_the_scale():
    device = torch.device("cuda")
    precision = Precision(PrecisionConfig(name="amp"), device)
    assert precision.dtype == torch.float16 and precision.scaler.is_enabled()
    model = nn.Linear(8, 2).to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with precision.autocast():
        loss = nn.functional.cross_entropy(model(torch.randn(16, 8, device=device)),
                                           torch.randint(2, (16,), device=device))
    precision.backward(loss)
    model.weight.grad[0, 0] = float("inf")
    before, scale = model.weight.detach().clone(), precision.scaler.get_scale()
    precision.step(optimizer)
    assert torch.equal(model.weight, before) and precision.scaler.get_scale() == scale / 2


def test_tf32_and_mfu_on_a_language_model(train_here):
    metrics, run_dir = train_here(*GPT, "precision=fp32", "precision.tf32=true")
    assert torch.backends.cuda.matmul.allow_tf32  # what the run set
    assert 0 < metrics["mfu"] < 1 and metrics["tokens_per_sec"] > 0
    assert falls(run_dir)
    bf16, _ = train_here(*GPT, "precision=bf16", name="bf16")
    assert 0 < bf16["mfu"] < 1


def test_compile_trains_on_cuda(train_here):
    metrics, run_dir = train_here(*GPT, "precision=bf16", "trainer.compile=true")
    assert metrics["steps"] == 30 and falls(run_dir)
    assert 0 < metrics["mfu"] < 1


@pytest.mark.parametrize("layout", ["ddp", "fsdp"])
def test_nccl_at_world_size_one(train_here, layout):
    metrics, run_dir = train_here(*GPU, f"parallel={layout}", "parallel.world_size=1",
                                  "backend=nccl", "precision=bf16")
    assert metrics["backend"] == "nccl" and falls(run_dir)


def test_fp16_under_ddp_with_nccl(train_here):
    """float16's scaler in a launched rank (fsdp at one rank is ddp: its sharded scaler
    needs two GPUs; two CPU ranks test it)."""
    metrics, run_dir = train_here(*GPU, "parallel=ddp", "parallel.world_size=1",
                                  "backend=nccl", "precision=fp16")
    assert metrics["precision_dtype"] == "float16" and falls(run_dir)


@pytest.mark.parametrize("layout", ["dp", "model"])
def test_one_process_layouts_on_one_gpu_named_twice(train_here, monkeypatch, layout):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)  # the run sets it: put back
    metrics, run_dir = train_here(*GPU, f"parallel={layout}", "parallel.world_size=2",
                                  "parallel.devices=[0,0]")
    assert metrics["world_size"] == 2 and falls(run_dir)


def test_dataloader_with_pinned_memory_and_workers(train_here):
    metrics, run_dir = train_here("data=mnist", "data.loader=dataloader", "data.num_workers=2",
                                  "data.pin_memory=true", "trainer.max_steps=40",
                                  "trainer.log_every_n_steps=10", "device=cuda")
    assert metrics["steps"] == 40 and falls(run_dir)


def test_the_finder_grows_until_cuda_runs_out_of_memory_and_trains_after(train_here, caplog):
    """A memory cap of 1.5 GB on this process (the allocator raises OutOfMemoryError past
    it) and a model whose steps are launch-bound at small batches (each doubling nearly
    twice as fast) and whose activations (~75 MB a sample) outgrow the cap within a few."""
    torch.cuda.set_per_process_memory_fraction(1.5 * 2**30 / torch.cuda.mem_get_info()[1])
    try:
        with caplog.at_level(logging.INFO):
            metrics, _ = train_here(
                "model=gpt", "data=bytes", "data.eval_fraction=0.01", "model.layers=2",
                "model.width=1024", "model.heads=8", "model.context=1024", "precision=bf16",
                "data.batch_size=1", "data.eval_batch_size=1", "trainer.auto_batch_size=true",
                "trainer.max_steps=3", "device=cuda", "optim=adamw")
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0)
        torch.cuda.empty_cache()
    table = next(r.getMessage() for r in caplog.records
                 if r.getMessage().startswith("batch-size finder chose"))
    assert "out of memory" in table, table
    chosen = int(table.split()[3])
    assert metrics["steps"] == 3 and metrics["global_batch_size"] == chosen >= 1


def test_a_checkpoint_written_on_cuda_evaluates_on_the_cpu(train_here, tmp_path):
    from parallab.commands import evaluate_in_process

    metrics, run_dir = train_here(*GPU, "trainer.max_steps=30")
    on_cpu = evaluate_in_process([f"ckpt={run_dir / 'checkpoints' / 'last.pt'}", "device=cpu"],
                                 tmp_path / "eval")
    assert on_cpu["eval_loss"] == pytest.approx(metrics["eval_loss"], rel=1e-3)
    assert on_cpu["eval_accuracy"] == pytest.approx(metrics["eval_accuracy"], abs=2 / 512)


def test_the_memory_snapshot_holds_the_first_steps(train_here):
    _, run_dir = train_here(*GPT, "trainer.memory_snapshot=true", "trainer.max_steps=5")
    snapshot = pickle.loads((run_dir / "memory_snapshot" / "rank0.pickle").read_bytes())
    assert snapshot["segments"]  # the allocator's memory, as memory_viz draws it
    actions = {e["action"] for trace in snapshot["device_traces"] for e in trace}
    assert "alloc" in actions, actions


@pytest.mark.skipif(torch.cuda.is_available() and
                    torch.cuda.get_device_capability() < FP8_CAPABILITY,
                    reason="float8 needs compute capability 8.9")
def test_fp8_trains_near_bf16(train_here):
    bf16, _ = train_here(*GPT, "precision=bf16", "trainer.max_steps=60", name="bf16")
    fp8, fp8_dir = train_here(*GPT, "precision=fp8", "trainer.max_steps=60", name="fp8")
    assert fp8["precision_dtype"] == "bfloat16" and falls(fp8_dir)
    assert fp8["eval_loss"] == pytest.approx(bf16["eval_loss"], rel=0.05)


@pytest.mark.skipif(torch.cuda.is_available() and
                    torch.cuda.get_device_capability() < FP8_CAPABILITY,
                    reason="float8 needs compute capability 8.9")
def test_fp8_rowwise_trains_near_bf16(train_here):
    bf16, _ = train_here(*GPT, "precision=bf16", "trainer.max_steps=60", name="bf16")
    fp8, fp8_dir = train_here(*GPT, "precision=fp8", "precision.fp8_recipe=rowwise",
                              "trainer.max_steps=60", name="fp8")
    assert falls(fp8_dir) and fp8["eval_loss"] == pytest.approx(bf16["eval_loss"], rel=0.05)


@pytest.mark.skipif(torch.cuda.is_available() and
                    torch.cuda.get_device_capability() < FP8_CAPABILITY,
                    reason="float8 needs compute capability 8.9")
def test_fsdp_gathers_float8_weights_and_trains_as_with_bf16_gathers(monkeypatch):
    """precision.fp8_all_gather through parallab's own sharding, on one rank (one GPU's
    NCCL takes no second rank; FSDP2 gathers over a mesh of one all the same): the
    sharded weights are torchao's float8-casting tensors, and the losses are those of
    bf16 gathers (the same tensorwise scales, taken before or after the gather)."""
    from types import SimpleNamespace

    import torch.distributed as torch_dist
    from torch.distributed.device_mesh import init_device_mesh

    from parallab.models.gpt import GPT as Model
    from parallab.parallel import fsdp
    from parallab.testing import free_port

    for key, value in {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()),
                       "RANK": "0", "WORLD_SIZE": "1"}.items():
        monkeypatch.setenv(key, value)
    torch_dist.init_process_group("nccl", device_id=torch.device("cuda", 0))
    try:
        mesh = init_device_mesh("cuda", (1,))
        tokens = torch.randint(0, 256, (8, 65), device="cuda",
                               generator=torch.Generator("cuda").manual_seed(0))
        runs = {}
        for gather in (False, True):
            torch.manual_seed(0)
            model = Model(vocab_size=256, context=64, layers=2, heads=4, width=256).cuda()
            precision = Precision(PrecisionConfig(name="fp8", fp8_all_gather=gather),
                                  torch.device("cuda"))
            model = fsdp.shard(precision.convert(model), mesh,
                               SimpleNamespace(stages=None, name="fsdp"),
                               fsdp.mixed_precision(torch.bfloat16), True, True)
            optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
            runs[gather] = []
            for _ in range(10):
                with precision.autocast():
                    logits = model(tokens[:, :-1])
                loss = nn.functional.cross_entropy(logits.flatten(0, 1).float(),
                                                   tokens[:, 1:].flatten())
                loss.backward()
                optimizer.step()
                optimizer.zero_grad()
                runs[gather].append(loss.item())
            kinds = {type(p.to_local()).__name__ for name, p in model.named_parameters()
                     if name.endswith("weight") and p.ndim == 2 and "blocks" in name}
            assert ("WeightWithDynamicFloat8CastTensor" in kinds) == gather, kinds
        assert runs[True][-1] < runs[True][0]
        assert runs[True] == pytest.approx(runs[False], rel=1e-2)
    finally:
        torch_dist.destroy_process_group()
