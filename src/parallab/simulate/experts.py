"""Mixtures of experts in a simulated step: where a model's MoE blocks are, and what expert
parallelism (parallel.ep) changes of a traced MoE block.

The block is traced with every expert on the rank (ep 1) and each expert an even share of
the tokens (models/experts.py's uniform routing, as vendor benchmarks force it). Under ep,
as parallel/expert_parallel.py lays it out:
- each rank holds experts / ep of them, FSDP2-sharded over the efsdp ranks ep leaves
  (dp_shard / ep_shard); the rest of the block over all dp_shard ranks;
- its experts still compute every routed pair of its tokens' worth (uniform routing sends
  it as many as it sends away), but where ep takes tp's ranks each tp rank routes only
  its slice of the tokens, which the traced tp rank ran whole: its experts' ops / tp;
- each MoE block's forward sends each token once to each rank holding any of its experts
  (ranks_a_token: how many, by simulate.routing) and takes the sums back, two all-to-alls,
  and its backward two more (again in a recompute): each priced by cluster.collective_s
  over the ranks the ep group spans, exposed.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from torch import nn

from parallab.simulate.cluster import Group, Rates


@dataclass(frozen=True)
class Mix:
    """A model's mixture of experts, read on meta."""

    experts: int  # routed experts of each MoE layer
    top_k: int  # experts each token is sent to
    width: int  # a token's width as it is sent
    moe_blocks: int  # blocks holding experts, of the model's blocks
    params: float  # elements of every MoE layer's experts


def mix_of(model: nn.Module, blocks: list[nn.Module]) -> Mix | None:
    """The model's mixture (None: dense): gpt's model.moe, or a transformers MoE config."""
    from parallab.models.experts import experts_of

    found = experts_of(model)
    if not found:
        return None
    held = [_holds(block, found) for block in blocks]
    cfg, config = getattr(model, "cfg", None), getattr(model, "config", None)
    top_k = getattr(getattr(cfg, "moe", None), "top_k", None) or getattr(
        config, "num_experts_per_tok", None)
    width = getattr(cfg, "width", None) or getattr(config, "hidden_size", None)
    return Mix(int(found[0][1].num_experts), int(top_k), int(width), sum(held),
               float(sum(p.numel() for _, m in found for p in m.parameters())))


def _holds(block: nn.Module, found: list[tuple[str, nn.Module]]) -> bool:
    inside = {id(m) for m in block.modules()}
    return any(id(m) in inside for _, m in found)


def first_of_each(model: nn.Module, blocks: list[nn.Module]
                  ) -> tuple[nn.Module, nn.Module | None]:
    """The first block holding experts, and the first dense one (None: every block mixes)."""
    from parallab.models.experts import experts_of

    found = experts_of(model)
    moe = [b for b in blocks if _holds(b, found)]
    dense = [b for b in blocks if not _holds(b, found)]
    return moe[0], (dense[0] if dense else None)


@dataclass(frozen=True)
class Split:
    """How a layout's ranks split an MoE block's experts."""

    ep: int = 1  # ranks splitting each layer's experts
    ep_tp: int = 1  # of them, a tp group's (each sending its slice of the tokens)
    efsdp: int = 1  # ranks each expert's weights are sharded over (FSDP2)
    share: float = 0.0  # MoE blocks over all blocks
    routed_bytes: float = 0.0  # a micro-batch's tokens as one MoE block sends them

    @classmethod
    def of(cls, mix: Mix | None, ep: int, tp: int, dp_shard: int, rows: int, seq_len: int,
           blocks: int, compute_bytes: int, routing: str = "random") -> "Split":
        if mix is None:
            return cls()
        ep_tp = tp if ep > 1 and tp > 1 else 1
        shards = ep // ep_tp
        units = rows * seq_len / ep_tp * ranks_a_token(mix.experts, mix.top_k, ep, routing)
        return cls(ep, ep_tp, max(1, dp_shard // shards), mix.moe_blocks / blocks,
                   units * mix.width * compute_bytes)


ROUTINGS = ("random", "round_robin")  # simulate.routing: how ranks_a_token counts


def ranks_a_token(experts: int, top_k: int, ep: int, routing: str) -> float:
    """The ep ranks a token is sent to, on average: one copy to each rank holding any of
    its top_k experts (parallel/expert_parallel.py's dedup), each rank experts / ep of them.
    random: the top_k drawn at random, 1 - C(E - E/ep, k) / C(E, k) the chance a rank is
    hit; round_robin: token t's experts t*k ... t*k + k - 1 (mod E), neighbours, as
    torchtitan's and NeMo's forced balance pick them (a token's k often on one rank)."""
    if ep == 1:
        return 1.0
    held = experts // ep
    if routing == "round_robin":
        return sum(len({(t * top_k + j) % experts // held for j in range(top_k)})
                   for t in range(experts)) / experts
    return ep * (1 - math.comb(experts - held, top_k) / math.comb(experts, top_k))


def units(block: float, experts: float, split: Split, dp_shard: int) -> list[tuple[float, int]]:
    """A block's FSDP2 units as (elements gathered whole, ranks sharding them): the block
    less its experts over dp_shard; its experts' share of a rank (experts / ep) over
    efsdp. One unit where there are no experts or ep is 1."""
    if split.ep == 1 or not experts:
        return [(block, dp_shard)]
    return [(block - experts, dp_shard), (experts / split.ep, split.efsdp)]


def stored(block: float, experts: float, split: Split) -> float:
    """Elements of a block a rank keeps before FSDP2 shards them (x 1/dp_shard): its experts
    at 1 / ep_tp of the traced rank's (which held every expert, whole on each tp rank)."""
    return block - experts + experts / split.ep_tp


def all_to_all_s(split: Split, rates: Rates, tp: int, pp: int, recompute: bool) -> float:
    """An average block's all-to-alls in one micro-batch: two forward (the pairs to their
    experts and back), two backward, two more where the forward is recomputed; over the ep
    ranks, ep_tp of a tp group's and the rest dp_shard ranks tp x pp apart."""
    if split.ep == 1:
        return 0.0
    group = Group(split.ep, Group.of(split.ep // split.ep_tp, tp * pp, rates.gpus_per_node).nodes)
    one = rates.collective_s("all_to_all", split.routed_bytes * (split.ep - 1) / split.ep, group)
    return split.share * (6 if recompute else 4) * one


def costs_under(costs, experts_s: dict[str, float], split: Split):
    """A traced block's costs with its experts' compute / ep_tp (each tp rank its slice)."""
    if split.ep_tp == 1:
        return costs
    cut = 1 - 1 / split.ep_tp
    compute = dict(costs.compute)
    for phase, seconds in experts_s.items():
        compute[(phase, "block")] = compute.get((phase, "block"), 0.0) - cut * seconds
    return dataclasses.replace(costs, compute=compute)
