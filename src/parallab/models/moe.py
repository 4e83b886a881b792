"""Mixture of experts for parallab's gpt: a router picks each token's top_k of `experts`
SwiGLU feed-forward networks, whose outputs it sums weighted by their scores (Switch,
Mixtral, DeepSeek-V3, Qwen3-MoE). Shared experts run on every token beside them.

    x (N, C) -> Router: fp32 scores (N, E), top_k ids and weights (N, k)
             -> Experts(x, ids, weights): tokens sorted by expert, each expert's rows
                multiplied by its 3-D weights (experts x out x in) in one grouped matmul
                (a loop over experts where grouped_mm does not apply), weighted, summed
             (+ shared experts) -> (N, C)

Experts (models/experts.py) take transformers' call (hidden_states, top_k_index,
top_k_weights), so expert parallelism (parallel/expert_parallel.py) replaces the same
forward of parallab's experts and a transformers MoE model's alike: the tokens go to the
ranks holding their experts and back around the module's own compute.

The router's load-balancing loss (Switch's, model.moe.aux_loss) does not travel with the
task loss: it is attached to the layer's output (Megatron-Core's way), so that its gradient
flows wherever the backward runs, a pipeline's stage included. Each micro-batch's share of
it is its share of the step's tokens (micro_batch()); the experts' load is counted for the
logged figures and for DeepSeek-V3's bias balancing (model.moe.bias_update).
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import re
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import torch
import torch.nn.functional as F
from torch import nn

from parallab.batch import local
from parallab.config.errors import ConfigError
from parallab.models.hf import EXPERTS_KEYS
from parallab.config.targets import check_types
from parallab.models.experts import (Experts, Load, count_ids, even_counts, experts_of,
                                     in_backward, uniform)

ROUTERS = ("softmax", "sigmoid")


@dataclass
class MoeConfig:
    experts: int | None = None  # routed experts; null: dense blocks
    top_k: int = 2  # experts each token is sent to
    width: int | None = None  # each expert's hidden width; null: the dense MLP's, 4 x width
    shared: int = 0  # shared experts every token runs (one SwiGLU, shared x width wide)
    every: int = 1  # block i is an MoE block where (i + 1) % every == 0; the others dense
    router: str = "softmax"  # softmax | sigmoid (DeepSeek-V3)
    aux_loss: float = 0.0  # Switch's load-balancing loss coefficient (0: none)
    bias_update: float = 0.0  # DeepSeek-V3's balancing bias step per optimizer step (0: none)
    capacity: float | None = None  # null: dropless; else tokens an expert takes, x fair share

    @property
    def on(self) -> bool:
        return self.experts is not None

    def is_moe(self, block: int) -> bool:
        return self.on and (block + 1) % self.every == 0

    def hidden(self, width: int) -> int:
        return self.width or 4 * width


def config_of(given: Any) -> MoeConfig:
    """model.moe as its dataclass (a mapping, None, or one already)."""
    if isinstance(given, MoeConfig):
        return given
    return MoeConfig(**dict(given or {}))


def problem(given: Any, layers: int) -> str | None:
    """One line on what is wrong with model.moe (`layers`: the model's blocks), else None."""
    try:
        cfg = config_of(given)
    except TypeError as error:
        keys = ", ".join(f.name for f in dataclasses.fields(MoeConfig))
        return f"model.moe: {error} (its keys: {keys})"
    try:  # a value of another type fails in the router's first forward, with a traceback
        check_types(MoeConfig, dataclasses.asdict(cfg), "model.moe")
    except ConfigError as error:
        return str(error)
    if not cfg.on:
        changed = [f.name for f in dataclasses.fields(MoeConfig)
                   if getattr(cfg, f.name) != f.default]
        return (f"model.moe.{changed[0]}={getattr(cfg, changed[0])} is set but "
                "model.moe.experts=null (dense blocks): set model.moe.experts, or leave "
                f"model.moe.{changed[0]} out") if changed else None
    for key, low in (("experts", 1), ("top_k", 1), ("width", 1), ("shared", 0), ("every", 1)):
        value = getattr(cfg, key)
        if value is not None and value < low:
            return f"model.moe.{key}={value} is out of range: it must be >= {low}"
    if cfg.top_k > cfg.experts:
        return (f"model.moe.top_k={cfg.top_k} is above model.moe.experts={cfg.experts}: a "
                "token picks at most every expert once; lower top_k")
    if cfg.every > layers:
        return (f"model.moe.every={cfg.every} leaves none of the {layers} blocks an MoE block "
                f"(block i is one where (i + 1) % every == 0): set every <= {layers}")
    if cfg.router not in ROUTERS:
        return f"model.moe.router={cfg.router} is unknown: use softmax or sigmoid (DeepSeek-V3)"
    for key in ("aux_loss", "bias_update"):
        if not 0 <= getattr(cfg, key) < math.inf:
            return f"model.moe.{key}={getattr(cfg, key)} is out of range: it must be >= 0"
    if cfg.capacity is not None and not 0 < cfg.capacity < math.inf:
        return (f"model.moe.capacity={cfg.capacity} is out of range: a capacity factor is > 0 "
                "(1.25: each expert takes 1.25 x its fair share), or null for dropless")
    return None


# --- each micro-batch's share of its step's router loss ---------------------------------

@dataclass
class _Share:
    tokens: float = 1.0  # this micro-batch's share of the step's tokens
    loss_scale: Callable[[], Any] | None = None  # float16's GradScaler scale, read in backward


_SHARE = _Share()


@contextlib.contextmanager
def micro_batch(tokens: float, loss_scale: Callable[[], Any] | None = None) -> Iterator[None]:
    """The forwards inside count as `tokens` of their step (a share in (0, 1]): their router
    loss is weighted so, as the task loss's terms are over the step's count."""
    saved = dataclasses.replace(_SHARE)
    _SHARE.tokens, _SHARE.loss_scale = tokens, loss_scale
    try:
        yield
    finally:
        _SHARE.tokens, _SHARE.loss_scale = saved.tokens, saved.loss_scale


def share() -> float:
    """The current micro-batch's share of its step's tokens."""
    return _SHARE.tokens


def split_share(n: int) -> contextlib.AbstractContextManager[None]:
    """The forwards inside each run one of `n` equal slices of the current micro-batch (a
    pipeline's micro-batches of the trainer's batch)."""
    return micro_batch(_SHARE.tokens / n, _SHARE.loss_scale)


def reset(model: nn.Module) -> None:
    """Forget what the model's MoE layers counted (a pipeline's shape-finding dry run): in
    place, as the run's counter reads the same ones."""
    held = [layer.load for layer in layers(model)] + [
        m.parallab_load for _, m in experts_of(model) if hasattr(m, "parallab_load")]
    for load in held:
        load.take_step()
        load.take_window()


class _AttachAux(torch.autograd.Function):
    """The layer's output as it is; in backward, the router loss's gradient (its weight in
    the objective, times float16's loss scale) beside the output's."""

    @staticmethod
    def forward(ctx, output, aux, weight, loss_scale):
        ctx.weight, ctx.loss_scale = weight, loss_scale
        ctx.save_for_backward(aux)
        return output.view_as(output)

    @staticmethod
    def backward(ctx, grad):
        (aux,) = ctx.saved_tensors
        scale = ctx.loss_scale() if ctx.loss_scale is not None else None
        weight = ctx.weight * (scale if scale is not None else 1.0)
        return grad, torch.ones_like(aux) * weight, None, None


# --- routing ---------------------------------------------------------------------------

class Router(nn.Module):
    """Scores in float32 whatever the run computes in (a bfloat16 softmax over many experts
    ties and flips its top_k); top_k ids by score (plus the balancing bias, which picks but
    does not weigh), their weights normalised to sum to 1 where k > 1."""

    def __init__(self, width: int, experts: int, top_k: int, kind: str = "softmax",
                 bias: bool = False):
        super().__init__()
        self.top_k, self.kind = top_k, kind
        self.gate = nn.Linear(width, experts, bias=False)
        # DeepSeek-V3's balancing bias: moved by the load after each step, never by gradients
        self.register_buffer("bias", torch.zeros(experts) if bias else None)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x (N, C) -> ids (N, k), weights (N, k) float32, scores (N, E) float32."""
        with torch.autocast(x.device.type, enabled=False):
            logits = F.linear(x.float(), local(self.gate.weight).float())
        scores = logits.softmax(-1) if self.kind == "softmax" else logits.sigmoid()
        picked = scores.detach() + self.bias if self.bias is not None else scores
        ids = picked.topk(self.top_k, dim=-1).indices
        weights = scores.gather(-1, ids)
        if self.top_k > 1:
            weights = weights / weights.sum(-1, keepdim=True)
        return ids, weights, scores


class SwiGLU(nn.Module):
    """The shared experts: one SwiGLU feed-forward network every token runs."""

    def __init__(self, width: int, hidden: int):
        super().__init__()
        self.gate = nn.Linear(width, hidden, bias=False)
        self.up = nn.Linear(width, hidden, bias=False)
        self.down = nn.Linear(hidden, width, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.silu(self.gate(x)) * self.up(x))


class MoE(nn.Module):
    """An MoE feed-forward layer: (B, T, C) -> (B, T, C)."""

    def __init__(self, width: int, cfg: MoeConfig, index: int = 0):
        super().__init__()
        self.index = index  # the block it sits in: its figures' name
        self.cfg = cfg
        hidden = cfg.hidden(width)
        self.router = Router(width, cfg.experts, cfg.top_k, cfg.router, cfg.bias_update > 0)
        self.experts = Experts(cfg.experts, width, hidden, cfg.top_k)
        self.shared = SwiGLU(width, cfg.shared * hidden) if cfg.shared else None
        self.load = Load(cfg.experts)
        # the data-parallel ranks' group, where the aux loss's load is counted globally (set
        # by the layout; None: this rank's tokens are the batch's)
        self.data_group = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        ids, weights, scores = self.router(x)
        counts = even_counts(ids.numel(), self.cfg.experts, ids).float() if uniform() else \
            torch.bincount(ids.flatten(), minlength=self.cfg.experts).float()
        kept = self._capacity(ids)
        y = self.experts(x, kept, weights)
        if self.shared is not None:
            y = y + self.shared(x)
        counted = self.training and not in_backward() and not uniform()  # not a trace's
        if counted:
            self.load.add(counts, dropped=(kept >= self.cfg.experts).sum(), routed=ids.numel())
        if self.training and self.cfg.aux_loss and torch.is_grad_enabled():
            aux = self._aux(scores, counts)
            if counted:
                self.load.add_aux(aux.detach() * _SHARE.tokens)
            y = _AttachAux.apply(y, aux, self.cfg.aux_loss * _SHARE.tokens, _SHARE.loss_scale)
        return y.view(shape)

    def _capacity(self, ids: torch.Tensor) -> torch.Tensor:
        """ids with the pairs past each expert's capacity set to `experts` (dropped: the
        token passes on by the residual alone); first come, first kept."""
        capacity = self.cfg.capacity
        if capacity is None:
            return ids
        E = self.cfg.experts
        limit = math.ceil(capacity * ids.numel() / E)
        one_hot = F.one_hot(ids.flatten(), E)
        place = (one_hot.cumsum(0) * one_hot).sum(-1) - 1  # its place in its expert's queue
        return torch.where(place < limit, ids.flatten(), E).view_as(ids)

    def _aux(self, scores: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """Switch's loss E x sum_i f_i P_i: f_i the share of (token, k) pairs expert i got,
        counted over every data-parallel rank's micro-batch (as one device would), P_i its
        mean score over this rank's tokens (scores normalised per token)."""
        if self.data_group is not None:
            counts = counts.clone()
            torch.distributed.all_reduce(counts, group=self.data_group)
        f = counts / counts.sum()
        p = (scores / scores.sum(-1, keepdim=True)).mean(0)
        return self.cfg.experts * (f * p).sum()

    def update_bias(self, counts: torch.Tensor) -> None:
        """DeepSeek-V3's auxiliary-loss-free balancing: each expert's bias stepped up where
        it got fewer tokens than the mean, down where more (`counts`: the step's, every
        data-parallel rank's)."""
        self.router.bias += self.cfg.bias_update * torch.sign(counts.mean() - counts)


