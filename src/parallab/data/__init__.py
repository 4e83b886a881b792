"""Data sets by name, and the per-rank loaders the trainer iterates."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from parallab.config import DataConfig, Loader
from parallab.data import mnist, synthetic
from parallab.data.loaders import DataLoaderLoader, MemoryLoader, ShardLoader
from parallab.data.split import Split
from parallab.distributed import Dist

# name -> (data config, seed) -> (train split, eval split)
DATASETS: dict[str, Callable[[DataConfig, int], tuple[Split, Split]]] = {
    "mnist": lambda cfg, seed: (mnist.load(cfg.root, "train"), mnist.load(cfg.root, "test")),
    "synthetic": synthetic.make,
}


@dataclass
class Data:
    train: ShardLoader
    eval: ShardLoader


def build_data(cfg: DataConfig, dist: Dist, seed: int, batch_scale: int = 1) -> Data:
    """Train and eval loaders for this rank; a process feeding several devices (dp) takes
    `batch_scale` times data.batch_size per step."""
    train, test = DATASETS[cfg.name](cfg, seed)
    batch, eval_batch = cfg.batch_size * batch_scale, cfg.eval_batch_size * batch_scale
    if cfg.loader is Loader.memory:
        return Data(MemoryLoader(train, dist, batch, True, seed),
                    MemoryLoader(test, dist, eval_batch, False, seed))
    return Data(DataLoaderLoader(train, dist, batch, True, seed, cfg),
                DataLoaderLoader(test, dist, eval_batch, False, seed, cfg))
