"""The input pipeline: real MNIST decoding, DistributedSampler sharding, both loader paths;
CIFAR-10 and image folders."""

from __future__ import annotations

import gzip
import pickle
import shutil
from pathlib import Path

import numpy as np

import pytest
import torch
from torch.utils.data import DistributedSampler

from parallab.config.schema import Loader
from parallab.data import build_data, images, mnist, resolve_loader
from parallab.data.images import Cifar10, ImageFolder
from parallab.data.loaders import DataLoaderLoader, MemoryLoader, ShardSampler
from parallab.data.mnist import MNIST
from parallab.data.synthetic import Synthetic
from parallab.data.text import Text
from parallab.launching.distributed import Dist

ROOT = MNIST().folder  # data.root=null: the copy parallab ships


def cpu_rank(rank: int, world_size: int) -> Dist:
    return Dist(rank, rank, world_size, world_size, torch.device("cpu"), None)


CPU = cpu_rank(0, 1)


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


# --- image sets ----------------------------------------------------------------------------
def write_cifar(root: Path, per_batch: int = 8) -> None:
    folder = root / images.CIFAR_DIR
    folder.mkdir(parents=True)
    rng = np.random.default_rng(0)
    for name in [*images.CIFAR_FILES["train"], *images.CIFAR_FILES["test"]]:
        batch = {"data": rng.integers(0, 256, (per_batch, 3072), dtype=np.uint8),
                 "labels": rng.integers(0, 10, per_batch).tolist()}
        (folder / name).write_bytes(pickle.dumps(batch))


def test_cifar10_from_files_with_augmentation_on_the_dataloader_path(tmp_path):
    write_cifar(tmp_path)
    cfg = Cifar10(root=str(tmp_path))
    assert cfg.problem() is None and resolve_loader(cfg) is Loader.dataloader
    train, test = images.make_cifar10(cfg, 0)
    assert train.inputs.shape == (40, 3, 32, 32) and len(test) == 8
    batch = train.prepare(train.inputs[:4])
    mean, std = torch.tensor(images.CIFAR_MEAN), torch.tensor(images.CIFAR_STD)
    torch.testing.assert_close(batch, (train.inputs[:4] / 255 - mean[:, None, None])
                               / std[:, None, None])
    cfg.num_workers = 1

    def first_batch(shuffle: bool) -> torch.Tensor:
        loader = DataLoaderLoader(train if shuffle else test, CPU, 8, shuffle, 0, cfg)
        return next(iter(loader))[0]

    augmented = first_batch(True)
    assert augmented.shape == (8, 3, 32, 32) and augmented.dtype == torch.float32
    torch.testing.assert_close(first_batch(True), augmented)  # workers seeded: reproducible
    order = MemoryLoader(train, CPU, 8, True, 0).sampler.indices()[:8]
    assert not torch.equal(augmented, train.prepare(train.inputs[order]))  # cropped, flipped
    torch.testing.assert_close(first_batch(False), test.prepare(test.inputs[:8]))


def test_cifar10_missing_is_one_line_naming_data_root(tmp_path):
    problem = Cifar10(root=str(tmp_path)).problem()
    assert problem.startswith(f"data.root={tmp_path} has no CIFAR-10 files") and "\n" not in problem
    (tmp_path / images.CIFAR_DIR).mkdir()
    (tmp_path / images.CIFAR_DIR / "data_batch_1").write_bytes(
        b"cos\nsystem\n(S'echo hi'\ntR.")  # a pickle naming code to run
    with pytest.raises(pickle.UnpicklingError, match="refusing os.system"):
        images.read_cifar(tmp_path, "train")


def write_folder(root: Path, classes=("cat", "dog"), per_class: int = 5) -> Path:
    from PIL import Image

    rng = np.random.default_rng(0)
    for name in classes:
        (root / name).mkdir(parents=True)
        for i in range(per_class):
            pixels = rng.integers(0, 256, (20 + i, 30, 3), dtype=np.uint8)
            Image.fromarray(pixels).save(root / name / f"{i}.png")
    return root


@pytest.mark.parametrize("loader", [Loader.memory, Loader.dataloader])
def test_imagefolder_on_both_paths(tmp_path, loader):
    cfg = ImageFolder(path=str(write_folder(tmp_path)), image_size=16,
                      augment=loader is Loader.dataloader, loader=loader, batch_size=4,
                      eval_batch_size=4)
    assert cfg.problem() is None and cfg.num_classes == 2
    data = build_data(cfg, CPU, seed=0)
    assert (len(data.train.source), len(data.eval.source)) == (8, 2)  # 1 of 5 held out per class
    for part in (data.train, data.eval):
        inputs, targets = next(iter(part))
        assert inputs.shape[1:] == (3, 16, 16) and inputs.dtype == torch.float32
        assert set(targets.tolist()) <= {0, 1}
    assert ImageFolder(path=str(tmp_path / "cat" / "0.png")).problem().startswith("data.path=")


@pytest.mark.parametrize("loader", [Loader.memory, Loader.dataloader])
def test_an_unreadable_image_is_skipped_with_a_counted_warning(tmp_path, loader, caplog):
    write_folder(tmp_path / "val")
    root = write_folder(tmp_path / "train")
    (root / "cat" / "9.png").write_bytes(b"not a png")
    (root / "dog" / "0.png").write_bytes((root / "dog" / "0.png").read_bytes()[:60])  # truncated
    cfg = ImageFolder(path=str(tmp_path), image_size=16, augment=False, loader=loader,
                      batch_size=4, eval_batch_size=4)
    data = build_data(cfg, CPU, seed=0)
    with caplog.at_level("WARNING", logger="parallab.data.images"):
        seen = [targets for _ in range(2) for _, targets in data.train]
    if loader is Loader.memory:  # dropped once, when decoded
        assert len(data.train.source) == 9
        assert "skipped 2 unreadable image(s) of 11" in caplog.text
    else:  # a readable neighbour stands in, so every batch keeps its size
        assert [len(t) for t in seen] == [4, 4, 3] * 2  # 11 files, 2 epochs
        assert caplog.text.count("skipped unreadable image") == 2  # once per file, not per epoch
        assert "2 skipped so far by this loader" in caplog.text


def test_loader_auto_picks_memory_when_the_set_fits():
    assert resolve_loader(MNIST()) is Loader.memory
    assert resolve_loader(Text()) is Loader.memory
    assert resolve_loader(Cifar10(augment=False)) is Loader.memory
    assert resolve_loader(Cifar10()) is Loader.dataloader  # augmentation per sample
    assert resolve_loader(Synthetic(train_size=10**6, shape=[3, 64, 64])) is Loader.dataloader
    assert resolve_loader(MNIST(loader=Loader.dataloader)) is Loader.dataloader
