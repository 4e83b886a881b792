"""Tensor-parallel plans: which module is split how, as torch's ParallelStyle objects keyed by
module name (what parallelize_module takes).

A plan comes, in this order, from parallel.tp_plan (module pattern -> style name, `*`
matching one name of a path, as transformers writes `model.layers.*.self_attn.q_proj`), the
model's own tp_plan() method (gpt, mlp: ParallelStyle objects), or a transformers model's
`tp_plan` (its config's base_model_tp_plan and its class's _tp_plan). Style names are
transformers': colwise and rowwise (the pair a block is split by: the first's output cut by
columns feeds the second's rows, one all-reduce after it), colwise_gather_output (a head
whose whole output every rank needs), embedding_rowwise (a vocabulary split embedding),
rowwise_split_input, sequence_parallel, replicated_with_grad_allreduce (weights each rank
applies to its own slice, their gradient summed).
"""

from __future__ import annotations

import re
from typing import Any, Callable, Iterator

from torch import nn

from parallab.config.errors import first_line
from parallab.models import hf, named_layer, tied_names
from parallab.parallel import expert_parallel
from parallab.parallel.regather import gather_again
from parallab.parallel.sequence_parallel import PlanError, sequence_plan


def _styles() -> dict[str, Any]:
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        SequenceParallel,
    )

    return {
        "colwise": ColwiseParallel,
        "rowwise": RowwiseParallel,
        "colwise_gather_output": lambda: ColwiseParallel(output_layouts=Replicate()),
        "colwise_rep": lambda: ColwiseParallel(output_layouts=Replicate()),
        "embedding_rowwise": lambda: RowwiseParallel(input_layouts=Replicate()),
        "rowwise_split_input": lambda: RowwiseParallel(input_layouts=Replicate()),
        "rowwise_rep": lambda: RowwiseParallel(input_layouts=Replicate()),
        "sequence_parallel": SequenceParallel,
        # weights each tp rank applies to its own slice (Qwen 3's q and k norms, over its
        # heads): replicated, their gradient summed over the tp ranks; as a DTensor any
        # dimension but the normed last one can be the slice's
        "replicated_with_grad_allreduce": lambda: SequenceParallel(sequence_dim=0,
                                                                   use_local_output=True),
        # an MoE model's experts module, its packed_colwise gate_up_proj and rowwise
        # down_proj (entries of their own in the plan, which this style lays out)
        EXPERTS: expert_parallel.tp_style(),
    }


EXPERTS = hf.TP_EXPERTS  # a transformers plan's style for an experts module (hf's name)


def source(model: nn.Module, given: dict[str, str] | None) -> str | None:
    """Where the plan comes from, for messages; None where there is none."""
    if given:
        return "parallel.tp_plan"
    if callable(getattr(model, "tp_plan", None)):
        return f"{type(model).__name__}.tp_plan()"
    if hf.tp_plan(model):
        return f"{type(model).__name__}'s own tp_plan (its config's base_model_tp_plan)"
    return None


def keeps_stream_whole(model: nn.Module, given: dict[str, str] | None) -> bool:
    """Its sequence-parallel plan keeps the stream between blocks a DTensor of the whole
    sequence (sequence_plan, a transformers model's own), where a tp_plan() of the model's
    own hands on local slices (gpt's)."""
    return not given and not callable(getattr(model, "tp_plan", None)) and \
        bool(hf.tp_plan(model))


def takes_sequence_parallel(model: nn.Module, given: dict[str, str] | None) -> bool:
    """The plan can cut the sequence between its split layers: a tp_plan() method with a
    sequence_parallel argument (gpt's), or a transformers model's own plan
    (sequence_plan; whether its layers are laid out for it: mesh.sp_problem)."""
    import inspect

    own = getattr(model, "tp_plan", None)
    if given:
        return False
    if callable(own):
        return "sequence_parallel" in inspect.signature(own).parameters
    return bool(hf.tp_plan(model))


def plan_of(model: nn.Module, given: dict[str, str] | None,
            sequence_parallel: bool = False, whole: bool = True) -> dict[str, Any]:
    """Module name -> ParallelStyle; PlanError where a pattern names no module of the
    `whole` model or a style is unknown; {} where the model has no plan. A pipeline
    rank's part (not whole) may hold no module a pattern names (no block, say)."""
    own = getattr(model, "tp_plan", None)
    if not given and callable(own):  # a plan without sequence parallelism need not know it
        return own(sequence_parallel=True) if sequence_parallel else own()
    patterns = given or hf.tp_plan(model) or {}
    plan = tied_split(model, expand(model, patterns,
                                    "parallel.tp_plan" if given else source(model, None),
                                    whole, strict=bool(given)))
    return sequence_plan(model, plan, whole) if sequence_parallel else plan


