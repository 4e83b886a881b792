"""The per-rank loaders the trainer iterates, over any data set config (config.DataConfig):
parallab's own (mnist.py, synthetic.py, text.py, bytetext.py, images.py) and a user's
Datasets (datasets.py)."""

from __future__ import annotations

import contextlib
import random
import sys
from dataclasses import dataclass
from typing import Iterator

import torch
from torch.utils.data import IterableDataset

from parallab.config.schema import DataConfig, Loader
from parallab.data.loaders import DataLoaderLoader, MemoryLoader, ShardLoader
from parallab.data.stream import StreamLoader
from parallab.launching.distributed import Dist

MEMORY_LIMIT_BYTES = 1 << 30  # data.loader=auto: a set this size or smaller is held in memory


def resolve_loader(cfg: DataConfig) -> Loader:
    """data.loader=auto: memory when the set is tensors (cfg.tensors) that fit in
    MEMORY_LIMIT_BYTES (train and eval, as stored: uint8 pixels, token ids) and no
    per-sample augmentation is asked for, else the DataLoader path. Sets without a
    memory_bytes property are small."""
    if cfg.loader is not Loader.auto:
        return cfg.loader
    fits = cfg.tensors and getattr(cfg, "memory_bytes", 0) <= MEMORY_LIMIT_BYTES
    return Loader.memory if fits and not getattr(cfg, "augment", False) else Loader.dataloader


def loader_problem(cfg: DataConfig) -> str | None:
    if cfg.loader is Loader.memory and not cfg.tensors:
        return (f"data.loader=memory: data={cfg.name} gives torch Datasets, not tensors held "
                "in memory: use data.loader=dataloader (or auto)")
    for key, low in (("batch_size", 1), ("eval_batch_size", 1), ("num_workers", 0)):
        if getattr(cfg, key) < low:
            return f"data.{key}={getattr(cfg, key)} is out of range: it must be >= {low}"
    if cfg.prefetch_factor is not None and cfg.prefetch_factor < 1:
        return f"data.prefetch_factor={cfg.prefetch_factor} is out of range: it must be >= 1"
    for key in ("prefetch_factor", "persistent_workers"):  # DataLoader workers' settings
        if getattr(cfg, key) not in (None, False) and cfg.num_workers == 0:
            return (f"data.{key}={getattr(cfg, key)} applies to DataLoader workers, and "
                    "data.num_workers=0 starts none: set data.num_workers>0, or drop it")
    return None


@dataclass
class Data:
    train: ShardLoader | StreamLoader
    eval: ShardLoader | StreamLoader


def _loader(source, dist: Dist, batch: int, shuffle: bool, seed: int, cfg: DataConfig):
    if isinstance(source, IterableDataset):
        return StreamLoader(source, dist, batch, seed, cfg)
    return DataLoaderLoader(source, dist, batch, shuffle, seed, cfg)


@contextlib.contextmanager
def drawn_from(seed: int) -> Iterator[None]:
    """torch's, Python's and numpy's global generators seeded with `seed`, and put back
    after. A user's Dataset may draw its samples from them as it is made: made under the
    run's seed, it is the same on every rank (whose torch generator holds a seed of its own
    for dropout) and in evaluate, run after run; the rank's own draws (dropout, a sample's
    augmentation) go on after it as if no dataset had been made."""
    numpy = sys.modules.get("numpy")  # torch imports it where it is installed
    python_state = random.getstate()
    numpy_state = numpy.random.get_state() if numpy is not None else None
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        random.seed(seed)
        if numpy is not None:
            numpy.random.seed(seed % 2**32)
        try:
            yield
        finally:
            random.setstate(python_state)
            if numpy is not None:
                numpy.random.set_state(numpy_state)


def build_data(cfg: DataConfig, dist: Dist, seed: int, batch_scale: int = 1,
               accumulate: int = 1) -> Data:
    """Train and eval loaders for this rank, their datasets made under the run's `seed`
    (drawn_from); a process feeding several devices (dp) takes `batch_scale` times
    data.batch_size per step; a step takes `accumulate` batches (data with loaders of its
    own keeps its epochs to whole steps)."""
    cfg.loader = resolve_loader(cfg)  # validate resolved it already, unless built directly
    batch, eval_batch = cfg.batch_size * batch_scale, cfg.eval_batch_size * batch_scale
    own = getattr(cfg, "loaders", None)  # a data set with loaders of its own (token_files)
    if callable(own):
        return Data(*own(dist, seed, batch, eval_batch, accumulate))
    with drawn_from(seed):
        train, test = cfg.make(seed)
    if isinstance(train, IterableDataset) or isinstance(test, IterableDataset):
        return Data(_loader(train, dist, batch, True, seed, cfg),
                    _loader(test, dist, eval_batch, False, seed, cfg))
    if cfg.loader is Loader.memory:
        return Data(MemoryLoader(train, dist, batch, True, seed),
                    MemoryLoader(test, dist, eval_batch, False, seed))
    return Data(DataLoaderLoader(train, dist, batch, True, seed, cfg),
                DataLoaderLoader(test, dist, eval_batch, False, seed, cfg))


def position(loader) -> dict | None:
    """What a checkpoint keeps of a loader that knows its place in the data (token_files':
    the next global sample, the files' fingerprints); None for the others, whose place the
    trainer's epoch and step give."""
    return loader.state_dict() if callable(getattr(loader, "state_dict", None)) else None


def restore_position(loader, state: dict | None) -> None:
    if state is not None and callable(getattr(loader, "load_state_dict", None)):
        loader.load_state_dict(state)


def source_tokens(loader) -> dict[str, int]:
    """Tokens each named source of a mixture gave the run so far ({} for other data)."""
    counted = getattr(loader, "tokens_by_source", None)
    return counted() if callable(counted) else {}
