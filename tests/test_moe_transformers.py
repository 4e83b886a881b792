"""transformers MoE models under expert parallelism: Qwen3-MoE trained as written under ep
against one device (its own router loss weighted and logged), its sharded checkpoint
exported in the published names and read back; Qwen3-MoE's, Mixtral's and OLMoE's experts
modules dispatched over ep and split by their own tp plans as they compute whole; sequence
parallelism refused in one line."""

from __future__ import annotations

import re

import pytest
import torch
from conftest import checked, losses
from test_moe import routed

from parallab.config.errors import ConfigError
from parallab.models import experts as experts_of
from parallab.training import checkpoint, weights

QWEN3_MOE = ["model=qwen3_moe_30b", "model.config.vocab_size=512", "model.config.hidden_size=64",
             "model.config.intermediate_size=128", "model.config.moe_intermediate_size=32",
             "model.config.num_hidden_layers=2", "model.config.num_attention_heads=4",
             "model.config.num_key_value_heads=2", "model.config.head_dim=16",
             "model.config.num_experts=4", "model.config.num_experts_per_tok=2", "data=tokens",
             "data.seq_len=32", "device=cpu", "trainer.max_steps=4", "trainer.log_every_n_steps=1",
             "trainer.checkpoint_every_n_steps=null", "trainer.save_best=false"]


def test_a_transformers_moe_model_refuses_sequence_parallelism_in_one_line():
    """gpt's MoE layers take sequence parallelism; a transformers one's are not cut
    around, said before launch."""
    with pytest.raises(ConfigError, match="sequence_parallel=true with a transformers mixture"):
        checked(*QWEN3_MOE, "parallel=fsdp_tp", "parallel.world_size=4", "parallel.tp=2",
                "parallel.sequence_parallel=true")


def test_adapters_in_the_experts_under_ep_are_one_line_before_launch():
    """peft's all-linear wraps a transformers MoE layer's experts, whose weights ep splits
    over its ranks and peft's beside them not: every worker had failed in the split. Named
    layers outside the experts train under ep."""
    lora = ["adapter=lora", "parallel=fsdp", "parallel.world_size=2", "parallel.ep=2"]
    with pytest.raises(ConfigError, match=re.escape(
            "adapter.target_modules=all-linear puts adapters in the experts "
            "(model.layers.0.mlp.experts), which parallel.ep=2 splits over ranks")):
        checked(*QWEN3_MOE, *lora, "adapter.target_modules=all-linear")
    checked(*QWEN3_MOE, *lora, "adapter.target_modules=[q_proj,v_proj]")


def test_a_folder_of_other_expert_shapes_is_one_line_and_loads_what_matches(tmp_path):
    """A transformers folder of 4 experts for a model of 8: transformers had raised after
    its own report (ignore_mismatched_sizes), a traceback before launch, also under
    trainer.init_strict=false. Now refused in one line; non-strict, the experts are left
    at the model's own start and said, the rest read."""
    from parallab.models import build_model

    folder = tmp_path / "four"
    build_model(checked(*QWEN3_MOE)[0].model).save_pretrained(folder)
    eight = [*QWEN3_MOE, "model.config.num_experts=8", f"trainer.init_from={folder}"]
    with pytest.raises(ConfigError, match=re.escape(
            "mlp.experts.down_proj [4, 64, 32] vs [8, 64, 32]")):
        checked(*eight)
    cfg, _ = checked(*eight, "trainer.init_strict=false")
    model = build_model(cfg.model)
    left = weights.load_into(model, folder, strict=False)
    assert {"model.layers.0.mlp.experts.down_proj", "model.layers.0.mlp.gate.weight"} <= set(left)
    assert "model.embed_tokens.weight" not in left


@pytest.mark.parametrize("k,said", [
    (0, "model.config.num_experts_per_tok=0 is out of range: it must be >= 1"),
    (5, "model.config.num_experts_per_tok=5 is above model.config.num_experts=4")])
