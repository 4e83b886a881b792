"""A transformers model's tensor-parallel plan made sequence parallel, as torchtitan splits
Llama: the residual stream between the split layers cut along the sequence, each block's
attention and MLP gathering their input once (GatherSequence)."""

from __future__ import annotations

import functools
from typing import Any, Callable

from torch import nn

from parallab.models import hf, named_layer


class PlanError(ValueError):
    """A plan that names no module, or a style parallab does not know, or one not laid out
    for sequence parallelism: one line."""


@functools.cache
def _gather_sequence() -> type:
    """GatherSequence, a ParallelStyle (torch.distributed's, imported when first asked)."""
    from torch.distributed.tensor.parallel import ParallelStyle

    class GatherSequence(ParallelStyle):
        """For the module whose split layers take the whole sequence (a transformers
        block's attention or MLP): its hidden states, cut along the sequence, gathered
        whole once as it is called (their gradient reduce-scattered once), where each of
        its column-split layers would gather its own input and reduce its gradient (q, k
        and v: three times). Where that input feeds tensorwise float8 layers alone
        (precision=fp8), it is cast to float8 first: gathered in one byte an element and
        kept so for their backward once, not once a layer in bf16."""

        def _apply(self, module: nn.Module, device_mesh) -> nn.Module:
            from parallab.parallel.float8_split import float8_input_cast

            cast = float8_input_cast(module)

            def gather(_, args, kwargs):
                if args:
                    return (_whole(args[0], device_mesh, cast), *args[1:]), kwargs
                if "hidden_states" in kwargs:  # transformers' attention, called by keyword
                    return args, {**kwargs, "hidden_states": _whole(
                        kwargs["hidden_states"], device_mesh, cast)}
                return args, kwargs

            module.register_forward_pre_hook(gather, with_kwargs=True)
            return module

    return GatherSequence


def hidden_states(args: tuple, kwargs: dict) -> Any:
    """The hidden states a block's attention or MLP is called with: its first argument, or
    transformers' attention's keyword."""
    return args[0] if args else kwargs.get("hidden_states")


def _whole(x: Any, mesh, cast: Callable[[Any], Any] | None) -> Any:
    from torch.distributed.tensor import DTensor, Replicate

    if not isinstance(x, DTensor):
        return x
    return (cast(x) if cast is not None else x).redistribute(mesh, (Replicate(),))


def sequence_plan(model: nn.Module, plan: dict[str, Any], whole: bool = True
                  ) -> dict[str, Any]:
    """A transformers model's plan (column- and row-split layers inside its blocks'
    attention and MLP) with the residual stream between them cut along the sequence, as
    torchtitan splits Llama: the embedding's output scattered, every norm on its slice
    (SequenceParallel), the attention's and the MLP's input gathered once (GatherSequence),
    the row-split layers' outputs reduce-scattered, the head gathering its input. The
    stream stays a DTensor, so that what the model reads of its shape (the causal mask,
    the positions) is the whole sequence's. PlanError where the model is not laid out so
    (a pipeline rank's part, not `whole`, may hold no head, embeddings or blocks)."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleOutput,
        RowwiseParallel,
        SequenceParallel,
    )

    seq, modules = Shard(1), dict(model.named_modules())
    names = {id(m): n for n, m in modules.items()}
    blocks = [names[id(b)] for b in hf.blocks(model) or ()]
    head = named_layer(model, "get_output_embeddings")
    embedding = named_layer(model, "get_input_embeddings")
    if whole and (head not in plan or embedding is None or not blocks):
        raise PlanError("parallel.sequence_parallel=true: the plan splits no head, or the "
                        f"model has no input embeddings or blocks ({type(model).__name__}): "
                        "set it false")
    cut: dict[str, Any] = {}
    for name, style in plan.items():
        parent = name.rpartition(".")[0]
        if name in (head, embedding):
            continue
        if parent in blocks or not any(name.startswith(b + ".") for b in blocks):
            raise PlanError(f"parallel.sequence_parallel=true: the plan splits {name}, not "
                            "inside a block's attention or MLP, whose input is gathered "
                            "whole: set it false")
        cut.setdefault(parent, _gather_sequence()())
        # as the plan has them but for the sequence: a column-split output it gathers
        # (OLMo 2's q and k, normed whole) stays gathered, as a row-split input it splits;
        # any other style (Qwen 3's norms over its heads) as it is
        cut[name] = ColwiseParallel(output_layouts=style.output_layouts[0],
                                    use_local_output=style.use_local_output) \
            if isinstance(style, ColwiseParallel) else \
            RowwiseParallel(input_layouts=style.input_layouts[0], output_layouts=seq,
                            use_local_output=False) if isinstance(style, RowwiseParallel) \
            else style
    gathered = tuple(n + "." for n, style in cut.items()
                     if isinstance(style, _gather_sequence()))
    cut.update({n: SequenceParallel() for n, m in modules.items()
                if "Norm" in type(m).__name__ and not n.startswith(gathered)})
    if embedding is not None:
        cut[embedding] = RowwiseParallel(input_layouts=Replicate(), output_layouts=seq,
                                         use_local_output=False) if embedding in plan else \
            PrepareModuleOutput(output_layouts=Replicate(), desired_output_layouts=seq,
                                use_local_output=False)
    if head is not None:
        cut[head] = ColwiseParallel(input_layouts=seq, output_layouts=Replicate())
    return cut
