"""A regression task the project generates: a smooth function of 8 features plus noise.

A plain map-style torch Dataset of (features, target) pairs; the same seed gives the same
samples, so the train and eval sets differ by seed.
"""

from __future__ import annotations

import torch
from torch.utils.data import Dataset


class Waves(Dataset):
    def __init__(self, size: int, features: int = 8, noise: float = 0.05, seed: int = 0):
        generator = torch.Generator().manual_seed(seed)
        # the function is fixed (seed 1234), the samples drawn from the given seed
        weights = torch.randn(features, 4, generator=torch.Generator().manual_seed(1234))
        self.x = torch.rand(size, features, generator=generator) * 2 - 1
        waves = torch.sin(2 * self.x @ weights / features ** 0.5)  # (size, 4)
        self.y = waves.sum(1, keepdim=True) + noise * torch.randn(size, 1, generator=generator)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.x[index], self.y[index]  # (features,), (1,)