def test_a_transformers_moe_models_experts_per_token_are_checked_as_gpts(k, said):
    """Not a router that sends no token anywhere (0: it trained, its experts idle), nor a
    topk failing on the data's batch, said as the data's fault (5 of 4)."""
    with pytest.raises(ConfigError, match=said):
        checked(*QWEN3_MOE, f"model.config.num_experts_per_tok={k}")
    with pytest.raises(ConfigError, match="num_local_experts=4: a token picks at most"):
        checked("model=mixtral_8x7b", "model.config.num_local_experts=4",
                "model.config.num_experts_per_tok=5", "data=tokens", "data.seq_len=32",
                "model.config.num_hidden_layers=1", "model.config.hidden_size=64")


@pytest.mark.parametrize("groups,said", [
    (["model.config.n_group=3"], "model.config.n_group=3 does not split "
     "model.config.n_routed_experts=8 into groups of 2 or more experts"),
    (["model.config.n_group=8"], "model.config.n_group=8 does not split"),
    (["model.config.topk_group=5"], "model.config.topk_group=5 is out of range: a token's "
     "experts come from 1 to model.config.n_group=4 groups"),
    (["model.config.topk_group=1", "model.config.num_experts_per_tok=3"],
     "model.config.num_experts_per_tok=3 is above the 2 experts of model.config.topk_group=1")])
def test_deepseeks_expert_groups_are_checked_before_the_router_runs(groups, said):
    """Groups that do not split the experts had failed in the router's view on the trial
    batch, said as the data's fault ("make data samples and the model's input agree")."""
    tiny = ["model=deepseek_v3", "model.config.n_routed_experts=8", "model.config.n_group=4",
            "model.config.topk_group=2", "model.config.num_experts_per_tok=2",
            "model.config.num_hidden_layers=2", "model.config.first_k_dense_replace=1",
            "model.config.hidden_size=64", "model.config.intermediate_size=128",
            "model.config.moe_intermediate_size=32", "model.config.num_attention_heads=2",
            "model.config.num_key_value_heads=2", "model.config.q_lora_rank=32",
            "model.config.kv_lora_rank=16", "model.config.qk_nope_head_dim=16",
            "model.config.qk_rope_head_dim=16", "model.config.v_head_dim=16",
            "model.config.vocab_size=256", "data=tokens", "data.seq_len=32", "device=cpu"]
    checked(*tiny)
    with pytest.raises(ConfigError, match=re.escape(said)):
        checked(*tiny, *groups)


@pytest.mark.slow
@pytest.mark.distributed
def test_a_transformers_moe_model_trains_under_ep_as_one_device_does(train_here):
    """Qwen3-MoE as written: its experts module's own forward on the tokens parallab's
    dispatch sends it, split over 2 ranks, its attention by its own tp plan; its own router
    loss, where its config outputs it, weighted by each micro-batch's share and logged."""
    own = [*QWEN3_MOE, "+model.config.output_router_logits=true", "data.batch_size=4"]
    # two micro-batches of 4, each weighted by its share of the step's tokens
    one, one_dir = train_here(*own, "trainer.accumulate_grad_batches=2", name="one")
    # its attention split by its plan over tp 2, its experts over ep 2 carved from the tp
    # ranks (the plan's styles for them left out), FSDP2 over 2 shards of 4 each
    ep, ep_dir = train_here(*own, "parallel=fsdp_tp", "parallel.world_size=4",
                            "parallel.tp=2", "parallel.ep=2", name="ep")
    assert losses(ep_dir) == pytest.approx(losses(one_dir), rel=1e-5)
    assert ep["expert_max_mean"] == pytest.approx(one["expert_max_mean"], rel=1e-5)
    assert ep["comm_all_to_all_mb"] > 0
    # Switch's loss near its floor, k = 2 (transformers' form), times the coefficient
    assert one["train_aux"] == pytest.approx(0.001 * 2, rel=0.1)
    # (of other micro-batches: the loss of a batch's routing is not the sum of its rows')
    assert ep["train_aux"] == pytest.approx(one["train_aux"], rel=1e-3)
    assert_exported_as_published(ep_dir, train_here)


