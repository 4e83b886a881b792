"""The seed recipe's MNIST CNN, with the dropout probabilities it meant to set."""

from __future__ import annotations

from torch import nn

from parallab.config import MnistCnnConfig
from parallab.models.base import Model, fits_classes


class MnistCNN(Model):
    input_shape = [1, 28, 28]

    def __init__(self, cfg: MnistCnnConfig):
        super().__init__()
        self.conv1 = nn.Sequential(  # (B, 1, 28, 28) -> (B, 10, 12, 12)
            nn.Conv2d(1, 10, kernel_size=5), nn.MaxPool2d(2), nn.ReLU())
        self.conv2 = nn.Sequential(  # -> (B, 20, 4, 4)
            nn.Conv2d(10, 20, kernel_size=5), nn.Dropout2d(cfg.dropout), nn.MaxPool2d(2),
            nn.ReLU())
        self.head = nn.Sequential(  # -> (B, num_classes) log-probabilities
            nn.Flatten(), nn.Linear(320, 50), nn.ReLU(),
            nn.Dropout(cfg.dropout),  # the seed's torch.dropout had no p
            nn.Linear(50, cfg.num_classes), nn.LogSoftmax(dim=1))

    def stages(self) -> list[nn.Module]:
        return [self.conv1, self.conv2, self.head]

    @classmethod
    def check_data(cls, cfg, data) -> str | None:
        if list(data.input_shape) != cls.input_shape:
            return (f"data.shape={list(data.input_shape)} does not fit model=mnist_cnn, which "
                    f"takes inputs of shape {cls.input_shape}: set data.shape={cls.input_shape}")
        return fits_classes(cfg, data)
