"""Weights in and out: a checkpoint's model exported as a torch file, one safetensors file or
a folder (a transformers model's save_pretrained folder; for any other model,
model.safetensors), each with the run's config beside it; and weights read back from any of
these and from parallab's checkpoints (.pt, sharded .dcp), for evaluate.py, `parallab export`
and trainer.init_from.

Keys are the model's parameter names: the prefixes wrappers add (DDP's `module.`, compile's
`_orig_mod.`, activation checkpointing's `_checkpoint_wrapped_module.`) never matter. Tied
weights are written once, as safetensors requires, and restored from the tensor they share.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import shutil
import tempfile
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

from parallab.config.errors import ConfigError, first_line
from parallab.training import checkpoint

log = logging.getLogger("parallab")
RUN_CONFIG = "parallab.yaml"  # the run's config beside exported weights
WEIGHTS = "model.safetensors"
# a wrapper's name where a path's part starts (at the start, or after a dot)
_WRAPPERS = re.compile(r"(?<![^.])(?:module|_orig_mod|_checkpoint_wrapped_module)\.")
FORMATS = ".pt (a torch file), .safetensors, or a folder"


def _safetensors():
    try:
        import safetensors.torch
    except ImportError:
        raise ConfigError('safetensors is not installed: pip install "parallab[hf]" (or '
                          'pip install safetensors)') from None
    return safetensors.torch


def plain_name(key: str) -> str:
    """`key` without the prefixes wrappers add."""
    return _WRAPPERS.sub("", key)


def is_weights(path: str | Path) -> bool:
    """An exported file or folder, not one of parallab's checkpoints."""
    path = Path(path)
    return path.suffix == ".safetensors" or path.is_dir() and not checkpoint.is_sharded(path)


def holds_adapters(path: str | Path) -> bool:
    """A peft adapter folder, or weights of a model with LoRA adapters (a checkpoint of an
    adapter=lora run): loaded into a model once its adapters are on."""
    from parallab.models import adapters

    return adapters.is_folder(path) or any(".lora_" in key for key in shapes(path))


def _files(path: Path) -> list[Path]:
    """A folder's safetensors files (one, or a transformers index's shards)."""
    if path.suffix == ".safetensors":
        return [path]
    index = path / f"{WEIGHTS}.index.json"
    if index.exists():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [path / name for name in names]
    if not (path / WEIGHTS).exists():
        raise checkpoint.CheckpointError(f"{path} holds no {WEIGHTS}: give a folder that "
                                         "parallab export or save_pretrained wrote")
    return [path / WEIGHTS]


def record(path: str | Path) -> dict[str, Any]:
    """What a checkpoint or an export records besides weights: {"step", "config", ...}
    (an export's config: the run's, where parallab wrote it)."""
    path = Path(path)
    if not is_weights(path):
        return checkpoint.load_meta(path)
    shapes(path)  # readable, or one line
    if path.suffix == ".safetensors":
        from safetensors import safe_open

        with safe_open(str(path), "pt") as reader:
            record = reader.metadata() or {}
        return {"step": int(record.get("step", 0)),
                "config": json.loads(record.get("parallab_config", "{}"))}
    from omegaconf import OmegaConf

    config = path / RUN_CONFIG
    return {"step": 0, "config": OmegaConf.to_container(OmegaConf.load(config))
            if config.exists() else {}}


def shapes(path: str | Path) -> dict[str, tuple[int, ...]]:
    """Each saved weight's shape, by plain name, reading no tensor data; CheckpointError
    for a file that cannot be read (truncated, not what its name says)."""
    try:
        return _shapes(Path(path))
    except (checkpoint.CheckpointError, ConfigError):
        raise
    except Exception as error:  # noqa: BLE001 - each reader fails its own way
        raise checkpoint.CheckpointError(f"{path} cannot be read as weights "
                                         f"({first_line(error)}): give a checkpoint, or what "
                                         "parallab export or save_pretrained wrote") from None


