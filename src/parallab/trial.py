"""One small batch tried in the controller, before any worker starts: does the data fit the
model, is the loss a scalar, and do the stages in order compute the model's forward?

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

from parallab import targets
from parallab.errors import ConfigError, first_line
from parallab.loss import Objective, build_loss
from parallab.parallel import stages as stages_of

OURS = "parallab."
CROSS_ENTROPY = "parallab.loss.CrossEntropy"


def needed(cfg) -> bool:
    """A user's part is in play, a loss other than cross-entropy (which every built-in model
    and data set is checked for), or stages named in the config."""
    return not (str(cfg.model.get(targets.TARGET, "")).startswith(OURS)
                and cfg.data._target_.startswith(OURS) and cfg.data.tensors
                and cfg.loss.get(targets.TARGET) == CROSS_ENTROPY) or bool(cfg.parallel.stages)


def find_stages(model: nn.Module, cfg) -> list[nn.Module] | None:
    try:
        return stages_of.find(model, cfg.parallel.stages)
    except KeyError as missing:
        names = [name for name, _ in model.named_children()]
        raise ConfigError(f"parallel.stages names {missing}, which is not a submodule of the "
                          f"model (its top-level modules: {', '.join(names)}): give module "
                          "names in forward order") from None


def model_on_meta(cfg) -> nn.Module:
    """The model, built without allocating its weights."""
    from parallab.models import build_model

    with torch.device("meta"):
        return build_model(cfg.model)


def stages_on_meta(cfg) -> list[nn.Module] | None:
    return find_stages(model_on_meta(cfg), cfg)


def one_batch(cfg, size: int = 2) -> tuple[Any, torch.Tensor]:
    """`size` training samples collated as the DataLoader would (data.collate_fn too)."""
    from torch.utils.data import default_collate

    from parallab.data.datasets import collate
    from parallab.data.loaders import _dataset
    from parallab.data.split import Split

    train, _ = cfg.data.make(cfg.seed)
    if isinstance(train, Split):
        inputs, labels = train.inputs[:size], train.targets[:size]
        return train.prepare(inputs), labels
    if isinstance(train, IterableDataset):
        samples = list(itertools.islice(iter(train), size))
    else:
        dataset = _dataset(train, train=False)
        samples = [dataset[i] for i in range(min(size, len(dataset)))]
    join = collate(cfg.data.collate_fn) if cfg.data.collate_fn is not None else default_collate
    return tuple(join(samples))


def run(cfg, strategy) -> list[nn.Module] | None:
    """Try one batch (when needed); returns the model's stages where the strategy uses them.
    ConfigError naming the key at fault."""
    if not needed(cfg):
        return stages_on_meta(cfg) if strategy.uses_stages else None
    torch.manual_seed(cfg.seed)
    model = targets.build_checked(cfg.model, "model")
    if not isinstance(model, nn.Module):
        raise ConfigError(f"model._target_={cfg.model[targets.TARGET]} returned "
                          f"{type(model).__name__}, not a torch.nn.Module: return the Module")
    inputs, labels = one_batch(cfg)
    loss = build_loss(cfg.loss)
    model.eval()
    with torch.no_grad():
        value = _loss_of(model, loss, inputs, labels)
    if not isinstance(value, torch.Tensor) or value.dim() != 0:
        shape = tuple(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__
        raise ConfigError(f"loss._target_={cfg.loss[targets.TARGET]} returns {shape}, not a "
                          "scalar: reduce it (mean over the batch)")
    stages = find_stages(model, cfg) if strategy.uses_stages else None
    if strategy.splits_model and stages is not None and not loss.from_model:
        differs = stages_of.chain_differs(model, stages, inputs)
        if differs:
            raise ConfigError(f"parallel={cfg.parallel.name} runs the model as its stages in "
                              f"order ({stages_of.source(model, cfg.parallel.stages)}), but "
                              f"{differs}: list the modules whose chain is the forward in "
                              "parallel.stages, or use parallel=ddp or fsdp")
    return stages


def _loss_of(model: nn.Module, loss: Objective, inputs: Any, labels: torch.Tensor):
    try:
        output = model(inputs, labels) if loss.from_model else model(inputs)
    except Exception as error:  # noqa: BLE001 - a user's forward may raise anything
        raise ConfigError(f"model: its forward fails on a batch of the data ({first_line(error)}"
                          "): make data samples and the model's input agree") from None
    try:
        return loss(output, labels)
    except Exception as error:  # noqa: BLE001
        raise ConfigError(f"loss: {first_line(error)} on a batch of the model's output: use a "
                          "loss that fits the model and the data's targets") from None
