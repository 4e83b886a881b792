"""Manual model parallelism (the DataParallel-and-model-parallel recipe): one process, the
model's parts on successive devices.

Each part's stages live on its device; a pre-hook moves the activation into the part, and
the output comes back to the first device where the targets are. The module itself is not
wrapped, so its state_dict is the single-device one.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from parallab.config.errors import ConfigError
from parallab.parallel import stages as stages_of
from parallab.parallel.base import Options, Plan, Runtime
from parallab.parallel.layout import Layout
from parallab.parallel.split import check_parts, part_ranges

log = logging.getLogger(__name__)


def _move_inputs(device: torch.device):
    def hook(module: nn.Module, args: tuple) -> tuple:
        return tuple(a.to(device, non_blocking=True) for a in args)
    return hook


def _move_output(device: torch.device):
    def hook(module: nn.Module, args: tuple, output: torch.Tensor) -> torch.Tensor:
        return output.to(device, non_blocking=True)
    return hook


def refuse_finder(cfg) -> None:
    if cfg.trainer.auto_batch_size:
        raise ConfigError(f"trainer.auto_batch_size=true with parallel={cfg.parallel.name}: "
                          "the finder does not try its parts across devices: use parallel=none, "
                          "ddp, fsdp, a mesh layout or pipeline")


class ModelParallelRuntime(Runtime):
    """One process, the model's parts on world_size devices."""

    @property
    def world_size(self) -> int:
        return self.layout.pp

    def devices(self) -> list[torch.device]:
        if self.dist.device.type == "cuda":
            return [torch.device("cuda", i) for i in self.gpus()]
        return [self.dist.device] * self.layout.pp  # every part on the CPU: same code path

    def wrap(self, model: nn.Module) -> nn.Module:
        stages = stages_of.find(model, self.p.stages)
        parts = part_ranges(stages, self.layout.pp, self.p.split)
        for device, part in zip(self.devices(), parts):
            for index in part:
                stages[index].to(device)
            stages[part[0]].register_forward_pre_hook(_move_inputs(device))
        stages[-1].register_forward_hook(_move_output(self.dist.device))
        log.info("parallel=model: stages %s on %s", [f"{p.start}-{p.stop - 1}" for p in parts],
                 [str(d) for d in self.devices()])
        return model


class ModelParallelPlan(Plan):
    dims = ("pp",)  # one process, the model's parts on world_size devices
    runtime = ModelParallelRuntime

    @classmethod
    def layout_of(cls, p, world_size: int) -> Layout:
        return Layout(world_size, cls.dims, pp=world_size)

    @classmethod
    def options(cls, p) -> Options:
        return Options(split=tuple(p.split) if p.split else None)

    @classmethod
    def check(cls, cfg, layout: Layout, stages=None) -> None:
        super().check(cfg, layout)
        check_parts(cfg, layout, stages)
        refuse_finder(cfg)
