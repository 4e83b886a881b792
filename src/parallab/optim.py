"""Optimizers by name, built from their config dataclass."""

from __future__ import annotations

import math
import sys

import torch
from torch import nn

IMPLEMENTATIONS = ("auto", "foreach", "fused", "for_loop")
SCHEMA_KEY = {"sgd": "momentum", "adam": "betas", "adamw": "betas"}  # a key of its schema
SCALINGS = {"none": 0.0, "linear": 1.0, "sqrt": 0.5}  # the power of global / base batch


def problem(cfg) -> str | None:
    """None if the optimizer's values make sense, else one line naming the key and the fix."""
    if cfg.name not in SCHEMA_KEY:  # a project's own option of another name
        return (f"optim.name={cfg.name} is not an optimizer parallab builds: use "
                f"{', '.join(SCHEMA_KEY)} (a project's optim option keeps one of their names)")
    if not hasattr(cfg, SCHEMA_KEY[cfg.name]):
        return (f"optim.name={cfg.name} on another optimizer's schema (it has no optim."
                f"{SCHEMA_KEY[cfg.name]}): begin the option with "
                f"`defaults: [/schema/optim/{cfg.name}@_here_, _self_]`")
    if cfg.implementation not in IMPLEMENTATIONS:
        return (f"optim.implementation={cfg.implementation} is unknown: use "
                f"{', '.join(IMPLEMENTATIONS[:-1])} or {IMPLEMENTATIONS[-1]}")
    if cfg.scale_lr not in SCALINGS:
        return f"optim.scale_lr={cfg.scale_lr} is unknown: use none, linear or sqrt"
    if cfg.base_batch_size < 1:
        return f"optim.base_batch_size={cfg.base_batch_size} is out of range: it must be >= 1"
    if not (math.isfinite(cfg.lr) and cfg.lr > 0):
        return f"optim.lr={cfg.lr} is out of range: it must be a finite number > 0"
    if not (math.isfinite(cfg.weight_decay) and cfg.weight_decay >= 0):
        return f"optim.weight_decay={cfg.weight_decay} is out of range: it must be >= 0"
    if hasattr(cfg, "momentum"):
        if not 0 <= cfg.momentum < 1:
            return f"optim.momentum={cfg.momentum} is out of range: it must be in [0, 1)"
        if cfg.nesterov and cfg.momentum == 0:
            return ("optim.nesterov=true needs momentum: set optim.momentum > 0, or "
                    "optim.nesterov=false")
    if hasattr(cfg, "betas"):
        betas = list(cfg.betas)
        if len(betas) != 2 or not all(0 <= b < 1 for b in betas):
            return (f"optim.betas={betas} must be two values in [0, 1), e.g. "
                    "optim.betas=[0.9,0.999]")
        if not (math.isfinite(cfg.eps) and cfg.eps > 0):
            return f"optim.eps={cfg.eps} is out of range: it must be > 0"
    return None


def scaled_lr(cfg, global_batch_size: int) -> float:
    """optim.lr scaled from optim.base_batch_size to the run's global batch (optim.scale_lr)."""
    return cfg.lr * (global_batch_size / cfg.base_batch_size) ** SCALINGS[cfg.scale_lr]


def kernels(implementation: str, params: list[torch.nn.Parameter]) -> dict[str, bool]:
    """torch's foreach/fused arguments for optim.implementation. A multi-tensor kernel
    takes DTensors or plain tensors, not both: parameters that mix them (a pipeline part
    split by tensor parallelism, its norms left whole) step one by one."""
    # no parameter is a DTensor unless its module was loaded (not imported just to ask)
    dtensor = sys.modules.get("torch.distributed.tensor")
    if dtensor and len({isinstance(p, dtensor.DTensor) for p in params}) > 1:
        implementation = "for_loop"
    if implementation == "auto":
        on_cuda = bool(params) and all(p.device.type == "cuda" for p in params)
        implementation = "fused" if on_cuda else "foreach"
    return {"fused": implementation == "fused", "foreach": implementation == "foreach"}


def param_groups(cfg, model: nn.Module, embeddings: set[int] = frozenset()) -> list[dict]:
    """The trainable parameters (a frozen backbone's left out). With optim.decay_all=false,
    weight decay only on weight matrices: none on biases, norm gains and embeddings (as
    nanoGPT and torchtitan's recipes), which decay shrinks toward zero for no gain; nor on
    `embeddings`, ids of parameters held as embeddings elsewhere (a pipeline's tied head)."""
    params = [p for p in model.parameters() if p.requires_grad]
    if cfg.decay_all or cfg.weight_decay == 0:
        return [{"params": params}]
    embeddings = set(embeddings) | {
        id(p) for m in model.modules() if isinstance(m, (nn.Embedding, nn.EmbeddingBag))
        for p in m.parameters()}
    decays = [p.ndim >= 2 and id(p) not in embeddings for p in params]
    groups = [{"params": [p for p, d in zip(params, decays) if d]},
              {"params": [p for p, d in zip(params, decays) if not d], "weight_decay": 0.0}]
    return [group for group in groups if group["params"]]


def build_optimizer(cfg, model: nn.Module, embeddings: set[int] = frozenset()
                    ) -> torch.optim.Optimizer:
    groups = param_groups(cfg, model, embeddings)
    how = kernels(cfg.implementation, [p for group in groups for p in group["params"]])
    if cfg.name == "sgd":
        return torch.optim.SGD(groups, lr=cfg.lr, momentum=cfg.momentum,
                               weight_decay=cfg.weight_decay, nesterov=cfg.nesterov, **how)
    optimizer = {"adam": torch.optim.Adam, "adamw": torch.optim.AdamW}[cfg.name]
    return optimizer(groups, lr=cfg.lr, betas=tuple(cfg.betas), eps=cfg.eps,
                     weight_decay=cfg.weight_decay, **how)
