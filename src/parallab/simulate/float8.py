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
its input and weight in the high precision (NOTE, for the answer), but for the layers tp
splits by torchao's float8 styles, which keep float8 copies (SplitCasts)."""

from __future__ import annotations

import weakref
from typing import Callable

import torch
from torch import nn

from parallab.simulate.cluster import Rates
from parallab.simulate.ops import Op, _nbytes
from parallab.simulate.sources import Sources, while_alive

# what copies a split layer's input as it is: autocast's cast
COPIES = {torch.ops.aten._to_copy.default, torch.ops.aten.clone.default}
PEAK = "fp8"  # the Rates.peaks key of the GPU's dense float8 matmul rate
NOTE = ("Float8: the Linear layers' inputs are kept for backward in bf16, as torchao's "
        "Float8Linear keeps them (parallab's precision=fp8), but those tp splits under the "
        "tensorwise recipe, kept in float8 as torchao's float8 styles keep them; Transformer "
        "Engine keeps float8 copies of them all, so a run on it (NeMo, Megatron-Core) holds "
        "less.")


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
    cast = [b for i, b in enumerate(operands) if i not in op.precast]  # SplitCasts
    casts = sum(kernels * overhead((reads * b + b / 2) / rates.hbm / kernels)
                for b in cast + ([op.slice_cast] if op.slice_cast else []))
    if op.phase == "backward":  # operands kept cast, laid out again for the weight's
        # gradient (torchao's preprocess_addmm: one row-major, one column-major), where a
        # cast would write them so
        casts += sum(overhead(b / rates.hbm) for i, b in enumerate(operands)
                     if i in op.precast)
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


