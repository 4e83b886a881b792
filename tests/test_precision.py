"""Precision modes, loss scaling, accumulation, clipping, memory format, profiler."""

from __future__ import annotations

import json
import logging
import os

import pytest
import torch
from conftest import FAST, losses, read_metrics, scalars
from torch import nn

from parallab.config.schema import PrecisionConfig
from parallab.precision import Precision, compute_dtype

CPU = torch.device("cpu")


@pytest.mark.parametrize("name,device,dtype", [
    ("fp32", "cpu", torch.float32), ("bf16", "cpu", torch.bfloat16),
    ("fp16", "cpu", torch.float16), ("amp", "cpu", torch.bfloat16),
    ("amp", "cuda", torch.float16), ("bf16", "cuda", torch.bfloat16),
])
def test_each_mode_computes_in_its_dtype(name, device, dtype):
    assert compute_dtype(name, device) == dtype


@pytest.mark.parametrize("name,scaled", [("fp32", False), ("bf16", False), ("amp", False),
                                         ("fp16", True), ("fp8", False)])
def test_a_grad_scaler_runs_exactly_where_the_dtype_is_float16(name, scaled):
    precision = Precision(PrecisionConfig(name=name), CPU)
    assert precision.scaler.is_enabled() == scaled
    with precision.autocast():
        out = nn.Linear(4, 4)(torch.randn(2, 4))
    assert out.dtype == precision.dtype


