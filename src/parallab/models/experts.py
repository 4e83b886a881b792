"""The experts of an MoE layer, and what a model holds of them: parallab's (gpt's), each a
SwiGLU network whose projections are 3-D weights (experts x out x in), and a transformers
MoE model's experts modules, which take the same call (hidden_states, top_k_index,
top_k_weights) and hold weights of experts x ... (Qwen3-MoE's gate_up_proj and down_proj).

A call sorts its (token, expert) pairs by expert, runs each expert's rows through it in
one grouped matmul (torch's grouped_mm; a loop over experts where it does not apply),
weights each pair's output by its router score and sums them back onto their tokens. Expert
parallelism (parallel/expert_parallel.py) keeps the sort and the sum and sends the rows to
the ranks holding their experts in between. What a layer's experts took is counted in a
Load (tokens per expert, pairs dropped and routed, the router loss), parallab's layers' and
a transformers model's experts modules' alike.
"""

from __future__ import annotations

import contextlib
import re
from typing import Iterator

import torch
import torch.nn.functional as F
from torch import nn

from parallab.batch import local
from parallab.models import hf


class _OnGrad(torch.autograd.Function):
    """Identity forward; backward `fn` of the gradient."""

    @staticmethod
    def forward(ctx, x, fn):
        ctx.fn = fn
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return ctx.fn(grad), None


def on_grad(x: torch.Tensor, fn) -> torch.Tensor:
    """x, whose gradient backward hands on as `fn` of it."""
    return _OnGrad.apply(x, fn)


def scale_grad(x: torch.Tensor, scale: float) -> torch.Tensor:
    """x, whose gradient is multiplied by `scale` (1: x as it is)."""
    return x if scale == 1.0 else on_grad(x, lambda grad: grad * scale)


_UNIFORM = [False]  # routing read from nothing: every expert an even share (a trace)


@contextlib.contextmanager
def uniform_routing() -> Iterator[None]:
    """Inside, each expert gets an even share of the (token, expert) pairs, whatever the
    router picked: a step traced on fake tensors, whose values cannot be read, routes as
    vendor benchmarks force it (parallab simulate)."""
    _UNIFORM[0] = True
    try:
        yield
    finally:
        _UNIFORM[0] = False


def uniform() -> bool:
    return _UNIFORM[0]


def even_counts(pairs: int, experts: int, like: torch.Tensor) -> torch.Tensor:
    """Each of `experts` an even share of `pairs` (the first ones one more where it does
    not divide), on `like`'s device; real even beside fake tensors: counts a step reads."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    share, rest = divmod(pairs, experts)
    with unset_fake_temporarily():
        return torch.tensor([share + (e < rest) for e in range(experts)],
                            device="cpu" if like.device.type == "meta" else like.device)


def sort_by_expert(ids: torch.Tensor, experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The (token, k) pairs of `ids` (N, k) in expert order, flat (ids >= experts: dropped,
    left out), and each expert's count."""
    if uniform():  # the pairs as they come, taken as sorted
        return torch.arange(ids.numel(), device=ids.device), even_counts(ids.numel(),
                                                                          experts, ids)
    flat = ids.flatten()
    counts = torch.bincount(flat, minlength=experts + 1)[:experts]
    order = flat.argsort(stable=True)[:int(counts.sum())]  # the dropped sort last
    return order, counts


