"""A batch as the data gives it, and how the model is called on it.

A batch is whatever the DataLoader's collate made of the samples: a tensor; an
`(inputs, targets)` pair (inputs may be a tensor, a dict or any nest of them); a dict, as
transformers batches are (`input_ids`, `attention_mask`, `labels`, ...); or nests of these.
Each tensor's first dimension is the sample.

    dict batch          model(**batch)                       labels: batch["labels"]
    (inputs, targets)   model(inputs), or under the model's  labels: targets
                        own loss model(inputs, targets)
    anything else       model(batch)                         no labels

Labels equal to IGNORE_INDEX (-100, torch's and transformers' convention) count nowhere: not
in the loss, not in accuracy, not as tokens.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Mapping
from typing import Any

import torch

IGNORE_INDEX = -100
LABELS = "labels"


def is_pair(batch: Any) -> bool:
    return isinstance(batch, (tuple, list)) and len(batch) == 2 and not isinstance(batch, str)


def labels_of(batch: Any) -> torch.Tensor | None:
    """The targets a batch carries: a dict's labels, a pair's second element, else None."""
    if isinstance(batch, Mapping):
        return batch.get(LABELS)
    if is_pair(batch):
        return batch[1]
    return None


def inputs_of(batch: Any) -> Any:
    """What the model takes without the targets: a dict less its labels, a pair's first."""
    if isinstance(batch, Mapping):
        return {k: v for k, v in batch.items() if k != LABELS}
    if is_pair(batch):
        return batch[0]
    return batch


def first_tensor(batch: Any) -> torch.Tensor | None:
    if isinstance(batch, torch.Tensor):
        return batch
    values = batch.values() if isinstance(batch, Mapping) else (
        batch if isinstance(batch, (tuple, list)) else ())
    for value in values:
        found = first_tensor(value)
        if found is not None:
            return found
    return None


def rows(batch: Any) -> int:
    """Samples in the batch: the first dimension of its first tensor."""
    if is_pair(batch) and isinstance(batch[1], torch.Tensor):  # the usual case, first
        return len(batch[1])
    tensor = first_tensor(batch)
    return len(tensor) if tensor is not None and tensor.dim() else 1


def apply(batch: Any, fn) -> Any:
    """`fn` on every tensor of the structure, the structure kept."""
    if isinstance(batch, torch.Tensor):
        return fn(batch)
    if isinstance(batch, Mapping):  # a plain dict (a BatchEncoding's data): model(**batch)
        return {k: apply(v, fn) for k, v in batch.items()}
    if isinstance(batch, (tuple, list)):
        return type(batch)(apply(b, fn) for b in batch)
    return batch


def take(batch: Any, n: int) -> Any:
    """The first n rows of every tensor."""
    return apply(batch, lambda t: t[:n] if t.dim() else t)


def pad_rows(batch: Any, n: int) -> Any:
    """Every tensor grown to n rows with copies of its first row (to be dropped after)."""
    def pad(t: torch.Tensor) -> torch.Tensor:
        if not t.dim() or len(t) >= n:
            return t
        return torch.cat([t, t[:1].expand(n - len(t), *t.shape[1:])])
    return apply(batch, pad)


def to_device(batch: Any, device: torch.device) -> Any:
    """Every tensor on `device`; a CPU run's batches as they are (no walk over them per step)."""
    if device.type == "cpu":
        return batch
    return apply(batch, lambda t: t.to(device, non_blocking=True))


def valid(labels: torch.Tensor) -> torch.Tensor:
    """Where the labels count (not IGNORE_INDEX); all of them for float targets."""
    if labels.is_floating_point():
        return torch.ones_like(labels, dtype=torch.bool)
    return labels != IGNORE_INDEX


def is_sequence(batch: Any) -> bool:
    """A language model's batch: integer labels per position, or input_ids."""
    labels = labels_of(batch)
    if isinstance(labels, torch.Tensor) and not labels.is_floating_point():
        return labels.dim() >= 2
    return isinstance(batch, Mapping) and "input_ids" in batch


def tokens(batch: Any) -> torch.Tensor | int:
    """Tokens the batch trains on: its labels that count, else its input ids (a tensor on the
    batch's device, summed by whoever reads it, so no device sync here)."""
    labels = labels_of(batch)
    if isinstance(labels, torch.Tensor) and labels.dim() >= 2:
        return valid(labels).sum()
    if isinstance(batch, Mapping) and "input_ids" in batch:
        return batch["input_ids"].numel()
    return 0


def seq_len(batch: Any) -> int | None:
    """Positions per sample of a language model's batch."""
    labels = labels_of(batch)
    for tensor in (labels, batch.get("input_ids") if isinstance(batch, Mapping) else None):
        if isinstance(tensor, torch.Tensor) and tensor.dim() >= 2:
            return tensor.shape[1]
    return None


@functools.lru_cache(maxsize=64)
def _forward_parameters(forward) -> tuple[list[str], bool]:
    """An unbound forward's parameter names (self excluded) and whether it takes **kwargs."""
    try:
        params = list(inspect.signature(forward).parameters.values())[1:]
    except (TypeError, ValueError):
        return [], True
    names = [p.name for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD,
                                                   p.KEYWORD_ONLY)]
    return names, any(p.kind is p.VAR_KEYWORD for p in params)


