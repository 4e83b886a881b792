"""The objective (the `loss` group): what a step minimises and how evaluation scores it.

Built in: auto (the default: the model's own loss where a dict batch's labels give it one,
else cross_entropy), cross_entropy (class scores against class indices, or per-position
scores against next tokens: every target position counts once, but ignored ones, -100),
fused_cross_entropy (the same, keeping only the logits for backward), mse,
bce_with_logits, and `model`, for a model whose forward takes the targets and returns the
loss (nanoGPT's (logits, loss), a transformers output's .loss). The built-in losses read
the logits of any output (.logits, ["logits"], a tuple's first element). Any other callable
`(output, targets) -> scalar loss` comes by `_target_`: a class (built with the YAML's
arguments, e.g. torch.nn.HuberLoss) or a function (its YAML arguments bound as keywords,
e.g. torch.nn.functional.smooth_l1_loss with beta); it gets the output as the model returns
it."""

from __future__ import annotations

import functools
import inspect
from collections.abc import Mapping
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn

from parallab import batch as batches
from parallab.config import targets


class Objective:
    """A loss: called with the model's output and the targets, returns a scalar tensor (the
    mean of its terms). A step's loss is token-correct: each micro-batch adds the sum of its
    terms divided by `items`, the terms of the whole global batch (all micro-batches, all
    data-parallel ranks) over the data-parallel ranks, so that the gradients every rank
    averages are those of the global batch's mean, however it is cut (step_loss)."""

    classifies = False  # targets are class indices: evaluation reports eval_accuracy
    from_model = False  # the forward gets the targets and returns the loss
    # takes logits cut by class over the tp ranks, a DTensor (tp_plans.shard_logits)
    takes_sharded_logits = False

    def __call__(self, output: Any, targets: torch.Tensor) -> torch.Tensor:
        raise TypeError(f"{type(self).__name__} does not say how to compute its loss")

    router_coefficient = 0.0  # a transformers MoE model's router_aux_loss_coef, where it outputs it
    aux: Any = 0.0  # its router loss term since last taken (observe/experts.py)

    def bind(self, model: nn.Module) -> Objective:
        """Learn what the model says of its own loss (FromModel) and of its router's (a
        transformers MoE model with output_router_logits); returns self."""
        config = getattr(batches.inner(model), "config", None)
        if getattr(config, "output_router_logits", False):
            self.router_coefficient = float(getattr(config, "router_aux_loss_coef", 0) or 0)
        return self

    def with_router_loss(self, output: Any, loss: torch.Tensor, added: bool = False
                         ) -> torch.Tensor:
        """The loss with a transformers MoE model's router loss (coefficient x aux_loss, as it
        computes it) weighted by this micro-batch's share of the step's tokens, as
        parallab's own routers' is (models/moe.py). `added`: the model's loss holds the
        term once already (its forward adds it to a loss of labels). The term joins the
        loss's gradient, not its value: train/loss stays the task loss, as parallab's own
        routers leave it, the term taken apart for train/aux."""
        aux = getattr(output, "aux_loss", None)
        if not self.router_coefficient or aux is None:
            return loss
        from parallab.models import moe

        term = self.router_coefficient * aux
        self.aux = self.aux + (term * moe.share()).detach()
        return loss + term * (moe.share() - (1 if added else 0)) - \
            (term * moe.share()).detach()

    def take_aux(self) -> Any:
        aux, self.aux = self.aux, 0.0
        return aux

    def count(self, targets: torch.Tensor | None) -> torch.Tensor | int:
        """How many terms the loss of a batch with these targets averages: one per sample."""
        return len(targets)

    def total(self, output: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """The sum of the batch's terms."""
        return self(output, targets) * self.count(targets)

    def scored(self, output: Any) -> Any:
        """What the loss reads of the model's output: its logits."""
        return scores(output)

    def step_loss(self, model: nn.Module, batch: Any, items) -> tuple[Any, torch.Tensor]:
        """The model's output on `batch` and the batch's share of the step's loss: the sum
        of its terms / `items` (in evaluation, the batch's own count: its mean); items None:
        the batch's own mean."""
        output = batches.call(model, batch, with_targets=False)
        scored, labels = self.scored(output), batches.labels_of(batch)
        if items is None:
            return output, self.with_router_loss(output, self(scored, labels))
        return output, self.with_router_loss(output, self.total(scored, labels) / items)


class OutputError(TypeError):
    """The model's output does not carry what the loss reads: one line naming its type."""


def scores(output: Any) -> torch.Tensor:
    """The logits of an output; OutputError naming its type where it carries none."""
    logits = batches.logits_in(output)
    if logits is None:
        raise OutputError(f"the model returns {batches.describe(output)}: no logits to score "
                        "(a tensor, .logits, [\"logits\"] or a tuple's first element)")
    return logits


class CrossEntropy(Objective):
    classifies = True

    def __init__(self, label_smoothing: float = 0.0):
        self.label_smoothing = label_smoothing

    @property
    def takes_sharded_logits(self) -> bool:
        # torch's loss_parallel computes the plain cross-entropy only, as _loss calls it (a
        # subclass of one's own may read the logits otherwise: they come whole)
        return self.label_smoothing == 0 and type(self) in (CrossEntropy, Auto)

    def __call__(self, output: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return self._loss(output, targets, "mean")

    def _loss(self, output: torch.Tensor, targets: torch.Tensor, reduction: str) -> torch.Tensor:
        # (B, C) vs (B,), or (B, T, V) vs (B, T): every target position counts once, but the
        # ignored ones (-100)
        loss = F.cross_entropy(output.flatten(0, -2).float(), targets.flatten(),
                               label_smoothing=self.label_smoothing, reduction=reduction,
                               ignore_index=batches.IGNORE_INDEX)
        # of logits cut by class (loss_parallel), a DTensor each tp rank holds whole
        return batches.local(loss)

    def count(self, targets: torch.Tensor) -> torch.Tensor:
        return batches.valid(targets).sum()

    def total(self, output: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return self._loss(output, targets, "sum")


class FusedCrossEntropy(CrossEntropy):
    """cross_entropy's loss, gradients and accuracy, computed as a fused kernel computes
    them (flash-attn's, as MosaicML's runs take it; Liger's): in float32 a slice of rows at
    a time, keeping for backward only the logits as the model gave them (bf16 under bf16
    precision), the gradient made in the logits' own dtype. cross_entropy keeps the float32
    log-probabilities of every position and class and makes their float32 gradient: over a
    vocabulary of 50,000-250,000, a large share of a step's peak."""

    takes_sharded_logits = False  # the logits come whole under tp (no loss_parallel)

    def _loss(self, output: torch.Tensor, targets: torch.Tensor, reduction: str) -> torch.Tensor:
        targets = targets.flatten()
        total = _FusedSum.apply(output.flatten(0, -2), targets, self.label_smoothing)
        return total if reduction == "sum" else total / self.count(targets)


class _FusedSum(torch.autograd.Function):
    """The summed cross-entropy of logits (N, V) against targets (N,), ignored ones
    (-100) adding nothing, a slice of rows at a time: each slice's float32 log-softmax (or
    softmax, for the gradient) made from the logits in one pass and dropped. Torch's own
    ops, for any device."""

    SLICE_BYTES = 2**28  # a float32 slice of rows at most (the most held beside the logits)

    @staticmethod
    def forward(ctx, logits: torch.Tensor, targets: torch.Tensor, smoothing: float):
        valid = targets != batches.IGNORE_INDEX
        picked_at = torch.where(valid, targets, 0).unsqueeze(1)
        terms = torch.empty(len(targets), dtype=torch.float32, device=logits.device)
        for rows in _FusedSum.slices(logits):
            logp = torch.log_softmax(logits[rows], dim=-1, dtype=torch.float32)
            terms[rows] = -(1 - smoothing) * logp.gather(1, picked_at[rows]).squeeze(1)
            if smoothing:  # torch's: the mean over classes of -log p, weighted
                terms[rows] -= smoothing * logp.mean(dim=-1)
        ctx.save_for_backward(logits, picked_at, valid)
        ctx.smoothing = smoothing
        return torch.where(valid, terms, 0.0).sum()

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        logits, picked_at, valid = ctx.saved_tensors
        smoothing = ctx.smoothing
        scale = torch.where(valid, grad.float(), 0.0).unsqueeze(1)
        minus = torch.full(picked_at.shape, smoothing - 1.0, dtype=torch.float32,
                           device=logits.device)  # added at each target
        out = torch.empty_like(logits)
        for rows in _FusedSum.slices(logits):
            g = torch.softmax(logits[rows], dim=-1, dtype=torch.float32)
            g.scatter_add_(1, picked_at[rows], minus[rows])
            if smoothing:
                g -= smoothing / logits.shape[-1]
            # cast as it is copied (mul's out= in another dtype is a slow path on CPU)
            out[rows].copy_(g.mul_(scale[rows]))
        return out, None, None

    @staticmethod
    def slices(logits: torch.Tensor) -> list[slice]:
        n, classes = logits.shape
        step = max(1, _FusedSum.SLICE_BYTES // (4 * classes))
        return [slice(start, start + step) for start in range(0, n, step)]


def _same_shape(name: str, output: torch.Tensor, targets: torch.Tensor) -> None:
    # broadcasting (B, 1) against (B,) would silently compare every pair
    if output.shape != targets.shape:
        raise ValueError(f"loss={name} compares outputs of shape {tuple(output.shape)} with "
                         f"targets of shape {tuple(targets.shape)}: they must be equal")


class MSE(Objective):
    def __call__(self, output: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return self.total(output, targets) / targets.numel()

    def count(self, targets: torch.Tensor) -> int:
        return targets.numel()  # the mean is over every element

    def total(self, output: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        _same_shape("mse", output, targets)
        return F.mse_loss(output.float(), targets.float(), reduction="sum")


class BCEWithLogits(Objective):
    def __init__(self, pos_weight: float | None = None):
        self.pos_weight = pos_weight

    def __call__(self, output: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return self.total(output, targets) / targets.numel()

    def count(self, targets: torch.Tensor) -> int:
        return targets.numel()

    def total(self, output: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        _same_shape("bce_with_logits", output, targets)
        weight = None if self.pos_weight is None else torch.tensor(self.pos_weight,
                                                                   device=output.device)
        return F.binary_cross_entropy_with_logits(output.float(), targets.float(),
                                                  pos_weight=weight, reduction="sum")


class FromModel(Objective):
    """The model's own loss: the forward gets the targets (a dict batch's labels, or a
    pair's second element) and returns the loss, or an output carrying it (`.loss`,
    `["loss"]`, the one scalar of a tuple). A forward that takes num_items_in_batch (a
    transformers model) gets the step's count, so that its loss is already the sum over its
    valid labels divided by it; any other's mean is weighted by its batch's count."""

    from_model = True
    takes_items = False  # the forward takes num_items_in_batch
    shifts = False  # the loss compares position t's output with label t + 1 (a causal LM)

    def bind(self, model: nn.Module) -> FromModel:
        from parallab.models import hf

        self.takes_items = batches.takes_items(model)
        self.shifts = hf.shifts_labels(batches.inner(model))
        return super().bind(model)

    def __call__(self, output: Any, targets: torch.Tensor | None = None) -> torch.Tensor:
        loss = batches.loss_in(output)
        if loss is None:
            raise OutputError(f"loss=model: the model returns {batches.describe(output)}, with "
                            "no loss in it (.loss, [\"loss\"], or the one scalar of a tuple): "
                            "give the forward the targets and return the loss, or use a loss "
                            "of the output, e.g. loss=cross_entropy")
        return loss

    def count(self, targets: torch.Tensor | None) -> torch.Tensor | int:
        if targets is None:
            return 1
        if targets.is_floating_point() or targets.dim() < 2:  # one term per sample
            return len(targets)
        return batches.valid(targets[..., 1:] if self.shifts else targets).sum()

    def step_loss(self, model: nn.Module, batch: Any, items) -> tuple[Any, torch.Tensor]:
        if self.takes_items and items is not None:
            output = batches.call(model, batch, with_targets=True, num_items_in_batch=items)
            return output, self.with_router_loss(output, self(output), added=True)
        output = batches.call(model, batch, with_targets=True)
        if items is None:
            return output, self.with_router_loss(output, self(output), added=True)
        return output, self(output) * self.count(batches.labels_of(batch)) / items


class Wrapped(Objective):
    """A user's callable `(output, targets) -> loss`, a mean over the batch's samples."""

    def __init__(self, fn: Callable[[Any, torch.Tensor], torch.Tensor]):
        self.fn = fn

    def __call__(self, output: Any, targets: torch.Tensor) -> torch.Tensor:
        return self.fn(output, targets)

    def scored(self, output: Any) -> Any:
        return output  # as the model returns it: the user's function reads what it needs


class Auto(CrossEntropy):
    """loss=auto (the default): the model's own loss where the batch is a dict carrying
    labels and the forward returns a loss with them (as transformers' Trainer takes it),
    else cross_entropy. The controller decides on one batch (resolve) before any worker
    starts; built unresolved (no trial: parallab's own parts), it is cross_entropy."""


AUTO = "parallab.loss.Auto"
CROSS_ENTROPY = "parallab.loss.CrossEntropy"
FROM_MODEL = "parallab.loss.FromModel"


def resolve(spec: dict[str, Any], model: nn.Module | None, batch: Any) -> dict[str, Any]:
    """loss=auto as the loss it is for this model and data (`model` None: parallab's own
    model, which returns scores); any other spec as it is."""
    if spec.get(targets.TARGET) != AUTO:
        return spec
    labelled = isinstance(batch, Mapping) and batches.LABELS in batch
    if model is None or not labelled:
        return {targets.TARGET: CROSS_ENTROPY}
    with torch.no_grad():
        output = batches.call(model, batch, with_targets=True)
    return {targets.TARGET: FROM_MODEL if batches.loss_in(output) is not None
            else CROSS_ENTROPY}


def check(spec: dict[str, Any]) -> None:
    """loss._target_ imports and takes the YAML's arguments (ConfigError otherwise)."""
    target = targets.locate(spec.get(targets.TARGET), "loss._target_")
    if not callable(target):
        raise targets.ConfigError(f"loss._target_={spec[targets.TARGET]} is not callable: "
                                  "name a loss class or a function (output, targets) -> loss")
    at_call = 0 if inspect.isclass(target) else 2  # a function's (output, targets)
    targets.check_arguments(target, targets.arguments(spec), "loss", at_call=at_call)
    targets.check_types(target, targets.arguments(spec), "loss")


def from_model(spec: dict[str, Any]) -> bool:
    """The loss the spec names is the model's own (loss=model)."""
    target = targets.locate(spec.get(targets.TARGET), "loss._target_")
    return bool(getattr(target, "from_model", False))


def build_loss(spec: dict[str, Any]) -> Objective:
    target = targets.locate(spec.get(targets.TARGET), "loss._target_")
    if not inspect.isclass(target):  # a function: the YAML's arguments bound as keywords
        return Wrapped(functools.partial(target, **targets.arguments(spec)))
    built = targets.build_checked(spec, "loss")  # a constructor's fault said as the loss's
    return built if isinstance(built, Objective) else Wrapped(built)
