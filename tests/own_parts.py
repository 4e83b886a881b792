"""Small user parts the tests name by _target_ (this directory is on the tests' path)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class SelfScoring(nn.Module):
    """A regressor whose forward(inputs, targets) returns its own loss (loss=model)."""

    def __init__(self, in_features: int = 8):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(in_features, 32), nn.ReLU(), nn.Linear(32, 1))

    def forward(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return F.mse_loss(self.net(inputs), targets)


def sequential(in_features: int = 8, width: int = 32) -> nn.Sequential:
    """A factory returning an nn.Sequential: its children are its stages."""
    return nn.Sequential(nn.Linear(in_features, width), nn.ReLU(), nn.Linear(width, width),
                         nn.ReLU(), nn.Linear(width, 1))


def half_mse(output: torch.Tensor, targets: torch.Tensor, scale: float = 0.5) -> torch.Tensor:
    """A loss function with an argument bound from the YAML."""
    return scale * F.mse_loss(output, targets)
