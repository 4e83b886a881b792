"""nn.DataParallel: one process scatters each batch over several GPUs (DDP is faster)."""

from __future__ import annotations

import logging

from torch import nn

from parallab.parallel.base import Plan, Runtime
from parallab.parallel.layout import Layout

log = logging.getLogger(__name__)


class DataParallelRuntime(Runtime):
    """One process, a replica on each of the layout's GPUs."""

    @property
    def devices_per_process(self) -> int:
        return self.layout.world_size  # on a CPU the layout is one device

    def wrap(self, model: nn.Module) -> nn.Module:
        model = self.on_device(model)
        if self.dist.device.type != "cuda":
            log.warning("parallel=dp on CPU runs on one device: DataParallel splits batches "
                        "over GPUs only")
            return model
        log.info("parallel=dp over %d GPUs; parallel=ddp is faster (one process per GPU, "
                 "no per-step scatter/gather)", self.layout.world_size)
        return nn.DataParallel(model, device_ids=self.gpus())

    def unwrap(self, model: nn.Module) -> nn.Module:
        return model.module if isinstance(model, nn.DataParallel) else model


class DataParallelPlan(Plan):
    dims = ("dp_replicate",)  # one process, a replica on each of world_size GPUs
    runtime = DataParallelRuntime

    @classmethod
    def layout_of(cls, p, world_size: int) -> Layout:
        return Layout(world_size, cls.dims, dp_replicate=world_size)

    @classmethod
    def resolve(cls, p, device_type: str, world_size: int, nnodes: int = 1) -> Layout:
        layout = super().resolve(p, device_type, world_size, nnodes)
        # DataParallel splits batches over GPUs only: on a CPU one device reads them
        return layout if device_type == "cuda" else Layout(plan=cls, dims=cls.dims)
