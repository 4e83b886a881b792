"""What a transformers model says of itself, read instead of asking the user: whether its
loss shifts the labels (a causal LM), its blocks (`_no_split_modules`: the units fsdp shards
and activation checkpointing wraps), its tensor-parallel plan (`tp_plan`, from the config's
`base_model_tp_plan` and the class's `_tp_plan`), and its shape for FLOPs. Nothing here
imports transformers unless the model is one of its.
"""

from __future__ import annotations

import sys
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
    found = [m for m in model.modules() if type(m).__name__ in names]
    return found or None


def tp_plan(model: nn.Module) -> dict[str, str] | None:
    """The model's own tensor-parallel plan, module pattern -> style name (transformers':
    "colwise", "rowwise", "embedding_rowwise", "colwise_gather_output", ...)."""
    if not is_transformers(model):
        return None
    plan = getattr(model, "tp_plan", None)
    if callable(plan):  # an older transformers: a method, or none
        return None
    return dict(plan) if plan else None


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


def vocab_problem(model: nn.Module, data) -> str | None:
    """A transformers model whose vocabulary is smaller than the data's tokenizer's."""
    config = getattr(model, "config", None)
    have, need = getattr(config, "vocab_size", None), getattr(data, "vocab_size", None)
    if isinstance(have, int) and isinstance(need, int) and have < need:
        return (f"model.config.vocab_size={have} is smaller than the {need} tokens of "
                f"data={data.name}'s vocabulary: set model.config.vocab_size={need}")
    return None


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
