"""Communication volume: the bytes one rank sends per collective kind in one training step.

Every collective torch runs goes through the dispatcher as a c10d op (DDP's bucketed
all-reduce from C++, FSDP2's all-gather and reduce-scatter, pipeline sends) or a functional
collective (DTensor's, tensor parallel), so one TorchDispatchMode sees them all. Each is
counted as the bytes a rank sends under the usual ring algorithms, the "bus bytes" of
nccl-tests: all-reduce 2(n-1)/n x the tensor, all-gather (n-1) x the input shard,
reduce-scatter (n-1)/n x the input, an all-to-all (n-1)/n x its input (expert
parallelism's tokens: the share that stays on the rank is an even one), a send its tensor. The figure depends on the layout,
the model and the batch, not on the device, so layouts compare on any machine.
"""

from __future__ import annotations

import collections
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

KINDS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "p2p", "broadcast")
MB = 2**20


def _group_size(args: tuple, kwargs: dict) -> int:
    """The process group's size: an argument of c10d ops (a ProcessGroup) or of functional
    collectives (group_size, or a group name)."""
    from torch.distributed import ProcessGroup
    from torch.distributed.distributed_c10d import _resolve_process_group

    for value in (*args, *kwargs.values()):
        if isinstance(value, torch.ScriptObject) and "ProcessGroup" in str(value._type()):
            return ProcessGroup.unbox(value).size()
    # a functional collective's group name is its last string argument (after reduce_op)
    name = kwargs.get("group_name") or next(
        (v for v in reversed(args) if isinstance(v, str)), None)
    return _resolve_process_group(name).size() if name else 1


def _nbytes(value: Any) -> int:
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, (list, tuple)):
        return sum(_nbytes(v) for v in value)
    return 0


# op name -> (kind, the argument holding the data, factor of n giving the bytes sent)
_OPS = {
    "c10d.allreduce_": ("all_reduce", 0, lambda n: 2 * (n - 1) / n),
    "_c10d_functional.all_reduce": ("all_reduce", 0, lambda n: 2 * (n - 1) / n),
    "_c10d_functional.all_reduce_coalesced": ("all_reduce", 0, lambda n: 2 * (n - 1) / n),
    "c10d._allgather_base_": ("all_gather", 1, lambda n: n - 1),  # (output, input, ...)
    "c10d.allgather_": ("all_gather", 1, lambda n: n - 1),
    "c10d.allgather_into_tensor_coalesced_": ("all_gather", 1, lambda n: n - 1),
    "_c10d_functional.all_gather_into_tensor": ("all_gather", 0, lambda n: n - 1),
    "_c10d_functional.all_gather_into_tensor_coalesced": ("all_gather", 0, lambda n: n - 1),
    "c10d._reduce_scatter_base_": ("reduce_scatter", 1, lambda n: (n - 1) / n),
    "c10d.reduce_scatter_": ("reduce_scatter", 1, lambda n: (n - 1) / n),
    "c10d.reduce_scatter_tensor_coalesced_": ("reduce_scatter", 1, lambda n: (n - 1) / n),
    "_c10d_functional.reduce_scatter_tensor": ("reduce_scatter", 0, lambda n: (n - 1) / n),
    "_c10d_functional.reduce_scatter_tensor_coalesced": ("reduce_scatter", 0,
                                                         lambda n: (n - 1) / n),
    "c10d.alltoall_base_": ("all_to_all", 1, lambda n: (n - 1) / n),  # (output, input, ...)
    "_c10d_functional.all_to_all_single": ("all_to_all", 0, lambda n: (n - 1) / n),
    "c10d.send": ("p2p", 0, lambda n: 1),
    "_c10d_functional.isend": ("p2p", 0, lambda n: 1),
    "c10d.broadcast_": ("broadcast", 0, lambda n: (n - 1) / n),
}


class CommCounter(TorchDispatchMode):
    """While active: bytes this rank sends, and the collectives it calls, by kind (KINDS)."""

    def __init__(self):
        super().__init__()
        self.sent: collections.Counter[str] = collections.Counter()
        self.calls: collections.Counter[str] = collections.Counter()  # each replayed by advise
        self.ranks: collections.Counter[str] = collections.Counter()  # the largest group

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        known = _OPS.get(func.name().replace("::", ".").removesuffix(".default"))
        if known is not None:
            kind, index, factor = known
            n = _group_size(args, kwargs)
            if n > 1:
                self.sent[kind] += int(_nbytes(args[index]) * factor(n))
                self.calls[kind] += 1
                self.ranks[kind] = max(self.ranks[kind], n)
        return func(*args, **kwargs)

    def figures(self) -> dict[str, float]:
        """comm_mb_per_step (all kinds), and comm_<kind>_mb, comm_<kind>_calls and
        comm_<kind>_ranks (its largest group) for each kind that ran."""
        ran = [kind for kind in KINDS if self.calls[kind]]
        return {"comm_mb_per_step": sum(self.sent.values()) / MB,
                **{f"comm_{kind}_mb": self.sent[kind] / MB for kind in ran},
                **{f"comm_{kind}_calls": self.calls[kind] for kind in ran},
                **{f"comm_{kind}_ranks": self.ranks[kind] for kind in ran}}
