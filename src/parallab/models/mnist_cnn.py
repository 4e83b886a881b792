"""The seed recipe's MNIST CNN, with the dropout probabilities it meant to set."""

from __future__ import annotations

from torch import nn

from parallab.models.base import Model, fits_classes, in_range


class MnistCNN(Model):
    input_shape = [1, 28, 28]

    def __init__(self, num_classes: int = 10, dropout: float = 0.5):
        super().__init__()
        self.conv1 = nn.Sequential(  # (B, 1, 28, 28) -> (B, 10, 12, 12)
            nn.Conv2d(1, 10, kernel_size=5), nn.MaxPool2d(2), nn.ReLU())
        self.conv2 = nn.Sequential(  # -> (B, 20, 4, 4)
            nn.Conv2d(10, 20, kernel_size=5), nn.Dropout2d(dropout), nn.MaxPool2d(2),
            nn.ReLU())
        self.head = nn.Sequential(  # -> (B, num_classes) log-probabilities
            nn.Flatten(), nn.Linear(320, 50), nn.ReLU(),
            nn.Dropout(dropout),  # the seed's torch.dropout had no p
            nn.Linear(50, num_classes), nn.LogSoftmax(dim=1))

    def stages(self) -> list[nn.Module]:
        return [self.conv1, self.conv2, self.head]

    @classmethod
    def check_data(cls, cfg, data) -> str | None:
        problem = in_range(cfg, {"num_classes": 1}, below_one=("dropout",))
        if problem:
            return problem
        if list(data.input_shape or []) != cls.input_shape:
            return (f"data={data.name} gives samples of shape {data.input_shape}, which does "
                    f"not fit model=mnist_cnn, which takes inputs of shape {cls.input_shape}: "
                    f"set data.shape={cls.input_shape}")
        return fits_classes(cfg, data)
