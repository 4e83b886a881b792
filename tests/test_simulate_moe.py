"""parallab simulate on mixtures of experts: an MoE block traced with uniform routing (its
grouped matmuls' FLOPs by hand, its experts' weights and ops marked), a mixture's dense
blocks traced apart, what expert parallelism changes of a step (weights gathered, tokens
sent, experts' bytes), the all-to-all's price inside and across nodes, and parallel=auto's
ep candidates as train takes them."""

from __future__ import annotations

import pytest

from parallab.parallel.layout import Layout
from test_simulate import configured

MOE = ["model=gpt", "model.layers=2", "model.heads=4", "model.width=64", "model.context=64",
       "model.moe.experts=8", "model.moe.top_k=2", "model.moe.width=64", "data.seq_len=32",
       "data.batch_size=4", "optim=adamw", "precision=bf16", "cluster=h100"]


def facts_of(*overrides: str):
    from parallab.simulate import Facts

    cfg = configured(*MOE, *overrides)
    facts = Facts.of(cfg)
    facts.cut()
    return cfg, facts


def test_an_moe_block_is_traced_with_each_expert_an_even_share():
    """On fake tensors the router's picks cannot be read: each expert takes an even share
    of the (token, expert) pairs, its three projections one grouped matmul each, forward
    2 x pairs x width x hidden FLOPs, backward twice that; its weights counted apart."""
    from parallab.simulate import trace

    cfg, facts = facts_of()
    found = trace.trace(cfg, facts.model, facts.block, facts.vocab,
                        trace.Shape(rows=4, seq_len=32, gathered=True))
    pairs, width, hidden = 4 * 32 * 2, 64, 64
    import torch

    grouped = [op for op in found.ops if op.replay[0] is torch.ops.aten._grouped_mm.default]
    assert all(op.experts for op in grouped)
    assert {op.phase for op in grouped} == {"forward", "backward"}
    forward = sum(op.flops for op in grouped if op.phase == "forward")
    assert forward == 3 * 2 * pairs * width * hidden
    assert sum(op.flops for op in grouped if op.phase == "backward") == 2 * forward
    assert found.params["experts"] == 8 * 3 * width * hidden
    assert all(op.weight_bytes for op in grouped)  # each reads (or writes) a 3-D weight
    assert facts.mix.experts == 8 and facts.mix.moe_blocks == 2 and facts.dense_model is None


def test_a_mixtures_dense_blocks_are_traced_apart():
    _, facts = facts_of("model.moe.every=2")  # block 1 mixes experts, block 0 is dense
    assert facts.mix.moe_blocks == 1 and facts.dense_model is not None
    dense = facts.dense_model.get_submodule(facts.dense_block)
    assert not hasattr(dense.mlp, "experts")
    assert hasattr(facts.model.get_submodule(facts.block).mlp, "experts")


def test_expert_parallelism_trades_gathered_experts_for_sent_tokens():
    """ep over the shards: each rank gathers its experts' share, not all; state is as
    sharded as before; each MoE block sends its pairs 4 times a micro-batch (6 with the
    forward recomputed); an expert op moves 1/ep of the weights it was traced with."""
    from parallab.simulate import Traces, predict, rates_of

    # wide enough that the experts' ops take longer than a kernel's launch
    cfg, facts = facts_of("parallel.world_size=8", "model.width=1024", "model.moe.width=2048",
                          "model.heads=8", "data.seq_len=64", "model.context=64")
    traces, rates = Traces(cfg, facts), rates_of(cfg.cluster, 8)
    one, eight = (predict(cfg, Layout.planned(8, 1, 8, batch_size=4, ep=ep), traces, rates)
                  for ep in (1, 8))
    assert "all_to_all_s" not in one.parts and eight.parts["all_to_all_s"] > 0
    assert eight.memory["gathered"] < one.memory["gathered"]
    assert eight.memory["state"] == pytest.approx(one.memory["state"])
    assert eight.parts["compute_s"] < one.parts["compute_s"]  # the experts' weights read
    full = predict(cfg, Layout.planned(8, 1, 8, batch_size=4, ep=8, checkpointing="full"),
                   traces, rates)
    assert full.parts["all_to_all_s"] == pytest.approx(1.5 * eight.parts["all_to_all_s"])


