"""Image sets: CIFAR-10 (torchvision's python version under data.root) and any folder of
class subfolders (data.path). Pixels stay uint8 until `prepare` normalises a batch on its
device; training augmentation runs per sample in the DataLoader's workers."""

from __future__ import annotations

import logging
import pickle
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any, Callable, ClassVar, Optional

import numpy as np
import torch
from torch.utils.data import Dataset

from parallab.config.schema import DataConfig, Loader
from parallab.data.split import Split

log = logging.getLogger(__name__)
CIFAR_DIR = "cifar-10-batches-py"
CIFAR_FILES = {"train": [f"data_batch_{i}" for i in range(1, 6)], "test": ["test_batch"]}
CIFAR_MEAN, CIFAR_STD = (0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616)
IMAGENET_MEAN, IMAGENET_STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)
EXTENSIONS = (".jpg", ".jpeg", ".png", ".ppm", ".bmp", ".pgm", ".tif", ".tiff", ".webp")


@dataclass
class ImageSplit(Split):
    """(N, C, H, W) uint8 images in memory, or (files set, inputs None) image files read per
    sample; mean and std per channel. train_ops / eval_ops: torchvision transforms applied to
    each sample's uint8 (C, H, W) tensor on the DataLoader path."""

    mean: tuple[float, ...] = (0.0,)
    std: tuple[float, ...] = (1.0,)
    files: list[str] | None = None
    train_ops: list[Callable] = field(default_factory=list)
    eval_ops: list[Callable] = field(default_factory=list)

    def prepare(self, inputs: torch.Tensor) -> torch.Tensor:
        if inputs.dtype != torch.uint8:
            return inputs
        mean = torch.tensor(self.mean, device=inputs.device).view(-1, 1, 1)
        std = torch.tensor(self.std, device=inputs.device).view(-1, 1, 1) * 255.0
        return (inputs - mean * 255.0) / std

    def dataset(self, train: bool) -> Dataset:
        return ImageDataset(self, self.train_ops if train else self.eval_ops)


class ImageDataset(Dataset):
    def __init__(self, split: ImageSplit, ops: list[Callable]):
        self.split, self.ops = split, ops
        self.unreadable: set[str] = set()  # files this process could not decode

    def __len__(self) -> int:
        return len(self.split)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        split = self.split
        if split.files is None:
            image = split.inputs[index]
        else:
            image, index = self.readable(index)
        for op in self.ops:
            image = op(image)
        return image, int(split.targets[index])

    def readable(self, index: int) -> tuple[torch.Tensor, int]:
        """The image at `index`, or, where that file cannot be decoded, the next readable one
        (a warning per file, counted): one bad file in a large folder should not end a run
        hours in, and a stand-in keeps the batch its size."""
        files = self.split.files
        for i in [(index + k) % len(files) for k in range(min(len(files), MAX_UNREADABLE))]:
            try:
                return read_image(files[i]), i
            except UNREADABLE as error:
                if files[i] not in self.unreadable:
                    self.unreadable.add(files[i])
                    log.warning("skipped unreadable image %s (%s: %s); %d skipped so far by "
                                "this loader", files[i], type(error).__name__, error,
                                len(self.unreadable))
        raise RuntimeError(f"{MAX_UNREADABLE} images in a row cannot be read, from {files[index]} "
                           "on: check the files under data.path")


# what PIL raises for a file that is not an image, is truncated or is malformed
UNREADABLE = (OSError, SyntaxError, ValueError)
MAX_UNREADABLE = 16  # in a row: past this the folder, not a file, is broken


def read_image(path: str) -> torch.Tensor:
    from PIL import Image

    with Image.open(path) as image:
        return torch.from_numpy(np.array(image.convert("RGB"))).permute(2, 0, 1).contiguous()


def read_images(samples: list[tuple[str, int]], fit: Callable
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """Every readable image, decoded and fitted, and its class; unreadable files skipped with
    one warning that counts them."""
    images, targets, bad = [], [], []
    for path, target in samples:
        try:
            images.append(fit(read_image(path)))
            targets.append(target)
        except UNREADABLE as error:
            bad.append(f"{path} ({type(error).__name__}: {error})")
    if bad:
        log.warning("skipped %d unreadable image(s) of %d: %s", len(bad), len(samples),
                    "; ".join(bad[:3]) + (" ..." if len(bad) > 3 else ""))
    if not images:
        raise RuntimeError(f"none of the {len(samples)} images can be read: check data.path")
    return torch.stack(images), torch.tensor(targets)


# --- CIFAR-10 ----------------------------------------------------------------------------
class _ArrayUnpickler(pickle.Unpickler):
    """CIFAR's batches are pickles: allow the numpy arrays they hold and nothing else, so a
    data file can never name code to run."""

    ALLOWED = {("numpy.core.multiarray", "_reconstruct"), ("numpy", "ndarray"),
               ("numpy._core.multiarray", "_reconstruct"), ("numpy", "dtype")}

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) not in self.ALLOWED:
            raise pickle.UnpicklingError(f"refusing {module}.{name} in a CIFAR batch file")
        return super().find_class(module, name)