class SplitCasts:
    """Under tp, the tensorwise recipe's split layers as train runs them: torchao's float8
    styles cast each split layer's input to float8 before its matmul, which keeps that
    one-byte copy for backward; where the input is gathered (a column-split layer's under
    gpt's sequence-parallel plan, or the attention's and MLP's of a transformers block that
    feed float8 layers alone: float8_split.feeds_float8), it is cast before the gather, which
    then moves one byte an element, and kept once for the layers it feeds. The trace runs
    the bf16 step: this tells its recorder which all-gathers move float8, and the saver
    what those layers keep."""

    def __init__(self, model: nn.Module, converted: set[nn.Module], names: dict[int, str],
                 sequence_parallel: bool):
        from torch.distributed.tensor import DTensor

        from parallab.parallel.float8_split import feeds_float8

        self.split = {names[id(m)] for m in converted if isinstance(m.weight, DTensor)}
        split = {m for m in converted if names[id(m)] in self.split}
        self.weights = {m.weight.to_local().untyped_storage()._cdata for m in split}
        self.ranks = next(iter(split)).weight.device_mesh.size() if split else 1
        self.charged: set[int] = set()  # gathered inputs whose slice's cast is priced
        # storage -> alive: the split layers' inputs (and autocast's copies of them) and
        # the inputs cast before their gather, each while its storage lives (a freed
        # storage's address is the next one's)
        self.inputs: dict[int, weakref.ref] = {}
        self.float8: set[int] = set()  # the collectives (sources.py) that gather float8
        self.sequence_parallel = sequence_parallel
        # the recorder's, for a cast's tensorwise scale all-reduced over the ranks what it
        # casts is cut over (DTensor's, inside the cast: no dispatch of its own to record)
        self.amax: Callable[[int, int, str | None], None] = lambda *_: None
        for module in model.modules():
            if module in split or feeds_float8(module, split.__contains__):
                module.register_forward_pre_hook(self._entered, prepend=True,
                                                 with_kwargs=True)

    def _entered(self, module, args, kwargs) -> None:
        from torch.distributed.tensor import DTensor, Shard

        from parallab.parallel.sequence_parallel import hidden_states
        from parallab.simulate.ops import _local

        x = hidden_states(args, kwargs)
        if isinstance(x, torch.Tensor):
            while_alive(_local(x).untyped_storage(), self.inputs, self.inputs)
        weight = getattr(module, "weight", None)
        if isinstance(weight, DTensor):  # a split layer's casts of what is cut over tp:
            ranks, rows = weight.device_mesh.size(), weight.placements == (Shard(1),)
            # its weight, and a row split's input (a column split's comes whole, or is
            # counted where it is cast before its gather)
            self.amax(ranks, 1 + rows, None)
            # in backward its weight again, and its output's gradient where that is cut (a
            # column split's, cut by columns; a row split's under sequence parallelism)
            self.amax(ranks, 1 + (not rows or self.sequence_parallel), "backward")

    def cast_first(self, source: torch.Tensor) -> bool:
        """Whether an all-gather of `source` (a local tensor) moves float8: one of the
        inputs cast before their gather."""
        return source.untyped_storage()._cdata in self.inputs

    def derived(self, func, sources: list[torch.Tensor], outputs: list[torch.Tensor]
                ) -> None:
        """Autocast's copy of a split layer's input is its input."""
        if func in COPIES and any(t.untyped_storage()._cdata in self.inputs
                                  for t in sources):
            for out in outputs:
                while_alive(out.untyped_storage(), self.inputs, self.inputs)

    def moved(self, sources: Sources, func, inputs: list[torch.Tensor]) -> float | None:
        """The share of its traced bytes a memory-bound op moves in train where it takes a
        float8 gather's output alone (the bf16 step's stand-in for it): one byte an element
        where it puts the gathered chunks together, none where it is autocast's copy (a
        float8 tensor's cast to the autocast dtype changes its metadata alone); None for
        any other op."""
        if not inputs or any(self._gathered(sources, t) is None for t in inputs):
            return None
        return 0.0 if func in COPIES else 1 / inputs[0].element_size()

    def _gathered(self, sources: Sources, t: torch.Tensor) -> tuple[int, int] | None:
        """The float8 all-gather `t` hands on (its output, the chunks put together,
        autocast's copy): (its serial, its bytes, one a value); None for any other."""
        return next(((serial, nbytes) for serial, nbytes, _ in sources.of(t)
                     if serial in self.float8), None)

    def casts(self, sources: Sources, backward: bool, parents: set[str],
              operands: list[torch.Tensor]) -> tuple[tuple[int, ...], float]:
        """A split layer's float8 matmul's operands cast before it (their places), and the
        bytes of a gathered input's slice whose cast before the gather it is charged with:
        Float8Linear alone casts each operand of each of its three matmuls; under the
        float8 styles a layer's input comes cast (once, on its slice where gathered: the
        first matmul reading it pays), and in backward its output's gradient is cast once
        for both matmuls, where the weight's gradient takes it with the input kept cast
        (each laid out again: seconds)."""
        if not any(p in self.split for p in parents):
            return (), 0.0
        keys = [t.untyped_storage()._cdata for t in operands]
        if backward:  # the weight's gradient: no weight among its operands, none cast here
            weighted = any(key in self.weights for key in keys)
            return (() if weighted else tuple(range(len(operands)))), 0.0
        first, precast = 0.0, []
        for i, t in enumerate(operands):
            gathered = self._gathered(sources, t)
            if gathered is not None:
                precast.append(i)
                if gathered[0] not in self.charged:
                    self.charged.add(gathered[0])
                    first += _nbytes(t) / self.ranks
        return tuple(precast), first

    def kept(self, sources: Sources, tensor: torch.Tensor, key: int, parents: set[str],
             cast: bool) -> tuple[object, int, bool | None] | None:
        """What a split layer keeps of `tensor` (local; `key` its storage's, as the saver
        counts it) as it saves it: (key, bytes, kept compiled: None where as the tensor is)
        of its input's one float8 copy, nothing of autocast's copy of its weight
        (Float8Linear keeps the weight it holds); None where no split float8 layer saves
        it, or what it saves is not its input (its output, which selective checkpointing
        keeps in bf16)."""
        gathered = self._gathered(sources, tensor)
        if gathered is not None:  # a collective's output: kept compiled
            return ("collective", gathered[0]), gathered[1], True
        layer = next((p for p in parents if p in self.split), None)
        if layer is None or not (cast or tensor.untyped_storage()._cdata in self.inputs):
            return None
        return (key, layer), 0 if cast else tensor.numel(), None

