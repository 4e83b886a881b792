"""A generated classification set that a model can learn: noisy copies of class prototypes,
or (data.vocab_size set) token sequences in which each class favours a few tokens of its own."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import ClassVar, Optional

import torch

from parallab.config.schema import DataConfig
from parallab.data.split import Split, TokenSplit

FAVOURED = 8  # tokens each class favours


@dataclass
class Synthetic(DataConfig):
    _target_: str = "parallab.data.synthetic.Synthetic"
    train_size: int = 8192
    eval_size: int = 2048
    shape: list[int] = field(default_factory=lambda: [1, 28, 28])
    num_classes: int = 10
    noise: float = 1.0  # std of the noise around each class prototype
    vocab_size: Optional[int] = None  # set: token sequences (ids 1..vocab_size-1, 0 = padding)
    seq_len: int = 32  # token sequences: the longest (lengths vary from seq_len / 2 up)

    name: ClassVar[str] = "synthetic"

    @property
    def input_shape(self) -> list[int]:
        return [self.seq_len] if self.vocab_size else list(self.shape)

    @property
    def memory_bytes(self) -> int:
        item = 8 if self.vocab_size else 4  # int64 ids, float32 values
        return (self.train_size + self.eval_size) * math.prod(self.input_shape) * item

    def train_length(self) -> int:
        return self.train_size

    def problem(self) -> str | None:
        for key, low in (("train_size", 1), ("eval_size", 1), ("num_classes", 2),
                         ("noise", 0.0), ("seq_len", 1)):
            if getattr(self, key) < low:
                return f"data.{key}={getattr(self, key)} is out of range: it must be >= {low}"
        if not self.shape or min(self.shape) < 1:
            return f"data.shape={list(self.shape)} must be sizes >= 1, e.g. data.shape=[1,28,28]"
        if self.vocab_size is not None and self.vocab_size < 2:
            return f"data.vocab_size={self.vocab_size} is out of range: it must be >= 2"
        return None

    def make(self, seed: int) -> tuple[Split, Split]:
        return make_tokens(self, seed) if self.vocab_size is not None else make_values(self, seed)


def make_values(cfg: Synthetic, seed: int) -> tuple[Split, Split]:
    generator = torch.Generator().manual_seed(seed)
    prototypes = torch.randn(cfg.num_classes, *cfg.shape, generator=generator)

    def sample(size: int) -> Split:
        targets = torch.randint(cfg.num_classes, (size,), generator=generator)
        noise = torch.randn(size, *cfg.shape, generator=generator)
        return Split(prototypes[targets] + cfg.noise * noise, targets)

    return sample(cfg.train_size), sample(cfg.eval_size)


def make_tokens(cfg: Synthetic, seed: int) -> tuple[TokenSplit, TokenSplit]:
    """Sequences of seq_len/2..seq_len tokens, right-padded with 0; each token is one of its
    class's favoured ids with probability 1 / (1 + noise), else uniform over 1..vocab_size-1."""
    generator = torch.Generator().manual_seed(seed)
    length, vocab = cfg.seq_len, cfg.vocab_size
    favoured = torch.randint(1, vocab, (cfg.num_classes, FAVOURED), generator=generator)

    def sample(size: int) -> TokenSplit:
        targets = torch.randint(cfg.num_classes, (size,), generator=generator)
        uniform = torch.randint(1, vocab, (size, length), generator=generator)
        pick = torch.randint(FAVOURED, (size, length), generator=generator)
        own = torch.rand(size, length, generator=generator) < 1 / (1 + cfg.noise)
        tokens = torch.where(own, favoured[targets[:, None], pick], uniform)
        lengths = torch.randint(max(1, length // 2), length + 1, (size, 1), generator=generator)
        return TokenSplit(tokens.masked_fill(torch.arange(length) >= lengths, 0), targets)

    return sample(cfg.train_size), sample(cfg.eval_size)
