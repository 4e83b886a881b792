"""MNIST from the IDX files LeCun et al. publish, gzipped or extracted, read into uint8 tensors.

data.root=null reads the copy parallab ships (data/MNIST/raw in the repository, inside the
package once installed), so the default run needs no download.
"""

from __future__ import annotations

import gzip
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar, Optional

import torch

from parallab.config.errors import first_line
from parallab.config.schema import DataConfig
from parallab.data.split import Split

MEAN, STD = 0.1307, 0.3081  # of the training pixels scaled to [0, 1]
FILES = {
    "train": ("train-images-idx3-ubyte", "train-labels-idx1-ubyte"),
    "test": ("t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte"),
}
SHIPPED = Path(__file__).resolve().parent / "files"  # the package's own data/


def raw_dir(root: str | Path) -> Path:
    return Path(root).expanduser() / "MNIST" / "raw"


def _find(root: str | Path, name: str) -> Path | None:
    for candidate in (raw_dir(root) / name, raw_dir(root) / f"{name}.gz"):
        if candidate.is_file():
            return candidate
    return None


def missing_files(root: str | Path) -> list[str]:
    names = [name for pair in FILES.values() for name in pair]
    return [name for name in names if _find(root, name) is None]


def download(root: str | Path) -> None:
    """Fetch the files with torchvision's downloader (it tries each of its mirrors)."""
    from torchvision.datasets import MNIST as TorchvisionMNIST

    for train in (True, False):
        TorchvisionMNIST(str(root), train=train, download=True)


def read_idx(path: Path) -> torch.Tensor:
    """An IDX file as a tensor: magic (0, 0, dtype 0x08 = uint8, ndim), then big-endian dims."""
    with (gzip.open if path.suffix == ".gz" else open)(path, "rb") as f:
        raw = f.read()
    if raw[:3] != b"\x00\x00\x08":
        raise ValueError(f"{path} is not an IDX file of unsigned bytes")
    ndim = raw[3]
    shape = [int.from_bytes(raw[4 + 4 * i: 8 + 4 * i], "big") for i in range(ndim)]
    return torch.frombuffer(bytearray(raw[4 + 4 * ndim:]), dtype=torch.uint8).reshape(shape)


def load(root: str | Path, split: str) -> Split:
    images_name, labels_name = FILES[split]
    images = read_idx(_find(root, images_name)).unsqueeze(1)  # (N, 1, 28, 28) uint8
    labels = read_idx(_find(root, labels_name)).long()
    return Split(images, labels, mean=MEAN, std=STD)


@dataclass
class MNIST(DataConfig):
    _target_: str = "parallab.data.mnist.MNIST"
    root: Optional[str] = None  # holds MNIST/raw/; null = the copy parallab ships
    download: bool = False

    name: ClassVar[str] = "mnist"
    same_data: ClassVar[tuple[str, ...]] = ("download",)  # the files, fetched or there
    input_shape: ClassVar[list[int]] = [1, 28, 28]
    num_classes: ClassVar[int] = 10
    memory_bytes: ClassVar[int] = 70_000 * 28 * 28

    @property
    def folder(self) -> Path:
        return Path(self.root).expanduser() if self.root is not None else SHIPPED

    def problem(self) -> str | None:
        missing = missing_files(self.folder)
        if missing and self.download:
            existed = {d for d in (self.folder, self.folder / "MNIST", raw_dir(self.folder))
                       if d.exists()}
            try:
                download(self.folder)
            except Exception as error:  # offline, mirror down, disk full: one line
                for made in (raw_dir(self.folder), self.folder / "MNIST", self.folder):
                    if made not in existed and made.is_dir() and not any(made.iterdir()):
                        made.rmdir()  # leave no empty MNIST/raw/ behind
                return (f"data.root={self.folder} has no MNIST files {missing} under "
                        f"MNIST/raw/ and data.download=true could not fetch them "
                        f"({first_line(error)}): copy them there by hand")
            missing = missing_files(self.folder)
        if missing:
            return (f"data.root={self.folder} has no MNIST files {missing} under MNIST/raw/ "
                    "(gzipped or not): copy them there, point data.root at them, or set "
                    "data.download=true")
        return None

    def make(self, seed: int) -> tuple[Split, Split]:
        return load(self.folder, "train"), load(self.folder, "test")
