"""Byte-level text: the bytes of one or more text files are the tokens (0..255).

The tail `eval_fraction` of the text is the eval split; each split is cut into
non-overlapping sequences of seq_len + 1 bytes: inputs the first seq_len, targets the same
sequence shifted by one (the next byte at every position).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar, Optional

import torch

from parallab.config.schema import DataConfig, Loader
from parallab.data.split import TokenSplit

DEFAULT_TEXT = Path(__file__).resolve().parent / "files" / "text" / "kjv.txt"  # shipped


def text_files(path: str | None) -> list[Path]:
    """The files data.path names: itself, or a directory's *.txt in sorted order."""
    root = Path(path).expanduser() if path is not None else DEFAULT_TEXT
    return sorted(root.glob("*.txt")) if root.is_dir() else [root]


def problem(cfg: Bytes) -> str | None:
    """None if data.path and the split settings give both splits a sequence, else one line."""
    if cfg.seq_len < 1:
        return f"data.seq_len={cfg.seq_len} is out of range: it must be >= 1"
    if cfg.loader is Loader.dataloader:  # loaders.SampleDataset turns uint8 into images
        return ("data.loader=dataloader does not take token data: use data.loader=memory "
                "with data=bytes")
    if not 0 < cfg.eval_fraction < 1:
        return f"data.eval_fraction={cfg.eval_fraction} is out of range: it must be in (0, 1)"
    files = text_files(cfg.path)
    missing = [str(f) for f in files if not f.is_file()]
    if not files or missing:
        what = f"no file {missing[0]}" if missing else "no *.txt in that directory"
        return (f"data.path={cfg.path}: {what}: give a text file or a directory of *.txt "
                "files (or data.path=null for the shipped text)")
    size = sum(f.stat().st_size for f in files)
    if min(int(size * cfg.eval_fraction), size - int(size * cfg.eval_fraction)) <= cfg.seq_len:
        return (f"data.path={cfg.path} holds {size} bytes, too few for a sequence of "
                f"data.seq_len={cfg.seq_len} in both splits (data.eval_fraction="
                f"{cfg.eval_fraction}): give more text or a shorter model.context")
    return None


def read_text(path: str | None) -> torch.Tensor:
    """All the bytes, as one uint8 tensor."""
    raw = b"".join(f.read_bytes() for f in text_files(path))
    return torch.frombuffer(bytearray(raw), dtype=torch.uint8)


def sequences(data: torch.Tensor, seq_len: int) -> TokenSplit:
    """Non-overlapping sequences: (N, seq_len) uint8 inputs and their next bytes as int64."""
    n = (len(data) - 1) // seq_len
    inputs = data[: n * seq_len].view(n, seq_len).clone()
    targets = data[1: n * seq_len + 1].view(n, seq_len).long()
    return TokenSplit(inputs, targets)


@dataclass
class Bytes(DataConfig):
    """Byte-level text: every byte a token, sequences of seq_len inputs and next-byte targets."""

    _target_: str = "parallab.data.bytetext.Bytes"
    path: Optional[str] = None  # a text file or a directory of *.txt; null = the shipped text
    seq_len: int = 256
    eval_fraction: float = 0.1  # the tail of the text held out
    batch_size: int = 32
    eval_batch_size: int = 64

    name: ClassVar[str] = "bytes"
    vocab_size: ClassVar[int] = 256
    num_classes: ClassVar[int] = 256
    next_token: ClassVar[bool] = True

    @property
    def input_shape(self) -> list[int]:
        return [self.seq_len]

    def problem(self) -> str | None:
        return problem(self)

    def train_length(self) -> int:
        """The training text's sequences, as make() cuts them."""
        size = sum(f.stat().st_size for f in text_files(self.path))
        cut = size - int(size * self.eval_fraction)
        return max(0, (cut - 1) // self.seq_len)

    def make(self, seed: int) -> tuple[TokenSplit, TokenSplit]:
        data = read_text(self.path)
        cut = len(data) - int(len(data) * self.eval_fraction)
        return sequences(data[:cut], self.seq_len), sequences(data[cut:], self.seq_len)
