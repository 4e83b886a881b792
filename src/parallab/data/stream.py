"""An IterableDataset (a stream) read by the ranks in turn.

Sample i of the stream goes to rank i % world_size, in rounds of world_size samples; a last,
short round is dropped, so every rank takes as many samples and so runs as many steps (a
rank with one step more would wait for its peers forever). Within a rank, DataLoader workers
take every num_workers-th sample of its share. Each epoch reads the stream again from its
start, calling its set_epoch(epoch) first where it has one (to reshuffle); every rank, and
every DataLoader worker, reads the whole stream to take its share of it. Resuming
mid-epoch reads the stream again past the batches already trained: exact for a stream that
gives the same samples for the same epoch. Without __len__, an epoch lasts until the stream
ends and trainer.max_steps bounds the run.
"""

from __future__ import annotations

import itertools
import math
from typing import Any, Iterator

from torch.utils.data import DataLoader, IterableDataset, get_worker_info

from parallab import batch as batches
from parallab.config.errors import ConfigError
from parallab.data.loaders import _collate, ignore_stop_signals, pinned
from parallab.launching.distributed import Dist


class RankShare(IterableDataset):
    """This rank's share of `stream`; in DataLoader worker w of W, the samples of this rank's
    batches w, w + W, ...: whole batches, which the DataLoader takes from its workers in
    turn, so the batches are those of one process reading alone."""

    def __init__(self, stream: IterableDataset, rank: int, world_size: int, batch_size: int):
        self.stream, self.rank, self.world_size = stream, rank, world_size
        self.batch_size = batch_size

    def __iter__(self) -> Iterator[Any]:
        worker = get_worker_info()
        worker_id, workers = (worker.id, worker.num_workers) if worker else (0, 1)
        source = iter(self.stream)
        for j in itertools.count():  # j: the round, and this rank's j-th sample
            round_ = list(itertools.islice(source, self.world_size))
            if len(round_) < self.world_size:
                return
            if (j // self.batch_size) % workers == worker_id:
                yield round_[self.rank]


def length(stream: Any) -> int | None:
    try:
        return len(stream)
    except TypeError:
        return None


class StreamLoader:
    """The trainer's loader interface over a stream (see the module's docstring)."""

    drop_last = False  # True: every batch full (a pipeline's stages have fixed shapes)
    all_valid = False  # labels are not looked at before a step: each step counts them
    num_valid = math.inf  # no sampler padding to leave out of evaluation

    def __init__(self, stream: IterableDataset, dist: Dist, batch_size: int, seed: int, cfg):
        self.source, self.dist, self.batch_size, self.seed, self.cfg = (
            stream, dist, batch_size, seed, cfg)
        self.device = dist.device
        self.epoch = self.skip = 0
        total = length(stream)
        self.per_rank = None if total is None else total // dist.world_size
        workers = cfg.num_workers > 0
        # not persistent: each epoch's workers must see the stream's set_epoch
        self.loader = DataLoader(
            RankShare(stream, dist.rank, dist.world_size, batch_size), batch_size=batch_size,
            collate_fn=_collate(cfg.collate_fn), worker_init_fn=ignore_stop_signals,
            num_workers=cfg.num_workers,
            pin_memory=pinned(cfg, self.device),
            prefetch_factor=cfg.prefetch_factor if workers else None)

    def __len__(self) -> int:
        if self.per_rank is None:
            raise TypeError("a stream without __len__ has no known number of batches")
        rounding = math.floor if self.drop_last else math.ceil
        return rounding(self.per_rank / self.batch_size)

    def set_epoch(self, epoch: int, skip_batches: int = 0) -> None:
        self.epoch, self.skip = epoch, skip_batches

    def __iter__(self) -> Iterator[Any]:
        if callable(getattr(self.source, "set_epoch", None)):
            self.source.set_epoch(self.epoch)
        for index, batch in enumerate(self.loader):
            if self.drop_last and batches.rows(batch) < self.batch_size:
                return
            if index >= self.skip:
                yield batches.to_device(batch, self.device)

    def resized(self, batch_size: int) -> StreamLoader:
        return StreamLoader(self.source, self.dist, batch_size, self.seed, self.cfg)


def refuse_partial_epoch(accumulate: int, batches: int) -> None:
    """A stream of unknown length whose epoch gives each rank fewer batches (`batches`)
    than one step accumulates (a sized one is refused before: run_length): every step would
    be short of the samples asked for."""
    raise ConfigError(too_few(accumulate, batches))


def too_few(accumulate: int, batches: int, batch_said: str = "data.batch_size") -> str:
    """Why an epoch of `batches` batches a rank cannot make a step of `accumulate`
    (`batch_said`: the batch as the user set it, DataConfig.batch_said)."""
    if batches == 0:  # no accumulation can help: each rank's share is under one batch
        return (f"an epoch of the data gives each rank no full batch of {batch_said}: lower "
                f"{batch_said.partition('=')[0]}, or give the data more samples")
    return (f"trainer.accumulate_grad_batches={accumulate} is more than the {batches} batches "
            f"an epoch of the data gives each rank: set it to at most {batches}, or lower "
            f"{batch_said.partition('=')[0]}")


def run_length(cfg, loader, batch_said: str | None = None) -> tuple[int | None, int | None]:
    """Optimizer steps per epoch and in the run (`cfg`: the trainer's keys) over `loader`
    (its batch as the user set it, `batch_said`, for what is said); None per epoch for a
    stream without __len__, which trainer.max_steps bounds."""
    if length(loader) is None:
        return None, cfg.max_steps
    if cfg.accumulate_grad_batches > len(loader):  # else steps of fewer samples than asked
        size = getattr(loader, "batch_size", None)
        raise ConfigError(too_few(cfg.accumulate_grad_batches, len(loader), batch_said or (
            f"data.batch_size={size}" if size else "data.batch_size")))
    per_epoch = math.ceil(len(loader) / cfg.accumulate_grad_batches)
    steps = cfg.epochs * per_epoch
    return per_epoch, min(steps, cfg.max_steps) if cfg.max_steps else steps