def assert_exported_as_published(run_dir, train_here) -> None:
    """The ep run's sharded checkpoint exported as a transformers folder in the family's
    published names (each expert's projections apart: what from_pretrained reads), and
    read back (trainer.init_from) through the model's class into its fused experts."""
    from safetensors import safe_open

    from parallab.commands import _export

    out = run_dir.parent / "exported"
    ckpt = checkpoint.latest(run_dir / "checkpoints")
    _export(ckpt, out)  # what `parallab export CKPT OUT` does
    with safe_open(str(out / "model.safetensors"), "pt") as saved:
        names = set(saved.keys())
    assert "model.layers.0.mlp.experts.3.gate_proj.weight" in names
    assert not any(name.endswith("experts.gate_up_proj") for name in names)
    model = _tiny_qwen3()
    trained = weights.read(ckpt, model)
    for name, value in weights.read(out, model).items():
        torch.testing.assert_close(value, trained[name])
    metrics, _ = train_here(*QWEN3_MOE, "data.batch_size=8", "trainer.max_steps=1",
                            f"trainer.init_from={out}", name="from_exported")
    assert metrics["steps"] == 1


def test_experts_split_over_tp_ranks_go_to_a_checkpoint_and_back(train_here):
    """Experts split over 2 tp ranks by the model's own plan (its packed gate_up_proj
    strided: each rank its slice of gate and of up, which torch's checkpoint planner reads
    as overlapping chunks) are saved as one device's weights, and resume to its losses;
    under a pipeline too, where no FSDP2 sums the q and k norms' partial gradients; and
    on into a pipeline's parts sharded, their experts dispatched over ep (found by the
    whole model's ep plan, which a part does not hold)."""
    run = [*QWEN3_MOE, "data.global_batch_size=8", "trainer.checkpoint_every_n_steps=2"]
    _, one_dir = train_here(*run, name="one")
    pipeline = ["parallel=pipeline", "parallel.world_size=4", "parallel.pp=2"]
    train_here(*run, "trainer.max_steps=2", *pipeline, "parallel.tp=2", name="tp")
    train_here(*run, "trainer.max_steps=3", "trainer.resume=auto", "parallel=tp",
               "parallel.world_size=2", name="tp")
    _, tp_dir = train_here(*run, "trainer.resume=auto", *pipeline, "parallel.dp_shard=2",
                           "parallel.ep=2", name="tp")  # step 4
    assert losses(tp_dir)[-2:] == pytest.approx(losses(one_dir)[-2:], rel=1e-5)
    model = _tiny_qwen3()
    one = weights.read(checkpoint.latest(one_dir / "checkpoints"), model)
    for name, value in weights.read(checkpoint.latest(tp_dir / "checkpoints"), model).items():
        torch.testing.assert_close(value, one[name], rtol=1e-4, atol=1e-6)


def test_a_transformers_router_loss_joins_the_gradient_not_the_logged_loss():
    """Qwen3-MoE with output_router_logits: the step's loss is the task loss (train/loss),
    its gradient the task loss's and the router term's (coefficient x aux_loss x the
    micro-batch's share), the term counted apart (train/aux)."""
    from parallab.loss import build_loss
    from parallab.models import moe

    model = _tiny_qwen3()
    model.config.output_router_logits = True
    tokens = torch.randint(0, 512, (2, 33))
    batch = (tokens[:, :-1], tokens[:, 1:])
    objective = build_loss({"_target_": "parallab.loss.CrossEntropy"}).bind(model)
    with moe.micro_batch(0.5):
        output, loss = objective.step_loss(model, batch, 64)
    task = objective.total(objective.scored(output), batch[1]) / 64
    term = 0.5 * model.config.router_aux_loss_coef * output.aux_loss
    assert objective.take_aux() == pytest.approx(term.item(), rel=1e-6)
    assert loss.item() == pytest.approx(task.item(), rel=1e-6)
    weight = model.model.embed_tokens.weight
    got = torch.autograd.grad(loss, weight, retain_graph=True)[0]
    expected = torch.autograd.grad(task + term, weight)[0]
    assert torch.allclose(got, expected, rtol=1e-5, atol=1e-8)


def _tiny_qwen3() -> torch.nn.Module:
    """QWEN3_MOE's model, built as a run builds it."""
    from conftest import typed

    from parallab import models

    cfg = typed(*QWEN3_MOE)
    return models.build_model(models.check(cfg.model, cfg.data))


