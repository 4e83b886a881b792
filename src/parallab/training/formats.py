"""The weight formats parallab reads and writes, one class each: a torch file (.pt: a
checkpoint, or export's file), a sharded checkpoint (a .dcp directory), one safetensors
file, a folder of safetensors weights (export's, or a transformers save_pretrained folder)
and a peft adapter folder. `format_of(path)` picks the reader from the path, once;
`writer_for(out)` the format export writes at OUT. A new format is one class here and one
line in FORMATS; the messages that list what is read or written come from FORMATS.

Every reader gives weights by plain name (without the prefixes wrappers add); the lazy one
reads a tensor when asked for, so that a rank keeping its part of each never holds them all.
"""

from __future__ import annotations

import json
import re
from abc import ABC, abstractmethod
from collections.abc import Mapping
from pathlib import Path
from typing import Any, ClassVar

import torch
from torch import nn

from parallab.config.errors import ConfigError, first_line
from parallab.training import checkpoint

RUN_CONFIG = "parallab.yaml"  # the run's config beside exported weights
WEIGHTS = "model.safetensors"
# a wrapper's name where a path's part starts (at the start, or after a dot)
_WRAPPERS = re.compile(r"(?<![^.])(?:module|_orig_mod|_checkpoint_wrapped_module)\.")


def plain_name(key: str) -> str:
    """`key` without the prefixes wrappers add."""
    return _WRAPPERS.sub("", key)


def safetensors_torch():
    try:
        import safetensors.torch
    except ImportError:
        raise ConfigError('safetensors is not installed: pip install "parallab[hf]" (or '
                          'pip install safetensors)') from None
    return safetensors.torch


def _opened(file: Path):
    """safetensors' reader of `file` (one line where safetensors is not installed)."""
    safetensors_torch()
    from safetensors import safe_open

    return safe_open(str(file), "pt")


def _folder_record(folder: Path) -> dict[str, Any]:
    from omegaconf import OmegaConf

    config = folder / RUN_CONFIG
    return {"step": 0, "config": OmegaConf.to_container(OmegaConf.load(config))
            if config.exists() else {}}


class Lazy(Mapping):
    """Weights by plain name, each read when asked for; release(name) lets go of what a
    read kept mapped."""

    def __init__(self, where: dict[str, Any], get, release=None):
        self.where, self._get, self._release = where, get, release

    def __getitem__(self, key: str) -> torch.Tensor:
        return self._get(self.where[key])

    def release(self, key: str) -> None:
        if self._release is not None:
            self._release(self[key])

    def __contains__(self, key: object) -> bool:  # Mapping's would read the tensor
        return key in self.where

    def __iter__(self):
        return iter(self.where)

    def __len__(self) -> int:
        return len(self.where)


class Format(ABC):
    """One weight format at `path`: its shapes (no tensor data read), its weights, what it
    records besides (step, the run's config), and, where export writes it (`suffix` set),
    the writer: a static write(model, record, target) -> what was written, in words."""

    said: ClassVar[str]  # in messages
    suffix: ClassVar[str | None] = None  # what export's OUT ends with to be written so

    def __init__(self, path: str | Path):
        self.path = Path(path)

    @staticmethod
    @abstractmethod
    def holds(path: Path) -> bool:
        """`path` is in this format (the first of FORMATS that holds it reads it)."""

    def shapes(self) -> dict[str, tuple[int, ...]]:
        """Each saved weight's shape, by plain name, reading no tensor data; CheckpointError
        for a file that cannot be read (truncated, not what its name says)."""
        return self._readable(self._shapes)

    def _readable(self, read: Any) -> Any:
        """read(), a reader's own error as one CheckpointError naming the path."""
        try:
            return read()
        except (checkpoint.CheckpointError, ConfigError):
            raise
        except Exception as error:  # noqa: BLE001 - each reader fails its own way
            raise checkpoint.CheckpointError(
                f"{self.path} cannot be read as weights ({first_line(error)}): give a "
                "checkpoint, or what parallab export or save_pretrained wrote") from None

    @abstractmethod
    def _shapes(self) -> dict[str, tuple[int, ...]]:
        """shapes(), any reader's error left to it."""

    @abstractmethod
    def read(self, model: nn.Module) -> dict[str, torch.Tensor]:
        """Whole tensors on the CPU (`model`: the template a sharded checkpoint needs)."""

    def record(self) -> dict[str, Any]:
        return checkpoint.load_meta(self.path)

    @staticmethod
    def covers(name: str) -> bool:
        """Whether weights in this format hold the model's weight `name` (one held by no
        file of it is missing from it)."""
        return True


