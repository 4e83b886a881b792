"""FSDP2 (fully_shard), used by the mesh layouts (fsdp, hsdp, fsdp_tp) and the pipeline's
parts: every stage with trainable parameters (or a transformers model's blocks), then the
root (which takes what is left, a frozen backbone included), sharded over the ranks.

Parameters, gradients and optimizer state are split across the shard group's ranks (each
holds 1/dp_shard of them); a stage's parameters are all-gathered for its forward and backward and freed after,
unless parallel.reshard_after_forward=false keeps them gathered until backward.
"""

from __future__ import annotations

import logging
import warnings

import torch
from torch import nn

from parallab.parallel import stages as stages_of
from parallab.parallel.base import params_by_mesh

log = logging.getLogger(__name__)


def shard(model: nn.Module, mesh, cfg, policy, is_main: bool,
          reshard_after_forward: bool) -> nn.Module:
    """fully_shard each stage (parallel.stages), then the root, over `mesh` (2-D: replicate
    x shard, HSDP), each computing and reducing as `policy` (mixed_precision's) says."""
    from torch.distributed.fsdp import fully_shard

    # FSDP2 warns at every forward whose output is a view (transformers' logits are a slice
    # of the head's output) that an in-place op on it would skip its hook: parallab reads
    # outputs out of place only
    warnings.filterwarnings("ignore", message="FSDP2-wrapped module .* returned a view tensor")

    stages = stages_of.units(model, cfg.stages)
    if stages is None and is_main:
        log.info("parallel=%s: the model declares no stages, so it is sharded as one unit "
                 "(every parameter gathered at once); set parallel.stages to shard its "
                 "blocks one by one", cfg.name)
    shared = {pid for pid, held in stages_of.holders(stages or []).items() if len(held) > 1}
    for stage in [*(stages or []), model]:
        _units_of_their_own_dtype(stage, mesh, policy, reshard_after_forward)
    for stage in stages or []:
        # a stage sharing a parameter with another (tied embeddings) is left to the root:
        # FSDP2 shards each parameter in one unit only. A frozen stage (the base beside
        # adapters) is a unit too: gathered only while it computes, as the trained ones
        if next(stage.parameters(), None) is not None and not (
                shared & {id(p) for p in stage.parameters()}):
            fully_shard(stage, mesh=mesh, mp_policy=policy,
                        reshard_after_forward=reshard_after_forward)
    # the root: whatever the stages leave; kept gathered, it is used again at once
    fully_shard(model, mesh=mesh, mp_policy=policy, reshard_after_forward=False)
    return model


def _units_of_their_own_dtype(stage: nn.Module, mesh, policy, reshard: bool) -> None:
    """The modules of `stage` whose weights are kept in another dtype than the rest of it
    (a transformers model's float32 router under bfloat16 state), each a unit of its own:
    FSDP2 gathers a unit's weights of one dtype (it had failed on the mixture)."""
    from collections import Counter

    from torch.distributed.fsdp import FSDPModule, fully_shard

    held = Counter(p.dtype for p in stage.parameters())
    if len(held) < 2:
        return
    most = held.most_common(1)[0][0]
    for module in stage.modules():
        own = list(module.parameters(recurse=False))
        if module is not stage and own and not isinstance(module, FSDPModule) and \
                all(p.dtype != most for p in own):
            fully_shard(module, mesh=mesh, mp_policy=policy, reshard_after_forward=reshard)


def mixed_precision(dtype: torch.dtype, reduce_dtype: torch.dtype = torch.float32):
    """FSDP2's policy: compute in the precision group's dtype, reduce gradients in
    precision.reduce_dtype (float32 unless asked). Its sharded gradients are in the weights'
    own dtype either way (precision.state_dtype); a pipeline's parts, reducing once a step,
    accumulate the whole gradients in the reduce dtype meanwhile."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    return MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=reduce_dtype)


def norm_squares(model: nn.Module, device: torch.device, leave: set[int] = frozenset()
                 ) -> torch.Tensor:
    """The squared 2-norm of `model`'s gradients over every shard of them: one reduction
    per mesh the gradients live on (tp-split and replicated parameters of the mesh layouts
    are on different ones); plain tensors count as this rank holds them. `leave`: ids of
    parameters counted elsewhere."""
    from torch.distributed.tensor import DTensor

    squares = torch.zeros((), device=device)
    for params in params_by_mesh(model, leave).values():
        norm = nn.utils.get_total_norm([p.grad for p in params])
        norm = norm.full_tensor() if isinstance(norm, DTensor) else norm
        squares = squares + norm.float() ** 2
    return squares
