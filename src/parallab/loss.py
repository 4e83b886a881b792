"""The objective (the `loss` group): what a step minimises and how evaluation scores it.

Built in: cross_entropy (class scores against class indices, or per-position scores against
next tokens: every target position counts once), mse, bce_with_logits, and `model`, for a
model whose forward(inputs, targets) returns the loss itself (as Hugging Face models do).
Any other callable `(output, targets) -> scalar loss` comes by `_target_`: a class (built
with the YAML's arguments, e.g. torch.nn.HuberLoss) or a function (its YAML arguments bound
as keywords, e.g. torch.nn.functional.smooth_l1_loss with beta).
"""

from __future__ import annotations

import functools
import inspect
from typing import Any, Callable

import torch
import torch.nn.functional as F

from parallab import targets


class Objective:
    """A loss: called with the model's output and the targets, returns a scalar tensor."""

    classifies = False  # targets are class indices: evaluation reports eval_accuracy
    from_model = False  # the model's forward(inputs, targets) returns the loss

    def __call__(self, output: Any, targets: torch.Tensor) -> torch.Tensor:
        raise TypeError(f"{type(self).__name__} does not say how to compute its loss")

    def weight(self, targets: torch.Tensor) -> int:
        """How many terms a batch's mean loss averages (evaluation sums loss x weight)."""
        return targets.numel()


class CrossEntropy(Objective):
    classifies = True

    def __init__(self, label_smoothing: float = 0.0):
        self.label_smoothing = label_smoothing

    def __call__(self, output: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        # (B, C) vs (B,), or (B, T, V) vs (B, T): every target position counts once
        return F.cross_entropy(output.flatten(0, -2).float(), targets.flatten(),
                               label_smoothing=self.label_smoothing)


def _same_shape(name: str, output: torch.Tensor, targets: torch.Tensor) -> None:
    # broadcasting (B, 1) against (B,) would silently compare every pair
    if output.shape != targets.shape:
        raise ValueError(f"loss={name} compares outputs of shape {tuple(output.shape)} with "
                         f"targets of shape {tuple(targets.shape)}: they must be equal")


class MSE(Objective):
    def __call__(self, output: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        _same_shape("mse", output, targets)
        return F.mse_loss(output.float(), targets.float())


class BCEWithLogits(Objective):
    def __init__(self, pos_weight: float | None = None):
        self.pos_weight = pos_weight

    def __call__(self, output: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        _same_shape("bce_with_logits", output, targets)
        weight = None if self.pos_weight is None else torch.tensor(self.pos_weight,
                                                                   device=output.device)
        return F.binary_cross_entropy_with_logits(output.float(), targets.float(),
                                                  pos_weight=weight)


class FromModel(Objective):
    """loss=model: the output is the loss (or has it as .loss, like a transformers output)."""

    from_model = True

    def __call__(self, output: Any, targets: torch.Tensor) -> torch.Tensor:
        return getattr(output, "loss", output)

    def weight(self, targets: torch.Tensor) -> int:
        return len(targets)


class Wrapped(Objective):
    """A user's callable `(output, targets) -> loss`."""

    def __init__(self, fn: Callable[[Any, torch.Tensor], torch.Tensor]):
        self.fn = fn

    def __call__(self, output: Any, targets: torch.Tensor) -> torch.Tensor:
        return self.fn(output, targets)


def check(spec: dict[str, Any]) -> None:
    """loss._target_ imports and takes the YAML's arguments (ConfigError otherwise)."""
    target = targets.locate(spec.get(targets.TARGET), "loss._target_")
    if not callable(target):
        raise targets.ConfigError(f"loss._target_={spec[targets.TARGET]} is not callable: "
                                  "name a loss class or a function (output, targets) -> loss")
    at_call = 0 if inspect.isclass(target) else 2  # a function's (output, targets)
    targets.check_arguments(target, targets.arguments(spec), "loss", at_call=at_call)


def from_model(spec: dict[str, Any]) -> bool:
    """The loss the spec names is the model's own (loss=model)."""
    target = targets.locate(spec.get(targets.TARGET), "loss._target_")
    return bool(getattr(target, "from_model", False))


def build_loss(spec: dict[str, Any]) -> Objective:
    target = targets.locate(spec.get(targets.TARGET), "loss._target_")
    if not inspect.isclass(target):  # a function: the YAML's arguments bound as keywords
        return Wrapped(functools.partial(target, **targets.arguments(spec)))
    built = targets.build(spec)
    return built if isinstance(built, Objective) else Wrapped(built)
