"""trainer.activation_checkpointing: keep fewer activations for backward and recompute the
rest, per stage (the first memory lever before a change of strategy).

`full` recomputes each stage's forward in backward and keeps only its input; `selective`
keeps the outputs of the matmul-like ops of a stage (the costliest to recompute per byte,
torch.utils.checkpoint's selective policy, as torchtitan's op list) and recomputes the
rest (norms, activations, dropout, adds). Each stage is wrapped with torch's
checkpoint_wrapper, whose state_dict hooks keep the parameter names of checkpoints as they
are, before compile and before any parallel wrapper (fsdp shards the wrapped stage).
The stages: parallel.stages where given, else the model's checkpoint_stages() (gpt: its
transformer blocks, as torchtitan), else its stages.
"""

from __future__ import annotations

import contextlib
from typing import Callable, Iterator

import torch
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from parallab.parallel import stages as stages_of

MODES = ("none", "full", "selective")
_aten = torch.ops.aten
# ops whose outputs selective keeps; the names torch has on this build
SAVED_OPS = frozenset(getattr(_aten, name).default for name in (
    "mm", "addmm", "bmm", "baddbmm", "convolution", "_scaled_mm",
    "_scaled_dot_product_flash_attention", "_scaled_dot_product_efficient_attention",
    "_scaled_dot_product_cudnn_attention", "_scaled_dot_product_flash_attention_for_cpu")
    if hasattr(_aten, name))


def problem(mode: str) -> str | None:
    if mode not in MODES:
        return (f"trainer.activation_checkpointing={mode} is unknown: use none, full or "
                "selective")
    return None


def _keep_matmuls(ctx, op, *args, **kwargs) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE if op in SAVED_OPS else CheckpointPolicy.PREFER_RECOMPUTE


def _selective_contexts():
    return create_selective_checkpoint_contexts(_keep_matmuls)


def units(model: nn.Module, names: list[str] | None) -> list[nn.Module] | None:
    """The modules each checkpointed as one: parallel.stages, the model's own choice, or its
    stages; None where the model has none."""
    own = getattr(model, "checkpoint_stages", None)
    if not names and callable(own):
        return list(own())
    return stages_of.find(model, names)


def stages_problem(cfg) -> str | None:
    """None if the run checkpoints nothing or the model (built on meta) has units to
    checkpoint, else one line; a parallel.stages name that is no submodule is trial's."""
    mode = cfg.trainer.activation_checkpointing
    if mode == "none":
        return None
    from parallab import trial

    model = trial.model_on_meta(cfg)
    try:
        found = units(model, cfg.parallel.stages)
    except KeyError:
        found = trial.find_stages(model, cfg)  # raises its one-line ConfigError
    if found:
        return None
    return (f"trainer.activation_checkpointing={mode}: the model declares no stages to "
            "checkpoint one by one: list its submodules in forward order in parallel.stages, "
            "give the model a stages() method, or use none")


def apply(model: nn.Module, mode: str, names: list[str] | None = None) -> nn.Module:
    """`model` with each unit replaced, in its parent, by its checkpoint-wrapped self."""
    if mode == "none":
        return model
    found = units(model, names)
    if not found:
        raise ValueError("activation checkpointing needs the model's stages")
    parents = {id(child): (parent, name) for parent in model.modules()
               for name, child in parent.named_children()}
    # selective's kept outputs go through saved_tensors_hooks like any saved tensor (torch's
    # coming default), so save_on_cpu and saved_for_backward see them
    kwargs = ({"context_fn": _selective_contexts, "respect_saved_tensors_hooks": True}
              if mode == "selective" else {})
    for unit in found:
        if id(unit) not in parents:  # the model itself: nothing to put it into
            raise ValueError("a stage is the whole model; list its submodules as stages")
        parent, name = parents[id(unit)]
        # the RNG state is kept (torch's default) so dropout recomputes the same masks
        setattr(parent, name, checkpoint_wrapper(unit, **kwargs))
    return model


@contextlib.contextmanager
def saved_for_backward(model: nn.Module) -> Iterator[Callable[[], int]]:
    """While active, every storage autograd saves for backward (parameters left out) is
    kept by identity (its StorageImpl, which fake tensors have too); the function yielded
    gives their bytes as of the call: made when a step is over, a parameter gather FSDP has
    freed again counts 0. A figure that does not depend on the device. A checkpointed stage
    saves only its inputs; a selective one also the outputs it keeps (routed through the
    hooks, below)."""
    params = {p.untyped_storage()._cdata for p in model.parameters()}
    saved: dict[int, torch.UntypedStorage] = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        if storage._cdata not in params:
            saved[storage._cdata] = storage
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        yield lambda: sum(s.nbytes() for s in saved.values())


def saved_bytes(model: nn.Module, forward: Callable[[], torch.Tensor]) -> int:
    """Bytes of activations that `forward()` (a forward pass of `model`) keeps for backward."""
    with saved_for_backward(model) as saved:
        forward()
        return saved()
