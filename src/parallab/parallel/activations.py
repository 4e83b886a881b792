"""trainer.activation_checkpointing: keep fewer activations for backward and recompute the
rest, per stage (the first memory lever before a change of layout).

`full` recomputes each stage's forward in backward and keeps only its input; `selective`
keeps the outputs of the matmul-like ops of a stage (the costliest to recompute per byte,
torch.utils.checkpoint's selective policy, as torchtitan's op list) and recomputes the rest
(norms, activations, dropout, adds); `selective_alternate` keeps only every second Linear's
matmul output of those (torchtitan's op-level policy, its default: a Llama block's q, v,
gate and down projections kept, k, o and up recomputed), less memory than selective for
more recompute (an adapter's own Linear layers count in the alternation too).
trainer.activation_checkpointing_every=N checkpoints every Nth stage only, the 1st, the
N+1th, ... of those the model lists (a pipeline rank's gpt lists its placeholders too, a
transformers model its own blocks), the others keeping all (torchtitan's layer-level policy
is full with 2). Each stage is wrapped with torch's checkpoint_wrapper, whose state_dict
hooks keep the parameter names of checkpoints as they are, before compile and before any
parallel wrapper (fsdp shards the wrapped stage).
The stages: parallel.stages where given, else the model's checkpoint_stages() (gpt: its
transformer blocks, as torchtitan), else its stages, else a transformers model's blocks.
"""

from __future__ import annotations

import contextlib
from typing import Callable, Iterator

import torch
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
    checkpoint_wrapper,
)
from torch.utils.checkpoint import (
    SAC_IGNORED_OPS,
    CheckpointPolicy,
    create_selective_checkpoint_contexts,
)

from parallab.batch import local
from parallab.parallel import stages as stages_of

_aten = torch.ops.aten
# ops whose outputs selective keeps; the names torch has on this build
SAVED_OPS = frozenset(getattr(_aten, name).default for name in (
    "mm", "addmm", "bmm", "baddbmm", "convolution", "_scaled_mm",
    "_scaled_dot_product_flash_attention", "_scaled_dot_product_efficient_attention",
    "_scaled_dot_product_cudnn_attention", "_scaled_dot_product_flash_attention_for_cpu")
    if hasattr(_aten, name))

LINEAR_OPS = frozenset((_aten.mm.default, _aten.addmm.default))  # what nn.Linear calls

# profiler markers are not computation, yet selective checkpointing matches every op of a
# recompute to the forward's: FSDP2's hooks of a unit inside a checkpointed stage (an MoE
# layer's experts, sharded apart under expert parallelism) mark the forward and its
# recompute differently, which torch then refuses as a nondeterministic region
SAC_IGNORED_OPS.update({torch.ops.profiler._record_function_enter_new.default,
                        torch.ops.profiler._record_function_exit._RecordFunction})


def problem(mode: str, every: int = 1) -> str | None:
    if mode not in MODES:
        return (f"trainer.activation_checkpointing={mode} is unknown: use none, full, "
                "selective or selective_alternate")
    if not (isinstance(every, int) and every >= 1):
        return (f"trainer.activation_checkpointing_every={every} is out of range: checkpoint "
                "every Nth stage, N >= 1 (1: every stage)")
    if every != 1 and mode == "none":
        return (f"trainer.activation_checkpointing_every={every} with "
                "trainer.activation_checkpointing=none: it says which stages are checkpointed, "
                "and none are: set trainer.activation_checkpointing=full or selective (or drop "
                "it)")
    return None


def _keep_matmuls(ctx, op, *args, **kwargs) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE if op in SAVED_OPS else CheckpointPolicy.PREFER_RECOMPUTE


def _selective_contexts():
    return create_selective_checkpoint_contexts(_keep_matmuls)


def _alternate_contexts():
    """selective, every second Linear's matmul (mm, addmm) recomputed: counted apart in the
    forward and in the recompute, so both make the same choices (the count is the
    stage's, from one call)."""
    counts = {False: 0, True: 0}

    def policy(ctx, op, *args, **kwargs) -> CheckpointPolicy:
        if op in LINEAR_OPS:
            counts[ctx.is_recompute] += 1
            if counts[ctx.is_recompute] % 2 == 0:
                return CheckpointPolicy.PREFER_RECOMPUTE
        return _keep_matmuls(ctx, op)

    return create_selective_checkpoint_contexts(policy)


# the selective modes' checkpoint policies: the modes are these, none and full
CONTEXTS = {"selective": _selective_contexts, "selective_alternate": _alternate_contexts}
MODES = ("none", "full", *CONTEXTS)


def units(model: nn.Module, names: list[str] | None) -> list[nn.Module] | None:
    """The modules each checkpointed as one: parallel.stages, the model's own choice, or its
    stages; None where the model has none."""
    own = getattr(model, "checkpoint_stages", None)
    if not names and callable(own):
        return list(own())
    return stages_of.units(model, names)


def stages_problem(cfg) -> str | None:
    """None if the run checkpoints nothing or the model (built on meta) has units to
    checkpoint, else one line; a parallel.stages name that is no submodule is trial's."""
    mode = cfg.trainer.activation_checkpointing
    if mode == "none":
        return None
    from parallab.models import build_on_meta

    model = build_on_meta(cfg.model)
    try:
        why = units_problem(model, cfg.parallel.stages)
    except KeyError:
        stages_of.configured(model, cfg.parallel.stages)  # raises its one-line ConfigError
        raise
    return why and f"trainer.activation_checkpointing={mode}: {why}"


