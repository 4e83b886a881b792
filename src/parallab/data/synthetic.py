"""A generated classification set that a model can learn: noisy copies of class prototypes,
or (data.vocab_size set) token sequences in which each class favours a few tokens of its own."""

from __future__ import annotations

import torch

from parallab.config import SyntheticDataConfig
from parallab.data.split import Split, TokenSplit

FAVOURED = 8  # tokens each class favours


def make(cfg: SyntheticDataConfig, seed: int) -> tuple[Split, Split]:
    if cfg.vocab_size is not None:
        return make_tokens(cfg, seed)
    generator = torch.Generator().manual_seed(seed)
    prototypes = torch.randn(cfg.num_classes, *cfg.shape, generator=generator)

    def sample(size: int) -> Split:
        targets = torch.randint(cfg.num_classes, (size,), generator=generator)
        noise = torch.randn(size, *cfg.shape, generator=generator)
        return Split(prototypes[targets] + cfg.noise * noise, targets)

    return sample(cfg.train_size), sample(cfg.eval_size)


def make_tokens(cfg: SyntheticDataConfig, seed: int) -> tuple[TokenSplit, TokenSplit]:
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