def _dispatch_as_one(rank: int, store: str) -> None:
    """On one of 2 gloo ranks, for each family: a tiny transformers model's first experts
    module called on this rank's half of the tokens through parallab's dispatch, against
    the module's own forward on all of them (its output on this half; its gradient, halved
    by the share ep takes, on the experts this rank holds)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from parallab.parallel import expert_parallel
    from parallab.parallel.layout import Layout

    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    layout = Layout(2, ("dp_replicate", "dp_shard", "tp"), True, dp_shard=2, ep=2)
    for family in FAMILIES:
        torch.manual_seed(0)
        model = _tiny(family)
        _, module = experts_of.experts_of(model)[0]
        for p in module.parameters():
            torch.nn.init.normal_(p, std=0.1)
        _, ids, weights = routed(n=16, experts=4, k=2, seed=1)
        x, probe = torch.randn(16, 32, requires_grad=True), torch.arange(32.0)
        weights.requires_grad_()
        y = module(x, ids, weights)
        (y * probe).sum().backward()
        want = {n: p.grad.clone() for n, p in module.named_parameters()}
        want_inputs = (x.grad.clone(), weights.grad.clone())
        mesh = init_device_mesh("cpu", (1, 2, 1), mesh_dim_names=layout.dims)
        expert_parallel.attach(model, mesh, layout)
        half = slice(8 * rank, 8 * rank + 8)
        got = module(x.detach()[half], ids[half], weights.detach()[half])
        torch.testing.assert_close(got, y[half].detach(), rtol=1e-4, atol=1e-5)
        (got * probe).sum().backward()
        for n, p in module.named_parameters():
            held = want[n][2 * rank:2 * rank + 2]
            torch.testing.assert_close(p.grad.to_local() * 2, held, rtol=1e-4, atol=1e-5)
        _tensor_parallel_as_one(family, x.detach(), ids, weights.detach(), probe, y, want,
                                want_inputs)
    dist.destroy_process_group()


def _tensor_parallel_as_one(family, x, ids, weights, probe, y, want, want_inputs) -> None:
    """The same experts split over 2 tp ranks by the model's own plan (its moe_tp_experts:
    the gate_up_proj packed colwise, the down_proj rowwise; for the experts modules its ep
    plan names, where transformers 5.25's tp plans leave them out): the whole output on
    every rank, the weights' gradients whole once gathered, the tokens' and routing
    weights' whole too."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import parallelize_module

    from parallab.parallel import tp_plans

    torch.manual_seed(0)
    model = _tiny(family)
    _, module = experts_of.experts_of(model)[0]
    for p in module.parameters():
        torch.nn.init.normal_(p, std=0.1)
    plan = tp_plans.plan_of(model, None)
    name = next(n for n, style in plan.items() if "Experts" in type(style).__name__)
    parallelize_module(model.get_submodule(name), init_device_mesh("cpu", (2,)), plan[name])
    x, weights = x.clone().requires_grad_(), weights.clone().requires_grad_()
    got = module(x, ids, weights)
    torch.testing.assert_close(got, y.detach(), rtol=1e-4, atol=1e-5)
    (got * probe).sum().backward()
    for n, p in module.named_parameters():
        torch.testing.assert_close(p.grad.full_tensor(), want[n], rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(x.grad, want_inputs[0], rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(weights.grad, want_inputs[1], rtol=1e-4, atol=1e-5)


FAMILIES = ("qwen3_moe", "mixtral", "olmoe")


def _tiny(family: str) -> torch.nn.Module:
    import transformers

    shape = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                 num_attention_heads=2, num_key_value_heads=2, num_experts_per_tok=2)
    config = {"qwen3_moe": lambda: transformers.Qwen3MoeConfig(
                  **shape, num_experts=4, moe_intermediate_size=16, head_dim=16),
              "mixtral": lambda: transformers.MixtralConfig(**shape, num_local_experts=4),
              "olmoe": lambda: transformers.OlmoeConfig(**shape, num_experts=4)}[family]()
    return transformers.AutoModelForCausalLM.from_config(config)


@pytest.mark.slow
@pytest.mark.distributed
def test_transformers_experts_modules_are_dispatched_as_written(tmp_path):
    """Qwen3-MoE's, Mixtral's and OLMoE's experts modules (their ep plan's
    ep_dispatch_experts), each split over 2 ranks by expert (ep) and by their tp plan's
    packed styles, compute what they compute whole."""
    import torch.multiprocessing as mp

    mp.spawn(_dispatch_as_one, args=(str(tmp_path / "store"),), nprocs=2)
