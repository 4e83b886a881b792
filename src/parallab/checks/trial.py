"""One small batch tried in the controller, before any worker starts: does the data fit the
model, does its output carry what the loss reads, is the loss a scalar, and do the stages in
order compute the model's forward?

parallab's own models, data sets and losses state what they take (check_data, input_shape),
so a run made only of them needs no trial; a user's model, data or loss gets one, as does
any run whose stages come from parallel.stages. Two samples, on the CPU, in eval mode.
"""

from __future__ import annotations

import itertools
from typing import Any

import torch
from torch import nn
from torch.utils.data import IterableDataset

from parallab import batch as batches
from parallab import loss as loss_of
from parallab.config import targets
from parallab.config.errors import ConfigError, first_line
from parallab.loss import AUTO, CROSS_ENTROPY, Objective
from parallab.models import build_on_meta
from parallab.parallel import stages as stages_of
from parallab.parallel.layout import Layout

OURS = "parallab."


def needed(cfg) -> bool:
    """A user's part is in play (a model, data, a loss other than cross-entropy, which every
    built-in model and data set is checked for, a metric or a collate function), or stages
    named in the config."""
    return not (str(cfg.model.get(targets.TARGET, "")).startswith(OURS)
                and cfg.data._target_.startswith(OURS) and cfg.data.tensors
                and cfg.loss.get(targets.TARGET) in (CROSS_ENTROPY, AUTO)) \
        or bool(cfg.parallel.stages) or bool(cfg.metrics) or cfg.data.collate_fn is not None


def stages_on_meta(cfg) -> list[nn.Module] | None:
    return stages_of.configured(build_on_meta(cfg.model), cfg.parallel.stages)


def one_batch(cfg, size: int = 2) -> Any:
    """`size` training samples collated as the DataLoader would (data.collate_fn too)."""
    from torch.utils.data import default_collate

    from parallab.data.datasets import collate
    from parallab.data.loaders import _dataset
    from parallab.data.split import Split

    train, _ = cfg.data.make(cfg.seed)
    if isinstance(train, Split) and cfg.data.collate_fn is None:  # sliced, as in memory
        inputs, labels = train.inputs[:size], train.targets[:size]
        return train.prepare(inputs), labels
    if isinstance(train, IterableDataset):
        samples = list(itertools.islice(iter(train), size))
    else:
        dataset = _dataset(train, train=False)
        samples = [dataset[i] for i in range(min(size, len(dataset)))]
    join = collate(cfg.data.collate_fn) if cfg.data.collate_fn is not None else default_collate
    try:
        batch = join(samples)
    except Exception as error:  # noqa: BLE001 - a user's collate may raise anything
        if cfg.data.collate_fn is None:
            raise
        raise ConfigError(f"data.collate_fn={cfg.data.collate_fn} fails on {len(samples)} "
                          f"samples ({first_line(error)}): make it take a list of samples "
                          "and return a batch") from None
    return tuple(batch) if isinstance(batch, list) else batch


class Probe:
    """The user's model and one batch of their data, built once in the controller for the
    checks that need them (loss=auto's choice, the trial); None where parallab's own parts
    need no trial."""

    def __init__(self, cfg):
        self.model: nn.Module | None = None
        self.batch: Any = None
        if not needed(cfg):
            return
        torch.manual_seed(cfg.seed)
        model = targets.build_checked(cfg.model, "model")
        if not isinstance(model, nn.Module):
            raise ConfigError(f"model._target_={cfg.model[targets.TARGET]} returned "
                              f"{type(model).__name__}, not a torch.nn.Module: return the "
                              "Module")
        from parallab.models import adapters, hf

        if not adapters.enabled(cfg.adapter) and not any(
                p.requires_grad for p in model.parameters()):  # (adapters: the frozen base)
            raise ConfigError(f"model._target_={cfg.model[targets.TARGET]} has no parameter "
                              "that takes a gradient (every one frozen, or layers held in a "
                              "plain list, which nn.Module does not see): nothing would "
                              "train; unfreeze some, or hold layers in nn.ModuleList")
        problem = hf.vocab_problem(model, cfg.data) or hf.positions_problem(model, cfg.data)
        if problem:
            raise ConfigError(problem)
        self.model, self.batch = hf.for_training(model).eval(), one_batch(cfg)
        refuse_keys(model, self.batch)


def refuse_keys(model: nn.Module, batch: Any) -> None:
    """A dict batch whose keys the forward does not take: ConfigError naming both."""
    if not isinstance(batch, dict):
        return
    names, open_ended = batches.parameters(model)
    unknown = [k for k in batch if k not in names]
    if unknown and not open_ended:
        raise ConfigError(f"data: a batch holds {', '.join(map(repr, batch))}, and the model's "
                          f"forward takes {', '.join(names) or 'nothing'}, not "
                          f"{', '.join(map(repr, unknown))}: make the Dataset's keys the "
                          "forward's parameters (a dict batch is passed as model(**batch))")


