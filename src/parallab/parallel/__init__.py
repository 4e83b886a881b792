"""Parallel strategies by name: each wraps a model for its way of splitting the work."""

from __future__ import annotations

from parallab.parallel.base import Strategy
from parallab.parallel.ddp import DDPStrategy
from parallab.parallel.dp import DataParallelStrategy

STRATEGIES: dict[str, type[Strategy]] = {
    "none": Strategy,
    "dp": DataParallelStrategy,
    "ddp": DDPStrategy,
}
