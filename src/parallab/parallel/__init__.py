"""Parallel strategies by name: each wraps a model for its way of splitting the work."""

from __future__ import annotations

from parallab.parallel.base import Strategy
from parallab.parallel.dp import DataParallelStrategy
from parallab.parallel.mesh import (
    FSDPTPStrategy,
    HSDPStrategy,
    MeshStrategy,
    TPStrategy,
)
from parallab.parallel.model import ModelParallelStrategy
from parallab.parallel.pipeline import PipelineStrategy

STRATEGIES: dict[str, type[Strategy]] = {
    "none": Strategy,
    "dp": DataParallelStrategy,
    "ddp": MeshStrategy,  # the mesh's presets: ddp and fsdp set dp_replicate or dp_shard
    "fsdp": MeshStrategy,
    "model": ModelParallelStrategy,
    "pipeline": PipelineStrategy,
    "hsdp": HSDPStrategy,
    "tp": TPStrategy,
    "fsdp_tp": FSDPTPStrategy,
}
