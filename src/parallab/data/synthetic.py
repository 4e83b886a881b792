"""A generated classification set that a model can learn: noisy copies of class prototypes."""

from __future__ import annotations

import torch

from parallab.config import SyntheticDataConfig
from parallab.data.split import Split


def make(cfg: SyntheticDataConfig, seed: int) -> tuple[Split, Split]:
    generator = torch.Generator().manual_seed(seed)
    prototypes = torch.randn(cfg.num_classes, *cfg.shape, generator=generator)

    def sample(size: int) -> Split:
        targets = torch.randint(cfg.num_classes, (size,), generator=generator)
        noise = torch.randn(size, *cfg.shape, generator=generator)
        return Split(prototypes[targets] + cfg.noise * noise, targets)

    return sample(cfg.train_size), sample(cfg.eval_size)
