"""Post-training dynamic int8 quantization of the Linear layers, with torchao.

torch.ao.quantization.quantize_dynamic is deprecated in PyTorch 2.14 (its own warning says
so); torchao's `quantize_` with Int8DynamicActivationInt8WeightConfig is its replacement:
int8 weights, activations quantized per token at run time.
"""

from __future__ import annotations

import copy
import io

import torch
from torch import nn

METHODS = ("dynamic_int8",)


def available() -> bool:
    try:
        import torchao.quantization  # noqa: F401
    except ImportError:
        return False
    return True


def serialized_mb(model: nn.Module) -> float:
    """The model's size as torch.save writes its state_dict."""
    buffer = io.BytesIO()
    torch.save(model.state_dict(), buffer)
    return buffer.getbuffer().nbytes / 2**20


def dynamic_int8(model: nn.Module) -> nn.Module:
    """A quantized copy of `model` (the original is left as it was)."""
    from torchao.quantization import Int8DynamicActivationInt8WeightConfig, quantize_

    quantized = copy.deepcopy(model).eval()
    quantize_(quantized, Int8DynamicActivationInt8WeightConfig(),
              filter_fn=lambda module, _: isinstance(module, nn.Linear))
    return quantized


def compare(model: nn.Module, score) -> dict[str, float]:
    """The model's size and its int8 copy's, and the copy's figures (score(model) -> dict)."""
    quantized = dynamic_int8(model)
    return {"model_size_mb": serialized_mb(model), "quantized_size_mb": serialized_mb(quantized),
            **{"quantized_" + k: v for k, v in score(quantized).items()}}