def tied_split(model: nn.Module, plan: dict[str, Any]) -> dict[str, Any]:
    """The plan with an input embedding tied to a head it splits by columns split by
    vocabulary rows as well (torchtitan splits it so): the shared (vocabulary, width)
    matrix then cut alike in both, by rows, so that it stays one parameter (split())."""
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import RowwiseParallel

    head = named_layer(model, "get_output_embeddings")
    embedding = named_layer(model, "get_input_embeddings")
    tied = tied_names(model)
    pair = {f"{head}.weight", f"{embedding}.weight"}
    if head in plan and embedding is not None and embedding not in plan and \
            cut_dim(model.get_submodule(head), plan[head]) == 0 and \
            any({alias, first} == pair for alias, first in tied.items()):
        return {**plan, embedding: RowwiseParallel(input_layouts=Replicate())}
    return plan


def cut_dim(module: nn.Module, style: Any) -> int | None:
    """The dimension of `module`'s weight a style cuts it along (a Linear's weight is (out,
    in), an Embedding's (vocabulary, width)); None where it is not cut by columns or rows."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    if not isinstance(style, (ColwiseParallel, RowwiseParallel)):
        return None
    return int(isinstance(style, ColwiseParallel) == isinstance(module, nn.Embedding))


def send_sequence_slices(part: nn.Module, mesh) -> None:
    """A pipeline part of a model whose sequence-parallel plan keeps the stream between its
    blocks a DTensor (a transformers model's: sequence_plan): what the part hands on is its
    rank's slice of the sequence as a plain tensor (a tp-th of the activation, as
    Megatron-LM's scatter-gather sends), what it is handed made the DTensor of the whole
    sequence again (the model reads its shape: the mask, the positions). The slices are
    even: mesh.sp_problem refuses a sequence length tp does not divide before launch, a
    part sending one of a length it could not see there fails with why."""
    import torch
    from torch.distributed.tensor import DTensor, Shard

    def received(_, args):
        if args and torch.is_tensor(args[0]) and args[0].is_floating_point() and \
                not isinstance(args[0], DTensor):  # the first part takes token ids
            return (DTensor.from_local(args[0], mesh, [Shard(1)], run_check=False),
                    *args[1:])
        return args

    def sent(_, args, output):
        # not logits cut by vocabulary (Shard(-1)): the loss takes them so. A copy, not
        # to_local's view: the split backward's schedules detach a stage's output in place
        if isinstance(output, DTensor) and output.placements == (Shard(1),):
            if output.shape[1] % mesh.size():  # a dataset's own length, no key checked
                raise ValueError(f"parallel.sequence_parallel=true under a pipeline: a "
                                 f"sequence of {output.shape[1]} tokens does not split "
                                 f"evenly over tp={mesh.size()}: pad the data's sequences "
                                 "to a multiple of it")
            return output.to_local().clone()
        return output

    part.register_forward_pre_hook(received)
    part.register_forward_hook(sent)


def split(model: nn.Module, mesh, given: dict[str, str] | None, sequence_parallel: bool,
          loss, whole: bool = True, ep: int = 1, regather: bool = False) -> bool:
    """The model split over `mesh` by its plan (plan_for's) as the trainer, advise's
    measured parts and simulate's trace split it: the plan's entries for the modules it
    holds (a pipeline rank's part, or simulate's model cut to a block: not the others, nor
    the nn.Identity left in their place), each tied weight kept one parameter (split, each
    module it is part of would hold a parameter of its own, the pair parting ways as they
    train; cut alike, as mesh.tp_problem makes sure, the first's is given to the others);
    its entries for experts modules left out where `ep` > 1 splits them; under sequence
    parallelism, where `regather`, each gathered input saved as its slice and gathered
    again in backward (regather.py). Whether the logits stay cut by vocabulary."""
    from torch.distributed.tensor.parallel import parallelize_module

    from parallab.parallel.float8_split import float8_style

    plan, sharded = plan_for(model, given, sequence_parallel, loss, whole)
    if ep > 1:  # expert parallelism splits the experts: the plan's styles for them stay out
        plan = {name: style for name, style in plan.items()
                if not isinstance(style, _styles()[EXPERTS])}
    held = {name: module for name, module in model.named_modules()
            if not isinstance(module, nn.Identity)}
    tied = tied_names(model)
    parallelize_module(model, mesh, {name: float8_style(held[name], style)
                                     for name, style in plan.items() if name in held})
    for alias, first in tied.items():
        owner, _, attr = alias.rpartition(".")
        setattr(model.get_submodule(owner), attr, model.get_parameter(first))
    if sequence_parallel and regather:
        gather_again(model, [name for name in plan if name in held])
    return sharded


def expand(model: nn.Module, patterns: dict[str, str], where: str | None,
           whole: bool = True, strict: bool = True) -> dict[str, Any]:
    """The patterns matched against the model's module names, each style built (a part,
    not `whole`: against the modules it holds, not the nn.Identity left for the others).
    Not `strict` (a model's own plan): a pattern may name modules this configuration of
    the model does not build (Qwen3-MoE's plan names its dense MLP's too, for the blocks
    a config leaves dense)."""
    styles = _styles()
    names = [name for name, module in model.named_modules()
             if name and (whole or not isinstance(module, nn.Identity))]
    plan: dict[str, Any] = {}
    experts = {p for p, style in patterns.items() if style == EXPERTS}
    for pattern, style in patterns.items():
        if str(pattern).rpartition(".")[0] in experts:  # an experts' weight: its module's
            continue
        if style not in styles:
            raise PlanError(f"{where}: {pattern}={style} is not a style parallab splits by: "
                            f"use one of {', '.join(styles)}")
        regex = re.compile(r"[^.]+".join(map(re.escape, str(pattern).split("*"))))
        matched = [name for name in names if regex.fullmatch(name)]
        if not matched and whole and strict:
            raise PlanError(f"{where} names {pattern}, which matches no module of "
                            f"{type(model).__name__} (its top-level modules: "
                            f"{', '.join(n for n, _ in model.named_children())}): give module "
                            "names or patterns with * for a layer index")
        plan.update({name: styles[style]() for name in matched})
    return plan


def loss_context(sharded: bool):
    """Where a loss and its backward run: under torch's loss_parallel where the logits are
    cut by vocabulary (its cross-entropy over the shards), else as they are."""
    import contextlib

    if not sharded:
        return contextlib.nullcontext()
    from torch.distributed.tensor.parallel import loss_parallel

    return loss_parallel()


def plan_for(model: nn.Module, given: dict[str, str] | None, sequence_parallel: bool,
             loss, whole: bool = True) -> tuple[dict[str, Any], bool]:
    """The plan a run splits the model by (plan_of's), its head's logits left cut by
    vocabulary where `loss` (an Objective) takes them so (shard_logits), and whether they
    are (split() applies it)."""
    plan = plan_of(model, given, sequence_parallel, whole)
    return shard_logits(model, plan) if loss.takes_sharded_logits else (plan, False)


def shard_logits(model: nn.Module, plan: dict[str, Any]) -> tuple[dict[str, Any], bool]:
    """The plan with the model's head (its get_output_embeddings(), as transformers names
    it) left cut by vocabulary: its logits a DTensor sharded on their last dimension, which
    the cross-entropy takes under torch's loss_parallel (a max, a sum and each target's
    logit all-reduced: a few floats a token). Gathered, every tp rank would hold the whole
    vocabulary's logits and their gradient and repeat the loss over them (torchtitan keeps
    them cut). The plan as it was, and False, where it gathers no head split by columns."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel

    name = named_layer(model, "get_output_embeddings")
    style = plan.get(name)
    if not isinstance(style, ColwiseParallel) or style.output_layouts[0] != Replicate():
        return plan, False
    cut = ColwiseParallel(input_layouts=style.input_layouts[0], output_layouts=Shard(-1),
                          use_local_output=False)
    return {**plan, name: cut}, True


def split_problem(model: nn.Module, plan: dict[str, Any], tp: int,
                  forward: Callable[[nn.Module], Any]) -> str | None:
    """None if the plan's pieces compose: `forward(model)` run with each split layer holding
    a tp rank's local shapes (then given its own weights back), else one line naming the
    layer the forward failed in. A plan with styles other than columns and rows (sequence
    parallel, prepared inputs) is not judged."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    if any(type(style) not in (ColwiseParallel, RowwiseParallel) for style in plan.values()):
        return None
    held = [(module, name, param) for module, dim in _local_dims(model, plan)
            for name, param in list(module.named_parameters(recurse=False))
            if _cut(module, name, param, dim, tp)]
    entered: list[str] = []
    hooks = [m.register_forward_pre_hook(lambda *_, n=n: entered.append(n))
             for n, m in model.named_modules() if n]
    try:
        forward(model)
    except Exception as error:  # noqa: BLE001 - whatever the user's forward raises
        where = f" in {entered[-1]}" if entered else ""
        return (f"the tensor-parallel plan does not compose at parallel.tp={tp}: split as "
                f"planned, the forward fails{where} ({first_line(error)}): follow each "
                "colwise layer by the rowwise one that takes its output (or gather its output "
                "with colwise_gather_output)")
    finally:
        for hook in hooks:
            hook.remove()
        for module, name, param in held:
            setattr(module, name, param)
    return None


def _local_dims(model: nn.Module, plan: dict[str, Any]) -> Iterator[tuple[nn.Module, int]]:
    """Each planned module whose local weights differ from its whole ones, and the weight
    dim a rank holds a slice of."""
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.parallel import ColwiseParallel

    for name, style in plan.items():
        module = model.get_submodule(name)
        table = isinstance(module, nn.Embedding)  # its weight is (rows, width), a Linear's
        if isinstance(style, ColwiseParallel):    # (out, in)
            if style.use_local_output and style.output_layouts[0] == Shard(-1):
                yield module, 1 if table else 0  # each rank's output keeps its columns
        elif style.input_layouts[0] == Shard(-1):
            yield module, 0 if table else 1  # takes a column-cut input, sums to whole


def _cut(module: nn.Module, name: str, param: nn.Parameter, dim: int, tp: int) -> bool:
    """`param` replaced by a rank's slice along `dim` (zeros that take no memory)."""
    if param.dim() <= dim:  # a row-cut layer's bias is whole
        return False
    shape = list(param.shape)
    shape[dim] //= tp
    setattr(module, name, nn.Parameter(param.new_zeros(()).expand(shape), requires_grad=False))
    return True
