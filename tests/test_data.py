"""The input pipeline: real MNIST decoding, DistributedSampler sharding, both loader paths."""

from __future__ import annotations

import gzip
import shutil

import pytest
import torch
from torch.utils.data import DistributedSampler

from parallab.config.schema import Loader
from parallab.data import build_data, mnist
from parallab.data.loaders import DataLoaderLoader, MemoryLoader, ShardSampler
from parallab.data.mnist import MNIST
from parallab.data.synthetic import Synthetic
from parallab.launching.distributed import Dist

ROOT = MNIST().folder  # data.root=null: the copy parallab ships


def cpu_rank(rank: int, world_size: int) -> Dist:
    return Dist(rank, rank, world_size, world_size, torch.device("cpu"), None)


@pytest.fixture(scope="module")
def mnist_train():
    return mnist.load(ROOT, "train")


def test_mnist_is_the_real_data_set(mnist_train):
    test = mnist.load(ROOT, "test")
    assert mnist_train.inputs.shape == (60000, 1, 28, 28) and test.inputs.shape == (10000, 1, 28, 28)
    assert mnist_train.targets[:5].tolist() == [5, 0, 4, 1, 9]
    assert test.targets[:5].tolist() == [7, 2, 1, 0, 4]
    assert torch.bincount(mnist_train.targets).tolist() == [
        5923, 6742, 5958, 6131, 5842, 5421, 5918, 6265, 5851, 5949]
    pixels = mnist_train.inputs.float() / 255
    assert pixels.mean().item() == pytest.approx(0.1307, abs=1e-4)
    assert pixels.std().item() == pytest.approx(0.3081, abs=1e-4)


def test_extracted_idx_files_read_the_same_as_gzipped(tmp_path):
    raw = mnist.raw_dir(tmp_path)
    raw.mkdir(parents=True)
    for name in ("t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte"):
        with gzip.open(mnist.raw_dir(ROOT) / f"{name}.gz") as src, open(raw / name, "wb") as dst:
            shutil.copyfileobj(src, dst)
    assert sorted(mnist.missing_files(tmp_path)) == sorted(mnist.FILES["train"])
    extracted, gzipped = mnist.load(tmp_path, "test"), mnist.load(ROOT, "test")
    assert torch.equal(extracted.inputs, gzipped.inputs)
    assert torch.equal(extracted.targets, gzipped.targets)


def test_batches_are_normalised_like_totensor_then_normalize(mnist_train):
    batch = mnist_train.prepare(mnist_train.inputs[:256])
    expected = (mnist_train.inputs[:256].float() / 255 - mnist.MEAN) / mnist.STD
    assert batch.dtype == torch.float32
    torch.testing.assert_close(batch, expected)


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_shards_are_disjoint_cover_the_set_and_have_equal_steps(world_size):
    split = Synthetic(train_size=1001, eval_size=10).make(seed=0)[0]
    loaders = [MemoryLoader(split, cpu_rank(r, world_size), 64, shuffle=True, seed=3)
               for r in range(world_size)]
    for epoch in (0, 1):
        shards = []
        for loader in loaders:
            loader.set_epoch(epoch)
            shards.append(list(loader.sampler)[: loader.num_valid])
        seen = [i for shard in shards for i in shard]
        assert sorted(seen) == list(range(1001))  # every sample once, padding excluded
        assert len({len(list(loader)) for loader in loaders}) == 1  # same step count everywhere
    first, second = [], []
    for epoch, out in ((0, first), (1, second)):
        loaders[0].set_epoch(epoch)
        out.extend(loaders[0].sampler)
    assert first != second  # reshuffled each epoch


@pytest.mark.parametrize("size,world_size", [(1001, 4), (10, 3), (2, 4), (64, 1)])
@pytest.mark.parametrize("shuffle", [True, False])
def test_shard_order_is_distributed_samplers(size, world_size, shuffle):
    for rank in range(world_size):
        ours = ShardSampler(size, rank, world_size, shuffle, seed=5)
        torchs = DistributedSampler(range(size), world_size, rank, shuffle=shuffle, seed=5)
        for epoch in (0, 3):
            ours.set_epoch(epoch)
            torchs.set_epoch(epoch)
            assert list(ours) == list(torchs) and len(ours) == len(torchs)


def test_memory_and_dataloader_paths_yield_the_same_batches(mnist_train):
    cfg = MNIST(num_workers=0)
    small = mnist.Split(mnist_train.inputs[:300], mnist_train.targets[:300], mnist.MEAN, mnist.STD)
    memory = MemoryLoader(small, cpu_rank(1, 2), 32, shuffle=True, seed=7)
    loader = DataLoaderLoader(small, cpu_rank(1, 2), 32, shuffle=True, seed=7, cfg=cfg)
    for epoch in (0, 1):
        memory.set_epoch(epoch)
        loader.set_epoch(epoch)
        pairs = list(zip(memory, loader, strict=True))
        assert len(pairs) == len(memory) == len(loader) == 5
        for (x1, y1), (x2, y2) in pairs:
            assert torch.equal(y1, y2)
            torch.testing.assert_close(x1, x2)


def test_synthetic_data_is_seeded_and_learnable():
    cfg = Synthetic(train_size=512, eval_size=256, shape=[1, 8, 8], num_classes=4)
    a, b = cfg.make(seed=1)[0], cfg.make(seed=1)[0]
    assert torch.equal(a.inputs, b.inputs) and a.inputs.shape == (512, 1, 8, 8)
    train, test = cfg.make(seed=1)
    # nearest class mean, estimated on train, classifies the held-out split well
    means = torch.stack([train.inputs[train.targets == c].mean(0) for c in range(4)])
    distances = ((test.inputs[:, None] - means[None]) ** 2).flatten(2).sum(-1)
    assert (distances.argmin(1) == test.targets).float().mean() > 0.9


def test_build_data_uses_the_configured_path():
    cfg = Synthetic(train_size=100, eval_size=50, loader=Loader.dataloader, batch_size=10)
    data = build_data(cfg, cpu_rank(0, 1), seed=0)
    assert isinstance(data.train, DataLoaderLoader) and len(data.train) == 10
    inputs, targets = next(iter(data.train))
    assert inputs.shape == (10, 1, 28, 28) and targets.dtype == torch.int64


def test_datasets_are_made_under_the_seed_and_leave_each_generators_stream_as_it_was():
    """A Dataset drawing from the global generators as it is made gets the same samples
    whatever the rank's own seed; after it, the rank's dropout and augmentation draws go on
    as if no dataset had been made (a rank's torch seed is its own; random's and numpy's
    stay unseeded, as before)."""
    import random

    import numpy

    from parallab.data import drawn_from

    def draws() -> tuple[float, float, float]:
        return torch.rand(1).item(), random.random(), float(numpy.random.rand())

    def seed_all(seed: int) -> None:
        torch.manual_seed(seed), random.seed(seed), numpy.random.seed(seed)

    made = []
    for rank_seed in (3, 4):
        seed_all(rank_seed)
        expected = draws()
        seed_all(rank_seed)
        with drawn_from(42):
            made.append(draws())
        assert draws() == expected
    assert made[0] == made[1]
