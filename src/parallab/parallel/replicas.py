"""A pipeline's replicas averaging their gradients beside the step's last backwards, as
DistributedDataParallel's buckets and Megatron-LM's overlapped gradient reduction do: a
bucket's all-reduce starts once each gradient in it has taken its last micro-batch, while
the rank's other parts are still running theirs (an interleaved schedule's first rank runs
its later parts' last backwards at least pp slots apart: parallel/schedules.py,
Schedule.settled), and the step waits for them all after the flush.

Buckets are launched in one fixed order (the parts from the last held, each part's
parameters from its last), a bucket only after the one before it, so that every replica
issues the same collectives in the same order whatever its backward reached first. A
gradient that takes no autograd accumulation hook (the zero-bubble schedules add their
weight gradients by hand) or none at all leaves its bucket, and those after it, to the
flush: the average is the same, only later. A parameter a replica's graph did not reach
takes its place there as zeros (DDP's rule), and the average where another replica's did.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from parallab import batch as batches


class Replicas:
    """The gradients of `parts` (a pipeline rank's, in the model's order) averaged over
    `group`'s `size` replicas in buckets of about `bucket_mb` MiB, each launched as its
    gradients have taken `microbatches` accumulations each (once per part holding it), and
    sent in `dtype` (precision.reduce_dtype: bfloat16 halves float32's bytes)."""

    def __init__(self, parts: list[nn.Module], group, size: int, microbatches: int,
                 bucket_mb: float, dtype: torch.dtype = torch.float32):
        self.group, self.size, self.dtype = group, size, dtype
        uses: dict[nn.Parameter, int] = {}
        for part in reversed(parts):  # a later part's last backward runs first
            for param in reversed(list(part.parameters())):
                if param.requires_grad:
                    uses[param] = uses.get(param, 0) + microbatches
        self.expected = uses
        self.buckets: list[list[nn.Parameter]] = []
        size_now, cap = 0.0, bucket_mb * 2**20
        for param in uses:
            if not self.buckets or size_now >= cap:
                self.buckets.append([])
                size_now = 0.0
            self.buckets[-1].append(param)
            size_now += batches.local(param).numel() * param.element_size()
        self.bucket_of = {p: i for i, bucket in enumerate(self.buckets) for p in bucket}
        self.counts: dict[nn.Parameter, int] = {}
        self.waiting: list[int] = []  # each bucket's gradients still short of their count
        self.launched: list[tuple[Any, torch.Tensor, list[nn.Parameter], list[torch.Tensor]]] = []
        self.armed = False
        for param in uses:
            param.register_post_accumulate_grad_hook(self._landed)

    def arm(self) -> None:
        """The next backwards are the step's last before the optimizer: reduce as they land."""
        self.counts = dict.fromkeys(self.expected, 0)
        self.waiting = [len(bucket) for bucket in self.buckets]
        self.launched = []
        self.armed = True

    def _landed(self, param: nn.Parameter) -> None:
        """One accumulation of `param`'s gradient (a constant time on each: it runs in
        every micro-batch's backward)."""
        if not self.armed:
            return
        self.counts[param] += 1
        if self.counts[param] == self.expected[param]:
            self.waiting[self.bucket_of[param]] -= 1
        while len(self.launched) < len(self.buckets) and not self.waiting[len(self.launched)]:
            self._launch(self.buckets[len(self.launched)])

    def _launch(self, bucket: list[nn.Parameter]) -> None:
        import torch.distributed as dist
        from torch._utils import _flatten_dense_tensors

        # every parameter of the bucket has its place on every replica (a missing
        # gradient's zeros) and one number more saying whether it had one, so that the
        # buffers match whatever each replica's graph reached (DDP's rule); a tp-split
        # gradient's replicas hold the same shard: its local tensor is averaged
        held = [batches.local(p.grad) if p.grad is not None else
                torch.zeros_like(batches.local(p)) for p in bucket]
        had = held[0].new_tensor([float(p.grad is not None) for p in bucket])
        flat = _flatten_dense_tensors([*held, had]).to(self.dtype)
        self.launched.append((dist.all_reduce(flat, group=self.group, async_op=True), flat,
                              bucket, [*held, had]))

    def finish(self) -> None:
        """The buckets not yet launched launched, every one waited for and its average
        written back into the gradients: a gradient none was made for here, but another
        replica made one, takes the average too, so that the replicas stay one model.
        Called after the step's schedule, whether or not it raised (every replica then
        issues every bucket once, in order)."""
        from torch._utils import _unflatten_dense_tensors

        self.armed = False
        for bucket in self.buckets[len(self.launched):]:
            self._launch(bucket)
        for work, flat, bucket, held in self.launched:
            work.wait()
            flat = flat / self.size  # (each cast to its gradient's own dtype as it lands:
            # a bucket can hold a float32 weight beside bfloat16 ones)
            *averages, had = _unflatten_dense_tensors(flat, held)
            for i, (param, here, averaged) in enumerate(zip(bucket, held, averages)):
                if param.grad is not None:
                    here.copy_(averaged)
                elif had[i].item():  # (read on the host only where a gradient is missing)
                    param.grad = _as_gradient(param, averaged.to(param.dtype))
        self.launched = []


def _as_gradient(param: nn.Parameter, local: torch.Tensor) -> torch.Tensor:
    """`local` (this rank's share of `param`'s averaged gradient) as its gradient."""
    from torch.distributed.tensor import DTensor

    local = local.clone()
    if isinstance(param, DTensor):
        return DTensor.from_local(local, param.device_mesh, param.placements, run_check=False)
    return local
