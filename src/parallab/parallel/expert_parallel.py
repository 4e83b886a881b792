"""Expert parallelism (parallel.ep): each MoE layer's experts split over `ep` ranks, each
token sent to the ranks holding its experts and back by an all-to-all (torchtitan's and
Megatron-Core's layout).

The ep ranks are carved out of the data-parallel shard ranks, and out of the tensor-parallel
ones where tp > 1 (ep a multiple of tp), as torchtitan carves them: the mesh's dp_shard is
cut into efsdp x ep_shard, and ep = ep_shard x tp. Each expert's weights are a DTensor
sharded by expert over the ep ranks (so any layout reads a checkpoint another wrote), and
FSDP2 shards each expert further over the efsdp ranks (and replicas) that ep leaves.

Per MoE layer and micro-batch, forward:
    each token once to each rank holding any of its experts (DeepEP's dedup by rank) ->
    counts all-to-all (ep integers) -> tokens all-to-all with their router weights (uneven,
    dropless), and their expert ids -> each rank's pairs grouped by its own experts -> the
    experts' own compute -> weighted and summed per token there -> back by the reverse
    all-to-all -> summed onto their tokens
and the reverse in backward. Where ep takes tp's ranks, each tp rank sends its slice of the
tokens (the tp group holds them all alike) and gathers the others' outputs after.

An expert's gradient sums over every token sent to it, from every ep rank: FSDP2 then
averages it over the efsdp ranks (and replicas) only, so it is scaled by 1 / ep_shard to be
the data-parallel mean the other weights' are. It is never reduced over ranks holding other
experts.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import torch
from torch import nn

from parallab.config.errors import ConfigError
from parallab.models import experts, moe

# --- what the model holds ----------------------------------------------------------------

def problem(model: nn.Module, layout) -> str | None:
    """Why `layout` (its ep > 1) cannot split `model`'s experts, in one line; None if it can."""
    ep, tp = layout.ep, layout.tp
    held = experts.count(model)
    if held is None:
        return (f"parallel.ep={ep}: {type(model).__name__} has no experts to split (gpt: set "
                "model.moe.experts; a transformers MoE model: its config's ep plan): set "
                "parallel.ep=1")
    if held % ep:
        return (f"parallel.ep={ep} does not divide the model's {held} experts: each rank "
                "holds an equal share; pick an ep that divides them")
    if tp > 1 and ep % tp:
        return (f"parallel.ep={ep} with parallel.tp={tp}: ep is carved from the tp ranks "
                "first, then from the data-parallel shards (torchtitan's layout): make ep a "
                f"multiple of {tp}")
    shards = ep // tp if tp > 1 else ep
    if layout.dp_shard % shards:
        return (f"parallel.ep={ep} takes {shards} of the data-parallel shard ranks "
                f"(parallel.dp_shard={layout.dp_shard}), which do not divide by it: pick an "
                f"ep whose share of them divides dp_shard, or set parallel.dp_shard to a "
                f"multiple of {shards}")
    return None


def refuse(cfg, layout) -> None:
    """ConfigError where the layout's ep cannot split the model's experts (checked before
    any worker starts, on the model built on meta)."""
    if layout.ep == 1:
        return
    from parallab.models import build_on_meta

    said = problem(build_on_meta(cfg.model), layout)
    if said:
        raise ConfigError(said)


# --- the ranks -----------------------------------------------------------------------------

@dataclasses.dataclass
class Meshes:
    """A rank's expert-parallel groups, cut from the layout's mesh."""

    ep: Any  # DeviceMesh of the ranks splitting each layer's experts
    fsdp: Any  # DeviceMesh each expert is sharded over by FSDP2 (efsdp; replicas first)
    tp: Any  # the tp group whose ranks each send a slice of the tokens; None: ep has no tp
    shards: int  # ep ranks carved from the data-parallel shards (ep_shard)

    @property
    def size(self) -> int:
        return self.ep.size()


