"""What a transformers model says of itself, read instead of asking the user: whether its
loss shifts the labels (a causal LM), its blocks (`_no_split_modules`: the units fsdp shards
and activation checkpointing wraps), its tensor-parallel plan (`tp_plan`, from the config's
`base_model_tp_plan` and the class's `_tp_plan`), and its shape for FLOPs. Nothing here
imports transformers unless the model is one of its.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping
from typing import Any

from torch import nn

INSTALL = 'pip install "parallab[hf]"'


def is_transformers(model: nn.Module) -> bool:
    """A transformers PreTrainedModel (checked without importing transformers)."""
    if "transformers" not in sys.modules:
        return False
    from transformers import PreTrainedModel

    return isinstance(model, PreTrainedModel)


def for_training(model: nn.Module) -> nn.Module:
    """A transformers model as a training run uses it: no key-value cache (a forward would
    build one it never reads again, and activation checkpointing's recompute would append
    to it a second time, as transformers' own gradient checkpointing also turns it off)."""
    if is_transformers(model):
        if getattr(model.config, "use_cache", False):
            model.config.use_cache = False
        _masks_built_eagerly(model)
    return model


def _masks_built_eagerly(model: nn.Module) -> None:
    """The attention masks of the model's classes built outside torch.compile's graph. Traced,
    transformers cannot tell a plain causal mask from a padded or packed one (it would have
    to read the tensors' values), so it builds the full (batch, 1, T, T) mask where eagerly
    it leaves it out and calls SDPA with is_causal=True; with a mask SDPA cannot take its
    flash kernels (GPT-2's attention took 2.6x the gpt's on an H200). Eagerly built, the
    mask is what transformers gives without compile; the graph breaks once, around it."""
    import torch
    from transformers import masking_utils

    # every module whose classes make up the model: a composite model's parts may call the
    # mask functions from their own modeling files
    for module_name in {type(m).__module__ for m in model.modules()}:
        namespace = vars(sys.modules[module_name])
        for name, value in list(namespace.items()):
            if (name.startswith("create_") and name.endswith("mask") and callable(value)
                    and getattr(value, "__module__", None) == masking_utils.__name__
                    and not getattr(value, "_torchdynamo_disable", False)):  # once
                namespace[name] = torch.compiler.disable(value, recursive=True)


def shifts_labels(model: nn.Module) -> bool:
    """Its loss compares the output at position t with the label at t + 1 (a decoder-only
    causal LM), so position 0's label is never a term: transformers' Trainer counts the same."""
    if not is_transformers(model):
        return False
    from transformers.loss.loss_utils import LOSS_MAPPING, ForCausalLMLoss

    # the loss transformers uses: its class's kind, or a causal LM's where it names none
    # (GPT2LMHeadModel), as PreTrainedModel.loss_function picks it
    kind = getattr(model, "loss_type", None)
    loss = LOSS_MAPPING[kind] if kind in LOSS_MAPPING else ForCausalLMLoss
    return loss is ForCausalLMLoss and not getattr(model.config, "is_encoder_decoder", False)


def blocks(model: nn.Module) -> list[nn.Module] | None:
    """The model's repeated blocks, in order: the modules whose class `_no_split_modules`
    names (LlamaDecoderLayer, GPT2Block); None for a model that names none."""
    names = set(getattr(model, "_no_split_modules", None) or ())
    if not names:
        return None
    # none left where a pipeline's rank holds only the embeddings and head: []
    return [m for m in model.modules() if type(m).__name__ in names]


TP_EXPERTS = "moe_tp_experts"  # a transformers tp plan's style for an experts module
EP_DISPATCHED = "ep_dispatch_experts"  # an ep plan's, for one it dispatches tokens to


def dispatched_experts(model: nn.Module) -> list[str]:
    """The module patterns of the experts modules a transformers model's ep plan dispatches
    tokens to (its `ep_dispatch_experts`); [] for a model without one."""
    return [pattern for pattern, style in (getattr(model, "ep_plan", None) or {}).items()
            if style == EP_DISPATCHED]


def tp_plan(model: nn.Module) -> dict[str, str] | None:
    """The model's own tensor-parallel plan, module pattern -> style name (transformers':
    "colwise", "rowwise", "embedding_rowwise", "colwise_gather_output", ...)."""
    if not is_transformers(model):
        return None
    plan = getattr(model, "tp_plan", None)
    if callable(plan):  # an older transformers: a method, or none
        return None
    if not plan:
        return None
    plan = dict(plan)
    # transformers 5.25 leaves the experts modules its ep plan dispatches to out of its tp
    # plan (its moe_tp_experts deprecated): split over tp as its earlier plans split them
    # (Megatron's expert tensor parallelism), not held whole by every tp rank
    for pattern in dispatched_experts(model):
        plan.setdefault(pattern, TP_EXPERTS)
    return plan


def heads_problem(model: nn.Module, tp: int) -> str | None:
    """A transformers config whose attention heads (query or key-value) tp does not divide:
    each rank computes whole heads."""
    config = getattr(model, "config", None)
    for key in ("num_attention_heads", "num_key_value_heads", "n_head"):
        heads = getattr(config, key, None)
        if isinstance(heads, int) and heads % tp:
            return (f"parallel.tp={tp} does not divide the model's {key}={heads}: each rank "
                    "computes whole heads; pick a tp that divides it")
    return None


EXPERTS_KEYS = ("num_experts", "num_local_experts", "n_routed_experts")  # the families' names


def experts_problem(config) -> str | None:
    """A transformers MoE config (model.config, as given) whose experts each token is sent
    to are none, or more than it holds: its router would route no token, or fail in topk."""
    if not isinstance(config, Mapping):
        return None
    k = config.get("num_experts_per_tok")
    key = next((key for key in EXPERTS_KEYS if isinstance(config.get(key), int)), None)
    if not isinstance(k, int) or key is None:
        return None
    if k < 1:
        return (f"model.config.num_experts_per_tok={k} is out of range: it must be >= 1 (the "
                "experts each token is sent to)")
    if k > config[key]:
        return (f"model.config.num_experts_per_tok={k} is above model.config.{key}="
                f"{config[key]}: a token picks at most every expert once; lower it")
    return _groups_problem(config, key, k)


def _groups_problem(config: Mapping, key: str, k: int) -> str | None:
    """DeepSeek's group-limited routing (model.config.n_group groups of equal size, each
    scored by its best two experts; a token's experts from the topk_group best groups):
    groups that do not split the experts had failed in the router's view, said as the
    data's fault."""
    groups, best = config.get("n_group"), config.get("topk_group")
    if not isinstance(groups, int) or not isinstance(best, int):
        return None
    experts = config[key]
    if groups < 1 or experts % groups or experts // groups < 2:
        return (f"model.config.n_group={groups} does not split model.config.{key}={experts} "
                "into groups of 2 or more experts (the router scores each group by its best "
                "two): give a divisor of the experts at most half their count")
    if not 1 <= best <= groups:
        return (f"model.config.topk_group={best} is out of range: a token's experts come from "
                f"1 to model.config.n_group={groups} groups")
    if k > best * (experts // groups):
        return (f"model.config.num_experts_per_tok={k} is above the {best * experts // groups} "
                f"experts of model.config.topk_group={best} groups: raise topk_group, or "
                "lower num_experts_per_tok")
    return None


def vocab_problem(model: nn.Module, data) -> str | None:
    """A transformers model whose vocabulary is smaller than the data's tokenizer's."""
    config = getattr(model, "config", None)
    have, need = getattr(config, "vocab_size", None), getattr(data, "vocab_size", None)
    if isinstance(have, int) and isinstance(need, int) and have < need:
        return (f"model.config.vocab_size={have} is smaller than the {need} tokens of "
                f"data={data.name}'s vocabulary: set model.config.vocab_size={need}")
    return None


def positions_problem(model: nn.Module, data) -> str | None:
    """A transformers model of learned positions (a table of them: GPT-2's n_positions)
    shorter than the data's sequences: one line before launch (its embedding would index
    past the table). Rotary positions (Llama's) take a longer sequence: not refused."""
    from collections.abc import Mapping

    config = getattr(model, "config", None)
    key = next((k for k in ("n_positions", "max_position_embeddings")
                if isinstance(getattr(config, k, None), int)), None)
    if key is None:
        return None
    limit = getattr(config, key)

    def length(owner) -> int | None:  # a data config's, or a dict data's train or eval set's
        value = owner.get("seq_len") if isinstance(owner, Mapping) else \
            getattr(owner, "seq_len", None)
        return value if isinstance(value, int) else None

    said, seq_len = next(((k, length(o)) for k, o in (
        ("data", data), ("data.train", getattr(data, "train", None)),
        ("data.eval", getattr(data, "eval", None))) if (length(o) or 0) > limit), (None, 0))
    if said is None:
        return None
    tokens = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    learned = any(isinstance(m, nn.Embedding) and m is not tokens and
                  limit <= m.num_embeddings <= limit + 2 for m in model.modules())
    if not learned:
        return None
    return (f"{said}.seq_len={seq_len} is longer than the model's {limit} learned positions "
            f"(model.config.{key}): set {said}.seq_len<={limit}, or model.config.{key}="
            f"{seq_len} (new positions train from scratch)")


def shape(model: nn.Module) -> dict[str, Any] | None:
    """(layers, width) of a transformer's config, for the attention term of its FLOPs."""
    config = getattr(model, "config", None)
    layers = _first(config, "num_hidden_layers", "n_layer", "num_layers")
    width = _first(config, "hidden_size", "n_embd", "d_model")
    if layers is None or width is None:
        return None
    return {"layers": layers, "width": width}


def _first(config: Any, *keys: str) -> int | None:
    for key in keys:
        value = getattr(config, key, None)
        if isinstance(value, int):
            return value
    return None


def converts_checkpoints(model: nn.Module) -> bool:
    """A transformers model whose saved weights transformers converts as it loads them (an
    MoE model's experts, published one by one, fused into 3-D weights in the model), so
    that their names are not the model's own."""
    if not is_transformers(model):
        return False
    from transformers.conversion_mapping import extract_weight_conversions_for_model

    return bool(extract_weight_conversions_for_model(model))


def pretrained(folder, model: nn.Module, meta: bool = False) -> tuple[dict[str, Any], dict]:
    """A transformers folder's weights as `model`'s class loads them, converted to its own
    names (its state_dict; on meta: the names alone), and transformers' loading info
    (missing, unexpected and mis-shaped keys)."""
    from torch.distributed.fsdp import FSDPModule

    # the model's own class, not the one FSDP2 made of it (its class's first base)
    own = next(c for c in type(model).__mro__ if not issubclass(c, FSDPModule))
    # only its weights are read: no layer swapped for the hub's kernels (transformers 5.25
    # kernelizes a loaded model by default, and refuses to on meta); a weight of another
    # shape is reported in the info (weights.fit_problem says it in one line), where
    # transformers had raised after printing its own report
    loaded, info = own.from_pretrained(str(folder), config=model.config,
                                       output_loading_info=True, use_kernels=False,
                                       ignore_mismatched_sizes=True,
                                       **({"device_map": "meta"} if meta else {}))
    return loaded.state_dict(), info


def summed_loss(model: nn.Module, logits, labels):
    """The model's own loss of `logits` against `labels`, summed over its terms (its
    loss_function, the labels shifted by a causal LM's, given one item to divide by)."""
    return model.loss_function(logits=logits, labels=labels,
                               vocab_size=model.config.vocab_size, num_items_in_batch=1)


def pipeline_stages(model: nn.Module) -> list[nn.Module] | None:
    """A decoder-only causal LM as a chain of stages whose last gives the forward's logits
    (a pipeline runs it so): its embeddings (the base model's modules with weights
    registered before its blocks), each block, its head (those registered after, then the
    output embeddings). Each wraps the model's own modules, which keep their names; the
    blocks get what the base model's forward gives them (masks, positions), computed from
    the activation and the batch's inputs. None for a model that is no such LM."""
    if not is_transformers(model) or not shifts_labels(model):
        return None
    found, base, head = blocks(model), model.base_model, model.get_output_embeddings()
    children = list(base.named_children())
    at = [i for i, (_, child) in enumerate(children)
          if found and isinstance(child, nn.ModuleList) and list(child) == found]
    dims = shape(model)
    if not at or base is model or head is None or dims is None:
        return None
    weighted = [(i, name, child) for i, (name, child) in enumerate(children)
                if next(child.parameters(), None) is not None]
    before = {name: child for i, name, child in weighted if i < at[0]}
    after = {name: child for i, name, child in weighted if i > at[0]}
    blocks_name = children[at[0]][0]
    return [_Embeddings(base, blocks_name, before),
            *(_Block(base, blocks_name, block, before, dims["width"]) for block in found),
            _Head(after, head)]


class _Reached(Exception):
    """Raised by _Stop: the base model's forward has reached its first block."""

    def __init__(self, args: tuple, kwargs: dict):
        self.args_, self.kwargs = args, kwargs


class _Stop(nn.Module):
    def forward(self, *args, **kwargs):
        raise _Reached(args, kwargs)


class _Zeros(nn.Module):
    """Stands for an embedding module in a forward whose result is not used: zeros of its
    output's shape (ids -> (..., width)), no weights."""

    def __init__(self, width: int):
        super().__init__()
        self.width = width

    def forward(self, x, *args, **kwargs):
        import torch

        shape = x.shape if not x.is_floating_point() else x.shape[:-1]
        return torch.zeros(*shape, self.width, device=x.device)


def _first_block_call(base: nn.Module, blocks_name: str, swapped: dict[str, nn.Module],
                      *args, **kwargs) -> tuple[tuple, dict]:
    """Run `base`'s own forward up to its first block (on a copy of it whose blocks are a
    _Stop, and whose modules `swapped` names stand in for its own); what that block gets."""
    import copy

    skeleton = copy.copy(base)
    skeleton._modules = {**base._modules, **swapped, blocks_name: nn.ModuleList([_Stop()])}
    try:
        skeleton(*args, **kwargs)
    except _Reached as reached:
        return reached.args_, reached.kwargs
    raise RuntimeError(f"{type(base).__name__}'s forward never reached its blocks")


class _Embeddings(nn.Module):
    """The base model's forward up to its first block: the input as the model takes it (its
    ids, and the batch's other inputs as keywords) -> the first block's activation."""

    def __init__(self, base: nn.Module, blocks_name: str, modules: dict[str, nn.Module]):
        super().__init__()
        self.__dict__["base"] = base  # not a child: only the modules it holds are
        self.blocks_name = blocks_name
        for name, module in modules.items():
            self.add_module(name, module)

    def forward(self, *args, **inputs):
        import torch

        call = torch.compiler.disable(_first_block_call)  # a graph break either way
        return call(self.base, self.blocks_name, {}, *args, **inputs)[0][0]


class _Block(nn.Module):
    """One block, called as the base model's forward calls it: beside the activation, what
    the forward computes before its blocks from the batch (masks, positions), computed again
    here without gradients and without the embeddings' weights (which may be on another
    rank), random draws undone."""

    takes_inputs = True

    def __init__(self, base: nn.Module, blocks_name: str, block: nn.Module,
                 embeddings: dict[str, nn.Module], width: int):
        super().__init__()
        self.__dict__["base"] = base
        self.blocks_name = blocks_name
        self.absent = {name: _Zeros(width) for name in embeddings}
        self.block = block

    def forward(self, hidden, input_ids=None, **inputs):
        import torch

        with torch.no_grad(), torch.random.fork_rng(
                devices=[hidden.device] if hidden.device.type == "cuda" else []):
            args, kwargs = torch.compiler.disable(_first_block_call)(
                self.base, self.blocks_name, self.absent, inputs_embeds=hidden, **inputs)
        out = self.block(hidden, *args[1:], **kwargs)
        return out[0] if isinstance(out, tuple) else out


class _Head(nn.Module):
    """The base model's modules after its blocks (a final norm), then the output
    embeddings: the activation -> logits."""

    def __init__(self, modules: dict[str, nn.Module], head: nn.Module):
        super().__init__()
        for name, module in modules.items():
            self.add_module(name, module)
        self.output_embeddings = head  # (registered last: after the base's modules)

    def forward(self, hidden, **inputs):
        *after, head = self.children()
        for module in after:
            hidden = module(hidden)
        return head(hidden)
