"""A user's own data: data.train and data.eval, each the `_target_` spec of a torch Dataset.

    # conf/data/waves.yaml in the user's config dir
    train: {_target_: mypkg.data.Waves, size: 4096, seed: 0}
    eval: {_target_: mypkg.data.Waves, size: 1024, seed: 1}
    batch_size: 32

A sample is an (inputs, targets) pair, a dict (transformers' `{"input_ids", "labels"}`:
the batch calls model(**batch)), or any structure torch's collate (or data.collate_fn)
joins. A map-style Dataset goes through the DataLoader path with
everything the built-in sets get: a disjoint shard per rank, a reshuffle per epoch, exact
mid-epoch resume, seeded workers, data.collate_fn. An IterableDataset is read in turn by
the ranks (sample i goes to rank i % world size), each taking the same number of batches.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any, ClassVar, Optional

import torch
from torch.utils.data import Dataset, IterableDataset

from parallab import batch as batches
from parallab.config import targets
from parallab.config.errors import ConfigError, first_line
from parallab.config.schema import DataConfig


@dataclass
class Datasets(DataConfig):
    _target_: str = "parallab.data.datasets.Datasets"
    train: Any = None  # _target_ spec of the training Dataset
    eval: Any = None  # _target_ spec of the evaluation Dataset
    vocab_size: Optional[int] = None  # token ids' vocabulary, where samples hold token ids

    name: ClassVar[str] = "datasets"
    tensors: ClassVar[bool] = False

    def _spec(self, split: str) -> dict[str, Any]:
        spec = getattr(self, split)
        if not isinstance(spec, dict) or targets.TARGET not in spec:
            raise ConfigError(f"data.{split} is {spec!r}: give the _target_ spec of a torch "
                              f"Dataset (data.{split}._target_=mypkg.data.MyDataset and its "
                              "arguments)")
        return spec

    def problem(self) -> str | None:
        """Both specs import, take their arguments, build a Dataset with a first sample;
        data.collate_fn imports."""
        if self.vocab_size is not None and self.vocab_size < 2:
            return f"data.vocab_size={self.vocab_size} is out of range: it must be >= 2"
        try:
            for split in ("train", "eval"):
                spec = self._spec(split)
                cls = targets.locate(spec[targets.TARGET], f"data.{split}._target_")
                if inspect.isclass(cls) and not issubclass(cls, (Dataset, IterableDataset)) \
                        and not hasattr(cls, "__getitem__"):
                    return (f"data.{split}._target_={spec[targets.TARGET]} is not a torch "
                            "Dataset (no __getitem__ and __len__, not an IterableDataset): "
                            "name a Dataset class or a function returning one")
                targets.check_arguments(cls, targets.arguments(spec), f"data.{split}")
                # its values against its annotations, as a model's (a null: its default)
                targets.check_types(cls, targets.arguments(spec), f"data.{split}", nulls=True)
                first_sample(self, split)
            if self.collate_fn is not None:
                collate(self.collate_fn)
        except ConfigError as error:
            return str(error)
        return None

    @property
    def input_shape(self) -> list[int] | None:
        inputs = batches.inputs_of(first_sample(self, "train"))
        return list(inputs.shape) if isinstance(inputs, torch.Tensor) else None

    def sized(self) -> bool:
        return _LENGTHS.get(repr(self._spec("train"))) is not False

    def train_length(self) -> int | None:
        """A map-style training Dataset's length (known from its first sample's reading)."""
        length = _LENGTHS.get(repr(self._spec("train")))
        return length if isinstance(length, int) and not isinstance(length, bool) else None

    def make(self, seed: int) -> tuple[Any, Any]:
        return targets.build(self._spec("train")), targets.build(self._spec("eval"))


_SAMPLES: dict[str, Any] = {}  # spec -> first sample: each Dataset built once
# spec -> a map-style Dataset's length; a stream's: False without one, True with one
_LENGTHS: dict[str, int | bool] = {}


def first_sample(cfg: Datasets, split: str) -> Any:
    """The split's first sample (checked: from a non-empty set)."""
    key = repr(cfg._spec(split))
    if key not in _SAMPLES:
        _SAMPLES[key] = _read_first_sample(cfg._spec(split), split)
    return _SAMPLES[key]


def _read_first_sample(spec: dict[str, Any], split: str) -> Any:
    dataset = targets.build_checked(spec, f"data.{split}")
    streams, sized = isinstance(dataset, IterableDataset), hasattr(dataset, "__len__")
    if not streams and not sized:
        raise ConfigError(f"data.{split}: {type(dataset).__name__} has no __len__: give a "
                          "map-style Dataset a length, or make it an IterableDataset")
    _LENGTHS[repr(spec)] = len(dataset) if sized and not streams else sized
    if not streams and not len(dataset):
        raise ConfigError(f"data.{split} is empty: give it samples")
    try:
        sample = next(iter(dataset)) if isinstance(dataset, IterableDataset) else dataset[0]
    except Exception as error:  # noqa: BLE001 - a user's __getitem__ may raise anything
        raise ConfigError(f"data.{split}: reading its first sample raised {first_line(error)}:"
                          " fix the Dataset") from None
    return sample


def collate(spec: Any) -> Any:
    """data.collate_fn as a callable: a dotted path, or a _target_ spec (built, or with
    _partial_: true bound)."""
    if isinstance(spec, str):
        fn = targets.locate(spec, "data.collate_fn")
    else:
        fn = targets.build_checked(spec, "data.collate_fn")
    if not callable(fn):
        raise ConfigError(f"data.collate_fn={spec} is not callable: name a function that "
                          "takes a list of samples and returns a batch")
    return fn
