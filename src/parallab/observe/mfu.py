"""Peak dense FLOP/s of CUDA devices, the denominator of model FLOPs utilisation (MFU), and
the model's FLOPs per token, its numerator. The peaks are data: gpus.yaml beside this
module, with their sources (a new GPU is an entry there).
"""

from __future__ import annotations

import functools
import re
from pathlib import Path

import torch

T = 1e12
DTYPES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16",
          torch.float8_e4m3fn: "fp8"}


@functools.cache
def table() -> tuple[tuple[str, dict[str, float]], ...]:
    """gpus.yaml: (pattern of a device's name, {precision: FLOP/s}), first match wins."""
    import yaml

    entries = yaml.safe_load((Path(__file__).with_name("gpus.yaml")).read_text())
    return tuple((e["match"], {k: float(v) * T for k, v in e["tflops"].items()})
                 for e in entries)


def peaks_of(device_name: str, listed: bool = False) -> dict[str, float] | None:
    """The named device's peaks by precision (fp32, tf32, bf16, fp16, fp8: FLOP/s), those
    it lacks taken as the rate that runs them (fp16 on BF16 tensor cores, tf32 without
    TF32 ones at fp32's; with `listed`, those the table lists alone); None for a device the
    table does not know."""
    if "laptop" in device_name.lower():  # laptop parts: lower, varying clocks
        return None
    for pattern, peaks in table():
        # whole words only: "A10" is not "A100", "L4" is not "L40S", "T4" is not "RTX 4090"
        if re.search(rf"(?<![A-Za-z0-9])(?:{pattern})(?![A-Za-z0-9])", device_name, re.I):
            return dict(peaks) if listed else filled(peaks)
    return None


def filled(peaks: dict[str, float]) -> dict[str, float]:
    """`peaks` with fp16 at bf16's rate and tf32 at fp32's where they are not given."""
    out = dict(peaks)
    if "fp16" not in out and "bf16" in out:
        out["fp16"] = out["bf16"]
    if "tf32" not in out and "fp32" in out:
        out["tf32"] = out["fp32"]
    return out


def peak_flops(device_name: str, dtype: torch.dtype, tf32: bool = False) -> float | None:
    """Dense peak FLOP/s of the named CUDA device computing in `dtype` (float32 matmuls on
    TF32 tensor cores if `tf32`); None for a device or dtype the table does not know."""
    kind, peaks = DTYPES.get(dtype), peaks_of(device_name)
    if kind is None or peaks is None:
        return None
    return peaks.get("tf32" if kind == "fp32" and tf32 else kind)


def peak_flops_of(device: torch.device, precision) -> float | None:
    """The peak of a CUDA device in the precision's compute dtype (precision.py)."""
    return peak_flops(torch.cuda.get_device_name(device), precision.dtype, precision.tf32)


def flops_per_token(model: torch.nn.Module, seq_len: int | None) -> float:
    """Training FLOPs (forward + backward) per token of `seq_len`-token sequences: the
    model's own flops_per_token where it has one (gpt), else the PaLM estimate nanoGPT uses:
    6 per weight a token is multiplied by (embedding look-ups are not; a head tied to them
    is; of an MoE layer's experts, the top_k a token meets), plus 12·layers·seq_len·width for
    attention where the model's config gives its shape (a transformers model); 0 for a model whose weights say nothing (no parameters).
    A frozen weight of a Linear layer (the base beside adapters) costs 4, not 6: its
    backward computes its input's gradient, not its own."""
    frozen = sum(m.weight.numel() for m in model.modules() if (
        isinstance(m, torch.nn.Linear) or type(m).__name__ == "Conv1D") and
        isinstance(getattr(m, "weight", None), torch.Tensor) and not m.weight.requires_grad)
    own = getattr(model, "flops_per_token", None)
    if callable(own):
        return float(own(seq_len)) - 2.0 * frozen
    from parallab.models import hf

    from parallab.models import moe

    looked_up = {id(m.weight) for m in model.modules() if isinstance(m, torch.nn.Embedding)}
    multiplied = {id(m.weight) for m in model.modules()
                  if isinstance(m, torch.nn.Linear) or type(m).__name__ == "Conv1D"}
    active = moe.active_shares(model)  # a token meets top_k of an MoE layer's experts
    weights = sum(p.numel() * active.get(id(p), 1.0) for p in model.parameters()
                  if id(p) not in looked_up or id(p) in multiplied)
    flops = 6.0 * weights - 2.0 * frozen
    shape = hf.shape(model)
    if shape and seq_len:
        flops += 12.0 * shape["layers"] * seq_len * shape["width"]
    return flops
