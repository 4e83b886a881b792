"""What every model provides: an ordered list of stages that compose into its forward.

A model is a chain of stage modules (`stages()`), each a real submodule taking one tensor
and returning one; `forward` runs them in order. That one fact is what the strategies
build on: fsdp shards each stage, model parallelism places stages on devices, the pipeline
keeps a run of stages per rank (the rest replaced by nn.Identity, so parameter names stay
those of the whole model and checkpoints move between strategies).
"""

from __future__ import annotations

import abc

import torch
from torch import nn


class Model(nn.Module, abc.ABC):
    @abc.abstractmethod
    def stages(self) -> list[nn.Module]:
        """The model's submodules in forward order, each taking and returning one tensor."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for stage in self.stages():
            x = stage(x)
        return x

    @classmethod
    def check_data(cls, cfg, data) -> str | None:
        """None if this model takes the data config's samples, else one line with the fix.
        May fill the model config's null (inferred) fields from the data."""
        return None


def fits_classes(cfg, data) -> str | None:
    """The common check for a classifier's head: enough outputs for the data's classes."""
    if cfg.num_classes < data.num_classes:
        return (f"model.num_classes={cfg.num_classes} is fewer than the {data.num_classes} "
                f"classes of data={data.name}: set model.num_classes={data.num_classes}")
    return None
