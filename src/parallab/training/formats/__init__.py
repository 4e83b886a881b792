"""The formats parallab reads and writes, one class each, one module each: a torch file
(.pt: a one-file checkpoint, or export's file), a sharded checkpoint (a .dcp directory),
one safetensors file, a folder of safetensors weights (export's, or a transformers
save_pretrained folder) and a peft adapter folder. `format_of(path)` picks the reader from
the path, once; `writer_for(out)` the format export writes at OUT; `checkpoint_format`
the one the Checkpointer writes a run's training state in under a layout. A new format is
one class (a module here) and one line in FORMATS; one that is a CheckpointFormat is
written and read as training state too, and the messages that list what is read or
written come from FORMATS.

Every reader gives weights by plain name (without the prefixes wrappers add); the lazy one
reads a tensor when asked for, so that a rank keeping its part of each never holds them all.
"""

from __future__ import annotations

from pathlib import Path

from parallab.training.formats.base import (
    CheckpointError,
    CheckpointFormat,
    FileFormat,
    Format,
    Lazy,
    disk_reason,
    held_as,
    load,
    plain_name,
    save,
)
from parallab.training.formats.safetensors_weights import (
    EXPORTED,
    RECORD,
    RUN_CONFIG,
    WEIGHTS,
    AdapterFolder,
    SafetensorsFile,
    WeightsFolder,
    earlier_export,
    safetensors_torch,
)
from parallab.training.formats.sharded import SHARDED_META, Sharded
from parallab.training.formats.torch_file import TorchFile

__all__ = ["CheckpointError", "CheckpointFormat", "FileFormat", "Format", "Lazy", "disk_reason",
           "held_as",
           "load", "plain_name", "save", "EXPORTED", "RECORD", "RUN_CONFIG", "WEIGHTS",
           "AdapterFolder", "SafetensorsFile", "WeightsFolder", "earlier_export",
           "safetensors_torch", "SHARDED_META", "Sharded", "TorchFile", "FORMATS",
           "format_of", "written", "read", "writer_for", "checkpoint_formats",
           "checkpoint_format", "state_format"]

# the first that holds a path reads it
FORMATS: list[type[Format]] = [Sharded, AdapterFolder, WeightsFolder, SafetensorsFile,
                               TorchFile]


def format_of(path: str | Path, key: str = "ckpt",
              instead: str = "use another checkpoint") -> Format:
    """The reader of the weights at `path`, which `key` named (`instead`: what to do where
    it cannot be read)."""
    path = Path(path)
    return next(kind for kind in FORMATS if kind.holds(path))(path, key, instead)


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


def checkpoint_formats() -> list[type[CheckpointFormat]]:
    """Those of FORMATS that hold a run's training state, in its order."""
    return [kind for kind in FORMATS if issubclass(kind, CheckpointFormat)]


def checkpoint_format(sharded: bool) -> type[CheckpointFormat]:
    """The format checkpoints are written in under a layout (Layout.sharded: every rank
    holds part of the model, and writes its part)."""
    return next(kind for kind in checkpoint_formats() if kind.sharded == sharded)


def state_format(path: str | Path, key: str = "ckpt",
                 instead: str = "use another checkpoint") -> CheckpointFormat:
    """The checkpoint format that reads the training state at `path`: the first that holds
    it; what none holds is read as the layout's whose checkpoints are shaped as it is (a
    directory as a sharded one, anything else as a file), so that its error says what is
    missing (no .metadata, no such file, not a readable checkpoint); `key` named it."""
    path = Path(path)
    kinds = checkpoint_formats()
    found = next((kind for kind in kinds if kind.holds(path)), None)
    return (found or checkpoint_format(sharded=path.is_dir()))(path, key, instead)
