"""trainer.fused_norms: a model's RMSNorm layers written out in Python (transformers' Llama,
Mistral, Qwen, Mixtral, DeepSeek: `weight * (x * rsqrt(mean(x^2) + eps))`) run as torch's
`nn.RMSNorm`, whose `F.rms_norm` is one fused kernel on a GPU that keeps only its input
(and one float per row) for backward, where the written-out form keeps a float32 copy of
its input and its normalized output: 6 bytes a value of width against 2 in bf16, twice a
block. torchtitan's `fused_rmsnorm` and Liger's kernel do the same. The weight is the same
Parameter under the same name, so checkpoints load either way.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F


def _eps(module: nn.Module) -> float | None:
    """The epsilon a written-out RMSNorm keeps (transformers' `variance_epsilon`, or `eps`)."""
    for name in ("variance_epsilon", "eps"):
        value = getattr(module, name, None)
        if isinstance(value, float):
            return value
    return None


def _candidate(module: nn.Module) -> bool:
    weight = getattr(module, "weight", None)
    return (type(module).__name__.endswith("RMSNorm") and not isinstance(module, nn.RMSNorm)
            and isinstance(weight, nn.Parameter) and weight.dim() == 1
            and _eps(module) is not None and not list(module.children()))


# class -> whether its forward computes torch's rms_norm (Gemma's scales by 1 + weight)
_TRIED: dict[type, bool] = {}


def fusable(module: nn.Module) -> bool:
    """A written-out RMSNorm whose forward gives what `F.rms_norm` gives: tried once per
    class, on a float32 instance of its own with a random weight, built on the CPU even
    where the model is built on meta or fake tensors."""
    if not _candidate(module):
        return False
    kind = type(module)
    if kind not in _TRIED:
        _TRIED[kind] = _tried(kind, _eps(module))
    return _TRIED[kind]


def _tried(kind: type, eps: float, width: int = 8) -> bool:
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    generator = torch.Generator().manual_seed(0)
    with unset_fake_temporarily(), torch.device("cpu"), torch.no_grad():
        try:  # transformers' RMSNorms take (hidden_size, eps)
            probe = kind(width, eps).float()
            probe.weight.copy_(torch.rand(width, generator=generator) + 0.5)
            x = torch.randn(3, width, generator=generator)
            written = probe(x)
        except Exception:  # noqa: BLE001 - a class built or called otherwise: left as it is
            return False
        fused = F.rms_norm(x, (width,), probe.weight, eps)
        return written.shape == fused.shape and torch.allclose(written, fused, rtol=1e-5,
                                                               atol=1e-6)


def fuse(model: nn.Module) -> int:
    """Each fusable RMSNorm of `model` replaced in place by an `nn.RMSNorm` holding the same
    weight; how many were replaced."""
    replaced = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if fusable(child):
                norm = nn.RMSNorm(child.weight.shape[0], eps=_eps(child),
                                  device=child.weight.device, dtype=child.weight.dtype)
                norm.weight = child.weight
                setattr(parent, name, norm)
                replaced += 1
    return replaced


# why trainer.fused_norms=true cannot apply to a model ({} its class)
NONE = ("trainer.fused_norms=true: {} has no RMSNorm written out as torch's rms_norm "
        "(transformers' Llama, Mistral, Qwen and their kin have), so nothing would be fused: "
        "leave trainer.fused_norms=false")
