"""Batches for one rank: DistributedSampler shards, on the in-memory or the DataLoader path.

A loader reads a source: a Split (tensors in memory, data/split.py) or any map-style torch
Dataset (a user's, data/datasets.py) whose samples the DataLoader collates into batches of
any structure (batch.py): (inputs, targets) pairs, dicts, ...

Both paths shard as torch's DistributedSampler does: a permutation seeded by seed + epoch,
padded with its head to a multiple of the world size, every rank taking every world_size-th
index, so each rank runs the same number of steps. Padding sits at the end of a rank's
shard; `num_valid` says how much of the shard is real, so evaluation counts every sample once.
"""

from __future__ import annotations

import math
import os
import signal
import threading
from typing import Any, Iterator

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, Sampler

from parallab import batch as batches
from parallab.config.schema import DataConfig
from parallab.data.split import Split
from parallab.launching.distributed import Dist


class ShardSampler(Sampler[int]):
    """DistributedSampler's order, computed as one tensor (a Python list of 60k ints per
    epoch costs more than the in-memory path spends on data in a whole epoch)."""

    def __init__(self, size: int, rank: int, world_size: int, shuffle: bool, seed: int):
        self.size, self.rank, self.world_size = size, rank, world_size
        self.shuffle, self.seed, self.epoch = shuffle, seed, 0
        self.per_rank = math.ceil(size / world_size)
        self.offset = 0  # samples of this epoch's shard already consumed (resuming)

    def set_epoch(self, epoch: int, offset: int = 0) -> None:
        self.epoch, self.offset = epoch, offset

    def indices(self) -> torch.Tensor:
        if self.shuffle:
            generator = torch.Generator().manual_seed(self.seed + self.epoch)
            order = torch.randperm(self.size, generator=generator)
        else:
            order = torch.arange(self.size)
        total = self.per_rank * self.world_size
        if total > self.size:  # pad with the head, repeated if the set is tiny
            head = order.repeat(math.ceil(total / self.size))[: total - self.size]
            order = torch.cat([order, head])
        return order[self.rank:total:self.world_size][self.offset:]

    def __iter__(self) -> Iterator[int]:
        return iter(self.indices().tolist())

    def __len__(self) -> int:
        return self.per_rank - self.offset


class ShardLoader:
    drop_last = False  # True: every batch full (a pipeline's stages have fixed shapes)
    all_valid = False  # True: no label is ignored (-100), so counts follow from shapes

    def __init__(self, source: Split | Dataset, dist: Dist, batch_size: int, shuffle: bool,
                 seed: int):
        self.source = source
        self.batch_size = batch_size
        self.dist, self.shuffle, self.seed = dist, shuffle, seed
        self.device = dist.device
        self.sampler = ShardSampler(len(source), dist.rank, dist.world_size, shuffle, seed)
        self.num_valid = len(range(dist.rank, len(source), dist.world_size))

    def set_epoch(self, epoch: int, skip_batches: int = 0) -> None:
        """Shuffle for `epoch`; start after its first `skip_batches` batches (resuming)."""
        self.sampler.set_epoch(epoch, offset=skip_batches * self.batch_size)

    def __len__(self) -> int:
        rounding = math.floor if self.drop_last else math.ceil
        return rounding(self.sampler.per_rank / self.batch_size)

    def batches(self, order: torch.Tensor) -> list[torch.Tensor]:
        """`order` in batches, the last one short or, with drop_last, dropped."""
        chunks = list(order.split(self.batch_size))
        short = self.drop_last and chunks and len(chunks[-1]) < self.batch_size
        return chunks[:-1] if short else chunks

    def resized(self, batch_size: int) -> ShardLoader:
        """The same shard in batches of another size."""
        return type(self)(self.source, self.dist, batch_size, self.shuffle, self.seed)



PREPARED_LIMIT_BYTES = 1 << 30  # a split made model input at once when it takes no more


class MemoryLoader(ShardLoader):
    """The whole split kept as one tensor on the device; a batch is one gather by index.
    A split whose model input (normalised float32 pixels, int64 token ids) fits in
    PREPARED_LIMIT_BYTES is prepared once, as a hand-written loop holds it (preparing each
    batch cost a small model's step 1%); a larger one keeps its stored form (uint8) and
    prepares each batch."""

    def __init__(self, split: Split, dist: Dist, batch_size: int, shuffle: bool, seed: int):
        super().__init__(split, dist, batch_size, shuffle, seed)
        self.inputs = split.inputs.to(self.device)
        self.prepare = split.prepare
        model_input = split.prepare(self.inputs[:1])
        if model_input.element_size() * self.inputs.numel() <= PREPARED_LIMIT_BYTES:
            self.inputs, self.prepare = split.prepare(self.inputs), None
        self.targets = split.targets.to(self.device)
        # looked at once: parallab's own sets ignore no label, and a step need not count them
        self.all_valid = bool(batches.valid(split.targets).all())

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        order = self.sampler.indices().to(self.device)
        for batch in self.batches(order):
            inputs = self.inputs[batch]
            yield (inputs if self.prepare is None else self.prepare(inputs)), self.targets[batch]


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
        if inputs.dtype == torch.uint8 and inputs.dim() == 3:  # (C, H, W) pixels -> PIL -> float
            pixels = inputs.numpy().transpose(1, 2, 0)
            inputs = self.transform(Image.fromarray(np.squeeze(pixels, axis=2)
                                                    if pixels.shape[2] == 1 else pixels))
        return inputs, int(self.split.targets[index])


