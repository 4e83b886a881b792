"""What a traced step runs as a GPU would run it, where the CPU's fake tensors would run
something else: the causal mask left to the attention kernel, a value head narrower than
the query's taken by the fused attention kernel, torch's rms_norm as its fused kernel
(trace.py enters each around the traced step)."""

from __future__ import annotations

import contextlib
import sys
from typing import Iterator
from unittest import mock

import torch


@contextlib.contextmanager
def masks() -> Iterator[None]:
    """transformers looks for packed sequences in the position ids, which it cannot read
    from fake tensors, and then builds the whole causal mask, which on a device it leaves to
    the attention kernel's is_causal: the simulated batch packs none (its positions are
    0..T-1), so the trace runs the device's ops, no mask."""
    masking = sys.modules.get("transformers.masking_utils")
    if not hasattr(masking, "find_packed_sequence_indices"):
        yield
        return
    with mock.patch.object(masking, "find_packed_sequence_indices", lambda position_ids: None):
        yield


@contextlib.contextmanager
def attention() -> Iterator[None]:
    """A value head narrower than the query's (DeepSeek's latent attention: 128 against
    192), which a GPU's fused kernels take (cuDNN's, the memory-efficient one; flash
    attention once the value is padded, as transformers pads it) and a CPU's does not (it
    falls back to the scores in memory): padded to the query's width, the output cut back,
    so that the trace runs the fused kernel a GPU runs."""
    import torch.nn.functional as F

    original = F.scaled_dot_product_attention

    def fused(query, key, value, *args, **kwargs):
        width = value.shape[-1]
        if width >= query.shape[-1]:
            return original(query, key, value, *args, **kwargs)
        value = F.pad(value, (0, query.shape[-1] - width))
        return original(query, key, value, *args, **kwargs)[..., :width]

    with mock.patch.object(F, "scaled_dot_product_attention", fused):
        yield


class _FusedRMSNorm(torch.autograd.Function):
    """torch's rms_norm as a GPU runs it (`_fused_rms_norm`, one kernel each way), where a
    CPU's runs its composite ops and keeps float32 copies: what it keeps for backward (its
    input, weight and one float a row) and its bytes (the input read and the output
    written; backward, the gradient read twice and the input once, for the input's
    gradient and the weight's)."""

    @staticmethod
    def forward(ctx, x, weight, normed: int):
        rstd = x.new_empty((*x.shape[:x.dim() - normed], *[1] * normed), dtype=torch.float32)
        ctx.save_for_backward(x, weight, rstd)
        return x * weight if weight is not None else x.clone()

    @staticmethod
    def backward(ctx, grad):
        x, weight, rstd = ctx.saved_tensors
        if weight is None:
            return grad.clone(), None, None
        both = grad * x
        if x.dim() > weight.dim():
            both = both.sum(dim=tuple(range(x.dim() - weight.dim())))
        return grad * weight, both, None


@contextlib.contextmanager
def norms() -> Iterator[None]:
    """F.rms_norm (nn.RMSNorm's, a model's own, trainer.fused_norms') traced as the fused
    kernel a GPU runs (_FusedRMSNorm), under CUDA autocast's policy for it: a lower-precision
    input cast to float32 first, that copy the one kept."""
    import torch.nn.functional as F

    def fused(input, normalized_shape, weight=None, eps=None):
        if torch.is_autocast_enabled(input.device.type) and input.dtype != torch.float32:
            input = input.float()
            weight = weight.float() if weight is not None else None
        normed = 1 if isinstance(normalized_shape, int) else len(normalized_shape)
        return _FusedRMSNorm.apply(input, weight, normed)

    with mock.patch.object(F, "rms_norm", fused):
        yield
