"""A residual MLP: an input projection, a stack of pre-norm residual blocks, an output head.

A plain nn.Module with no parallab base class. Its forward is the chain inp -> blocks -> out,
so parallab can cut it into stages once they are named in the config:
parallel.stages=[inp, "blocks.*", out].
"""

from __future__ import annotations

import torch
from torch import nn


class Block(nn.Module):
    def __init__(self, width: int, expansion: int):
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.mlp = nn.Sequential(nn.Linear(width, expansion * width), nn.GELU(),
                                 nn.Linear(expansion * width, width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, width) -> (B, width)
        return x + self.mlp(self.norm(x))


class ResMLP(nn.Module):
    def __init__(self, in_features: int, out_features: int, width: int = 64, depth: int = 4,
                 expansion: int = 2):
        super().__init__()
        self.inp = nn.Linear(in_features, width)
        self.blocks = nn.ModuleList(Block(width, expansion) for _ in range(depth))
        self.out = nn.Sequential(nn.LayerNorm(width), nn.Linear(width, out_features))

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, in) -> (B, out)
        x = self.inp(x)
        for block in self.blocks:
            x = block(x)
        return self.out(x)
