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
import math
from typing import TYPE_CHECKING, Any, Callable

import torch
from torch import nn

from parallab import batch as batches
from parallab.config import targets
from parallab.config.errors import ConfigError

if TYPE_CHECKING:
    from parallab.data.loaders import ShardLoader
    from parallab.launching.distributed import Dist
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


def check(specs: dict[str, Any], loss) -> None:
    own = names(loss, {})
    for name, spec in specs.items():
        if PREFIX + name in own:  # its figure would replace the run's own, silently
            raise ConfigError(f"metrics.{name} would report as {PREFIX + name}, the run's own "
                              f"figure (best.pt and early stopping follow it): give the metric "
                              f"another name, e.g. metrics.my_{name}")
        if not isinstance(spec, dict) or targets.TARGET not in spec:
            raise ConfigError(f"metrics.{name}={spec!r}: give a _target_ spec, e.g. "
                              f"+metrics.{name}._target_=torchmetrics.MeanAbsoluteError")
        target = targets.locate(spec[targets.TARGET], f"metrics.{name}._target_")
        at_call = 0 if inspect.isclass(target) else 2  # a function's (output, targets)
        targets.check_arguments(target, targets.arguments(spec), f"metrics.{name}", at_call)
        targets.check_types(target, targets.arguments(spec), f"metrics.{name}")


def check_on(specs: dict[str, Any], output: Any, labels: torch.Tensor) -> None:
    """Each metric scores a batch (the trial's) to a number; ConfigError naming the one that
    does not, before any worker starts rather than after all training."""
    for name, spec in specs.items():
        target = targets.locate(spec.get(targets.TARGET), f"metrics.{name}._target_")
        if inspect.isroutine(target) and not spec.get("_partial_"):  # else called with none
            raise ConfigError(f"metrics.{name}._target_={spec[targets.TARGET]} is a function, "
                              "which is called on each batch as (output, targets): give it "
                              f"+metrics.{name}._partial_=true")
        metric = targets.build_checked(spec, f"metrics.{name}")  # its constructor's fault
        try:
            if hasattr(metric, "update") and hasattr(metric, "compute"):
                metric.update(output, labels)
                value = metric.compute()
            else:
                value = metric(output, labels)
            float(value)
        except Exception as error:  # noqa: BLE001 - a user's metric may raise anything
            from parallab.config.errors import first_line

            raise ConfigError(f"metrics.{name}: {first_line(error)} on a batch of the model's "
                              "output: make it return a number (a scalar tensor or a "
                              "float)") from None


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
        weight = batches.weight(labels)  # samples, or a language model's valid tokens
        for index, metric in enumerate(self.metrics.values()):
            if hasattr(metric, "update") and hasattr(metric, "compute"):
                metric.update(output, labels)
            else:  # a plain function: its value weighted by the batch's samples or tokens
                self.sums[index] += metric(output, labels) * weight
        self.sums[-1] += weight

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
             forward: Callable[[nn.Module, Any], Any] | None = None) -> dict[str, float]:
    """eval_loss (and eval_accuracy where the loss classifies, and the configured metrics)
    over the whole split: the sum of every term (each valid label of each sample, counted
    once) over their number, summed over ranks, so the batch size never changes them.
    `forward` (a runtime's eval_forward) returns None on ranks that do not score."""
    was_training = model.training
    model.eval()
    extra = Metrics(metric_specs or {}, dist.device)
    totals = torch.zeros(3, dtype=torch.float64, device=dist.device)  # loss, correct, count
    remaining = loader.num_valid  # the rest of this rank's shard is sampler padding
    for batch in loader:
        rows = batches.rows(batch)
        n = min(rows, remaining)
        remaining -= n
        with precision.autocast() if precision else contextlib.nullcontext():
            if loss.from_model:  # the model scores itself, on this rank's real rows only
                if n:
                    _score_own(model, loss, batches.take(batch, n) if n < rows else batch,
                               totals)
                else:  # sampler padding only, but run all the same: a sharded layout's
                    loss.step_loss(model, batch, None)  # forward gathers with every rank
                continue
            output = forward(model, batch) if forward else batches.call(model, batch, False)
        if output is None or n == 0:
            continue
        scored = loss.scored(output)
        labels = batches.labels_of(batch)
        if n < rows:
            scored, labels = batches.take(scored, n), labels[:n]
        count = loss.count(labels)
        totals[0] += loss.total(scored, labels).double()
        totals[2] += count
        if loss.classifies:
            totals[1] += ((scored.argmax(dim=-1) == labels) & batches.valid(labels)).sum()
        extra.update(scored, labels)
    dist.all_reduce_sum(totals)
    model.train(was_training)
    total_loss, correct, count = totals.tolist()
    figures = {LOSS: total_loss / count if count else math.nan}
    if loss.classifies:
        figures[ACCURACY] = correct / count if count else math.nan
    return {**figures, **extra.compute(dist)}


def _score_own(model: nn.Module, loss: Objective, batch: Any, totals: torch.Tensor) -> None:
    """A model that computes its own loss: its sum over the batch's valid labels."""
    count = loss.count(batches.labels_of(batch))
    items = count.clamp(min=1) if isinstance(count, torch.Tensor) else max(count, 1)
    mean = loss.step_loss(model, batch, items)[1]
    if isinstance(count, torch.Tensor):  # labels all ignored: nothing added (its mean is 0/0)
        totals[0] += torch.where(count > 0, mean.double() * items, 0.0)
    else:
        totals[0] += mean.double() * items
    totals[2] += count