def _dataset(source: Split | Dataset, train: bool) -> Dataset:
    """The per-sample Dataset of a source: a user's as it is; a split with its own
    (augmentation, image files) gives it, for training or evaluation; else SampleDataset."""
    if not isinstance(source, Split):
        return source
    own = getattr(source, "dataset", None)
    return own(train=train) if own is not None else SampleDataset(source)


class DataLoaderLoader(ShardLoader):
    """torch's DataLoader over a per-sample Dataset, batches moved to the device."""

    def __init__(self, source: Split | Dataset, dist: Dist, batch_size: int, shuffle: bool,
                 seed: int, cfg: DataConfig):
        super().__init__(source, dist, batch_size, shuffle, seed)
        self.cfg = cfg
        # a Split's uint8 pixels or token ids become model input on the device, as in memory
        self.prepare = source.prepare if isinstance(source, Split) else None
        dataset = _dataset(source, train=shuffle)  # the training split is the shuffled one
        # torch seeds each worker's torch, random and numpy from this generator, reseeded per
        # epoch from (seed, rank, epoch): the same config augments the same way every run
        # (without workers, transforms draw from this process's RNG, seeded by the run)
        self.generator = torch.Generator()
        self.set_epoch(0)
        workers = cfg.num_workers > 0
        self.loader = DataLoader(
            dataset, batch_size=batch_size, sampler=self.sampler, generator=self.generator,
            collate_fn=_collate(cfg.collate_fn), worker_init_fn=ignore_stop_signals,
            num_workers=cfg.num_workers, pin_memory=pinned(cfg, self.device),
            persistent_workers=cfg.persistent_workers and workers,
            prefetch_factor=cfg.prefetch_factor if workers else None)

    def set_epoch(self, epoch: int, skip_batches: int = 0) -> None:
        super().set_epoch(epoch, skip_batches)
        self.generator.manual_seed(hash((self.seed, self.dist.rank, epoch)) & (2**63 - 1))

    def resized(self, batch_size: int) -> ShardLoader:
        return DataLoaderLoader(self.source, self.dist, batch_size, self.shuffle, self.seed,
                                self.cfg)

    def __iter__(self) -> Iterator[Any]:
        for batch in self.loader:
            if self.drop_last and batches.rows(batch) < self.batch_size:
                return
            yield prepared(batches.to_device(batch, self.device), self.prepare)


def prepared(batch: Any, prepare) -> Any:
    """A pair's inputs made model input (a Split's uint8 pixels or token ids); any other
    batch as it is."""
    if prepare is None or not batches.is_pair(batch):
        return batch
    return prepare(batch[0]), batch[1]


def pinned(cfg: DataConfig, device: torch.device) -> bool:
    """data.pin_memory: page-locked batches where they go to a GPU (null: there, always)."""
    return device.type == "cuda" and cfg.pin_memory is not False


def ignore_stop_signals(worker_id: int) -> None:
    """A DataLoader worker leaves a stop to the trainer: Ctrl-C signals the whole process
    group and a scheduler's SIGTERM every process of the job, and a worker ended by either
    would break the epoch before the agreed checkpoint (the worker still ends with its
    parent). Its parent's own SIGTERM still ends it (torch ending its workers, or
    multiprocessing's exit handler, which then waits for them: ignored, a run that had
    failed hung there for good)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if not hasattr(signal, "sigwaitinfo"):  # (macOS) no sender to tell: ignored, as before
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        return
    parent = os.getppid()
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})  # taken by the thread alone

    def watch() -> None:
        while signal.sigwaitinfo({signal.SIGTERM}).si_pid != parent:
            pass
        os._exit(128 + signal.SIGTERM)

    threading.Thread(target=watch, name="parent-sigterm", daemon=True).start()


def _collate(spec: Any):
    if spec is None:
        return None
    from parallab.data.datasets import collate

    return collate(spec)


def micro_batches(loader, size: int) -> Iterator[list]:
    """The loader's batches in groups of `size` (the last group may be shorter): the
    micro-batches of one optimizer step (trainer.accumulate_grad_batches)."""
    group: list = []
    for batch in loader:
        group.append(batch)
        if len(group) == size:
            yield group
            group = []
    if group:
        yield group


def to_channels_last(batch: Any) -> Any:
    """trainer.channels_last: a pair's image inputs (N, C, H, W) in NHWC memory format."""
    if batches.is_pair(batch) and isinstance(batch[0], torch.Tensor) and batch[0].dim() == 4:
        return batch[0].contiguous(memory_format=torch.channels_last), batch[1]
    return batch
