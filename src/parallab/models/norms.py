"""trainer.fused_norms: a model's RMSNorm layers written out in Python (transformers' Llama,
Mistral, Qwen, Mixtral, DeepSeek: the input cast to float32, normed, cast back and scaled
by the weight) run as torch's `nn.RMSNorm`, whose `F.rms_norm` is one fused kernel on a
GPU keeping only its input (and one float a row) for backward, where the written-out form
keeps its normed output and, for a bf16 input, a float32 copy of it: 2 bytes a value of
width against 6, twice a block. torchtitan's `fused_rmsnorm` and Liger's kernel do the
same. The weight is the same Parameter under the same name, so checkpoints load either
way. In float32 the two give the same values; in bf16 the fused kernel rounds once, after
the weight, where the written-out form rounds before it too.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F


class FusedRMSNorm(nn.RMSNorm):
    """torch's RMSNorm in its input's dtype, outside autocast (whose CUDA policy would cast a
    bf16 input to float32 and keep that copy for backward), as torchtitan runs it."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight = self.weight.to(x.dtype) if self.weight is not None else None
        with torch.autocast(x.device.type, enabled=False):
            return F.rms_norm(x, self.normalized_shape, weight, self.eps)


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


def _settings(module: nn.Module) -> tuple:
    """What a module holds beside its tensors (its epsilon, a flag that changes its form):
    a class's modules are tried once for each set of these."""
    return tuple(sorted((k, v) for k, v in vars(module).items() if k != "training"
                        and not k.startswith("_") and isinstance(v, (bool, int, float, str))))


# (class, settings) -> whether the module computes torch's rms_norm (Gemma's: 1 + weight)
_TRIED: dict[tuple, bool] = {}


def fusable(module: nn.Module) -> bool:
    """A written-out RMSNorm whose forward gives what `F.rms_norm` gives: tried once per
    class and settings, on a float32 instance with its settings and a random weight, made
    on the CPU even where the model is built on meta or fake tensors."""
    if not _candidate(module):
        return False
    key = (type(module), _settings(module))
    if key not in _TRIED:
        tried = _tried(module)
        if tried is None:  # a class built or called otherwise: left as it is, asked again
            return False
        _TRIED[key] = tried
    return _TRIED[key]


def _tried(module: nn.Module, width: int = 8) -> bool | None:
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    eps = _eps(module)
    generator = torch.Generator().manual_seed(0)
    with unset_fake_temporarily(), torch.device("cpu"), torch.no_grad():
        try:  # transformers' RMSNorms take (hidden_size, eps)
            probe = type(module)(width, eps)
            vars(probe).update(_settings(module))
            probe = probe.to_empty(device="cpu").float()  # built on meta where asked so
            probe.weight.copy_(torch.rand(width, generator=generator) + 0.5)
            x = torch.randn(3, width, generator=generator)
            written = probe(x)
        except Exception:  # noqa: BLE001 - a constructor or forward of another form
            return None
        fused = F.rms_norm(x, (width,), probe.weight, eps)
        return written.shape == fused.shape and torch.allclose(written, fused, rtol=1e-5,
                                                               atol=1e-6)


def fuse(model: nn.Module) -> int:
    """Each fusable RMSNorm of `model` replaced in place by a FusedRMSNorm holding the same
    weight (one for a module two parents share); how many were replaced."""
    made: dict[int, nn.Module] = {}
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if id(child) not in made and fusable(child):
                norm = FusedRMSNorm(child.weight.shape[0], eps=_eps(child),
                                    device=child.weight.device, dtype=child.weight.dtype)
                norm.weight = child.weight
                made[id(child)] = norm
            if id(child) in made:
                setattr(parent, name, made[id(child)])
    return len(made)


# why trainer.fused_norms=true cannot apply to a model ({} its class)
NONE = ("trainer.fused_norms=true: {} has no RMSNorm written out as torch's rms_norm "
        "(transformers' Llama, Mistral, Qwen and their kin have), so nothing would be fused: "
        "leave trainer.fused_norms=false")