def resolve_loss(cfg, probe: Probe) -> None:
    """loss=auto: the model's own loss or cross_entropy, decided on the probe's batch."""
    try:
        cfg.loss = loss_of.resolve(cfg.loss, probe.model, probe.batch)
    except Exception as error:  # noqa: BLE001 - a user's forward may raise anything
        raise ConfigError(f"model: its forward fails on a batch of the data "
                          f"({first_line(error)}): make data samples and the model's input "
                          "agree") from None


def run(cfg, layout, probe: Probe | None = None) -> list[nn.Module] | None:
    """Try one batch (when needed); returns the model's stages where the layout uses them.
    ConfigError naming the key at fault."""
    probe = probe or Probe(cfg)
    if probe.model is None:
        return stages_on_meta(cfg) if layout.uses_stages else None
    model, batch = probe.model, probe.batch
    labels = batches.labels_of(batch)
    if isinstance(labels, torch.Tensor) and not labels.is_floating_point() and \
            labels.numel() and not batches.valid(labels).any():
        raise ConfigError(f"data: every label of the first {batches.rows(batch)} training "
                          "samples is -100 (ignored), so the run would train on nothing: give "
                          "labels to learn from (-100 marks only the tokens to leave out)")
    loss = loss_of.build_loss(cfg.loss).bind(model)
    with torch.no_grad():
        value = _loss_of(model, loss, batch)
    if not isinstance(value, torch.Tensor) or value.dim() != 0:
        shape = tuple(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__
        raise ConfigError(f"loss._target_={cfg.loss[targets.TARGET]} returns {shape}, not a "
                          "scalar: reduce it (mean over the batch)")
    if cfg.metrics:
        from parallab import metrics

        with torch.no_grad():
            output = batches.call(model, batch, with_targets=False)
        metrics.check_on(cfg.metrics, loss.scored(output), batches.labels_of(batch))
    stages = stages_of.configured(model, cfg.parallel.stages) if layout.uses_stages else None
    if layout.cuts_model and stages is not None and not loss.from_model:
        differs = stages_of.chain_differs(model, stages, batches.inputs_of(batch))
        if differs:
            raise ConfigError(f"parallel={cfg.parallel.name} runs the model as its stages in "
                              f"order ({stages_of.source(model, cfg.parallel.stages)}), but "
                              f"{differs}: list the modules whose chain is the forward in "
                              "parallel.stages, or use parallel=ddp or fsdp")
    return stages


def tp_split_problem(cfg, layout: Layout, probe: Probe) -> str | None:
    """Where a user's model is split by a plan over the layout's tp ranks: does the plan
    compose (tp_plans.split_problem, on the probe's model and batch)?"""
    if probe.model is None or layout.tp == 1 or layout.sequence_parallel:
        return None
    from parallab.parallel import options_of, tp_plans

    model, batch = probe.model, probe.batch
    from_model = loss_of.build_loss(cfg.loss).from_model
    plan = tp_plans.plan_of(model, options_of(cfg.parallel).tp_plan)
    with torch.no_grad():
        return tp_plans.split_problem(model, plan, layout.tp, lambda m: batches.call(
            m, batch, with_targets=from_model))


def _loss_of(model: nn.Module, loss: Objective, batch: Any):
    """The batch's mean loss; ConfigError naming the part at fault."""
    labels = batches.labels_of(batch)
    if loss.from_model and batches.is_pair(batch) and not batches.takes_targets(model):
        names = ", ".join(batches.parameters(model)[0]) or "nothing"
        raise ConfigError(f"loss=model gives the forward the targets, but "
                          f"{type(model).__name__}.forward takes {names} alone: use a loss of "
                          "its output (loss=cross_entropy, mse, ...), or let the forward take "
                          "the targets and return its loss")
    count = loss.count(labels) if labels is not None or loss.from_model else 1
    count = count.clamp(min=1) if isinstance(count, torch.Tensor) else max(count, 1)
    try:
        output = batches.call(model, batch, with_targets=loss.from_model)
    except Exception as error:  # noqa: BLE001 - a user's forward may raise anything
        raise ConfigError(f"model: its forward fails on a batch of the data ({first_line(error)}"
                          "): make data samples and the model's input agree") from None
    try:
        if loss.from_model:
            return loss(output)
        return loss.total(loss.scored(output), labels) / count
    except loss_of.OutputError as error:  # the output's type and keys, and the fix
        raise ConfigError(str(error)) from None
    except Exception as error:  # noqa: BLE001
        raise ConfigError(f"loss: {first_line(error)} on a batch of the model's output: use a "
                          "loss that fits the model and the data's targets") from None
