"""Verses of a text file as a transformers user's Dataset: one line a sample, its bytes the
token ids (a vocabulary of 256), padded to seq_len.

Each sample is a dict, as a tokenizer's output is: input_ids, attention_mask (1 for the
verse's tokens, 0 for padding) and labels (the input ids, -100 on padding, so that padding
counts in no loss: the model shifts the labels itself). Verses differ in length, so batches
hold different numbers of valid labels: the loss of a step is the mean over its valid
labels, however the batch is cut into micro-batches and ranks.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch.utils.data import Dataset

PAD = 0


def shipped_text() -> Path:
    """The corpus parallab ships (data=bytes reads it too)."""
    from parallab.data.bytetext import DEFAULT_TEXT

    return DEFAULT_TEXT


class Verses(Dataset):
    def __init__(self, path: str | None = None, seq_len: int = 64, size: int = 2048,
                 offset: int = 0):
        """`size` lines of the file from line `offset` (blank lines skipped)."""
        lines = Path(path or shipped_text()).read_text(encoding="utf-8").splitlines()
        verses = [line.encode("utf-8")[:seq_len] for line in lines if line.strip()]
        chosen = verses[offset:offset + size]
        self.input_ids = torch.full((len(chosen), seq_len), PAD, dtype=torch.long)
        self.attention_mask = torch.zeros((len(chosen), seq_len), dtype=torch.long)
        for row, verse in enumerate(chosen):
            self.input_ids[row, :len(verse)] = torch.tensor(list(verse))
            self.attention_mask[row, :len(verse)] = 1
        self.labels = self.input_ids.masked_fill(self.attention_mask == 0, -100)

    def __len__(self) -> int:
        return len(self.input_ids)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.input_ids[index], "attention_mask": self.attention_mask[index],
                "labels": self.labels[index]}
