"""The seed recipe's MNIST CNN, with the dropout probabilities it meant to set."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from parallab.config import MnistCnnConfig


class MnistCNN(nn.Module):
    input_shape = (1, 28, 28)

    def __init__(self, cfg: MnistCnnConfig):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 10, kernel_size=5)
        self.conv2 = nn.Conv2d(10, 20, kernel_size=5)
        self.conv2_drop = nn.Dropout2d(cfg.dropout)
        self.fc1 = nn.Linear(320, 50)
        self.fc1_drop = nn.Dropout(cfg.dropout)  # the seed's torch.dropout had no p
        self.fc2 = nn.Linear(50, cfg.num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu(F.max_pool2d(self.conv1(x), 2))  # (B, 10, 12, 12)
        x = F.relu(F.max_pool2d(self.conv2_drop(self.conv2(x)), 2))  # (B, 20, 4, 4)
        x = self.fc1_drop(F.relu(self.fc1(x.flatten(1))))  # (B, 50)
        return F.log_softmax(self.fc2(x), dim=1)  # (B, num_classes) log-probabilities
