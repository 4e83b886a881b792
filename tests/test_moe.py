"""Mixtures of experts: gpt's MoE layers (grouped matmul against the loop over experts, the
router in float32, capacity, the router loss's gradient and share, the balancing bias),
expert parallelism against one device under fsdp, hsdp, fsdp_tp and pipelines, resumed
across ep degrees and layouts, what a run logs of the experts' load, and bad input in one
line (transformers MoE models: test_moe_transformers.py)."""

from __future__ import annotations

import re

import pytest
import torch
from conftest import checked, losses, read_metrics, scalars

from parallab.config.errors import ConfigError
from parallab.models import experts as experts_of, moe
from parallab.models.gpt import GPT, flops_per_token
from parallab.training import checkpoint, weights

GPT_MOE = ["data=bytes", "data.eval_fraction=0.002", "model=gpt", "model.heads=2",
           "model.width=32", "model.context=32", "model.moe.experts=4", "model.moe.width=32",
           "device=cpu", "trainer.log_every_n_steps=1", "trainer.checkpoint_every_n_steps=null",
           "trainer.save_best=false", "optim.lr=0.05", "trainer.max_steps=10"]
# the router loss with a shared expert; DeepSeek-V3's sigmoid router and balancing bias,
# dense blocks between the MoE ones
AUX = {"layers": 2, "moe": {"aux_loss": 0.01, "shared": 1}}
BIAS = {"layers": 4, "moe": {"bias_update": 0.01, "router": "sigmoid", "every": 2}}
BATCH = 16  # global


def overrides(shape: dict) -> list[str]:
    return [f"model.layers={shape['layers']}",
            *(f"model.moe.{k}={v}" for k, v in shape["moe"].items())]


def build(shape: dict) -> GPT:
    return GPT(layers=shape["layers"], heads=2, width=32, context=32,
               moe={"experts": 4, "width": 32, **shape["moe"]})


def routed(n: int = 24, experts: int = 4, k: int = 2, seed: int = 0):
    torch.manual_seed(seed)
    x = torch.randn(n, 16, requires_grad=True)
    ids = torch.stack([torch.randperm(experts)[:k] for _ in range(n)])
    return x, ids, torch.rand(n, k)


def test_grouped_matmul_is_the_loop_over_experts_and_takes_any_gradient():
    """grouped_mm and the loop give one output and one gradient; a sum's expanded gradient
    (which grouped_mm's backward refuses on a CPU) is made contiguous first."""
    layer = experts_of.Experts(4, 16, 32, 2)
    for w in (layer.gate, layer.up, layer.down):
        torch.nn.init.normal_(w, std=0.1)
    x, ids, weights = routed()
    outs, grads = [], []
    for grouped in (True, False):
        layer.grouped = grouped
        layer.zero_grad()
        x.grad = None
        y = layer(x, ids, weights)
        y.sum().backward()
        outs.append(y.detach())
        grads.append([x.grad.clone(), layer.gate.grad.clone(), layer.down.grad.clone()])
    assert experts_of.grouped_mm_applies(x, layer.gate, layer.up, layer.down)
    torch.testing.assert_close(outs[0], outs[1], rtol=1e-5, atol=1e-6)
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    # bfloat16 takes it where strides are 16-byte aligned; a width of 4 is not
    assert experts_of.grouped_mm_applies(x.bfloat16(), layer.gate.bfloat16())
    assert not experts_of.grouped_mm_applies(x, torch.empty(4, 6, 16))


def test_the_router_scores_in_float32_and_its_weights_sum_to_one():
    for kind in moe.ROUTERS:
        router = moe.Router(16, 8, 2, kind, bias=True)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            ids, weights, scores = router(torch.randn(10, 16))
        assert weights.dtype == scores.dtype == torch.float32
        torch.testing.assert_close(weights.sum(-1), torch.ones(10))
        # the balancing bias picks, it does not weigh
        router.bias[ids[0, 0]] = -100.0
        again = router(torch.randn(10, 16))[0]
        assert not (again == ids[0, 0]).any()


def test_capacity_drops_the_pairs_past_each_experts_share_and_counts_them():
    cfg = moe.MoeConfig(experts=4, top_k=1, width=32, capacity=1.0)
    layer = moe.MoE(16, cfg).train()
    with torch.no_grad():  # every token to expert 0: it takes its fair share, 3 of 12
        layer.router.gate.weight.zero_()
        layer.router.gate.weight[0] = 1.0
    x = torch.ones(1, 12, 16)
    y = layer(x)
    kept = (y.flatten(0, 1).abs().sum(-1) > 0).sum()
    assert kept == 3  # the others pass by the residual alone
    window = layer.load.take_window()
    assert window[:4].tolist() == [12, 0, 0, 0] and window[4] == 9 and window[5] == 12


