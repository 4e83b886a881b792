"""Models by name; each is a plain nn.Module built from its own config dataclass."""

from __future__ import annotations

from torch import nn

from parallab.models.mnist_cnn import MnistCNN

MODELS: dict[str, type[nn.Module]] = {"mnist_cnn": MnistCNN}


def build_model(cfg) -> nn.Module:
    return MODELS[cfg.name](cfg)
