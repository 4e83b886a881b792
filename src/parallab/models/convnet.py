"""A small BatchNorm CNN for image classification, the fast MNIST preset's model.

Each block is conv 3x3 -> 2x2 max-pool -> BatchNorm -> ReLU, `channels` wide; the last block
pools globally instead, so any image size fits, and one linear layer scores the classes. BatchNorm lets it train at a learning rate the MNIST recipe's CNN cannot take:
one epoch reaches what the recipe's ten do. Its stages are the blocks and the head.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from parallab.models.base import Model, fits_classes, in_range


class ConvBlock(nn.Module):
    """conv 3x3 -> 2x2 max-pool (the last block: a global one) -> BatchNorm -> ReLU. Pooling
    first leaves a quarter of the values to normalize (docs/benchmarks.md: time to accuracy)."""

    def __init__(self, in_channels: int, out_channels: int, last: bool = False):
        super().__init__()
        # no bias: BatchNorm's shift takes its place
        self.conv = nn.Conv2d(in_channels, out_channels, 3, padding=1, bias=False)
        self.norm = (nn.BatchNorm1d if last else nn.BatchNorm2d)(out_channels)
        self.last = last

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.conv(x)
        x = x.amax(dim=(2, 3)) if self.last else F.max_pool2d(x, 2)
        return F.relu(self.norm(x))


class ConvNet(Model):
    def __init__(self, num_classes: int = 10, in_channels: int = 1,
                 channels: tuple[int, ...] = (16, 32, 64)):
        super().__init__()
        widths = [in_channels, *channels]
        self.blocks = nn.ModuleList(
            ConvBlock(a, b, last=i == len(channels) - 1)
            for i, (a, b) in enumerate(zip(widths, widths[1:])))
        self.head = nn.Linear(widths[-1], num_classes)

    def stages(self) -> list[nn.Module]:
        return [*self.blocks, self.head]

    @classmethod
    def check_data(cls, cfg, data) -> str | None:
        problem = in_range(cfg, {"num_classes": 1, "in_channels": 1})
        if problem:
            return problem
        channels = list(cfg["channels"] or [])
        if not channels or min(channels) < 1:
            return (f"model.channels={channels} is not a list of block widths: give one "
                    "positive width per block, e.g. [16,32,64]")
        shape = list(getattr(data, "input_shape", None) or [])
        if len(shape) != 3:
            return (f"model=convnet takes images (channels, height, width), and data="
                    f"{data.name} gives samples of shape {shape or None}: use image data")
        if cfg["in_channels"] is None:
            cfg["in_channels"] = shape[0]
        if cfg["in_channels"] != shape[0]:
            return (f"model.in_channels={cfg['in_channels']} does not match the {shape[0]} "
                    f"channels of data={data.name}: set model.in_channels={shape[0]} (or null)")
        if min(shape[1:]) < 2 ** (len(channels) - 1):
            return (f"model.channels has {len(channels)} blocks, each halving the "
                    f"{shape[1]}x{shape[2]} images of data={data.name}: use fewer blocks")
        return fits_classes(cfg, data)