def layers(model: nn.Module) -> list[MoE]:
    """The model's MoE layers (a pipeline rank's: those of its parts)."""
    return [m for m in model.modules() if isinstance(m, MoE)]


def shape_of(model: nn.Module) -> tuple[int, int, float] | None:
    """(blocks, experts per MoE layer, router loss coefficient) of a model mixing experts,
    from its config (the whole model's, whatever part of it a rank holds): gpt's, or a
    transformers MoE model's (its coefficient where it outputs its router logits); None
    for a dense one."""
    cfg = getattr(model, "cfg", None)
    if isinstance(getattr(cfg, "moe", None), MoeConfig):
        return (cfg.layers, cfg.moe.experts, cfg.moe.aux_loss) if cfg.moe.on else None
    config = getattr(model, "config", None)
    experts = next((getattr(config, k) for k in EXPERTS_KEYS
                    if isinstance(getattr(config, k, None), int)), None)
    blocks = getattr(config, "num_hidden_layers", None)
    if not experts or not isinstance(blocks, int) or not getattr(model, "ep_plan", None):
        return None
    own_loss = getattr(config, "output_router_logits", False)
    return blocks, experts, float(getattr(config, "router_aux_loss_coef", 0.0) or 0.0) \
        if own_loss else 0.0


def active_shares(model: nn.Module) -> dict[int, float]:
    """The share of each expert weight a token is multiplied by (top_k of the experts), by
    the parameter's id, for a transformers MoE model's experts (gpt counts its own)."""
    shape, top_k = shape_of(model), getattr(getattr(model, "config", None),
                                            "num_experts_per_tok", None)
    if not shape or not isinstance(top_k, int):
        return {}
    return {id(p): top_k / shape[1] for _, module in experts_of(model)
            for p in module.parameters(recurse=False)}


