"""Sequence parallelism's gathered inputs freed after forward and gathered again in backward,
as Megatron-LM does (parallel.regather_in_backward).

Under sequence parallelism a split layer's input comes cut along the sequence and is
gathered whole as the layer (or a transformers block's attention or MLP) is called. Its
column-split linears save that whole input for their weights' gradients, so that each block
keeps tp slices' worth of it until backward. Here a module that gathers its input saves,
in place of the whole (any view of it that autograd keeps, or autocast's copy of it where
the stream is wider than the compute dtype), its rank's slice, and gathers that again
(and casts it, as autocast did) when backward asks for it: the same redistribute, the
same bytes, one more all-gather a gather. Made with torch's saved-tensor hooks, pushed over the module's forward:
what else is saved goes to the hooks below them (activation checkpointing's, a planner's
count), the slice too, so that each of those sees what is kept."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from parallab.parallel.sequence_parallel import hidden_states


def gather_again(model: nn.Module, names: list[str]) -> None:
    """Hooks on the modules of `model` named `names` (a tensor-parallel plan's): where one
    is called with a sequence-cut DTensor that its style gathers whole, the whole is saved
    as the slice (GatheredInput)."""
    for name in names:
        module = model.get_submodule(name)
        calls = _Calls()
        # first, before the style's own hook gathers the input; then, after it
        module.register_forward_pre_hook(calls.before, prepend=True, with_kwargs=True)
        module.register_forward_pre_hook(calls.after, with_kwargs=True)
        module.register_forward_hook(calls.done, always_call=True)


def _gathered(cut: Any, whole: Any) -> bool:
    """Whether the style's hook made `whole`, a plain tensor (or fake, as simulate traces),
    replicated, of the sequence `cut` came cut in. Not a float8 tensor, which torchao's
    styles gather in their own format."""
    from torch._subclasses.fake_tensor import FakeTensor
    from torch.distributed.tensor import DTensor, Replicate, Shard

    if not isinstance(cut, DTensor) or cut.placements != (Shard(1),) or whole is cut or \
            not torch.is_tensor(whole) or whole.shape != cut.shape:
        return False
    replicated = not isinstance(whole, DTensor) or whole.placements == (Replicate(),)
    local = _local(whole)
    return replicated and (type(local) is torch.Tensor or isinstance(local, FakeTensor))


def _checkpointed(hooks) -> bool:
    """Whether the saved-tensor hooks below are activation checkpointing's (its forward's
    or its recomputation's): a region it recomputes keeps none of the gathered input, and
    gathers it again as it recomputes."""
    return hooks is not None and getattr(hooks[0], "__qualname__", "").startswith(
        ("_checkpoint_hook.", "_recomputation_hook."))


def _local(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local tensor, or the tensor."""
    from torch.distributed.tensor import DTensor

    return t._local_tensor if isinstance(t, DTensor) else t


def _storage(t: torch.Tensor) -> Any:
    """The storage a tensor (a DTensor's local one) views; None for a subclass without one
    (a float8 tensor that a layer inside saves)."""
    try:
        return _local(t).untyped_storage()
    except (RuntimeError, NotImplementedError, TypeError):
        return None


class _Calls:
    """One module's hooks: the slice seen before its style's hook, the saved-tensor hooks
    pushed after it where the input came out gathered, popped as the forward ends. One
    call at a time (a module is not called inside itself); a style's hook that fails
    leaves nothing behind: the next call's `before` takes the slot."""

    def __init__(self):
        self.cut: Any = None
        self.gathered: GatheredInput | None = None
        self.hooks: Any = None

    def before(self, _, args, kwargs) -> None:
        self.cut = hidden_states(args, kwargs)

    def after(self, _, args, kwargs) -> None:
        cut, whole, self.cut = self.cut, hidden_states(args, kwargs), None
        below = torch._C._autograd._top_saved_tensors_default_hooks(False)
        if _gathered(cut, whole) and not _checkpointed(below):
            self.gathered = GatheredInput(cut, whole, below)
            self.hooks = self.gathered.hooks()
            self.hooks.__enter__()

    def done(self, *_) -> None:
        if self.hooks is not None:
            self.hooks.__exit__(None, None, None)
            self.gathered.release()
        self.gathered = self.hooks = None


def _cast_of(t: torch.Tensor, node: Any, numel: int) -> bool:
    """Whether `t` is (a view of) a cast of the tensor whose grad_fn is `node`, whole: the
    copy autocast makes of the gathered input for each split layer where the stream is of
    a wider dtype (a pipeline's parts not sharded, in bf16)."""
    fn = t.grad_fn
    for _ in range(3):  # the views a linear takes of its input (reshape, view)
        if fn is None:
            return False
        if fn.name() == "ToCopyBackward0":
            storage = _storage(t)
            return fn.next_functions[0][0] is node and storage is not None and \
                storage.nbytes() == numel * t.element_size()
        if "View" not in fn.name() and "Reshape" not in fn.name():
            return False
        fn = fn.next_functions[0][0]
    return False


@dataclass
class _Kept:
    """A saved view of the gathered input (or of a cast of it, `dtype`): its geometry in
    the whole's storage, and whether autograd saved the DTensor or its local tensor."""

    size: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int
    dtensor: bool
    dtype: torch.dtype | None = None


class GatheredInput:
    """One call's gathered input: kept as its slice (through the hooks below, where any),
    gathered again once however many of its views (or casts) backward unpacks, then let
    go. Of the whole, only its storage, geometry and autograd node are kept: not holding
    it is the point."""

    def __init__(self, cut: Any, whole: torch.Tensor, outer: Any):
        self.cut = cut  # the sequence-cut DTensor the module was called with, till packed
        self.outer = outer  # the saved-tensor hooks below these (pack, unpack), or None
        self.mesh = cut.device_mesh
        storage, local = _storage(whole), _local(whole)
        self.storage = None if storage is None else storage._cdata
        self.base_offset, self.contiguous = local.storage_offset(), local.is_contiguous()
        self.node, self.numel = whole.grad_fn, whole.numel()
        self.packed_cut: Any = None  # the slice, as the hooks below packed it
        self.views = self.unpacked = 0  # views of the whole (or of its casts) saved, given
        self.again: dict = {}  # dtype (None: the whole's) -> the whole made again, in use

    def hooks(self):
        return torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack)

    def release(self) -> None:
        """The forward is over: a slice no view took is let go (the hooks' unpack, which
        autograd keeps with each tensor saved under them, would hold it to backward)."""
        if self.views == 0:
            self.cut = None

    def pack(self, t: torch.Tensor) -> Any:
        from torch.distributed.tensor import DTensor

        storage = _storage(t)
        whole = self.contiguous and self.storage is not None and storage is not None and \
            storage._cdata == self.storage
        cast = not whole and self.node is not None and _cast_of(t, self.node, self.numel)
        if not whole and not cast:
            return (self.outer[0](t),) if self.outer else t
        local = _local(t)
        if self.views == 0:  # the slice saved as the hooks below would save it
            self.packed_cut = self.outer[0](self.cut) if self.outer else self.cut
            self.cut = None
        self.views += 1
        # a cast is a fresh contiguous copy: its views' offsets are from its start
        offset = local.storage_offset() - (self.base_offset if whole else 0)
        return _Kept(tuple(local.shape), tuple(local.stride()), offset,
                     isinstance(t, DTensor), None if whole else t.dtype)

    def unpack(self, packed: Any) -> torch.Tensor:
        if isinstance(packed, _Kept):
            return self.view(packed)
        return self.outer[1](packed[0]) if isinstance(packed, tuple) else packed

    def view(self, kept: _Kept) -> torch.Tensor:
        from torch.distributed.tensor import DTensor, Replicate

        if None not in self.again:
            cut = self.outer[1](self.packed_cut) if self.outer else self.packed_cut
            again = cut.redistribute(cut.device_mesh, (Replicate(),))._local_tensor
            self.again[None] = again if again.is_contiguous() else again.contiguous()
        if kept.dtype not in self.again:  # autocast's copy, made again as it made it
            self.again[kept.dtype] = self.again[None].to(kept.dtype)
        source = self.again[kept.dtype]
        self.unpacked += 1
        if self.unpacked % self.views == 0:
            # let go after the last view (a second backward over the same graph, as a
            # split backward's weight pass may make, gathers anew)
            self.again = {}
        offset = source.storage_offset() + kept.offset
        local = source.as_strided(kept.size, kept.stride, offset)
        if not kept.dtensor:
            return local
        return DTensor.from_local(local, self.mesh, (Replicate(),), run_check=False)