def meshes(mesh, layout) -> Meshes:
    """`mesh` (dp_replicate, dp_shard, [pp,] tp) with dp_shard cut into efsdp x ep_shard."""
    tp = layout.tp if layout.tp > 1 else 1
    shards = layout.ep // tp
    cut = mesh._unflatten("dp_shard", (layout.dp_shard // shards, shards),
                          ("efsdp", "ep_shard"))
    ep = cut["ep_shard", "tp"]._flatten("ep") if tp > 1 else cut["ep_shard"]
    fsdp = cut["dp_replicate", "efsdp"] if layout.dp_replicate > 1 else cut["efsdp"]
    return Meshes(ep, fsdp, mesh["tp"].get_group() if tp > 1 else None, shards)


def data_group(mesh, layout):
    """The data-parallel ranks' group (replicas x shards: those reading different samples),
    where a router's load is counted over the whole batch; None for one data rank."""
    if layout.dp == 1:
        return None
    if mesh is None:  # replicas only (DDP): every rank
        return torch.distributed.group.WORLD
    names = [d for d in ("dp_replicate", "dp_shard") if getattr(layout, d) > 1]
    sub = mesh[tuple(names)]
    return (sub._flatten("dp") if len(names) > 1 else sub).get_group()


# --- laying the model out --------------------------------------------------------------------

def attach(model: nn.Module, mesh, layout) -> Meshes | None:
    """The MoE layers told their data-parallel group; where ep > 1, each experts module's
    weights sharded by expert over the ep ranks and its forward dispatching tokens to them.
    The meshes, for the experts' FSDP2 units (shard())."""
    group = data_group(mesh, layout)
    for layer in moe.layers(model):
        layer.data_group = group
    if layout.ep == 1:
        return None
    from torch.distributed.tensor import Shard, distribute_tensor

    ep = meshes(mesh, layout)
    for _, module in experts.experts_of(model):
        total = int(module.num_experts)
        for name, param in list(module.named_parameters(recurse=False)):
            if param.dim() and param.shape[0] == total:
                sharded = distribute_tensor(param.data, ep.ep, [Shard(0)], src_data_rank=None)
                setattr(module, name, nn.Parameter(sharded, param.requires_grad))
        module.num_experts = total // ep.size  # what its own compute sees: its share
        module.forward = functools.partial(_dispatched, module, total, ep)
        module.grad_scale = 1.0 / ep.shards
    return ep


def shard(modules: list[nn.Module], ep: Meshes, policy, reshard_after_forward: bool) -> None:
    """Each experts module (experts.experts_of's, of the whole model: a pipeline's part has
    no ep plan to find a transformers model's by) an FSDP2 unit of its own over the efsdp
    ranks, before the blocks holding it: FSDP2 shards a parameter in one unit, and theirs
    lives on the ep mesh.
    Experts are cut along dim 0 while there are enough of them on a rank, else along the
    next (torchtitan's choice: padding a dim of 1 to efsdp ranks would waste memory)."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Shard

    ranks = ep.fsdp.size()

    def placement(param: nn.Parameter):
        return Shard(0) if param.to_local().shape[0] >= ranks else Shard(1)

    for module in modules:
        if next(module.parameters(), None) is not None:
            fully_shard(module, mesh=ep.fsdp, mp_policy=policy,
                        reshard_after_forward=reshard_after_forward,
                        shard_placement_fn=placement)


# --- the dispatch ----------------------------------------------------------------------------

class _AllToAll(torch.autograd.Function):
    """all_to_all_single of rows, uneven splits; backward the reverse exchange."""

    @staticmethod
    def forward(ctx, x, out_splits, in_splits, group):
        ctx.splits, ctx.group = (out_splits, in_splits), group
        out = x.new_empty(sum(out_splits), *x.shape[1:])
        torch.distributed.all_to_all_single(out, x.contiguous(), out_splits, in_splits,
                                            group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        out_splits, in_splits = ctx.splits
        return _AllToAll.apply(grad, in_splits, out_splits, ctx.group), None, None, None


def _summed_over(group):
    """The gradient summed over `group` (Megatron's copy to the tensor-parallel region's
    backward): each tp rank used its own slice of the tokens."""
    def summed(grad: torch.Tensor) -> torch.Tensor:
        grad = grad.contiguous()
        torch.distributed.all_reduce(grad, group=group)
        return grad
    return summed


class _GatherOverTp(torch.autograd.Function):
    """Each tp rank's rows gathered (all equal in number); backward its own rows' gradient
    (the ranks hold the same gradient of the whole: the layers after run alike on each)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group, ctx.rows = group, len(x)
        parts = [torch.empty_like(x) for _ in range(torch.distributed.get_world_size(group))]
        torch.distributed.all_gather(parts, x.contiguous(), group=group)
        return torch.cat(parts)

    @staticmethod
    def backward(ctx, grad):
        start = torch.distributed.get_rank(ctx.group) * ctx.rows
        return grad[start:start + ctx.rows], None


def _tp_slice(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, group):
    """This tp rank's slice of the tokens, ids and weights (tokens padded to divide)."""
    n, size = torch.distributed.get_world_size(group), len(x)
    rank, rows = torch.distributed.get_rank(group), -(-size // n)
    pad = rows * n - size
    if pad:  # padding routes nowhere: its ids past every expert (dropped)
        x = torch.cat([x, x.new_zeros(pad, x.shape[-1])])
        ids = torch.cat([ids, ids.new_full((pad, ids.shape[-1]), torch.iinfo(ids.dtype).max)])
        weights = torch.cat([weights, weights.new_zeros(pad, weights.shape[-1])])
    # each rank's slice gives its rows' gradients only: summed, every rank has them all
    x, weights = (experts.on_grad(t, _summed_over(group)) for t in (x, weights))
    cut = slice(rank * rows, (rank + 1) * rows)
    return x[cut], ids[cut], weights[cut]


def _dispatched(module: nn.Module, total: int, ep: Meshes, x: torch.Tensor, ids: torch.Tensor,
                weights: torch.Tensor) -> torch.Tensor:
    """The experts module's forward under expert parallelism: (N, C), (N, k), (N, k) -> (N, C)."""
    size = len(x)
    if ep.tp is not None:
        x, ids, weights = _tp_slice(x, ids, weights, ep.tp)
    ids = ids.clamp(max=total)  # padding's and capacity's dropped pairs: one past the last
    y = _exchange(module, x, ids, weights, total, ep)
    if ep.tp is not None:
        y = _GatherOverTp.apply(y, ep.tp)[:size]
    return y


def _units(ids: torch.Tensor, weights: torch.Tensor, total: int, n: int):
    """Each token once to each rank holding any of its experts (DeepEP's dedup by rank: a
    token whose k experts sit on one rank crosses once, not k times), in rank order: the
    units' tokens, their ids among the rank's own experts (those on other ranks: past the
    last, left out there) and weights (0 there), and each rank's count. On fake tensors
    (uniform routing: nothing to read) every pair is a unit, an even share to each rank."""
    local, k = total // n, ids.shape[-1]
    if experts.uniform():
        tokens = torch.arange(ids.numel(), device=ids.device) // k
        return tokens, ids.new_zeros(ids.numel(), 1), weights.reshape(-1, 1), \
            [ids.numel() // n] * n
    rank_of = ids // local  # a dropped pair's: n
    hit = torch.zeros(len(ids), n + 1, dtype=torch.bool, device=ids.device)
    ranks, tokens = hit.scatter_(1, rank_of, True)[:, :n].T.nonzero(as_tuple=True)
    mine = rank_of[tokens] == ranks[:, None]
    own = torch.where(mine, ids[tokens] - ranks[:, None] * local, local)
    sent = torch.bincount(ranks, minlength=n).tolist()
    return tokens, own, torch.where(mine, weights[tokens], 0), sent


def _exchange(module: nn.Module, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor,
              total: int, ep: Meshes) -> torch.Tensor:
    """Tokens to the ranks holding their experts (once a rank, with their routing there),
    through those experts, weighted and summed there, back and summed onto their tokens."""
    group, n = ep.ep.get_group(), ep.size
    local = total // n
    tokens, own, share, sent = _units(ids, weights, total, n)
    got = sent if experts.uniform() else _counts_from(sent, group, x.device)
    # the router's weights travel beside the rows, in their dtype (combine casts them so)
    rows = _AllToAll.apply(torch.cat([x[tokens], share.to(x.dtype)], 1), got, sent, group)
    own_there = own.new_empty(sum(got), own.shape[1])
    torch.distributed.all_to_all_single(own_there, own.contiguous(), got, sent, group=group)
    rows, share_there = rows[:, :x.shape[1]], rows[:, x.shape[1]:]
    order, counts = experts.sort_by_expert(own_there, local)
    out = _compute(module, rows[order // own_there.shape[1]], counts)
    summed = experts.combine(out, order, share_there, own_there.shape[1], len(rows))
    back = _AllToAll.apply(summed, sent, got, group)
    return back.new_zeros(len(x), back.shape[1]).index_add_(0, tokens, back)


def _counts_from(sent: list[int], group, device: torch.device) -> list[int]:
    """The rows each rank sends this one, told first: the receivers size their buffers
    (on `device`: NCCL exchanges a GPU's tensors only)."""
    got = torch.empty(len(sent), dtype=torch.long, device=device)
    torch.distributed.all_to_all_single(got, torch.tensor(sent, device=device), group=group)
    return got.tolist()


def _compute(module: nn.Module, rows: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """Rows grouped by this rank's experts through them: parallab's experts' grouped compute,
    or a transformers experts module's own forward (its weights as this rank holds them,
    every row weighted 1)."""
    if isinstance(module, experts.Experts):
        return module.compute(rows, counts)
    ids = torch.arange(len(counts), device=rows.device).repeat_interleave(counts)[:, None]
    return _own_forward(module, rows, ids, rows.new_ones(len(rows), 1))


# --- a transformers plan's experts over tp ranks (its moe_tp_experts) ------------------------

# each weight of an experts module by its name: the placement over tp its plan gives it (a
# packed_colwise gate_up_proj holds gate and up halves, each cut by rows; a rowwise
# down_proj is cut along its input)
TP_PLACEMENTS = {"gate_up_proj": ("strided", 1), "down_proj": ("shard", 2)}


def tp_problem(module: nn.Module, tp: int) -> str | None:
    """Why a transformers experts module cannot be split over `tp` ranks as its plan's
    moe_tp_experts splits it, in one line; None if it can."""
    names = {name for name, _ in module.named_parameters(recurse=False)}
    if names != set(TP_PLACEMENTS):
        return (f"parallel.tp={tp}: the plan splits the experts of {type(module).__name__}, "
                f"whose weights ({', '.join(sorted(names))}) parallab does not split by its "
                "packed styles: set parallel.ep to split the experts over ranks instead")
    inner = module.down_proj.shape[2]
    if inner % tp:
        return (f"parallel.tp={tp} does not divide the experts' width {inner}: pick a tp "
                "that divides it, or split the experts with parallel.ep")
    return None


@functools.cache
def tp_style():
    """The ParallelStyle of a transformers plan's moe_tp_experts (torch's imported when
    first asked; one class)."""
    from torch.distributed.tensor.parallel import ParallelStyle

    class ExpertsTensorParallel(ParallelStyle):
        """Each expert cut over the tp ranks as Megatron cuts an MLP: gate and up by rows
        (the packed gate_up_proj's halves each), down by its input; every rank runs all
        its tokens through its slices, the outputs summed over the ranks (and the tokens'
        and routing weights' gradients, each rank's being its slices')."""

        def _apply(self, module: nn.Module, device_mesh) -> nn.Module:
            from torch.distributed.tensor import Shard, distribute_tensor
            from torch.distributed.tensor.placement_types import _StridedShard

            for name, (kind, dim) in TP_PLACEMENTS.items():
                placement = _StridedShard(dim, split_factor=2) if kind == "strided" else \
                    Shard(dim)
                param = getattr(module, name)
                setattr(module, name, nn.Parameter(distribute_tensor(
                    param.data, device_mesh, [placement], src_data_rank=None),
                    param.requires_grad))
            module.forward = functools.partial(_tp_forward, module, device_mesh.get_group())
            return module

    return ExpertsTensorParallel


class _SumOver(torch.autograd.Function):
    """Forward the sum over `group` (each rank's slices' part of the output); backward the
    gradient as it is (every rank runs what follows alike)."""

    @staticmethod
    def forward(ctx, x, group):
        x = x.contiguous()
        torch.distributed.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def _tp_forward(module: nn.Module, group, x: torch.Tensor, ids: torch.Tensor,
                weights: torch.Tensor) -> torch.Tensor:
    x, weights = (experts.on_grad(t, _summed_over(group)) for t in (x, weights))
    return _SumOver.apply(_own_forward(module, x, ids, weights), group)


def _own_forward(module: nn.Module, x: torch.Tensor, ids: torch.Tensor,
                 weights: torch.Tensor) -> torch.Tensor:
    """A transformers experts module's own forward, on the weights as this rank holds them
    (their gradients scaled by its grad_scale: expert parallelism's share)."""
    from torch.nn.utils.stateless import _reparametrize_module

    from parallab.batch import local

    held = {name: experts.scale_grad(local(p), getattr(module, "grad_scale", 1.0))
            for name, p in module.named_parameters(recurse=False)}
    with _reparametrize_module(module, held):
        return type(module).forward(module, x, ids, weights)