def _shapes(path: Path) -> dict[str, tuple[int, ...]]:
    if checkpoint.is_sharded(path):
        from torch.distributed.checkpoint import FileSystemReader

        entries = FileSystemReader(str(path)).read_metadata().state_dict_metadata
        return {plain_name(k[len("model."):]): tuple(v.size) for k, v in entries.items()
                if k.startswith("model.") and hasattr(v, "size")}
    if is_weights(path):
        from safetensors import safe_open

        found = {}
        for file in _files(path):
            with safe_open(str(file), "pt") as reader:
                found.update({plain_name(k): tuple(reader.get_slice(k).get_shape())
                              for k in reader.keys()})
        return found
    state = checkpoint.load(path, mmap=True)
    weights = state.get("model", state) if isinstance(state, dict) else {}
    return {plain_name(k): tuple(v.shape) for k, v in weights.items()
            if isinstance(v, torch.Tensor)}


def read(path: str | Path, model: nn.Module) -> dict[str, torch.Tensor]:
    """The saved weights by plain name, whole tensors on the CPU (`model`, whole: the
    template a sharded checkpoint is read into)."""
    path = Path(path)
    if checkpoint.is_sharded(path):
        template = {k: v.detach().clone() for k, v in model.state_dict().items()}
        template = {k: v for k, v in template.items() if plain_name(k) in shapes(path)}
        checkpoint.load_sharded(path, {"model": template})
        return {plain_name(k): v for k, v in template.items()}
    if is_weights(path):
        loaded: dict[str, torch.Tensor] = {}
        for file in _files(path):
            loaded.update(_safetensors().load_file(str(file)))
        return {plain_name(k): v for k, v in loaded.items()}
    state = checkpoint.load(path)
    weights = state.get("model", state)
    return {plain_name(k): v for k, v in weights.items() if isinstance(v, torch.Tensor)}


def _aliases(model: nn.Module) -> dict[str, str]:
    """Each tied parameter's other names -> the first name it has."""
    first: dict[int, str] = {}
    aliases = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        aliases.update({name: first[id(param)]} if id(param) in first else {})
        first.setdefault(id(param), name)
    return aliases


def fit(model: nn.Module, saved: dict[str, tuple[int, ...]]) -> tuple[list, list, list]:
    """(missing, unexpected, mis-shaped) names between `model` (meta will do) and saved
    shapes; a tied weight saved under any of its names is present."""
    aliases = _aliases(model)
    own = {plain_name(k): tuple(v.shape) for k, v in model.state_dict().items()}
    present = set(saved) | {alias for alias, first in aliases.items() if first in saved} | {
        first for alias, first in aliases.items() if alias in saved}
    missing = [k for k in own if k not in present]
    unexpected = [k for k in saved if k not in own]
    wrong = [f"{k} {list(saved[k])} vs {list(own[k])}" for k in own
             if k in saved and saved[k] != own[k]]
    return missing, unexpected, wrong


def fit_problem(model: nn.Module, path: str | Path, key: str, strict: bool) -> str | None:
    """One line where the weights at `path` do not fit `model` (strict: every name and
    shape; else: some weight must match)."""
    missing, unexpected, wrong = fit(model, shapes(path))
    said = [f"{len(found)} {what} ({', '.join(found[:5])})" for what, found in
            (("missing", missing), ("unexpected", unexpected), ("mis-shaped", wrong)) if found]
    if not said or not strict and len(missing) + len(wrong) < len(model.state_dict()):
        return None
    fix = ("trainer.init_strict=false loads those that match" if strict else
           "give weights of this model")
    return (f"{key}={path} does not fit {type(model).__name__}: {'; '.join(said)}: {fix}")


