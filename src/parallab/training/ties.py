"""Tied weights read from a file: a checkpoint or export holding two of a model's tied
names (an embedding and its head) apart with different values is an untied model's, which
a tied model would take one of without a word."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn

from parallab.models import tied_names
from parallab.training import formats
from parallab.training.formats import plain_name


def tie_problem(model: nn.Module, path: str | Path, key: str, spec: Any = None) -> str | None:
    """Weights at `path` holding two of `model`'s tied names (an embedding and its head)
    apart with different values, an untied model's: one had won without a word (a
    pipeline's stages each took their own). Two saved equal are one. Files are read a tensor
    at a time; a .dcp, which keeps a tied run's two names apart too, those two whole, but
    where it records a run of this model `spec` (tied as trained)."""
    if not (tied := tied_names(model)):
        return None
    reader = formats.format_of(path)
    saved = reader.lazy() if isinstance(reader, formats.FileFormat) else \
        _sharded_tensors(reader, {name for pair in tied.items() for name in pair}, spec)
    for alias, first in tied.items():
        if alias in saved and first in saved and not _one_tensor(saved[alias], saved[first]):
            return (f"{key}={path} holds {first} and {alias} apart (an untied model's), which "
                    f"{type(model).__name__} ties into one weight: give weights of a tied "
                    "model, or untie this one (model.tie_embeddings=false for gpt, "
                    "model.config.tie_word_embeddings=false for a transformers model)")
    return None


def _sharded_tensors(reader, names: set[str], spec: Any) -> dict[str, torch.Tensor]:
    """The weights of these names a sharded checkpoint holds, read whole in this process
    (none where it records a run of the model `spec`)."""
    from parallab.training import checkpoint

    own = reader.sharded and spec is not None and \
        checkpoint.saved_config(reader.record()).get("model") == spec
    entries = reader.index.state_dict_metadata if reader.sharded and not own else {}
    template = {k[6:]: torch.empty(v.size, dtype=v.properties.dtype) for k, v in entries.items()
                if k.startswith("model.") and plain_name(k[6:]) in names and hasattr(v, "size")}
    if template:  # ("model." is 6 characters)
        reader.read_state({"model": template})
    return {plain_name(k): v for k, v in template.items()}


def _one_tensor(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Two saved names of one weight: one tensor mapped twice (a tied state_dict saved
    whole), told without reading it (an embedding of GiBs paged in at start), or two equal."""
    return (a.data_ptr() == b.data_ptr() and a.shape == b.shape and a.stride() == b.stride()
            and a.dtype == b.dtype) or torch.equal(a, b)