def test_an_all_to_all_across_nodes_pays_the_nics():
    """Each rank sends its share straight to each peer: inside a node over NVLink, to
    the other nodes' ranks through its own NIC, the slower link taking the longer."""
    from parallab.simulate import rates_of
    from parallab.simulate.cluster import Group

    rates = rates_of(configured(*MOE).cluster, 64)
    sent = 2**30
    inside = rates.collective_s("all_to_all", sent, Group(8, 1))
    across = rates.collective_s("all_to_all", sent, Group(64, 8))
    assert across > 4 * inside
    whole = sent * 64 / 63  # the input, of which 56 of 64 parts leave the node
    assert across == pytest.approx(whole * 56 / 64 / rates.inter, rel=0.01)


def test_auto_offers_ep_and_its_commands_are_trains():
    """parallel=auto adds each ep the shards and tp carve, dividing the experts; the
    command simulate prints for one passes train's own checks."""
    from conftest import checked

    from parallab.simulate import run, search

    cfg = configured(*MOE, "parallel=auto", "parallel.world_size=8")
    facts = run.Facts.of(cfg)
    grid = search.grid(cfg, facts, 8)
    layouts = [c.layout for c in grid]
    eps = {(x.tp, x.dp_shard, x.ep) for x in layouts if x.pp == 1}
    assert {(1, 8, 8), (2, 4, 8), (1, 4, 4)} <= eps and not any(x.ep == 16 for x in layouts)
    best = next(c for c in grid if (c.layout.ep, c.layout.tp, c.layout.pp) == (8, 2, 1))
    assert "parallel.ep=8" in best.overrides and "E8" in best.label
    _, layout = checked(*[o for o in MOE if not o.startswith(("cluster", "precision"))],
                        "data=tokens", *best.overrides)
    assert (layout.ep, layout.tp, layout.dp_shard) == (8, 2, 4)


def test_a_token_is_priced_once_for_each_rank_holding_its_experts():
    """ep sends a token once to each rank holding any of its top_k: 8 experts, 2 a token,
    over 2 ranks, random picks hit 2 x (1 - C(4,2)/C(8,2)) ranks on average; round_robin's
    neighbours always sit on one; the all-to-all's bytes follow; a routing simulate does
    not price is one line."""
    from parallab.config.errors import ConfigError
    from parallab.simulate import experts, run

    assert experts.ranks_a_token(8, 2, 2, "random") == pytest.approx(2 * (1 - 6 / 28))
    assert experts.ranks_a_token(8, 2, 2, "round_robin") == 1.0
    assert experts.ranks_a_token(256, 8, 64, "round_robin") == 2.0  # DeepSeek-V3 at ep 64
    _, facts = facts_of()
    split = {routing: experts.Split.of(facts.mix, 2, 1, 2, 4, 32, 2, 2, routing)
             for routing in experts.ROUTINGS}
    assert split["random"].routed_bytes == pytest.approx(
        4 * 32 * 2 * (1 - 6 / 28) * 64 * 2)
    assert split["round_robin"].routed_bytes == 4 * 32 * 64 * 2
    with pytest.raises(ConfigError, match="simulate.routing=sorted is not a routing"):
        run.check(configured(*MOE, "simulate.routing=sorted", "parallel.world_size=2"))
    dense = [o for o in MOE if not o.startswith("model.moe")]
    with pytest.raises(ConfigError, match="this model has none: leave it out"):
        run.given(configured(*dense, "simulate.routing=round_robin", "parallel=fsdp",
                             "parallel.world_size=2"))


def test_a_float8_moe_block_prices_only_its_converted_layers_matmuls_in_float8():
    """precision=fp8 converts the Linear layers (a shared expert's too), not the routed
    experts' grouped weights: their matmuls stay bf16 in both phases, though a shared
    expert's Linear is still among the tracked parents as backward runs them."""
    from parallab.simulate import trace

    cfg, facts = facts_of("model.moe.shared=1", "precision=fp8")
    found = trace.trace(cfg, facts.model, facts.block, facts.vocab,
                        trace.Shape(rows=4, seq_len=32, gathered=True, precision="fp8"))
    block = [op for op in found.ops if op.region == "block" and op.kind == "matmul"]
    assert any(op.experts for op in block) and not any(op.fp8 and op.experts for op in block)
    # the attention's two Linear layers and the shared expert's three, each forward once
    # and backward twice (the input's gradient, the weight's)
    assert [sum(op.fp8 for op in block if op.phase == phase)
            for phase in ("forward", "backward")] == [5, 10]
