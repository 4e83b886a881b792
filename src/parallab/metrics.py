"""Evaluation figures: eval_loss always, eval_accuracy where the loss classifies (targets are
class indices), and the user's further metrics by `_target_` (Config.metrics), reported as
eval_<name>. One place names them, for metrics.json, TensorBoard and the sweep summary.

A metric is a torchmetrics-like object (update(output, targets), compute(), reset(); under
a process group torchmetrics reduces its state over the ranks in compute) or any callable
(output, targets) -> value, averaged over the samples of every rank.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch

from parallab import targets
from parallab.errors import ConfigError

LOSS, ACCURACY = "eval_loss", "eval_accuracy"
PREFIX = "eval_"


def names(loss, specs: dict[str, Any]) -> list[str]:
    """The eval figures a run with this loss and these metrics reports."""
    return [LOSS, *([ACCURACY] if loss.classifies else []), *(PREFIX + n for n in specs)]


def objective(cfg, loss) -> str:
    """The figure a sweep's objective returns: Config.objective, else accuracy or loss."""
    return cfg.objective or (ACCURACY if loss.classifies else LOSS)


def check(specs: dict[str, Any]) -> None:
    for name, spec in specs.items():
        if not isinstance(spec, dict) or targets.TARGET not in spec:
            raise ConfigError(f"metrics.{name}={spec!r}: give a _target_ spec, e.g. "
                              f"+metrics.{name}._target_=torchmetrics.MeanAbsoluteError")
        target = targets.locate(spec[targets.TARGET], f"metrics.{name}._target_")
        at_call = 0 if inspect.isclass(target) else 2  # a function's (output, targets)
        targets.check_arguments(target, targets.arguments(spec), f"metrics.{name}", at_call)


class Metrics:
    """The user's metrics for one evaluation pass."""

    def __init__(self, specs: dict[str, Any], device: torch.device):
        self.device = device
        self.metrics = {}
        for name, spec in specs.items():
            metric = targets.build(spec)
            self.metrics[name] = metric.to(device) if hasattr(metric, "to") else metric
        self.sums = torch.zeros(len(self.metrics) + 1, dtype=torch.float64, device=device)

    def update(self, output: torch.Tensor, labels: torch.Tensor) -> None:
        for index, metric in enumerate(self.metrics.values()):
            if hasattr(metric, "update") and hasattr(metric, "compute"):
                metric.update(output, labels)
            else:  # a plain function: its value weighted by the batch's samples
                self.sums[index] += float(metric(output, labels)) * len(labels)
        self.sums[-1] += len(labels)

    def compute(self, dist) -> dict[str, float]:
        dist.all_reduce_sum(self.sums)
        figures = {}
        for index, (name, metric) in enumerate(self.metrics.items()):
            if hasattr(metric, "update") and hasattr(metric, "compute"):
                figures[PREFIX + name] = float(metric.compute())
                metric.reset()
            else:
                figures[PREFIX + name] = (self.sums[index] / self.sums[-1]).item()
        return figures
