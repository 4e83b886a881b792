"""Safetensors weights: one file, a folder of them (export's, or a transformers
save_pretrained folder, one file or an index's shards) and a peft adapter folder. Export
writes the run's config beside them (a file's metadata, a folder's RUN_CONFIG)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from torch import nn

from parallab.config.errors import ConfigError
from parallab.training.formats.base import CheckpointError, FileFormat, Lazy, plain_name

RUN_CONFIG = "parallab.yaml"  # the run's config beside exported weights
BASE = "parallab_base.json"  # beside adapters alone: the weights they were trained on
RECORD = "parallab_record.json"  # the step exported: RUN_CONFIG is a config, of the run's keys
WEIGHTS = "model.safetensors"


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


def _folder_record(reader: FileFormat) -> dict[str, Any]:
    """An exported folder's record: its step, its run's config, the base its adapters were
    trained on; CheckpointError in one line where export's files there are damaged."""
    from omegaconf import OmegaConf

    folder = reader.path
    config, base, record = folder / RUN_CONFIG, folder / BASE, folder / RECORD
    # a folder of an earlier export, or save_pretrained's, records no step
    step = _json_object(record, reader).get("step", 0) if record.exists() else 0
    if not isinstance(step, int) or isinstance(step, bool):
        raise _damaged(record, reader, f"records step {step!r}, not a whole number")
    return {"step": step, "config": OmegaConf.to_container(OmegaConf.load(config))
            if config.exists() else {},
            **({"base": _json_object(base, reader)} if base.exists() else {})}


def _json_object(file: Path, reader: FileFormat) -> dict[str, Any]:
    """A JSON object export wrote beside the weights `reader` reads."""
    try:
        value = json.loads(file.read_text())
    except (OSError, ValueError) as error:
        raise _damaged(file, reader, f"is not JSON ({type(error).__name__})") from None
    if not isinstance(value, dict):
        raise _damaged(file, reader, f"holds a JSON {type(value).__name__}, not an object")
    return value


def _damaged(file: Path, reader: FileFormat, what: str) -> CheckpointError:
    return CheckpointError(f"{reader.key}={reader.path}: its {file.name} {what}: the export "
                           f"is damaged: {reader.instead}")


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
            raise CheckpointError(f"{self.path} holds no {WEIGHTS}: give a folder "
                                  "that parallab export or save_pretrained wrote")
        return [self.path / WEIGHTS]

    def record(self) -> dict[str, Any]:
        self.shapes()  # readable, or one line
        return _folder_record(self)

    @staticmethod
    def write(model: nn.Module, record: dict[str, Any], target: Path) -> str:
        from omegaconf import OmegaConf

        from parallab.models import adapters, hf

        target.mkdir()
        if adapters.is_peft_model(model):
            model.save_pretrained(str(target))
            if record.get("base"):  # where its base is and its fingerprint
                (target / BASE).write_text(json.dumps(record["base"]))
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
        (target / RECORD).write_text(json.dumps({"step": record.get("step", 0)}) + "\n")
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
        return _folder_record(self)

    @staticmethod
    def covers(name: str) -> bool:
        return ".lora_" in name  # the adapters' weights, not the base's


# what an export to a folder may write (WeightsFolder.write: peft's, transformers' or its
# own), by name or pattern
EXPORTED = ("adapter_config.json", "adapter_model.safetensors", "config.json",
            "generation_config.json", WEIGHTS, f"{WEIGHTS}.index.json",
            "model-*-of-*.safetensors", RUN_CONFIG, RECORD)


def earlier_export(folder: Path) -> list[str]:
    """The files an earlier export wrote in `folder`, where one did (it left RUN_CONFIG);
    none in a folder no export wrote, whose files are its user's."""
    if not (folder / RUN_CONFIG).is_file():
        return []
    return sorted({p.name for pattern in EXPORTED for p in folder.glob(pattern) if p.is_file()})

