"""The MNIST recipe's CNN, with the dropout probabilities it meant to set.

Three stages (what model and pipeline parallelism cut, fsdp shards and activation
checkpointing wraps), each one module call: pooling, ReLU, dropout and log-softmax run as
functions inside it, as the recipe's forward runs them (a module for each made the step 1%
slower than the recipe's).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from parallab.models.base import Model, fits_classes, in_range, token_ids_problem


class ConvStage(nn.Module):
    """conv 5x5 -> channel dropout -> 2x2 max-pool -> ReLU."""

    def __init__(self, in_channels: int, out_channels: int, dropout: float = 0.0):
        super().__init__()
        self.conv = nn.Conv2d(in_channels, out_channels, kernel_size=5)
        self.dropout = dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.conv(x)
        if self.dropout:
            x = F.dropout2d(x, self.dropout, self.training)
        return F.relu(F.max_pool2d(x, 2))


class Head(nn.Module):
    """(B, 20, 4, 4) -> 50 -> ReLU -> dropout -> num_classes log-probabilities."""

    def __init__(self, num_classes: int, dropout: float):
        super().__init__()
        self.hidden = nn.Linear(320, 50)
        self.out = nn.Linear(50, num_classes)
        self.dropout = dropout  # the recipe's torch.dropout had no p

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.dropout(F.relu(self.hidden(x.flatten(1))), self.dropout, self.training)
        return F.log_softmax(self.out(x), dim=1)


class MnistCNN(Model):
    input_shape = [1, 28, 28]

    def __init__(self, num_classes: int = 10, dropout: float = 0.5):
        super().__init__()
        self.conv1 = ConvStage(1, 10)  # (B, 1, 28, 28) -> (B, 10, 12, 12)
        self.conv2 = ConvStage(10, 20, dropout)  # -> (B, 20, 4, 4)
        self.head = Head(num_classes, dropout)  # -> (B, num_classes)

    def stages(self) -> list[nn.Module]:
        return [self.conv1, self.conv2, self.head]

    @classmethod
    def check_data(cls, cfg, data) -> str | None:
        problem = in_range(cfg, {"num_classes": 1}, below_one=("dropout",))
        if problem:
            return problem
        problem = token_ids_problem("mnist_cnn", "images", data)
        if problem:
            return problem
        if list(data.input_shape or []) != cls.input_shape:
            fix = (f"set data.shape={cls.input_shape}" if hasattr(data, "shape") else
                   "use data=mnist, or a model of its samples (model=mlp, model=convnet)")
            return (f"data={data.name} gives samples of shape {data.input_shape}, which does "
                    f"not fit model=mnist_cnn, which takes inputs of shape {cls.input_shape}: "
                    f"{fix}")
        return fits_classes(cfg, data)