class _Lazy(Mapping):
    """A file's weights by plain name, each read when asked for (a .pt memory-mapped, a
    safetensors file tensor by tensor): a rank that keeps only its part of each never
    holds the whole model."""

    def __init__(self, path: Path, aliases: dict[str, str]):
        self.path, self.aliases = path, aliases
        if is_weights(path):
            from safetensors import safe_open

            self.where = {}
            for file in _files(path):
                with safe_open(str(file), "pt") as reader:
                    self.where.update({plain_name(k): (file, k) for k in reader.keys()})
        else:
            state = checkpoint.load(path, mmap=True)
            self.mapped = {plain_name(k): v for k, v in state.get("model", state).items()}
            self.where = dict.fromkeys(self.mapped)
        for alias, first in aliases.items():  # a tied weight, saved under one of its names
            if alias not in self.where and first in self.where:
                self.where[alias] = self.where[first]
            elif first not in self.where and alias in self.where:
                self.where[first] = self.where[alias]

    def __getitem__(self, key: str) -> torch.Tensor:
        if not is_weights(self.path):
            return self.mapped[key if key in self.mapped else self.aliases.get(key, key)]
        from safetensors import safe_open

        file, name = self.where[key]
        with safe_open(str(file), "pt") as reader:
            return reader.get_tensor(name)

    def release(self, key: str) -> None:
        """A memory-mapped tensor's pages let go once its part is copied: read, they stay in
        the rank's resident set until the whole file is unmapped (the kernel reads them
        again from the file if touched; nothing is written to them)."""
        if is_weights(self.path):
            return
        import ctypes
        import os

        tensor = self.mapped[key if key in self.mapped else self.aliases.get(key, key)]
        page = os.sysconf("SC_PAGE_SIZE")
        start = tensor.data_ptr() // page * page
        madvise = ctypes.CDLL(None).madvise
        madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        madvise(start, tensor.data_ptr() + tensor.nbytes - start, 4)  # MADV_DONTNEED

    def __contains__(self, key: object) -> bool:  # Mapping's would read the tensor
        return key in self.where

    def __iter__(self):
        return iter(self.where)

    def __len__(self) -> int:
        return len(self.where)


@contextlib.contextmanager
def parameters_on_meta() -> Iterator[None]:
    """Modules built inside hold their parameters on meta, their buffers for real (a rotary
    table computed in __init__): the weights take no memory until the model is laid out
    (accelerate's init_empty_weights(include_buffers=False)). Each parameter is made, then
    let go, one at a time; one assigned again (a tied head) stays the same object."""
    register = nn.Module.register_parameter

    def on_meta(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        if param is not None and not param.is_meta:
            param = nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)
        register(module, name, param)

    nn.Module.register_parameter = on_meta
    try:
        yield
    finally:
        nn.Module.register_parameter = register


def load_held(model: nn.Module, path: str | Path, device: torch.device) -> None:
    """`model`, laid out with its parameters on meta (parameters_on_meta), given storage on
    `device`, its buffers as built, and each rank's
    part of the weights at `path` (torchtitan's order: no rank holds the whole model): a
    .dcp read shard by shard, a file tensor by tensor, each cut here and copied straight
    into the rank's own part."""
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        set_model_state_dict,
    )

    path = Path(path)
    buffers = {name: b for name, b in model.named_buffers() if not b.is_meta}
    model.to_empty(device=device)
    with torch.no_grad():  # buffers were built for real: computed ones (a rotary table) kept
        for name, value in buffers.items():
            model.get_buffer(name).copy_(value)
    if checkpoint.is_sharded(path):
        held = get_model_state_dict(model)
        checkpoint.load_sharded(path, {"model": held})
        set_model_state_dict(model, held)
        return
    saved = _Lazy(path, _aliases(model))
    with torch.no_grad():
        for key, mine in model.state_dict().items():  # views of the parameters themselves
            name = plain_name(key)
            part = checkpoint.held_as({name: mine}, saved, path)[name]
            _local(mine).copy_(_local(part))
            saved.release(name)


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """What this rank holds of `tensor`."""
    from torch.distributed.tensor import DTensor

    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def model_from(path: str | Path, model: nn.Module) -> nn.Module:
    """`model` with every weight saved at `path` (a checkpoint or an export)."""
    load_into(model, path)
    return model


