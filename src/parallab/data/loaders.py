"""Batches for one rank: DistributedSampler shards, on the in-memory or the DataLoader path.

Both paths shard the same way: a permutation seeded by (seed, epoch), padded to a multiple
of the world size, every rank taking every world_size-th index, so each rank runs the same
number of steps. Padding sits at the end of a rank's shard; `num_valid` says how much of the
shard is real, so evaluation can count every sample exactly once.
"""

from __future__ import annotations

import math
from typing import Iterator

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler

from parallab.config import DataConfig
from parallab.data.split import Split
from parallab.distributed import Dist


class ShardLoader:
    def __init__(self, split: Split, dist: Dist, batch_size: int, shuffle: bool, seed: int):
        self.split = split
        self.batch_size = batch_size
        self.device = dist.device
        self.sampler = DistributedSampler(range(len(split)), num_replicas=dist.world_size,
                                          rank=dist.rank, shuffle=shuffle, seed=seed)
        self.num_valid = len(range(dist.rank, len(split), dist.world_size))

    def set_epoch(self, epoch: int) -> None:
        self.sampler.set_epoch(epoch)

    def __len__(self) -> int:
        return math.ceil(len(self.sampler) / self.batch_size)


class MemoryLoader(ShardLoader):
    """The whole split kept as one tensor on the device; a batch is one gather by index."""

    def __init__(self, split: Split, dist: Dist, batch_size: int, shuffle: bool, seed: int):
        super().__init__(split, dist, batch_size, shuffle, seed)
        self.inputs = split.inputs.to(self.device)
        self.targets = split.targets.to(self.device)

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        order = torch.tensor(list(self.sampler), device=self.device)
        for batch in order.split(self.batch_size):
            yield self.split.prepare(self.inputs[batch]), self.targets[batch]


class SampleDataset(Dataset):
    """Per-sample access as torchvision datasets give it: PIL image, ToTensor, Normalize."""

    def __init__(self, split: Split):
        from torchvision import transforms

        self.split = split
        self.transform = transforms.Compose(
            [transforms.ToTensor(), transforms.Normalize((split.mean,), (split.std,))])

    def __len__(self) -> int:
        return len(self.split)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        from PIL import Image

        inputs = self.split.inputs[index]
        if inputs.dtype == torch.uint8:  # (C, H, W) pixels -> PIL -> normalised float
            pixels = inputs.numpy().transpose(1, 2, 0)
            inputs = self.transform(Image.fromarray(np.squeeze(pixels, axis=2)
                                                    if pixels.shape[2] == 1 else pixels))
        return inputs, int(self.split.targets[index])


class DataLoaderLoader(ShardLoader):
    """torch's DataLoader over a per-sample Dataset, batches moved to the device."""

    def __init__(self, split: Split, dist: Dist, batch_size: int, shuffle: bool, seed: int,
                 cfg: DataConfig):
        super().__init__(split, dist, batch_size, shuffle, seed)
        self.loader = DataLoader(
            SampleDataset(split), batch_size=batch_size, sampler=self.sampler,
            num_workers=cfg.num_workers, pin_memory=cfg.pin_memory and self.device.type == "cuda",
            persistent_workers=cfg.persistent_workers and cfg.num_workers > 0)

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        for inputs, targets in self.loader:
            yield (inputs.to(self.device, non_blocking=True),
                   targets.to(self.device, non_blocking=True))
