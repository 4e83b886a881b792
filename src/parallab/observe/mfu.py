"""Peak dense FLOP/s of CUDA devices, the denominator of model FLOPs utilisation (MFU).

Figures are the vendor datasheets' dense ones: NVIDIA prints tensor-core rates "with
sparsity" (2:4 structured), twice what dense matmuls can reach, so those are halved here.
GeForce cards are rated with FP32 accumulate (what PyTorch uses), half their FP16-accumulate
rate. A device not in the table gets no peak: better no MFU than a wrong one.

Sources (FP32 is the non-tensor rate; TF32 and BF16/FP16 are tensor-core, dense):
- H100 SXM/PCIe/NVL: NVIDIA H100 Tensor Core GPU datasheet,
  https://resources.nvidia.com/en-us-tensor-core/nvidia-tensor-core-gpu-datasheet
- H200 SXM/NVL: NVIDIA H200 datasheet, https://www.nvidia.com/en-us/data-center/h200/
- GH200: NVIDIA GH200 Grace Hopper Superchip datasheet (the H100 SXM rates)
- B200: NVIDIA HGX B200 specs (per GPU: 1/8 of the HGX figures),
  https://www.nvidia.com/en-us/data-center/hgx/
- A100: https://www.nvidia.com/content/dam/en-zz/Solutions/Data-Center/a100/pdf/nvidia-a100-datasheet-us-nvidia-1758950-r4-web.pdf
- A10 (and AWS's A10G, which NVIDIA publishes no sheet for; the A10's rates, as Lightning
  assumes): https://www.nvidia.com/content/dam/en-zz/Solutions/Data-Center/a10/pdf/a10-datasheet.pdf
- L4: https://resources.nvidia.com/en-us-data-center-overview/l4-gpu-datasheet
- L40S: https://resources.nvidia.com/en-us-l40s/l40s-datasheet-28413
- V100 SXM2/PCIe/V100S: https://images.nvidia.com/content/technologies/volta/pdf/volta-v100-datasheet-update-us-1165301-r5.pdf
- T4: https://www.nvidia.com/content/dam/en-zz/Solutions/Data-Center/tesla-t4/t4-tensor-core-datasheet-951643.pdf
- RTX 4090: NVIDIA Ada Lovelace GPU architecture whitepaper, appendix A
- RTX 3090: NVIDIA Ampere GA102 GPU architecture whitepaper, appendix A
"""

from __future__ import annotations

import re

import torch

T = 1e12
# (pattern in torch.cuda.get_device_name(), {"fp32", "tf32", "bf16", "fp16": FLOP/s}), first
# match wins, so a name that contains another (H100 NVL, H100) comes first. Where BF16 tensor
# cores exist, FP16 runs at the same rate (no "fp16" entry then). Volta and Turing have no
# TF32 or BF16 tensor cores: fp32 models run at the FP32 rate there.
PEAKS: list[tuple[str, dict[str, float]]] = [
    ("H100 NVL", {"fp32": 60 * T, "tf32": 835 / 2 * T, "bf16": 1671 / 2 * T,
                  "fp8": 3341 / 2 * T}),
    ("H100 PCIe", {"fp32": 51 * T, "tf32": 756 / 2 * T, "bf16": 1513 / 2 * T,
                   "fp8": 3026 / 2 * T}),
    ("H200 NVL", {"fp32": 60 * T, "tf32": 835 / 2 * T, "bf16": 1671 / 2 * T,
                  "fp8": 3341 / 2 * T}),
    # H100 SXM reports itself as e.g. "NVIDIA H100 80GB HBM3"; H200 SXM as "NVIDIA H200"
    ("GH200|H200|H100", {"fp32": 67 * T, "tf32": 989 / 2 * T, "bf16": 1979 / 2 * T,
                         "fp8": 3958 / 2 * T}),
    ("B200", {"fp32": 75 * T, "tf32": 1125 * T, "bf16": 2250 * T, "fp8": 4500 * T}),
    ("A100", {"fp32": 19.5 * T, "tf32": 156 * T, "bf16": 312 * T}),
    ("A10G?", {"fp32": 31.2 * T, "tf32": 62.5 * T, "bf16": 125 * T}),
    ("L40S", {"fp32": 91.6 * T, "tf32": 366 / 2 * T, "bf16": 733 / 2 * T,
              "fp8": 1466 / 2 * T}),
    ("L4", {"fp32": 30.3 * T, "tf32": 120 / 2 * T, "bf16": 242 / 2 * T, "fp8": 485 / 2 * T}),
    ("V100S", {"fp32": 16.4 * T, "fp16": 130 * T}),
    (r"V100-SXM\d", {"fp32": 15.7 * T, "fp16": 125 * T}),
    ("V100-PCIE", {"fp32": 14 * T, "fp16": 112 * T}),
    ("T4", {"fp32": 8.1 * T, "fp16": 65 * T}),
    ("RTX 4090", {"fp32": 82.6 * T, "tf32": 82.6 * T, "bf16": 165.2 * T}),
    ("RTX 3090", {"fp32": 35.6 * T, "tf32": 35.6 * T, "bf16": 71 * T}),
]
DTYPES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16",
          torch.float8_e4m3fn: "fp8"}


def peak_flops(device_name: str, dtype: torch.dtype, tf32: bool = False) -> float | None:
    """Dense peak FLOP/s of the named CUDA device computing in `dtype` (float32 matmuls on
    TF32 tensor cores if `tf32`); None for a device or dtype the table does not know."""
    kind = DTYPES.get(dtype)
    if kind is None or "laptop" in device_name.lower():  # laptop parts: lower, varying clocks
        return None
    for pattern, peaks in PEAKS:
        # whole words only: "A10" is not "A100", "L4" is not "L40S", "T4" is not "RTX 4090"
        if re.search(rf"(?<![A-Za-z0-9])(?:{pattern})(?![A-Za-z0-9])", device_name, re.I):
            if kind == "fp32" and tf32:
                return peaks.get("tf32", peaks["fp32"])
            return peaks.get(kind, peaks.get("bf16") if kind == "fp16" else None)
    return None


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