def loads(model: nn.Module, experts: int) -> list[tuple[int, Load]]:
    """Each MoE layer's counter by the block it sits in: parallab's layers' own, and for a
    transformers model's experts modules one made here, counted from the ids their router
    picks (a hook on their call, which expert parallelism keeps)."""
    found = [(layer.index, layer.load) for layer in layers(model)]
    for name, module in experts_of(model):
        if isinstance(module, Experts):
            continue
        if not hasattr(module, "parallab_load"):
            module.parallab_load = Load(experts)
            module.register_forward_pre_hook(count_ids)
        block = re.search(r"(?:^|\.)(\d+)\.", name)
        found.append((int(block.group(1)) if block else 0, module.parallab_load))
    return found


def step_done(layers: list[MoE]) -> None:
    """After an optimizer step: each balanced layer's bias stepped by the step's load,
    counted over every data-parallel rank (one all-reduce for all of them)."""
    counts = [layer.load.take_step() for layer in layers]
    balanced = [(layer, c) for layer, c in zip(layers, counts) if layer.router.bias is not None]
    if not balanced:
        return
    stacked = torch.stack([c.to(layer.router.bias.device) for layer, c in balanced])
    group = balanced[0][0].data_group
    if group is not None:
        torch.distributed.all_reduce(stacked, group=group)
    with torch.no_grad():
        for (layer, _), step in zip(balanced, stacked):
            layer.update_bias(step)


def init_weights(layer: MoE, std: float, out_std: float) -> None:
    """gpt's initialisation: normal(std), the projections back into the residual stream
    (the experts' and shared experts' down) normal(out_std), as GPT-2 scales them."""
    layer.experts.reset_parameters(std, out_std)
    for weight in (layer.router.gate.weight,
                   *([layer.shared.gate.weight, layer.shared.up.weight] if layer.shared else [])):
        nn.init.normal_(weight, std=std)
    if layer.shared:
        nn.init.normal_(layer.shared.down.weight, std=out_std)


def active_weights(cfg: MoeConfig, width: int) -> int:
    """Weights one token is multiplied by in an MoE layer: the router, its top_k experts
    and the shared ones (MFU counts these, not every expert's)."""
    hidden = cfg.hidden(width)
    return width * cfg.experts + 3 * width * hidden * (cfg.top_k + cfg.shared)


def all_weights(cfg: MoeConfig, width: int) -> int:
    hidden = cfg.hidden(width)
    return width * cfg.experts + 3 * width * hidden * (cfg.experts + cfg.shared)
