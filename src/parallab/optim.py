"""Optimizers by name, built from their config dataclass."""

from __future__ import annotations

from typing import Iterable

import torch


def build_optimizer(cfg, params: Iterable[torch.nn.Parameter]) -> torch.optim.Optimizer:
    if cfg.name == "sgd":
        return torch.optim.SGD(params, lr=cfg.lr, momentum=cfg.momentum,
                               weight_decay=cfg.weight_decay, nesterov=cfg.nesterov)
    optimizer = {"adam": torch.optim.Adam, "adamw": torch.optim.AdamW}[cfg.name]
    return optimizer(params, lr=cfg.lr, betas=tuple(cfg.betas), eps=cfg.eps,
                     weight_decay=cfg.weight_decay)
