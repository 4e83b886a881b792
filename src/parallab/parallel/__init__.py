"""Parallel layouts by name (parallel=NAME): each a Plan (pure: degrees, checks, options)
whose Runtime lays a model out for its way of splitting the work."""

from __future__ import annotations

from parallab.parallel.auto import AutoPlan
from parallab.parallel.base import Options, Plan
from parallab.parallel.dp import DataParallelPlan
from parallab.parallel.mesh import MeshPlan
from parallab.parallel.model import ModelParallelPlan
from parallab.parallel.pipeline import PipelinePlan

PLANS: dict[str, type[Plan]] = {
    "none": Plan,
    "dp": DataParallelPlan,
    "ddp": MeshPlan,  # the mesh's presets, each setting some of its degrees
    "fsdp": MeshPlan,
    "model": ModelParallelPlan,
    "pipeline": PipelinePlan,
    "hsdp": MeshPlan,
    "tp": MeshPlan,
    "fsdp_tp": MeshPlan,
    "auto": AutoPlan,  # parallab simulate's: every layout, ranked
}


def options_of(p) -> Options:
    """The parallel config `p`'s settings beyond its degrees, as its plan reads them."""
    return PLANS[p.name].options(p)