def test_an_inf_gradient_skips_the_step_lowers_the_scale_and_training_goes_on():
    torch.manual_seed(0)
    model = nn.Linear(8, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    precision = Precision(PrecisionConfig(name="fp16"), CPU)
    inputs, targets = torch.randn(16, 8), torch.randint(2, (16,))

    def step(poison: bool) -> None:
        with precision.autocast():
            loss = nn.functional.cross_entropy(model(inputs), targets)
        precision.backward(loss)
        if poison:
            model.weight.grad[0, 0] = float("inf")
        precision.step(optimizer)
        optimizer.zero_grad()

    before, scale = model.weight.detach().clone(), precision.scaler.get_scale()
    step(poison=True)
    assert torch.equal(model.weight, before)  # the step was skipped
    assert precision.scaler.get_scale() < scale  # and the scale lowered
    step(poison=False)
    assert not torch.equal(model.weight, before)  # the next one trains
    assert precision.state_dict()["scale"] == precision.scaler.get_scale()


def overflow_on_one_rank() -> tuple[bool, float, float]:
    """On each of 2 ranks: an FSDP2-sharded Linear in float16 whose gradient shard is inf on
    rank 1 only; rank 0's (skipped, scale before, scale after) its scaler's step."""
    import torch.distributed as dist
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    dist.init_process_group("gloo")
    try:
        torch.manual_seed(0)
        model = fully_shard(nn.Linear(8, 8), mp_policy=MixedPrecisionPolicy(
            param_dtype=torch.float16, reduce_dtype=torch.float32))
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        precision = Precision(PrecisionConfig(name="fp16"), CPU, sharded=True)
        with precision.autocast():
            loss = model(torch.randn(4, 8)).float().square().mean()
        precision.backward(loss)
        if dist.get_rank() == 1:
            model.weight.grad.to_local().view(-1)[0] = float("inf")
        before, scale = model.weight.to_local().clone(), precision.scaler.get_scale()
        precision.step(optimizer)
        return (torch.equal(model.weight.to_local(), before), scale,
                precision.scaler.get_scale())
    finally:
        dist.destroy_process_group()


@pytest.mark.distributed
def test_an_overflow_on_one_shard_skips_the_step_on_every_rank():
    """Sharded gradients: rank 0's own shard is finite, yet it skips the step and lowers its
    scale with rank 1, so the ranks stay one model (ShardedGradScaler all-reduces the flag;
    on torch 2.14 DTensor's own check of the sharded gradients would agree too)."""
    from parallab.launching import launch

    skipped, scale, after = launch.elastic(overflow_on_one_rank, (), 2, 0,
                                           {"OMP_NUM_THREADS": "1"})
    assert skipped and after == scale / 2


@pytest.mark.slow
@pytest.mark.distributed
def test_fp16_under_fsdp_trains_as_one_process_does(train_here):
    """float16 with loss scaling over 2 shards (ShardedGradScaler) follows one process's
    float16 run on the same global batch, to float16's rounding."""
    common = [*FAST, "precision=fp16", "model.dropout=0", "trainer.max_steps=10",
              "trainer.log_every_n_steps=1"]
    _, single_dir = train_here(*common, "data.batch_size=64", name="single")
    metrics, fsdp_dir = train_here(*common, "data.batch_size=32", "parallel=fsdp",
                                   "parallel.world_size=2", name="fsdp")
    assert metrics["precision_dtype"] == "float16"
    single, sharded = losses(single_dir), losses(fsdp_dir)
    assert len(sharded) == 10 and sharded == pytest.approx(single, rel=2e-3)


def test_fp8_turns_the_linear_layers_but_the_output_into_float8():
    """torchao's module swap runs anywhere (its matmuls need an H100-class GPU): every
    Linear of gpt's blocks becomes a Float8Linear; the head's output layer and a width
    float8 matmuls cannot take (not a multiple of 16) stay as they were."""
    from torchao.float8.float8_linear import Float8Linear

    from parallab.models.gpt import GPT

    model = GPT(vocab_size=256, context=32, layers=2, heads=2, width=32)
    model.blocks[0].mlp[0] = nn.Linear(32, 40)  # 40 % 16 != 0
    Precision(PrecisionConfig(name="fp8"), CPU).convert(model)
    kinds = {name: type(m).__name__ for name, m in model.named_modules()
             if isinstance(m, nn.Linear)}
    assert kinds.pop("head.out") == kinds.pop("blocks.0.mlp.0") == "Linear"
    assert kinds and all(kind == Float8Linear.__name__ for kind in kinds.values())


@pytest.mark.parametrize("recipe,gather,granularity", [("tensorwise", True, "TENSORWISE"),
                                                       ("rowwise", False, "AXISWISE")])
def test_fp8_takes_the_recipe_and_float8_all_gather_asked_for(recipe, gather, granularity):
    """precision.fp8_recipe picks torchao's scales (one per tensor, or per row);
    precision.fp8_all_gather has FSDP2 gather the weights in float8 (their class says so)."""
    from torchao.float8.float8_linear import Float8Linear

    from parallab.models.gpt import GPT

    model = GPT(vocab_size=256, context=32, layers=1, heads=2, width=32)
    Precision(PrecisionConfig(name="fp8", fp8_recipe=recipe, fp8_all_gather=gather),
              CPU).convert(model)
    layers = [m for m in model.modules() if isinstance(m, Float8Linear)]
    assert layers and all(m.config.cast_config_weight.scaling_granularity.name == granularity
                          and m.config.enable_fsdp_float8_all_gather == gather
                          for m in layers)
    gathered = {type(m.weight).__name__ != "Parameter" for m in layers}
    assert gathered == {gather}


@pytest.mark.slow
@pytest.mark.parametrize("mode,dtype", [("amp", "bfloat16"), ("bf16", "bfloat16"),
                                        ("fp16", "float16")])
def test_each_precision_trains_end_to_end(train_here, caplog, mode, dtype):
    _, run_dir = train_here(*FAST, f"precision={mode}", "trainer.max_steps=20")
    metrics = read_metrics(run_dir)
    assert metrics["precision_dtype"] == dtype
    loss = [value for _, value in scalars(run_dir, "train/loss")]
    assert loss[-1] < loss[0]
    state = torch.load(run_dir / "checkpoints" / "last.pt", weights_only=True)
    assert ("scale" in state["grad_scaler"]) == (dtype == "float16")
    if mode == "fp16":  # a warning: what train.py shows on the console and in train.log
        assert any(r.levelno == logging.WARNING and "precision=fp16 computes in float16 on CPU"
                   in r.getMessage() for r in caplog.records)


@pytest.mark.slow
def test_accumulating_two_half_batches_equals_one_full_batch(train_here):
    common = [*FAST, "model.dropout=0", "trainer.max_steps=12", "trainer.log_every_n_steps=1"]
    _, full_dir = train_here(*common, "data.batch_size=64", name="full")
    _, halves_dir = train_here(*common, "data.batch_size=32",
                               "trainer.accumulate_grad_batches=2", name="halves")
    assert read_metrics(halves_dir)["global_batch_size"] == 64
    for (s1, a), (s2, b) in zip(scalars(full_dir, "train/loss"),
                                scalars(halves_dir, "train/loss"), strict=True):
        assert s1 == s2 and b == pytest.approx(a, rel=1e-4, abs=1e-5)


@pytest.mark.slow
@pytest.mark.distributed
def test_ddp_with_accumulation_matches_one_process(train_here):
    common = [*FAST, "model.dropout=0", "trainer.max_steps=10", "trainer.log_every_n_steps=1"]
    _, single_dir = train_here(*common, "data.batch_size=64", name="single")
    _, ddp_dir = train_here(*common, "data.batch_size=16", "trainer.accumulate_grad_batches=2",
                            "parallel=ddp", "parallel.world_size=2", name="ddp")
    for (_, a), (_, b) in zip(scalars(single_dir, "train/loss"), scalars(ddp_dir, "train/loss"),
                              strict=True):
        assert b == pytest.approx(a, rel=1e-4, abs=1e-5)


@pytest.mark.slow
def test_clipping_bounds_each_update(train_here):
    """With plain SGD at lr 1, an update is the clipped gradient: its norm is at most 1e-3."""
    args = [*FAST, "optim.lr=1.0", "optim.momentum=0", "trainer.max_steps=3",
            "trainer.clip_grad_norm=0.001"]
    _, run_dir = train_here(*args, "trainer.epochs=1", name="clipped")
    _, base_dir = train_here(*args, "trainer.max_steps=1", name="start")  # weights after 1 step
    start = torch.load(base_dir / "checkpoints" / "last.pt", weights_only=True)["model"]
    end = torch.load(run_dir / "checkpoints" / "last.pt", weights_only=True)["model"]
    moved = torch.sqrt(sum(((end[k] - start[k]) ** 2).sum() for k in start))
    assert 0 < moved <= 2 * 0.001 * 1.0001  # two more clipped steps


@pytest.mark.slow
def test_channels_last_trains_the_same_model(train_here):
    common = [*FAST, "trainer.max_steps=10", "trainer.log_every_n_steps=1"]
    _, plain_dir = train_here(*common, name="plain")
    _, nhwc_dir = train_here(*common, "trainer.channels_last=true", name="nhwc")
    for (_, a), (_, b) in zip(scalars(plain_dir, "train/loss"), scalars(nhwc_dir, "train/loss"),
                              strict=True):
        assert b == pytest.approx(a, rel=1e-3)


@pytest.mark.slow
def test_profiler_writes_one_chrome_trace_and_the_run_is_unchanged_in_kind(train_here, capfd,
                                                                         monkeypatch):
    monkeypatch.delenv("KINETO_LOG_LEVEL", raising=False)
    _, run_dir = train_here(*FAST, "trainer.profile=true", "trainer.max_steps=10")
    # on the CPU, no error line from the profiler's GPU side, nor its start and stop (the
    # first profiler in this process, where kineto starts and would log them); kineto
    # quieted for the profile alone, the process's environment left as it was
    said = capfd.readouterr().err
    assert "gpuGetDeviceCount" not in said and "profiler_start" not in said
    assert "KINETO_LOG_LEVEL" not in os.environ
    traces = list((run_dir / "profiler").glob("rank0.*.pt.trace.json"))
    assert len(traces) == 1
    assert json.loads(traces[0].read_text())["traceEvents"]
    _, plain_dir = train_here(*FAST, "trainer.max_steps=10", name="plain")
    assert set(read_metrics(run_dir)) == set(read_metrics(plain_dir))


@pytest.mark.slow
def test_switches_show_in_hparams(train_here):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    _, run_dir = train_here(*FAST, "precision=bf16", "trainer.max_steps=3")
    events = EventAccumulator(str(run_dir))
    events.Reload()
    start = events.PluginTagToContent("hparams")["_hparams_/session_start_info"]
    for key in (b"precision", b"precision.tf32", b"trainer.compile", b"trainer.channels_last",
                b"trainer.accumulate_grad_batches", b"trainer.clip_grad_norm", b"bfloat16",
                b"precision.state_dtype", b"precision.reduce_dtype"):
        assert key in start


@pytest.mark.slow
def test_dynamic_int8_quantization_reports_sizes_and_accuracies(train_here):
    _, run_dir = train_here("trainer.max_steps=300", "trainer.quantize=dynamic_int8")
    metrics = read_metrics(run_dir)
    assert metrics["quantized_size_mb"] < metrics["model_size_mb"]
    assert metrics["eval_accuracy"] > 0.8
    assert abs(metrics["quantized_eval_accuracy"] - metrics["eval_accuracy"]) < 0.01
    for tag in ("quantize/model_size_mb", "quantize/quantized_size_mb",
                "quantize/quantized_eval_accuracy", "quantize/quantized_eval_loss"):
        assert scalars(run_dir, tag), tag


def test_the_memory_snapshot_is_written_once_while_recording(monkeypatch, tmp_path):
    """The allocator's calls stood in for (they need CUDA; the GPU set runs the real ones):
    the snapshot is dumped after the third step, with recording on, and not again at the
    end of a longer run (a dump after recording stopped holds no trace)."""
    from parallab.observe import memory

    calls = []
    monkeypatch.setattr(torch.cuda.memory, "_record_memory_history",
                        lambda enabled="all", **kw: calls.append(("record", enabled)))
    monkeypatch.setattr(torch.cuda.memory, "_dump_snapshot",
                        lambda path: calls.append(("dump", calls[-1][1])))
    with memory.snapshot(True, tmp_path, 0, True) as recorder:
        for _ in range(5):
            recorder.step()
    assert calls == [("record", "all"), ("dump", "all"), ("record", None)]


def _fp8_split_as_one(rank: int, store: str, out: str) -> None:
    """On one of 2 gloo ranks: gpt in float8 (each recipe) split by its tp plan, through
    torchao's float8 styles where the scales are tensorwise, three SGD steps, against the
    same model whole (on rank 0); the losses and the styles chosen, to rank 0's file."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from parallab.models.gpt import GPT
    from parallab.parallel import tp_plans
    from parallab.parallel.float8_split import float8_style

    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    found = {}
    for recipe in ("tensorwise", "rowwise"):
        precision = Precision(PrecisionConfig(name="fp8", fp8_recipe=recipe), CPU)
        runs = []
        for split in (False, True) if rank == 0 else (True,):  # the whole model: rank 0's
            torch.manual_seed(0)
            model = precision.convert(GPT(vocab_size=256, context=32, layers=2, heads=4,
                                          width=64))
            plan = model.tp_plan()
            styles = {type(float8_style(model.get_submodule(n), s)).__name__
                      for n, s in plan.items() if n.endswith(("qkv", "proj", "mlp.0", "mlp.2"))}
            if split:
                tp_plans.split(model, mesh, None, False, _WholeLogits())
            optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
            torch.manual_seed(1)
            x, y = torch.randint(0, 256, (4, 32)), torch.randint(0, 256, (4, 32))
            seen = []
            for _ in range(3):  # one batch again: its loss falls steps apart
                with precision.autocast():
                    loss = nn.functional.cross_entropy(model(x).float().flatten(0, 1),
                                                       y.flatten())
                loss.backward()
                optimizer.step()
                optimizer.zero_grad()
                seen.append(loss.item())
            runs.append(seen)
        found[recipe] = {"whole": runs[0], "split": runs[-1], "styles": sorted(styles)}
    if rank == 0:
        with open(out, "w") as f:
            json.dump(found, f)
    dist.destroy_process_group()


class _WholeLogits:
    takes_sharded_logits = False


@pytest.mark.distributed
def test_fp8_under_tensor_parallel_trains_as_one_device_does(tmp_path):
    """precision=fp8 with tp: the float8 Linear layers split by gpt's plan (tensorwise
    scales through torchao's float8 styles, which gather in float8; rowwise through
    torch's), three steps' losses those of the model whole within float8's noise."""
    import torch.multiprocessing as mp

    out = tmp_path / "found.json"
    mp.spawn(_fp8_split_as_one, args=(str(tmp_path / "store"), str(out)), nprocs=2)
    found = json.loads(out.read_text())
    assert found["tensorwise"]["styles"] == ["Float8ColwiseParallel", "Float8RowwiseParallel"]
    assert found["rowwise"]["styles"] == ["ColwiseParallel", "RowwiseParallel"]
    for recipe, runs in found.items():
        # float8's rounding (2 mantissa bits in the gradients) meets partial sums taken
        # in another order: 1.4e-3 apart by the third step here
        assert runs["split"] == pytest.approx(runs["whole"], rel=5e-3), recipe
        assert runs["whole"][-1] < runs["whole"][0] - 0.05  # it trains
