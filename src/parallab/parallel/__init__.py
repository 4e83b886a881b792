"""Parallel strategies by name: each wraps a model for its way of splitting the work."""

from __future__ import annotations

from parallab.parallel.base import Strategy
from parallab.parallel.ddp import DDPStrategy
from parallab.parallel.dp import DataParallelStrategy
from parallab.parallel.fsdp import FSDPStrategy
from parallab.parallel.mesh import FSDPTPStrategy, HSDPStrategy, TPStrategy
from parallab.parallel.model import ModelParallelStrategy
from parallab.parallel.pipeline import PipelineStrategy

STRATEGIES: dict[str, type[Strategy]] = {
    "none": Strategy,
    "dp": DataParallelStrategy,
    "ddp": DDPStrategy,
    "fsdp": FSDPStrategy,
    "model": ModelParallelStrategy,
    "pipeline": PipelineStrategy,
    "hsdp": HSDPStrategy,
    "tp": TPStrategy,
    "fsdp_tp": FSDPTPStrategy,
}
