"""Models by name; each is a Model (models/base.py) built from its own config dataclass."""

from __future__ import annotations

from parallab.models.base import Model
from parallab.models.gpt import GPT
from parallab.models.lstm import LSTMClassifier
from parallab.models.mlp import MLP
from parallab.models.mnist_cnn import MnistCNN
from parallab.models.resnet import ResNet18

MODELS: dict[str, type[Model]] = {"mnist_cnn": MnistCNN, "mlp": MLP, "gpt": GPT,
                                  "lstm": LSTMClassifier, "resnet18": ResNet18}


def build_model(cfg) -> Model:
    return MODELS[cfg.name](cfg)