def load_into(model: nn.Module, path: str | Path, strict: bool = True) -> list[str]:
    """`model` (whole, on the CPU) given the weights at `path`; returns the names left at
    their initial values (strict=False), after fit_problem said they may be."""
    saved = read(path, model)
    aliases = _aliases(model)
    for alias, first in aliases.items():  # a tied weight written under one of its names
        if first not in saved and alias in saved:
            saved[first] = saved[alias]
    own = {plain_name(k): k for k in model.state_dict()}
    state = model.state_dict()
    kept = {own[k]: v for k, v in saved.items()
            if k in own and tuple(v.shape) == tuple(state[own[k]].shape)}
    left = [k for k in own if own[k] not in kept and k not in aliases]
    if strict and left:
        raise ConfigError(f"{path} leaves {', '.join(left[:5])} unset: give weights of this "
                          "model, or trainer.init_strict=false")
    model.load_state_dict({**state, **kept})
    return left


def export_kind(ckpt: Path, out: Path, force: bool) -> str:
    """What export writes at `out` (`.pt`, `.safetensors`, or `folder`: an existing folder
    whatever its name, or a name with no suffix), checked before anything is read or
    written: never the checkpoint itself, inside it or around it, and an existing OUT only
    with --force. ConfigError in one line otherwise."""
    kind = ("folder" if out.is_dir() or not out.suffix else
            out.suffix if out.suffix in (".pt", ".safetensors") else None)
    if kind is None:
        raise ConfigError(f"{out}: export writes {FORMATS} (no other suffix)")
    if not out.parent.is_dir():
        raise ConfigError(f"{out.parent} is not a directory: create it, or give a "
                          "path in an existing one")
    source, target = ckpt.resolve(), out.resolve()
    clash = ("the checkpoint" if target == source else "inside the checkpoint"
             if source in target.parents else "a folder holding the checkpoint"
             if target in source.parents else None)
    if clash is not None:
        raise ConfigError(f"{out} is {clash} {ckpt}: export to another path (the checkpoint "
                          "is kept as it is)")
    if (out.exists() or out.is_symlink()) and not force:
        raise ConfigError(f"{out} exists: give a new name, or --force to replace what export "
                          "writes there")
    if out.exists() and kind != "folder" and not out.is_file():
        raise ConfigError(f"{out} is not a file: export writes a {kind} file there only in "
                          "place of one")
    return kind


def export(model: nn.Module, record: dict[str, Any], out: Path, kind: str) -> str:
    """`model`'s weights written as `kind` (export_kind) at `out` with the run's `record`
    (step, config); what was written, in words. Written under a temporary name beside OUT and
    moved into place last: an export that fails leaves OUT as it was, and one into an
    existing folder replaces only the files it writes."""
    from parallab.models import hf

    scratch = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        if kind == ".pt":
            checkpoint.save(scratch / out.name, {"model": model.state_dict(), **record})
            what = "the full model state as one torch file"
        elif kind == ".safetensors":
            _safetensors().save_model(model, str(scratch / out.name), metadata={
                "format": "pt", "step": str(record.get("step", 0)),
                "parallab_config": json.dumps(record.get("config", {}))})
            what = "the model's weights as one safetensors file (the run's config in its metadata)"
        else:
            what = _write_folder(model, record, scratch / "folder", hf.is_transformers(model))
        if kind != "folder":
            os.replace(scratch / out.name, out)
        elif not out.is_dir():
            os.replace(scratch / "folder", out)
        else:
            for written in (scratch / "folder").iterdir():
                os.replace(written, out / written.name)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return what


def _write_folder(model: nn.Module, record: dict[str, Any], folder: Path,
                  transformers: bool) -> str:
    from omegaconf import OmegaConf

    from parallab.models import adapters

    folder.mkdir()
    if adapters.is_peft_model(model):
        model.save_pretrained(str(folder))
        what = ("a peft adapter folder (adapter_config.json, adapter_model.safetensors) "
                "PeftModel.from_pretrained and trainer.init_from read")
    elif transformers:
        model.save_pretrained(str(folder))
        what = "a transformers folder (config.json, model.safetensors) from_pretrained reads"
    else:
        _safetensors().save_model(model, str(folder / WEIGHTS), metadata={"format": "pt"})
        what = f"a folder ({WEIGHTS}) evaluate.py and trainer.init_from read"
    OmegaConf.save(OmegaConf.create(record.get("config", {})), folder / RUN_CONFIG)
    return f"{what}, with the run's config in {RUN_CONFIG}"