def cifar_missing(root: str | Path) -> list[str]:
    folder = Path(root).expanduser() / CIFAR_DIR
    return [name for names in CIFAR_FILES.values() for name in names
            if not (folder / name).is_file()]


def read_cifar(root: str | Path, split: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(N, 3, 32, 32) uint8 images and (N,) labels of one split."""
    images, labels = [], []
    for name in CIFAR_FILES[split]:
        with open(Path(root).expanduser() / CIFAR_DIR / name, "rb") as f:
            batch = _ArrayUnpickler(f, encoding="latin1").load()
        images.append(np.asarray(batch["data"], dtype=np.uint8).reshape(-1, 3, 32, 32))
        labels.extend(batch["labels"])
    return torch.from_numpy(np.concatenate(images)), torch.tensor(labels)


def cifar_problem(cfg: Cifar10) -> str | None:
    """None once the files are under data.root (fetched first if data.download), else a line."""
    missing = cifar_missing(cfg.root)
    reason = ""
    if missing and cfg.download:
        from torchvision.datasets import CIFAR10

        try:
            CIFAR10(cfg.root, train=True, download=True)
        except Exception as error:  # offline, mirror down, disk full: say so in one line
            reason = (f" and data.download=true could not fetch them ({type(error).__name__}: "
                      f"{(str(error).splitlines() or [''])[0]})")
        missing = cifar_missing(cfg.root)
    if missing:
        return (f"data.root={cfg.root} has no CIFAR-10 files {missing} under {CIFAR_DIR}/"
                f"{reason}: put the python version (cifar-10-python.tar.gz, extracted) there, "
                "point data.root at it, or set data.download=true")
    return None


def make_cifar10(cfg: Cifar10, seed: int) -> tuple[ImageSplit, ImageSplit]:
    from torchvision import transforms

    augment = [transforms.RandomCrop(32, padding=4), transforms.RandomHorizontalFlip()]
    return tuple(ImageSplit(*read_cifar(cfg.root, split), mean=CIFAR_MEAN, std=CIFAR_STD,
                            train_ops=augment if cfg.augment else [])
                 for split in ("train", "test"))


# --- a folder of class subfolders --------------------------------------------------------
@dataclass(frozen=True)
class FolderLayout:
    classes: list[str]
    train: list[tuple[str, int]]  # (file, class index)
    eval: list[tuple[str, int]]

    @property
    def size(self) -> int:
        return len(self.train) + len(self.eval)


def _images_by_class(root: Path, classes: list[str]) -> list[tuple[str, int]]:
    return [(str(f), i) for i, name in enumerate(classes)
            for f in sorted((root / name).rglob("*")) if f.suffix.lower() in EXTENSIONS]


@lru_cache(maxsize=4)
def _layout(path: str, eval_fraction: float) -> FolderLayout:
    root = Path(path)
    held_out = next((root / name for name in ("val", "test") if (root / name).is_dir()), None)
    if (root / "train").is_dir() and held_out is not None:
        classes = sorted(d.name for d in (root / "train").iterdir() if d.is_dir())
        return FolderLayout(classes, _images_by_class(root / "train", classes),
                            _images_by_class(held_out, classes))
    classes = sorted(d.name for d in root.iterdir() if d.is_dir())
    files = _images_by_class(root, classes)
    # hold out eval_fraction of each class, chosen by a fixed seed (not the run's: the eval
    # set stays the same whatever seed trains)
    order = torch.randperm(len(files), generator=torch.Generator().manual_seed(0)).tolist()
    by_class: list[list[tuple[str, int]]] = [[] for _ in classes]
    for j in order:
        by_class[files[j][1]].append(files[j])
    train, held = [], []
    for of_class in by_class:
        cut = round(len(of_class) * eval_fraction)
        held += of_class[:cut]
        train += of_class[cut:]
    return FolderLayout(classes, sorted(train), sorted(held))


def folder_layout(path: str | None, eval_fraction: float = 0.2) -> FolderLayout:
    """Classes and files of data.path; empty when it is not a folder."""
    root = Path(path or "").expanduser()
    if path is None or not root.is_dir():
        return FolderLayout([], [], [])
    return _layout(str(root.resolve()), eval_fraction)


def folder_problem(cfg: ImageFolder) -> str | None:
    if cfg.image_size < 1:
        return f"data.image_size={cfg.image_size} is out of range: it must be >= 1"
    if not 0 <= cfg.eval_fraction < 1:
        return f"data.eval_fraction={cfg.eval_fraction} is out of range: it must be in [0, 1)"
    layout = folder_layout(cfg.path, cfg.eval_fraction)
    if not layout.classes:
        return (f"data.path={cfg.path or 'null'} is not a folder with one subfolder of "
                "images per class (or train/ and val/ folders of them): point data.path at one")
    if len(layout.classes) < 2:
        return (f"data.path={cfg.path} holds one class folder ({layout.classes[0]}): a "
                "classifier needs at least two, one subfolder of images per class")
    if not layout.train or not layout.eval:
        which = "training" if not layout.train else "held-out"
        return (f"data.path={cfg.path} gives no {which} images (of {', '.join(EXTENSIONS)}): "
                "add images, or change data.eval_fraction")
    return None


def make_imagefolder(cfg: ImageFolder, seed: int) -> tuple[ImageSplit, ImageSplit]:
    from torchvision import transforms

    size = cfg.image_size
    fit = [transforms.Resize(size, antialias=True), transforms.CenterCrop(size)]
    augment = [transforms.RandomResizedCrop(size, antialias=True),
               transforms.RandomHorizontalFlip()] if cfg.augment else fit
    layout = folder_layout(cfg.path, cfg.eval_fraction)

    def split(samples: list[tuple[str, int]]) -> ImageSplit:
        files = [f for f, _ in samples]
        targets = torch.tensor([c for _, c in samples])
        common = dict(mean=IMAGENET_MEAN, std=IMAGENET_STD, train_ops=augment, eval_ops=fit)
        if cfg.loader is Loader.memory:  # decoded once, fitted to size x size
            return ImageSplit(*read_images(samples, transforms.Compose(fit)), **common)
        return ImageSplit(None, targets, files=files, **common)

    return split(layout.train), split(layout.eval)


def augment_problem(cfg: Cifar10 | ImageFolder) -> str | None:
    if cfg.augment and cfg.loader is Loader.memory:
        return ("data.augment=true with data.loader=memory: augmentation runs per sample on "
                "the DataLoader path: use data.loader=dataloader (or auto), or data.augment=false")
    return None


@dataclass
class Cifar10(DataConfig):
    """CIFAR-10, torchvision's python version under data.root/cifar-10-batches-py."""

    _target_: str = "parallab.data.images.Cifar10"
    root: str = "data"  # holds cifar-10-batches-py/
    download: bool = False
    augment: bool = True  # random crop (padding 4) + horizontal flip, per sample (DataLoader path)
    batch_size: int = 128

    name: ClassVar[str] = "cifar10"
    same_data: ClassVar[tuple[str, ...]] = ("download",)  # the files, fetched or there
    input_shape: ClassVar[list[int]] = [3, 32, 32]
    num_classes: ClassVar[int] = 10
    memory_bytes: ClassVar[int] = 60_000 * 3 * 32 * 32

    def problem(self) -> str | None:
        return augment_problem(self) or cifar_problem(self)

    def make(self, seed: int) -> tuple[ImageSplit, ImageSplit]:
        return make_cifar10(self, seed)


@dataclass
class ImageFolder(DataConfig):
    """Any folder of class subfolders (or train/ and val/ folders of them)."""

    _target_: str = "parallab.data.images.ImageFolder"
    path: Optional[str] = None
    image_size: int = 224  # resized (shorter side) and cropped to image_size square
    eval_fraction: float = 0.2  # held out of each class when there is no train/ + val/
    augment: bool = True  # random resized crop + horizontal flip, per sample (DataLoader path)
    batch_size: int = 32
    eval_batch_size: int = 64

    name: ClassVar[str] = "imagefolder"

    @property
    def input_shape(self) -> list[int]:
        return [3, self.image_size, self.image_size]

    @property
    def num_classes(self) -> int:
        return len(folder_layout(self.path, self.eval_fraction).classes)

    @property
    def memory_bytes(self) -> int:
        return folder_layout(self.path, self.eval_fraction).size * 3 * self.image_size ** 2

    def problem(self) -> str | None:
        return augment_problem(self) or folder_problem(self)

    def make(self, seed: int) -> tuple[ImageSplit, ImageSplit]:
        return make_imagefolder(self, seed)