def combine(out: torch.Tensor, order: torch.Tensor, weights: torch.Tensor, top_k: int,
            tokens: int) -> torch.Tensor:
    """Each sorted pair's output weighted and summed back onto its token: (tokens, C)."""
    weighted = out * weights.flatten()[order].unsqueeze(-1).to(out.dtype)
    return out.new_zeros(tokens, out.shape[-1]).index_add_(0, order // top_k, weighted)


def grouped_mm_applies(x: torch.Tensor, *weights: torch.Tensor) -> bool:
    """torch's grouped_mm takes these: bfloat16 (or float32 on a CPU, not compiled nor
    fake: the compiler's and the fake tensors' shape rule takes 16-bit inputs only) with
    every stride a multiple of 16 bytes; on a GPU the fast kernel is bfloat16's (Hopper
    and newer)."""
    from torch._subclasses.fake_tensor import FakeTensor

    # a GPU's rule where the tensors are fake (a trace, advise's memory): its shape rule
    # is the 16-bit one
    fp32 = not x.is_cuda and not torch.compiler.is_compiling() and not isinstance(x, FakeTensor)
    dtypes = (torch.bfloat16, torch.float32) if fp32 else (torch.bfloat16,)
    if not hasattr(F, "grouped_mm") or x.dtype not in dtypes:
        return False
    if x.is_cuda and torch.cuda.get_device_capability(x.device) < (9, 0):
        return False
    align = 16 // x.element_size()
    return all(w.shape[-1] % align == 0 and w.shape[-2] % align == 0 for w in weights)


class Experts(nn.Module):
    """`experts` SwiGLU networks, each projection one 3-D weight (experts x out x in):
    gate and up (hidden x width), down (width x hidden)."""

    def __init__(self, experts: int, width: int, hidden: int, top_k: int):
        super().__init__()
        self.num_experts, self.top_k = experts, top_k  # transformers' attribute name
        self.gate = nn.Parameter(torch.empty(experts, hidden, width))
        self.up = nn.Parameter(torch.empty(experts, hidden, width))
        self.down = nn.Parameter(torch.empty(experts, width, hidden))
        self.grouped = True  # grouped_mm where it applies; False: the loop over experts
        self.grad_scale = 1.0  # expert parallelism's share of each expert's gradient
        self.reset_parameters()

    def reset_parameters(self, std: float = 0.02, out_std: float | None = None) -> None:
        """normal(std) weights; the projection back (down) normal(out_std), as GPT-2 scales
        the residual stream's."""
        for weight in (self.gate, self.up):
            nn.init.normal_(weight, std=std)
        nn.init.normal_(self.down, std=std if out_std is None else out_std)

    def forward(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor
                ) -> torch.Tensor:
        """x (N, C), ids and weights (N, k) -> (N, C): each token's experts, weighted."""
        order, counts = sort_by_expert(ids, self.num_experts)
        out = self.compute(x[order // ids.shape[-1]], counts)
        return combine(out, order, weights, ids.shape[-1], len(x))

    def compute(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """Rows of x grouped by expert, counts[e] of them for expert e (of those this rank
        holds) -> each row through its expert."""
        weights = [scale_grad(local(w), self.grad_scale) for w in (self.gate, self.up, self.down)]
        dtype = torch.get_autocast_dtype(x.device.type) if torch.is_autocast_enabled(
            x.device.type) else x.dtype
        x, (gate, up, down) = x.to(dtype), [w.to(dtype) for w in weights]
        if self.grouped and grouped_mm_applies(x, gate, up, down):
            offsets = counts.cumsum(0).to(torch.int32)
            mm = lambda a, w: F.grouped_mm(a, w.transpose(-2, -1), offs=offsets)  # noqa: E731
            h = F.silu(mm(x, gate)) * mm(x, up)
            # grouped_mm's backward on a CPU takes a contiguous output gradient only (a
            # sum's expanded one fails with 'Invalid strides')
            return on_grad(mm(h, down), torch.Tensor.contiguous)
        outs, start = [], 0
        for e, n in enumerate(counts.tolist()):
            rows = x[start:start + n]
            outs.append(F.linear(F.silu(F.linear(rows, gate[e])) * F.linear(rows, up[e]),
                                 down[e]))
            start += n
        return torch.cat(outs) if outs else x.new_zeros(0, down.shape[1])


def experts_of(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The model's experts modules by name: parallab's, and those a transformers model's
    ep plan dispatches tokens to (its `ep_dispatch_experts`), each taking (hidden_states,
    top_k_index, top_k_weights) and holding weights of experts x ..."""
    regexes = [re.compile(r"[^.]+".join(map(re.escape, p.split("*"))))
               for p in hf.dispatched_experts(model)]
    return [(name, m) for name, m in model.named_modules()
            if isinstance(m, Experts) or any(r.fullmatch(name) for r in regexes)]


def count(model: nn.Module) -> int | None:
    """The experts each MoE layer holds (None: the model has none)."""
    found = experts_of(model)
    return int(found[0][1].num_experts) if found else None


def in_backward() -> bool:
    """A forward running again inside backward (activation checkpointing's recompute): its
    load is not counted twice."""
    return torch._C._current_graph_task_id() != -1


class Load:
    """What an MoE layer saw since it was last read: tokens per expert, pairs dropped and
    routed, and its router loss (each micro-batch's weighted by its share of its step)."""

    def __init__(self, experts: int):
        self.experts = experts
        self.step = torch.zeros(experts)  # this step's tokens per expert (bias balancing)
        self.window = torch.zeros(experts + 3)  # tokens per expert, dropped, routed, aux

    def add(self, counts: torch.Tensor, dropped: torch.Tensor, routed: int) -> None:
        if self.step.device != counts.device:
            self.step, self.window = self.step.to(counts.device), self.window.to(counts.device)
        self.step += counts
        self.window[:self.experts] += counts
        self.window[self.experts] += dropped
        self.window[self.experts + 1] += routed

    def add_aux(self, aux: torch.Tensor) -> None:
        self.window[self.experts + 2] += aux.to(self.window.device)

    def take_step(self) -> torch.Tensor:
        counts, self.step = self.step, torch.zeros_like(self.step)
        return counts

    def take_window(self) -> torch.Tensor:
        window, self.window = self.window, torch.zeros_like(self.window)
        return window


def count_ids(module: nn.Module, args: tuple) -> None:
    """A transformers experts module's call (hidden_states, top_k_index, top_k_weights)
    counted: the tokens its router sent each expert (dropless: none dropped)."""
    if module.training and not in_backward():
        load, ids = module.parallab_load, args[1]
        load.add(torch.bincount(ids.flatten(), minlength=load.experts).float(), 0, ids.numel())
