"""precision=fp8 priced: the Linear layers torchao's float8 recipes train (precision.py).

Float8 kernels do not run on fake tensors, so a float8 step is traced as its bf16 step
(what Float8Linear leaves: bf16 autocast around it) and the matmuls of the Linear layers
train converts are priced as float8 runs them:
- their FLOPs at the GPU's fp8 peak x cluster.matmul_efficiency, scaled by how much less
  of its peak a float8 GEMM reaches than a bf16 one in a published sweep of shapes
  (cluster.gemm_peak_share: H100 70.9% against 80.3%), their two operands read in one
  byte an element where the trace read two;
- beside each, its operands' casts: each operand's amax (read once) and its scaled cast
  (read again, written in one byte), two kernels eager; compiled, torch.compile fuses
  the two into one read (torchtitan's float8 runs are compiled). Tensorwise and rowwise
  scales move the same bytes there; rowwise adds a pass over each gradient matmul's output
  (`rescaled`), priced so compiled too (the multiply follows cuBLAS's kernel, which
  Inductor cannot fuse it into);
- under FSDP2 with precision.fp8_all_gather, those layers' weights gathered in float8 (one
  byte an element, the others in bf16), and held so.
What the trace keeps for backward stays the bf16 step's, as torchao's Float8Linear saves
its input and weight in the high precision (NOTE, for the answer).
"""

from __future__ import annotations

from torch import nn

from parallab.simulate.cluster import Rates
from parallab.simulate.ops import Op

PEAK = "fp8"  # the Rates.peaks key of the GPU's dense float8 matmul rate
NOTE = ("Float8: the Linear layers' inputs are kept for backward in bf16, as torchao's "
        "Float8Linear keeps them (parallab's precision=fp8); Transformer Engine keeps float8 "
        "copies, so a run on it (NeMo, Megatron-Core) holds less.")


def layers(model: nn.Module) -> set[nn.Module]:
    """The Linear layers precision=fp8 converts (precision.float8_converts)."""
    from parallab.precision import float8_converts, output_layer

    output = output_layer(model)
    return {m for name, m in model.named_modules() if isinstance(m, nn.Linear)
            and float8_converts(m, name, output)}


def problem(precision: str, rates: Rates) -> str | None:
    """Why a float8 step cannot be priced on the cluster (its GPU has no float8 peak)."""
    if precision == "fp8" and not rates.peaks.get(PEAK):
        return ("precision=fp8: the cluster's GPU has no float8 tensor cores (Ada, Hopper "
                "and later have them): use precision=bf16, or a cluster of such GPUs")
    return None


def seconds(op: Op, rates: Rates, compile: bool, overhead, recipe: str = "tensorwise"
            ) -> float:
    """A float8 Linear's matmul and its operands' casts (see the module's docstring);
    `overhead`: a kernel's time with its launch (costs._with_overhead)."""
    operands = [b for _, b in op.reads]
    written = sum(b for _, b in op.writes)
    multiplies = op.flops / (rates.peaks[PEAK] * (rates.float8_efficiency or
                                                  rates.matmul_efficiency))
    gemm = overhead((sum(operands) / 2 + written) / rates.hbm + multiplies)
    reads, kernels = (1, 1) if compile else (2, 2)
    casts = sum(kernels * overhead((reads * b + b / 2) / rates.hbm / kernels)
                for b in operands)
    return gemm + casts + (overhead(2 * written / rates.hbm) if rescaled(op, recipe) else 0.0)


def rescaled(op: Op, recipe: str) -> bool:
    """A gradient's matmul under rowwise scales: torchao runs it without fast accumulation,
    where its rowwise kernel is slow, so as the tensorwise kernel at unit scales, and then
    multiplies the output by its rows' and columns' scales (float8_ops.addmm_float8_unwrapped):
    one more read and write of the output. The forward's matmul, run again in backward by
    a checkpoint too, takes the rowwise kernel with fast accumulation: no such pass."""
    return recipe == "rowwise" and op.phase == "backward" and not op.recomputed


def gathered_bytes(compute_bytes: int, share: float) -> float:
    """Bytes an element of a block's weights takes gathered: `share` of them (the float8
    layers', precision.fp8_all_gather) in one byte, the rest in the compute dtype."""
    return compute_bytes - share * (compute_bytes - 1)