class FileFormat(Format):
    """Weights in files read a tensor at a time: a rank keeping its part of each reads
    them through lazy() and never holds them all."""

    @abstractmethod
    def lazy(self) -> Lazy:
        """The weights by plain name, each read when asked for."""


class Sharded(Format):
    said = ".dcp (a sharded checkpoint)"

    @staticmethod
    def holds(path: Path) -> bool:
        return checkpoint.is_sharded(path)

    def _shapes(self) -> dict[str, tuple[int, ...]]:
        from torch.distributed.checkpoint import FileSystemReader

        entries = FileSystemReader(str(self.path)).read_metadata().state_dict_metadata
        return {plain_name(k[len("model."):]): tuple(v.size) for k, v in entries.items()
                if k.startswith("model.") and hasattr(v, "size")}

    def read(self, model: nn.Module) -> dict[str, torch.Tensor]:
        saved = self.shapes()
        template = {k: v.detach().clone() for k, v in model.state_dict().items()
                    if plain_name(k) in saved}
        checkpoint.load_sharded(self.path, {"model": template})
        return {plain_name(k): v for k, v in template.items()}


class TorchFile(FileFormat):
    said = ".pt (a torch file)"
    suffix = ".pt"

    @staticmethod
    def holds(path: Path) -> bool:
        return not path.is_dir() and path.suffix != ".safetensors"

    def _weights(self, mmap: bool) -> dict[str, torch.Tensor]:
        state = checkpoint.load(self.path, mmap=mmap)
        weights = state.get("model", state) if isinstance(state, dict) else {}
        return {plain_name(k): v for k, v in weights.items() if isinstance(v, torch.Tensor)}

    def _shapes(self) -> dict[str, tuple[int, ...]]:
        return {k: tuple(v.shape) for k, v in self._weights(mmap=True).items()}

    def read(self, model: nn.Module) -> dict[str, torch.Tensor]:
        return self._weights(mmap=False)

    def lazy(self) -> Lazy:
        mapped = self._weights(mmap=True)
        return Lazy(mapped, lambda tensor: tensor, _let_go)

    @staticmethod
    def write(model: nn.Module, record: dict[str, Any], target: Path) -> str:
        checkpoint.save(target, {"model": model.state_dict(), **record})
        return "the full model state as one torch file"


def _let_go(tensor: torch.Tensor) -> None:
    """A memory-mapped tensor's pages let go once its part is copied: read, they stay in
    the rank's resident set until the whole file is unmapped (the kernel reads them again
    from the file if touched; nothing is written to them)."""
    import ctypes
    import os

    page = os.sysconf("SC_PAGE_SIZE")
    start = tensor.data_ptr() // page * page
    madvise = ctypes.CDLL(None).madvise
    madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    madvise(start, tensor.data_ptr() + tensor.nbytes - start, 4)  # MADV_DONTNEED


class SafetensorsFile(FileFormat):
    said = ".safetensors"
    suffix = ".safetensors"

    @staticmethod
    def holds(path: Path) -> bool:
        return path.suffix == ".safetensors" and not path.is_dir()

    def files(self) -> list[Path]:
        return [self.path]

    @staticmethod
    def name(key: str) -> str:
        """A saved weight's name as a model's state_dict has it."""
        return plain_name(key)

    def _shapes(self) -> dict[str, tuple[int, ...]]:
        found = {}
        for file in self.files():
            with _opened(file) as reader:
                found.update({self.name(k): tuple(reader.get_slice(k).get_shape())
                              for k in reader.keys()})
        return found

    def read(self, model: nn.Module) -> dict[str, torch.Tensor]:
        loaded = {}
        for file in self.files():  # each file read once, whole
            loaded.update(safetensors_torch().load_file(str(file)))
        return {self.name(k): v for k, v in loaded.items()}

    def lazy(self) -> Lazy:
        where = {}
        for file in self.files():
            with _opened(file) as reader:
                where.update({self.name(k): (file, k) for k in reader.keys()})

        def get(at: tuple[Path, str]) -> torch.Tensor:
            with _opened(at[0]) as reader:
                return reader.get_tensor(at[1])

        return Lazy(where, get)

    def record(self) -> dict[str, Any]:
        def metadata() -> dict[str, str]:
            with _opened(self.path) as reader:
                return reader.metadata() or {}

        saved = self._readable(metadata)  # readable, or one line
        return {"step": int(saved.get("step", 0)),
                "config": json.loads(saved.get("parallab_config", "{}"))}

    @staticmethod
    def write(model: nn.Module, record: dict[str, Any], target: Path) -> str:
        safetensors_torch().save_model(model, str(target), metadata={
            "format": "pt", "step": str(record.get("step", 0)),
            "parallab_config": json.dumps(record.get("config", {}))})
        return "the model's weights as one safetensors file (the run's config in its metadata)"


