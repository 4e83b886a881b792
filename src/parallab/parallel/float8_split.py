"""precision=fp8's Linear layers split by tensor parallelism as torchtitan splits them:
torchao's float8 styles, which cast a split layer's input to float8 before they gather it
(a gather of one byte an element), and the input cast once for the layers it alone feeds."""

from __future__ import annotations

from typing import Any, Callable

import torch


def float8_style(module: torch.nn.Module, style: Any) -> Any:
    """A float8 Linear layer's (precision=fp8) column or row split as torchao's float8
    styles, which cast its input to float8 before they gather it (a gather of one byte an
    element, the layer's matmul in float8 on DTensors), as torchtitan splits them; where its
    scaling is tensorwise (torchao's styles take that alone; rowwise keeps torch's)."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    if type(style) not in (ColwiseParallel, RowwiseParallel) or \
            type(module).__name__ != "Float8Linear" or not _tensorwise(module):
        return style
    from torchao.float8.float8_tensor_parallel import (
        Float8ColwiseParallel,
        Float8RowwiseParallel,
    )

    cls = Float8ColwiseParallel if type(style) is ColwiseParallel else Float8RowwiseParallel
    return cls(input_layouts=style.input_layouts[0], output_layouts=style.output_layouts[0],
               use_local_output=style.use_local_output)


def feeds_float8(module: torch.nn.Module, float8: Callable[[torch.nn.Module], bool]) -> bool:
    """Whether the input of `module` (a transformers block's attention or MLP, which a
    sequence-parallel plan gathers once) feeds float8 Linear layers alone, so that it can
    be cast to float8 once and gathered in one byte an element (torchao's
    PrepareFloat8ModuleInput, as torchtitan splits Llama): no weights of its own, and each
    child with weights a float8 layer of the tensorwise recipe (`float8`) or a norm, which
    norms their outputs (Qwen 3's and OLMo 2's q and k). An MoE layer (its router, its
    experts) does not."""
    holding = [m for m in module.children() if next(m.parameters(), None) is not None]
    return next(module.parameters(recurse=False), None) is None and \
        any(float8(m) for m in holding) and \
        all(float8(m) or "Norm" in type(m).__name__ for m in holding)


def float8_input_cast(module: torch.nn.Module) -> Callable[[Any], Any] | None:
    """Where `module`'s input feeds its tensorwise Float8Linear layers alone (feeds_float8),
    the cast that gives it to them in float8 (as torchao's float8 styles cast it); None
    elsewhere."""
    if not feeds_float8(module, lambda m: type(m).__name__ == "Float8Linear" and
                        _tensorwise(m)):
        return None
    from torchao.float8.config import e4m3_dtype
    from torchao.float8.float8_scaling_utils import hp_tensor_to_float8_dynamic
    from torchao.float8.float8_training_tensor import GemmInputRole

    config = next(m for m in module.children()
                  if type(m).__name__ == "Float8Linear").linear_mm_config
    return lambda x: hp_tensor_to_float8_dynamic(x, e4m3_dtype, config,
                                                 gemm_input_role=GemmInputRole.INPUT)


def gathers_in_float8(cfg) -> bool:
    """Whether precision `cfg` splits its float8 Linear layers by torchao's styles, which
    gather their input in float8 (float8_style: the tensorwise recipe)."""
    return cfg.name == "fp8" and cfg.fp8_recipe == "tensorwise"


def _tensorwise(module: torch.nn.Module) -> bool:
    from torchao.float8.config import ScalingGranularity

    casts = (module.config.cast_config_input, module.config.cast_config_weight,
             module.config.cast_config_grad_output)
    return all(c.scaling_granularity == ScalingGranularity.TENSORWISE for c in casts)