def units_problem(model: nn.Module, names: list[str] | None) -> str | None:
    """None if the model has units to checkpoint one by one, each a submodule of it: apply()
    puts each unit's checkpointed self in its parent's place, which the model itself or a
    wrapper its stages() makes on each call has not. KeyError for a name it lacks."""
    found = units(model, names)
    if not found:
        return ("the model declares no stages to checkpoint one by one: list its submodules "
                "in forward order in parallel.stages, give the model a stages() method, or "
                "use none")
    held = {id(m) for m in model.modules() if m is not model}
    loose = next((unit for unit in found if id(unit) not in held), None)
    if loose is None:
        return None
    what = "the model itself" if loose is model else \
        f"{type(loose).__name__}, no submodule of the model"
    source = "the model's checkpoint_stages()" if not names and callable(
        getattr(model, "checkpoint_stages", None)) else stages_of.source(model, names)
    return (f"{source} gives {what}, which it cannot wrap in a parent's place: give the "
            "model's own submodules in forward order (parallel.stages), or use none")


def apply(model: nn.Module, mode: str, names: list[str] | None = None, every: int = 1
          ) -> nn.Module:
    """`model` with each unit (every `every`th: the 1st, the N+1th, ...) replaced, in its
    parent, by its checkpoint-wrapped self."""
    if mode == "none":
        return model
    found = units(model, names)
    if found is None:  # (a pipeline rank may hold none of the blocks: [])
        raise ValueError("activation checkpointing needs the model's stages")
    parents = {id(child): (parent, name) for parent in model.modules()
               for name, child in parent.named_children()}
    # selective's kept outputs go through saved_tensors_hooks like any saved tensor (torch's
    # coming default), so save_on_cpu and saved_for_backward see them
    kwargs = ({"context_fn": CONTEXTS[mode], "respect_saved_tensors_hooks": True}
              if mode in CONTEXTS else {})
    for unit in found[::every]:
        if id(unit) not in parents:  # the model itself: nothing to put it into
            raise ValueError("a stage is the whole model; list its submodules as stages")
        parent, name = parents[id(unit)]
        # the RNG state is kept (torch's default) so dropout recomputes the same masks
        setattr(parent, name, checkpoint_wrapper(unit, **kwargs))
    return model


def _storages(tensor: torch.Tensor) -> list[torch.UntypedStorage]:
    """What `tensor` holds: a wrapper subclass's inner tensors' storages (a float8 tensor's
    one-byte data and its scale), whose own storage is sized as the high-precision tensor
    it stands for."""
    from torch.utils._python_dispatch import is_traceable_wrapper_subclass

    if not is_traceable_wrapper_subclass(tensor):
        return [tensor.untyped_storage()]
    names, _ = tensor.__tensor_flatten__()
    return [s for name in names for s in _storages(getattr(tensor, name))]


class Saved:
    """The storages autograd saved for backward while counting, by identity (a StorageImpl,
    which fake tensors have too), parameters left out; their bytes as of the call: counted
    when a step is over, a parameter gather FSDP has freed again counts 0.

    Two kinds, because they add up differently over a pipeline's micro-batches:
    `casts()`, copies of the model's parameters (autocast's low-precision casts of weights),
    which autocast caches for its whole context, so the micro-batches of one pipeline step
    share one copy that lives to the step's end; `per_pass()`, the rest (activations),
    which each forward pass saves anew and its backward frees. Calling it gives both."""

    def __init__(self, model: nn.Module):
        self.params = {id(p) for p in model.parameters()}
        # a DTensor by its shard: its wrapper's storage is sized as the whole tensor, and a
        # view of a weight's shard is not a view of its wrapper
        self.storages = {local(p).untyped_storage()._cdata for p in model.parameters()}
        self.saved: dict[int, torch.UntypedStorage] = {}
        self.cast_ids: set[int] = set()

    def pack(self, tensor: torch.Tensor) -> torch.Tensor:
        for storage in _storages(local(tensor)):
            if storage._cdata not in self.storages:
                self.saved[storage._cdata] = storage
                if is_cast(tensor, self.params):
                    self.cast_ids.add(storage._cdata)
        return tensor

    def casts(self) -> int:
        return sum(s.nbytes() for k, s in self.saved.items() if k in self.cast_ids)

    def per_pass(self) -> int:
        return sum(s.nbytes() for k, s in self.saved.items() if k not in self.cast_ids)

    def __call__(self) -> int:
        return sum(s.nbytes() for s in self.saved.values())

    def held(self, passes: float) -> float:
        """Bytes held at once over `passes` forward passes of what was counted (one): the
        activations of each, autocast's parameter casts once (shared by a step's passes)."""
        return self.per_pass() * passes + self.casts()


def is_cast(tensor: torch.Tensor, params: set[int]) -> bool:
    """A copy of one of `params` (their ids; or a view of one, as linear saves the weight
    transposed): made by _to_copy straight from the parameter's gradient accumulator, as
    autocast casts a weight (Saved, and simulate's trace, count it once a step)."""
    base = tensor if tensor._base is None else tensor._base
    node = base.grad_fn
    if node is None or node.name() != "ToCopyBackward0":
        return False
    source = node.next_functions[0][0]
    return id(getattr(source, "variable", None)) in params


@contextlib.contextmanager
def saved_for_backward(model: nn.Module) -> Iterator[Saved]:
    """While active, what autograd saves for backward is counted (Saved); a figure that
    does not depend on the device. A checkpointed stage saves only its inputs; a selective
    one also the outputs it keeps (routed through the hooks, in apply)."""
    saved = Saved(model)
    with torch.autograd.graph.saved_tensors_hooks(saved.pack, lambda tensor: tensor):
        yield saved


def saved_bytes(model: nn.Module, forward: Callable[[], torch.Tensor]) -> int:
    """Bytes of activations that `forward()` (a forward pass of `model`) keeps for backward."""
    with saved_for_backward(model) as saved:
        forward()
        return saved()