def test_ep_sends_each_token_once_to_each_rank_holding_its_experts():
    """8 experts over 2 ranks (4 each): a token whose experts share a rank crosses once,
    with its routing there (the others' ids past the rank's last, weighted 0); a dropped
    pair (id 8) goes nowhere."""
    from parallab.parallel.expert_parallel import _units

    ids = torch.tensor([[0, 1], [0, 5], [8, 8], [6, 7]])
    weights = torch.tensor([[0.6, 0.4], [0.7, 0.3], [0.5, 0.5], [0.2, 0.8]])
    tokens, own, share, sent = _units(ids, weights, 8, 2)
    assert tokens.tolist() == [0, 1, 1, 3] and sent == [2, 2]
    assert own.tolist() == [[0, 1], [0, 4], [4, 1], [2, 3]]
    torch.testing.assert_close(share, torch.tensor([[0.6, 0.4], [0.7, 0.0], [0.0, 0.3],
                                                    [0.2, 0.8]]))


def test_the_router_loss_adds_its_coefficient_times_its_share_to_the_gradient():
    """Attached to the layer's output, Switch's loss gives the router the gradient of
    task + coefficient x share x aux, share being the micro-batch's of the step."""
    torch.manual_seed(0)
    cfg = moe.MoeConfig(experts=4, top_k=2, width=32, aux_loss=0.1)
    layer = moe.MoE(16, cfg).train()
    x = torch.randn(2, 6, 16)
    with moe.micro_batch(0.25):
        layer(x).pow(2).sum().backward()
    attached = layer.router.gate.weight.grad.clone()
    layer.zero_grad()
    ids, weights, scores = layer.router(x.flatten(0, 1))
    counts = torch.bincount(ids.flatten(), minlength=4).float()
    y = layer.experts(x.flatten(0, 1), ids, weights)
    (y.pow(2).sum() + 0.1 * 0.25 * layer._aux(scores, counts)).backward()
    torch.testing.assert_close(attached, layer.router.gate.weight.grad)
    aux = float(layer._aux(scores, counts).detach())
    assert float(layer.load.take_window()[-1]) == pytest.approx(0.25 * aux)


def test_the_balancing_bias_steps_toward_the_mean_load():
    layer = moe.MoE(16, moe.MoeConfig(experts=4, width=32, bias_update=0.1))
    layer.load.step = torch.tensor([6.0, 2.0, 0.0, 0.0])
    moe.step_done([layer])
    # the mean is 2: the overloaded one down, the idle ones up, the one at the mean kept
    assert layer.router.bias.tolist() == pytest.approx([-0.1, 0.0, 0.1, 0.1])
    assert layer.load.step.sum() == 0  # counted afresh each step


def test_flops_count_the_experts_a_token_meets():
    dense, mixed = GPT(layers=2, heads=2, width=32, context=32).cfg, build(AUX).cfg
    C = 32
    per_moe = C * 4 + 3 * C * 32 * (2 + 1)  # router, top 2 experts and the shared one
    per_dense = 8 * C * C + 5 * C
    assert flops_per_token(mixed, 32) - flops_per_token(dense, 32) == pytest.approx(
        6 * 2 * (per_moe - per_dense))
    assert moe.active_weights(mixed.moe, C) < moe.all_weights(mixed.moe, C)


