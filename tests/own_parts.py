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


class WaveStream(torch.utils.data.IterableDataset):
    """The example's regression samples as a stream; reshuffled by set_epoch; `sized`: with
    a __len__ (then an epoch's steps are known)."""

    def __init__(self, size: int = 512, seed: int = 0, sized: bool = True):
        from own_model.data import Waves

        self.samples, self.seed, self.epoch = Waves(size, seed=seed), seed, 0
        if sized:
            self.__class__ = SizedWaveStream

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __iter__(self):
        order = torch.randperm(len(self.samples),
                               generator=torch.Generator().manual_seed(self.seed + self.epoch))
        return (self.samples[i] for i in order.tolist())


class SizedWaveStream(WaveStream):
    def __len__(self) -> int:
        return len(self.samples)
