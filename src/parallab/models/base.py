"""What parallab's own models share: an ordered list of stages that compose into forward.

A user's model needs none of this (parallel/stages.py finds stages from parallel.stages or
an nn.Sequential); parallab's models declare theirs with stages(), and check the data they
are given with check_data before any worker starts. A user's model class may define
check_data too, a classmethod: the controller calls it the same way.
"""

from __future__ import annotations

import abc
from typing import Any, Callable

import torch
from torch import nn


class Model(nn.Module, abc.ABC):
    """A family's model: its stages (required) and what it may declare of itself. Each
    optional member is None here, where a family does not give it; parallab reads it where
    it is defined, on a user's model too (a Module that is no Model may define the same
    names, and is read alike)."""

    # (sequence_parallel: bool = False) -> {module name: ParallelStyle}: its tensor-
    # parallel plan (parallel/tp_plans.py); a sequence_parallel argument says it can cut the
    # sequence between its split layers
    tp_plan: Callable[..., dict[str, Any]] | None = None
    # (tp: int) -> str | None: why it cannot be split over tp ranks, one line (mesh.py)
    tp_problem: Callable[[int], str | None] | None = None
    # () -> [Module]: what activation checkpointing wraps, where not its stages
    # (parallel/activations.py)
    checkpoint_stages: Callable[[], list[nn.Module]] | None = None
    # (seq_len: int) -> float: training FLOPs per token, for MFU (observe/mfu.py), where
    # counting its weights would not give them
    flops_per_token: Callable[[int], float] | None = None
    # adapter=lora's default layers by name (models/adapters.py)
    lora_target_modules: tuple[str, ...] | None = None

    @abc.abstractmethod
    def stages(self) -> list[nn.Module]:
        """The model's submodules in forward order, each taking and returning one tensor."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for stage in self.stages():
            x = stage(x)
        return x

    @classmethod
    def check_data(cls, cfg: dict[str, Any], data) -> str | None:
        """None if this model takes the data's samples, else one line with the fix. May fill
        the model config's null (inferred) arguments from the data (a DataConfig)."""
        return None


def in_range(cfg: dict[str, Any], low: dict[str, float], below_one: tuple[str, ...] = ()
             ) -> str | None:
    """The first argument under its lower bound (`low`), or a probability not in [0, 1)."""
    for key, bound in low.items():
        if cfg.get(key) is not None and cfg[key] < bound:
            return f"model.{key}={cfg[key]} is out of range: it must be >= {bound}"
    for key in below_one:
        if not 0 <= cfg.get(key, 0.0) < 1:
            return f"model.{key}={cfg[key]} is out of range: it must be in [0, 1)"
    return None


def token_ids_problem(model: str, takes: str, data) -> str | None:
    """A model of numbers or images given token ids (a vocabulary, or next-token targets
    whose vocabulary follows the model's)."""
    next_token = getattr(data, "next_token", False)  # lstm classifies, gpt predicts them
    if getattr(data, "vocab_size", None) or next_token:
        return (f"model={model} takes {takes}, but data={data.name} holds token ids: use "
                f"{'model=gpt' if next_token else 'model=lstm or model=gpt'}")
    return None


def fits_classes(cfg: dict[str, Any], data) -> str | None:
    """The common check for a classifier's head: enough outputs for the data's classes."""
    classes = getattr(data, "num_classes", None)
    if classes is None:  # a user's Dataset: the model's own setting stands
        if cfg["num_classes"] is not None:
            return None
        return (f"model.num_classes=null: data={data.name} does not say how many classes it "
                "has: set model.num_classes")
    if cfg["num_classes"] is None:
        cfg["num_classes"] = classes
    if cfg["num_classes"] < classes:
        return (f"model.num_classes={cfg['num_classes']} is fewer than the {classes} "
                f"classes of data={data.name}: set model.num_classes={classes}")
    return None