@pytest.mark.parametrize("given, message", [
    (["model.moe.experts=null", "model.moe.top_k=4"],
     "model.moe.top_k=4 is set but model.moe.experts=null"),
    (["model.moe.top_k=5"], "model.moe.top_k=5 is above model.moe.experts=4"),
    (["model.moe.capacity=0"], "model.moe.capacity=0 is out of range"),
    (["model.moe.router=relu"], "model.moe.router=relu is unknown"),
    # a value of another type: the router's first forward failed with a traceback (in the
    # workers, under a launched layout)
    (["model.moe.top_k=1.5"], "model.moe.top_k=1.5 is not of type int"),
    (["model.moe.experts=abc"], "model.moe.experts='abc' is not of type int or NoneType"),
    (["model.moe.experts=[4]"], "model.moe.experts=[4] is not of type int"),
    (["model.moe.capacity=abc"], "model.moe.capacity='abc' is not of type int or float"),
    # a bool is an int to Python: true had failed in the model's constructor, no key named
    (["model.moe.experts=true"], "model.moe.experts=True is not of type int or NoneType, as "
     "parallab.models.moe.MoeConfig declares: give an int"),
    (["parallel=fsdp", "parallel.world_size=2", "parallel.ep=2", "model.moe.shared=1.5"],
     "model.moe.shared=1.5 is not of type int"),
    (["model.moe.every=3"], "model.moe.every=3 leaves none of the 2 blocks"),
    (["parallel=fsdp", "parallel.world_size=4", "parallel.ep=4", "model.moe.experts=6",
      "model.moe.top_k=2"], "parallel.ep=4 does not divide the model's 6 experts"),
    (["parallel=fsdp_tp", "parallel.world_size=8", "parallel.tp=4", "parallel.ep=2",
      "model.heads=4"], "make ep a multiple of 4"),
    (["parallel=fsdp", "parallel.world_size=4", "parallel.ep=3"],
     "parallel.ep=3 is carved from the data-parallel shard and tp ranks"),
    (["parallel=ddp", "parallel.world_size=2", "parallel.ep=2"],
     "every rank holds the whole model"),
    (["parallel=pipeline", "parallel.world_size=2", "parallel.ep=2"],
     "every rank holds its part of the model whole"),
    (["parallel.ep=2"], "parallel.ep=2 with parallel=none: one process holds"),
    # the ways out named were those the user had taken, or left tp out
    (["parallel=fsdp", "parallel.world_size=1", "parallel.ep=2"],
     "parallel.ep=2 with parallel.world_size=1: one rank holds every expert: give "
     "parallel.world_size >= 2"),
    (["parallel=ddp", "parallel.world_size=2", "parallel.ep=2"],
     "use parallel=fsdp, hsdp, tp or fsdp_tp, or a pipeline with parallel.dp_shard > 1"),
    # auto is every layout, not one that holds the whole model
    (["parallel=auto", "parallel.world_size=2", "parallel.ep=2"],
     "parallel=auto stands for every layout, and a run trains one"),
    (["parallel=fsdp", "parallel.world_size=2", "parallel.ep=2", "model.moe.experts=null",
      "model.moe.width=null"],
     "GPT has no experts to split"),
    (["parallel=fsdp", "parallel.world_size=2", "parallel.ep=0"], "parallel.ep=0 is out of range"),
])
def test_bad_moe_input_is_one_line_before_launch(given, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        checked(*GPT_MOE, "model.layers=2", *given)


@pytest.fixture(scope="module")
def one_device(tmp_path_factory):
    """The references, in-process: the router loss with a shared expert, and DeepSeek-V3's
    sigmoid router with its balancing bias (dense blocks between)."""
    from parallab.cli import train_in_process

    runs = {}
    for name, extra in (("aux", AUX), ("bias", BIAS)):
        runs[name] = tmp_path_factory.mktemp(name) / "run"
        train_in_process([*GPT_MOE, *overrides(extra), f"data.batch_size={BATCH}",
                          "logger=[tensorboard,csv]"], runs[name])
    return runs


def final_weights(run_dir, model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return weights.model_from(checkpoint.latest(run_dir / "checkpoints"), model).state_dict()


# each leg: (layout, data-parallel ranks, the step it runs to)
LEGS = {
    # ep 4 over 4 shards with selective checkpointing, then ep 4 carved from tp 2 and 2
    # shards (tokens sliced over the tp ranks) with sequence parallelism (the MoE layer
    # takes the whole sequence) and full checkpointing, then hsdp 2 x 2 with ep 2
    "aux": [(["parallel=fsdp", "parallel.world_size=4", "parallel.ep=4",
              "trainer.activation_checkpointing=selective"], 4, 4),
            (["parallel=fsdp_tp", "parallel.world_size=4", "parallel.tp=2", "parallel.ep=4",
              "parallel.sequence_parallel=true", "trainer.activation_checkpointing=full"], 2, 7),
            (["parallel=hsdp", "parallel.world_size=4", "parallel.ep=2"], 4, 10)],
    # pipelines: 2 parts x 2 shards, ep 2 of the shards, interleaved; then 2 parts x tp 2,
    # ep 2 of the tp ranks, 1F1B (the balancing bias all-reduced over the data ranks)
    "bias": [(["parallel=pipeline", "parallel.world_size=4", "parallel.pp=2",
               "parallel.dp_shard=2", "parallel.dp_replicate=1", "parallel.ep=2",
               "parallel.schedule=interleaved_1f1b"], 2, 5),
             (["parallel=pipeline", "parallel.world_size=4", "parallel.pp=2", "parallel.tp=2",
               "parallel.ep=2"], 1, 10)],
}


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize("reference", LEGS, ids=["fsdp-fsdp_tp-hsdp", "pipelines"])
def test_expert_parallel_trains_as_one_device_does_across_ep_degrees(train_here, one_device,
                                                                      reference):
    """Dropless routing over ep ranks, the experts' gradients reduced over the ranks
    holding them, resumed under another ep degree and layout each leg: the losses, the
    router loss and the final weights (the balancing bias too) of one device."""
    extra = AUX if reference == "aux" else BIAS
    for leg, (layout, ranks, until) in enumerate(LEGS[reference]):
        metrics, run_dir = train_here(*GPT_MOE, *overrides(extra), *layout,
                                      f"data.batch_size={BATCH // ranks}",
                                      f"trainer.max_steps={until}",
                                      *(["trainer.resume=auto"] if leg else []))
    expected = one_device[reference]
    assert losses(run_dir) == pytest.approx(losses(expected), rel=1e-4, abs=1e-5)
    got, want = final_weights(run_dir, build(extra)), final_weights(expected, build(extra))
    assert {k for k in want if "bias" in k and "router" in k} == (
        {"blocks.1.mlp.router.bias", "blocks.3.mlp.router.bias"} if reference == "bias" else set())
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-4, atol=1e-5)
    # the experts' load is every rank's, counted once (a pipeline's shape-finding run not)
    block = "expert/block1/max_mean"
    assert [v for _, v in scalars(run_dir, block)] == pytest.approx(
        [v for _, v in scalars(expected, block)], rel=1e-6)
    summary = read_metrics(expected)  # the run's, over its resumes (the last leg's alone)
    for key in ("expert_max_mean", "train_aux"):
        assert metrics.get(key) == pytest.approx(summary.get(key), rel=1e-4)
    if reference == "aux":
        assert [v for _, v in scalars(run_dir, "train/aux")] == pytest.approx(
            [v for _, v in scalars(expected, "train/aux")], rel=1e-4)
        assert metrics["comm_all_to_all_mb"] > 0


def test_a_run_logs_each_layers_load(one_device):
    """Tokens per expert as a histogram, max/mean, dropped and the router loss per MoE
    block, train/aux beside train/loss; in the CSV too; summarised in metrics.json."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run_dir = one_device["aux"]
    metrics = read_metrics(run_dir)
    assert metrics["train_aux"] == pytest.approx(0.02, rel=0.2)  # 0.01 x 2 layers x ~1
    assert metrics["expert_max_mean"] >= 1 and metrics["expert_dropped"] == 0
    events = EventAccumulator(str(next(run_dir.glob("events.out.tfevents.*"))),
                              size_guidance={"histograms": 0})
    events.Reload()
    assert {"expert/block0/tokens", "expert/block1/tokens"} <= set(events.Tags()["histograms"])
    tokens = events.Histograms("expert/block0/tokens")[0].histogram_value
    assert tokens.num == BATCH * 32 * 2  # every (token, expert) pair of a step counted once
    header = (run_dir / "metrics.csv").read_text().splitlines()[0].split(",")
    assert {"train/aux", "expert/block1/max_mean", "expert/block1/dropped"} <= set(header)
    bias = read_metrics(one_device["bias"])
    assert "train_aux" not in bias and bias["expert_max_mean"] >= 1
    # blocks 1 and 3 mix experts; 0 and 2 are dense
    assert scalars(one_device["bias"], "expert/block3/max_mean")
    assert not scalars(one_device["bias"], "expert/block0/max_mean")


def test_a_capacity_factor_logs_the_tokens_it_drops(train_here):
    metrics, run_dir = train_here(*GPT_MOE, "model.layers=2", "model.moe.capacity=0.5",
                                  "trainer.max_steps=3", "data.batch_size=4")
    assert metrics["expert_dropped"] >= 0.5  # half of each expert's fair share, at most
    assert all(v >= 0.5 for _, v in scalars(run_dir, "expert/block0/dropped"))
