"""Tensor-parallel plans: which module is split how, as torch's ParallelStyle objects keyed by
module name (what parallelize_module takes).

A plan comes, in this order, from parallel.tp_plan (module pattern -> style name, `*`
matching one name of a path, as transformers writes `model.layers.*.self_attn.q_proj`), the
model's own tp_plan() method (gpt, mlp: ParallelStyle objects), or a transformers model's
`tp_plan` (its config's base_model_tp_plan and its class's _tp_plan). Style names are
transformers': colwise and rowwise (the pair a block is split by: the first's output cut by
columns feeds the second's rows, one all-reduce after it), colwise_gather_output (a head
whose whole output every rank needs), embedding_rowwise (a vocabulary split embedding),
rowwise_split_input, sequence_parallel.
"""

from __future__ import annotations

import re
from typing import Any

from torch import nn

from parallab.models import hf


def _styles() -> dict[str, Any]:
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel,
                                                   SequenceParallel)

    return {
        "colwise": ColwiseParallel,
        "rowwise": RowwiseParallel,
        "colwise_gather_output": lambda: ColwiseParallel(output_layouts=Replicate()),
        "colwise_rep": lambda: ColwiseParallel(output_layouts=Replicate()),
        "embedding_rowwise": lambda: RowwiseParallel(input_layouts=Replicate()),
        "rowwise_split_input": lambda: RowwiseParallel(input_layouts=Replicate()),
        "rowwise_rep": lambda: RowwiseParallel(input_layouts=Replicate()),
        "sequence_parallel": SequenceParallel,
    }


STYLE_NAMES = ("colwise", "rowwise", "colwise_gather_output", "colwise_rep",
               "embedding_rowwise", "rowwise_split_input", "rowwise_rep", "sequence_parallel")


class PlanError(ValueError):
    """A plan that names no module, or a style this module does not know: one line."""


def source(model: nn.Module, given: dict[str, str] | None) -> str | None:
    """Where the plan comes from, for messages; None where there is none."""
    if given:
        return "parallel.tp_plan"
    if callable(getattr(model, "tp_plan", None)):
        return f"{type(model).__name__}.tp_plan()"
    if hf.tp_plan(model):
        return f"{type(model).__name__}'s own tp_plan (its config's base_model_tp_plan)"
    return None


def takes_sequence_parallel(model: nn.Module, given: dict[str, str] | None) -> bool:
    """The plan can cut the sequence between its split layers: a tp_plan() method with a
    sequence_parallel argument (gpt's)."""
    import inspect

    own = getattr(model, "tp_plan", None)
    return not given and callable(own) and \
        "sequence_parallel" in inspect.signature(own).parameters


def plan_of(model: nn.Module, given: dict[str, str] | None,
            sequence_parallel: bool = False) -> dict[str, Any]:
    """Module name -> ParallelStyle; PlanError where a pattern names no module or a style
    is unknown; {} where the model has no plan."""
    own = getattr(model, "tp_plan", None)
    if not given and callable(own):  # a plan without sequence parallelism need not know it
        return own(sequence_parallel=True) if sequence_parallel else own()
    patterns = given or hf.tp_plan(model) or {}
    return expand(model, patterns, "parallel.tp_plan" if given else source(model, None))


def expand(model: nn.Module, patterns: dict[str, str], where: str | None) -> dict[str, Any]:
    """The patterns matched against the model's module names, each style built."""
    styles = _styles()
    names = [name for name, _ in model.named_modules() if name]
    plan: dict[str, Any] = {}
    for pattern, style in patterns.items():
        if style not in styles:
            raise PlanError(f"{where}: {pattern}={style} is not a style parallab splits by: "
                            f"use one of {', '.join(STYLE_NAMES)}")
        regex = re.compile(r"[^.]+".join(map(re.escape, str(pattern).split("*"))))
        matched = [name for name in names if regex.fullmatch(name)]
        if not matched:
            raise PlanError(f"{where} names {pattern}, which matches no module of "
                            f"{type(model).__name__} (its top-level modules: "
                            f"{', '.join(n for n, _ in model.named_children())}): give module "
                            "names or patterns with * for a layer index")
        plan.update({name: styles[style]() for name in matched})
    return plan