class WeightsFolder(SafetensorsFile):
    said = "a folder"
    suffix = ""  # OUT without a suffix, or an existing folder

    @staticmethod
    def holds(path: Path) -> bool:
        return path.is_dir()

    def files(self) -> list[Path]:
        """A folder's safetensors files (one, or a transformers index's shards)."""
        index = self.path / f"{WEIGHTS}.index.json"
        if index.exists():
            names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
            return [self.path / name for name in names]
        if not (self.path / WEIGHTS).exists():
            raise checkpoint.CheckpointError(f"{self.path} holds no {WEIGHTS}: give a folder "
                                             "that parallab export or save_pretrained wrote")
        return [self.path / WEIGHTS]

    def record(self) -> dict[str, Any]:
        self.shapes()  # readable, or one line
        return _folder_record(self.path)

    @staticmethod
    def write(model: nn.Module, record: dict[str, Any], target: Path) -> str:
        from omegaconf import OmegaConf

        from parallab.models import adapters, hf

        target.mkdir()
        if adapters.is_peft_model(model):
            model.save_pretrained(str(target))
            what = ("a peft adapter folder (adapter_config.json, adapter_model.safetensors) "
                    "PeftModel.from_pretrained and trainer.init_from read")
        elif hf.is_transformers(model):
            model.save_pretrained(str(target))
            what = "a transformers folder (config.json, model.safetensors) from_pretrained reads"
        else:
            safetensors_torch().save_model(model, str(target / WEIGHTS),
                                           metadata={"format": "pt"})
            what = f"a folder ({WEIGHTS}) evaluate.py and trainer.init_from read"
        (target / "README.md").unlink(missing_ok=True)  # peft's model card: a folder's README
        OmegaConf.save(OmegaConf.create(record.get("config", {})), target / RUN_CONFIG)
        return f"{what}, with the run's config in {RUN_CONFIG}"


class AdapterFolder(SafetensorsFile):
    """peft's adapter folder: the adapters' weights under peft's names
    (`base_model.model.<layer>.lora_A.weight`), read under the names a model with its
    adapters on has (`<layer>.lora_A.default.weight`)."""

    said = "a peft adapter folder"
    suffix = None  # export writes one through WeightsFolder, from peft's PeftModel

    @staticmethod
    def holds(path: Path) -> bool:
        from parallab.models import adapters

        return adapters.is_folder(path)

    def files(self) -> list[Path]:
        return [self.path / "adapter_model.safetensors"]

    @staticmethod
    def name(key: str) -> str:
        from parallab.models import adapters

        return adapters.injected_name(key)

    def record(self) -> dict[str, Any]:
        return _folder_record(self.path)

    @staticmethod
    def covers(name: str) -> bool:
        return ".lora_" in name  # the adapters' weights, not the base's


# what an export to a folder may write (WeightsFolder.write: peft's, transformers' or its
# own), by name or pattern
EXPORTED = ("adapter_config.json", "adapter_model.safetensors", "config.json",
            "generation_config.json", WEIGHTS, f"{WEIGHTS}.index.json",
            "model-*-of-*.safetensors", RUN_CONFIG)


def earlier_export(folder: Path) -> list[str]:
    """The files an earlier export wrote in `folder`, where one did (it left RUN_CONFIG);
    none in a folder no export wrote, whose files are its user's."""
    if not (folder / RUN_CONFIG).is_file():
        return []
    return sorted({p.name for pattern in EXPORTED for p in folder.glob(pattern) if p.is_file()})


# the first that holds a path reads it
FORMATS: list[type[Format]] = [Sharded, AdapterFolder, WeightsFolder, SafetensorsFile,
                               TorchFile]


def format_of(path: str | Path) -> Format:
    """The reader of the weights at `path`."""
    path = Path(path)
    return next(kind for kind in FORMATS if kind.holds(path))(path)


def _listed(kinds: list[type[Format]]) -> str:
    return f"{', '.join(kind.said for kind in kinds[:-1])} or {kinds[-1].said}"


def written() -> str:
    """What export writes, in words, from FORMATS (the plainest first)."""
    return _listed([kind for kind in reversed(FORMATS) if kind.suffix is not None])


def read() -> str:
    """What is read, in words, from FORMATS (the plainest first)."""
    return _listed(list(reversed(FORMATS)))


def writer_for(out: Path) -> type[Format] | None:
    """The format export writes at `out`: a folder for an existing folder or a name with no
    suffix, else the format its suffix names; None for a suffix nothing writes."""
    suffix = "" if out.is_dir() else out.suffix
    return next((kind for kind in FORMATS if kind.suffix == suffix), None)
