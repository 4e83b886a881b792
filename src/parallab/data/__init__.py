"""Data sets by name, and the per-rank loaders the trainer iterates."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from parallab.config import DataConfig, Loader
from parallab.data import bytetext
from parallab.data import images, mnist, synthetic, text
from parallab.data.loaders import DataLoaderLoader, MemoryLoader, ShardLoader
from parallab.data.split import Split
from parallab.distributed import Dist

# name -> (data config, seed) -> (train split, eval split)
DATASETS: dict[str, Callable[[DataConfig, int], tuple[Split, Split]]] = {
    "mnist": lambda cfg, seed: (mnist.load(cfg.root, "train"), mnist.load(cfg.root, "test")),
    "synthetic": synthetic.make,
    "bytes": bytetext.make,
    "text": text.make,
    "cifar10": images.make_cifar10,
    "imagefolder": images.make_imagefolder,
}
MEMORY_LIMIT_BYTES = 1 << 30  # data.loader=auto: a set this size or smaller is held in memory


def resolve_loader(cfg: DataConfig) -> Loader:
    """data.loader=auto: memory when the set's tensors (train and eval, as stored: uint8
    pixels, token ids) fit in MEMORY_LIMIT_BYTES and no per-sample augmentation is asked
    for, else the DataLoader path. Sets without a memory_bytes property are small."""
    if cfg.loader is not Loader.auto:
        return cfg.loader
    fits = getattr(cfg, "memory_bytes", 0) <= MEMORY_LIMIT_BYTES
    return Loader.memory if fits and not getattr(cfg, "augment", False) else Loader.dataloader


@dataclass
class Data:
    train: ShardLoader
    eval: ShardLoader


def build_data(cfg: DataConfig, dist: Dist, seed: int, batch_scale: int = 1) -> Data:
    """Train and eval loaders for this rank; a process feeding several devices (dp) takes
    `batch_scale` times data.batch_size per step."""
    cfg.loader = resolve_loader(cfg)  # validate resolved it already, unless built directly
    train, test = DATASETS[cfg.name](cfg, seed)
    batch, eval_batch = cfg.batch_size * batch_scale, cfg.eval_batch_size * batch_scale
    if cfg.loader is Loader.memory:
        return Data(MemoryLoader(train, dist, batch, True, seed),
                    MemoryLoader(test, dist, eval_batch, False, seed))
    return Data(DataLoaderLoader(train, dist, batch, True, seed, cfg),
                DataLoaderLoader(test, dist, eval_batch, False, seed, cfg))
