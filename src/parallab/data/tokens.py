"""Generated token sequences for language models (data=tokens): each token is the one a
fixed random map gives for the token before it, or with probability `noise` one drawn at
random, so a model can learn the map; targets are the next tokens. Nothing is read from
disk, which is why parallab simulate takes it by default: there only its shapes matter."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Optional

import torch

from parallab.config.schema import DataConfig, Loader
from parallab.data.split import TokenSplit


@dataclass
class Tokens(DataConfig):
    _target_: str = "parallab.data.tokens.Tokens"
    vocab_size: Optional[int] = 256
    seq_len: int = 256
    train_size: int = 2048
    eval_size: int = 128
    noise: float = 0.1
    batch_size: int = 8
    eval_batch_size: int = 8

    name: ClassVar[str] = "tokens"
    next_token: ClassVar[bool] = True

    @property
    def num_classes(self) -> int | None:
        return self.vocab_size

    @property
    def input_shape(self) -> list[int]:
        return [self.seq_len]

    def problem(self) -> str | None:
        if self.vocab_size is None:
            return ("data.vocab_size=null: data=tokens draws ids from a vocabulary the model's "
                    "config does not state here: set data.vocab_size")
        if self.loader is Loader.dataloader:  # loaders.SampleDataset takes one label a sample
            return ("data.loader=dataloader does not take token data: use data.loader=memory "
                    "with data=tokens")
        for key, low in (("vocab_size", 2), ("seq_len", 1), ("train_size", 1), ("eval_size", 1)):
            if getattr(self, key) < low:
                return f"data.{key}={getattr(self, key)} is out of range: it must be >= {low}"
        if not 0 <= self.noise <= 1:
            return f"data.noise={self.noise} is out of range: it is a share, in [0, 1]"
        return None

    def train_length(self) -> int:
        return self.train_size

    def make(self, seed: int) -> tuple[TokenSplit, TokenSplit]:
        generator = torch.Generator().manual_seed(seed)
        follows = torch.randperm(self.vocab_size, generator=generator)
        return (sequences(self, follows, self.train_size, generator),
                sequences(self, follows, self.eval_size, generator))


def sequences(cfg: Tokens, follows: torch.Tensor, size: int,
              generator: torch.Generator) -> TokenSplit:
    """`size` sequences of seq_len + 1 tokens: inputs the first seq_len, targets the next."""
    length = cfg.seq_len + 1
    tokens = torch.empty(size, length, dtype=torch.int64)
    tokens[:, 0] = torch.randint(cfg.vocab_size, (size,), generator=generator)
    drawn = torch.randint(cfg.vocab_size, (size, length), generator=generator)
    random = torch.rand(size, length, generator=generator) < cfg.noise
    for t in range(1, length):
        tokens[:, t] = torch.where(random[:, t], drawn[:, t], follows[tokens[:, t - 1]])
    ids = tokens.to(torch.int32)  # half the memory; fed to the model as int64
    return TokenSplit(ids[:, :-1].contiguous(), ids[:, 1:].long().contiguous())
