"""Evaluation figures: eval_loss always, eval_accuracy where the loss classifies (targets are
class indices), and the user's further metrics by `_target_` (Config.metrics), reported as
eval_<name>. One place names them, for metrics.json, TensorBoard and the sweep summary.

A metric is a torchmetrics-like object (update(output, targets), compute(), reset(); under
a process group torchmetrics reduces its state over the ranks in compute) or any callable
(output, targets) -> value, averaged over the samples of every rank.
"""

from __future__ import annotations

import contextlib
import inspect
from typing import TYPE_CHECKING, Any, Callable

import torch
from torch import nn

from parallab import targets
from parallab.errors import ConfigError

if TYPE_CHECKING:
    from parallab.data.loaders import ShardLoader
    from parallab.distributed import Dist
    from parallab.loss import Objective
    from parallab.precision import Precision

LOSS, ACCURACY = "eval_loss", "eval_accuracy"
PREFIX = "eval_"


def names(loss, specs: dict[str, Any]) -> list[str]:
    """The eval figures a run with this loss and these metrics reports."""
    return [LOSS, *([ACCURACY] if loss.classifies else []), *(PREFIX + n for n in specs)]


def objective(cfg, loss) -> str:
    """The figure a sweep's objective returns: Config.objective, else accuracy or loss."""
    return cfg.objective or (ACCURACY if loss.classifies else LOSS)


def objective_of(figures: dict[str, Any], name: str | None) -> Any:
    """A finished run's objective from its metrics.json (a run without accuracy: its loss)."""
    return figures.get(name) if name else figures.get(ACCURACY, figures.get(LOSS))


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


@torch.no_grad()
def evaluate(model: nn.Module, loader: ShardLoader, dist: Dist, precision: Precision | None,
             loss: Objective, metric_specs: dict[str, Any] | None = None,
             forward: Callable[[nn.Module, Any], torch.Tensor | None] | None = None
             ) -> dict[str, float]:
    """eval_loss (and eval_accuracy where the loss classifies, and the configured metrics)
    over the whole split: each sample counted once, summed over ranks. `forward` (a
    strategy's eval_forward) returns None on ranks that do not score."""
    was_training = model.training
    model.eval()
    extra = Metrics(metric_specs or {}, dist.device)
    totals = torch.zeros(3, dtype=torch.float64, device=dist.device)  # loss, correct, count
    remaining = loader.num_valid  # the rest of this rank's shard is sampler padding
    for inputs, labels in loader:
        n = min(len(labels), remaining)
        remaining -= n
        with precision.autocast() if precision else contextlib.nullcontext():
            if loss.from_model:  # the model scores itself, on this rank's real rows only
                if n:
                    inputs, labels = _rows(inputs, n), labels[:n]
                    totals[0] += loss(model(inputs, labels), labels).double() * loss.weight(labels)
                    totals[2] += loss.weight(labels)
                continue
            output = forward(model, inputs) if forward else model(inputs)
        if output is None or n == 0:
            continue
        output, labels = output[:n], labels[:n]
        totals[0] += loss(output, labels).double() * loss.weight(labels)
        totals[2] += loss.weight(labels)
        if loss.classifies:
            totals[1] += (output.argmax(dim=-1) == labels).sum()
        extra.update(output, labels)
    dist.all_reduce_sum(totals)
    model.train(was_training)
    total_loss, correct, count = totals.tolist()
    figures = {LOSS: total_loss / count}
    if loss.classifies:
        figures[ACCURACY] = correct / count
    return {**figures, **extra.compute(dist)}


def _rows(batch: Any, n: int) -> Any:
    """The first n rows of a batch: a tensor, or tensors in a tuple, list or dict."""
    if isinstance(batch, torch.Tensor):
        return batch[:n]
    if isinstance(batch, (tuple, list)):
        return type(batch)(_rows(b, n) for b in batch)
    if isinstance(batch, dict):
        return {k: _rows(v, n) for k, v in batch.items()}
    return batch