def inner(model: torch.nn.Module) -> torch.nn.Module:
    """The module whose forward says what the model takes (under DDP or DataParallel: the
    module it wraps)."""
    while isinstance(getattr(model, "module", None), torch.nn.Module):
        model = model.module
    return model


def parameters(model: torch.nn.Module) -> tuple[list[str], bool]:
    return _forward_parameters(type(inner(model)).forward)


def takes_targets(model: torch.nn.Module) -> bool:
    """The forward takes the targets too: a `labels` or `targets` parameter, or a second one."""
    names, _ = parameters(model)
    return LABELS in names or "targets" in names or len(names) >= 2


def takes_items(model: torch.nn.Module) -> bool:
    """The forward takes num_items_in_batch (transformers' loss kwargs): its loss is then the
    sum over the batch's valid labels divided by that number. A forward that names it; or a
    transformers model whose loss reads it (its own `accepts_loss_kwargs`, else **kwargs, as
    transformers' Trainer decides). Any other forward's **kwargs say nothing of its loss: a
    hand-written model that returns its own mean is weighted by its batch's count instead."""
    from parallab.models import hf

    names, open_ended = parameters(model)
    if "num_items_in_batch" in names:
        return True
    if not hf.is_transformers(inner(model)):
        return False
    flag = getattr(inner(model), "accepts_loss_kwargs", None)
    return bool(flag) if flag is not None else open_ended


def call(model: torch.nn.Module, batch: Any, with_targets: bool, **extra: Any) -> Any:
    """The model's output on `batch`; `with_targets`: the forward gets the targets too, so
    that it can compute its own loss; `extra`: keywords for the forward (num_items_in_batch)."""
    if isinstance(batch, Mapping):
        given = batch if with_targets else inputs_of(batch)
        return model(**given, **extra)
    if is_pair(batch):
        inputs, targets = batch
        if not with_targets:
            return model(**inputs) if isinstance(inputs, Mapping) else model(inputs)
        names, _ = parameters(model)
        if isinstance(inputs, Mapping):
            return model(**inputs, **{LABELS if LABELS in names else "targets": targets},
                         **extra)
        if LABELS in names:  # a transformers model: its second parameter is not the labels
            return model(inputs, labels=targets, **extra)
        return model(inputs, targets, **extra)
    return model(batch, **extra)


def describe(output: Any) -> str:
    """An output's type and keys, for messages."""
    name = type(output).__name__
    if isinstance(output, Mapping):
        return f"{name} with keys {', '.join(map(str, output.keys())) or 'none'}"
    if isinstance(output, (tuple, list)):
        parts = [f"tensor{tuple(o.shape)}" if isinstance(o, torch.Tensor) else type(o).__name__
                 for o in output]
        return f"{name} of {', '.join(parts) or 'nothing'}"
    if isinstance(output, torch.Tensor):
        return f"tensor of shape {tuple(output.shape)}"
    return name


def _field(output: Any, name: str) -> torch.Tensor | None:
    """`output.name` or `output[name]` (transformers' ModelOutput, a dict), if a tensor."""
    value = output.get(name) if isinstance(output, Mapping) else getattr(output, name, None)
    return value if isinstance(value, torch.Tensor) else None


def loss_in(output: Any) -> torch.Tensor | None:
    """The loss an output carries: `.loss` / `["loss"]`, the one scalar tensor of a tuple
    ((logits, loss), as nanoGPT returns), or the output itself when it is a scalar; None
    where there is none."""
    if isinstance(output, torch.Tensor):
        return output if output.dim() == 0 else None
    found = _field(output, "loss")
    if found is None and isinstance(output, (tuple, list)):
        scalars = [o for o in output if isinstance(o, torch.Tensor) and o.dim() == 0]
        return scalars[0] if len(scalars) == 1 else None
    return found


def logits_in(output: Any) -> torch.Tensor | None:
    """The scores an output carries: itself if a tensor, `.logits` / `["logits"]`, or a
    tuple's first tensor."""
    if isinstance(output, torch.Tensor):
        return output
    found = _field(output, "logits")
    if found is None and isinstance(output, (tuple, list)) and output:
        first = output[0]
        return first if isinstance(first, torch.Tensor) and first.dim() else None
    return found


def local(tensor: torch.Tensor) -> torch.Tensor:
    """What this rank holds of `tensor` (a DTensor's local shard; a tensor as it is)."""
    from torch.distributed.tensor import DTensor

    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def whole(output: Any) -> Any:
    """The output with each DTensor in it gathered whole (logits cut by vocabulary)."""
    from torch.distributed.tensor import DTensor
    from torch.utils._pytree import tree_map_only

    return tree_map_only(DTensor, lambda t: t.full_tensor(), output)


def weight(labels: torch.Tensor) -> torch.Tensor | int:
    """What a batch's figure is weighted by when figures are averaged over batches: a
    language model's valid labels (tokens), else its samples."""
    if not labels.is_floating_point() and labels.dim() >= 2:
        return valid(labels).sum()
    return len(labels)
