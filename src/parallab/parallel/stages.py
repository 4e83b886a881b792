"""A model's stages: submodules in forward order, each taking and returning one tensor,
whose chain is the model's forward. Layouts build on them: fsdp shards each stage, model
parallelism places stages on devices, the pipeline keeps a run of stages per rank.

Found in this order: the module names parallel.stages lists ("blocks.*" expands over the
children of a ModuleList or Sequential); the model's own stages() method; the children of
an nn.Sequential. None when none applies: no parallab base class is needed for data
parallelism, fsdp then shards the root alone, model parallelism refuses. The pipeline also
takes a transformers causal LM's own chain (chain(): its embeddings, blocks and head), and
runs runs of stages as Parts, each one of torch's pipeline stages.
"""

from __future__ import annotations

import torch
from torch import nn

from parallab.config.errors import ConfigError


def named(model: nn.Module, names: list[str]) -> list[nn.Module]:
    """The submodules `names` lists, `*` expanded; KeyError naming the first one missing."""
    stages: list[nn.Module] = []
    for name in names:
        if name == "*" or name.endswith(".*"):
            parent = name[:-2] if name.endswith(".*") else ""
            stages += list(_submodule(model, parent).children())
        else:
            stages.append(_submodule(model, name))
    return stages


def _submodule(model: nn.Module, name: str) -> nn.Module:
    try:
        return model.get_submodule(name)
    except AttributeError:
        raise KeyError(name) from None


def configured(model: nn.Module, names: list[str] | None) -> list[nn.Module] | None:
    """`find`, with a name in parallel.stages that is no submodule one line (ConfigError)."""
    try:
        return find(model, names)
    except KeyError as missing:
        children = [name for name, _ in model.named_children()]
        raise ConfigError(f"parallel.stages names {missing}, which is not a submodule of the "
                          f"model (its top-level modules: {', '.join(children)}): give module "
                          "names in forward order") from None


def find(model: nn.Module, names: list[str] | None = None) -> list[nn.Module] | None:
    if names:
        return named(model, list(names))
    own = getattr(model, "stages", None)
    if callable(own) and not isinstance(own, nn.Module):  # the method, not a ModuleList
        return list(own())
    if isinstance(model, nn.Sequential):
        return list(model.children())
    return None


def chain(model: nn.Module, names: list[str] | None = None) -> list[nn.Module] | None:
    """The stages a pipeline runs one after the other: find()'s, else a transformers causal
    LM's (models/hf.py: its embeddings, each block, its head), whose forward is no chain."""
    from parallab.models import hf

    return find(model, names) or hf.pipeline_stages(model)


def held(stage: nn.Module, names: dict[int, str]) -> list[nn.Module]:
    """The model's modules a stage holds (`names`: the model's, by id): the stage itself, or,
    for a stage that wraps the model's modules (a transformers model's), its children."""
    return [stage] if id(stage) in names else list(stage.children())


def refreshed(model: nn.Module, stages: list[nn.Module], names: dict[int, str]
              ) -> list[nn.Module]:
    """`stages` as `model` holds them now, by the names they had (`names`, taken before):
    activation checkpointing has put wrappers in their places since."""
    now = []
    for stage in stages:
        if id(stage) in names:
            now.append(model.get_submodule(names[id(stage)]))
            continue
        for child_name, child in list(stage.named_children()):
            if id(child) in names:  # (else refreshed already)
                stage.register_module(child_name, model.get_submodule(names[id(child)]))
        now.append(stage)
    return now


class Part(nn.Module):
    """A run of stages, one of torch's pipeline stages: the first of the model takes the
    model's input as the model does (a dict's keys as keywords); each other stage the one
    before's output, and the batch's other inputs too where it says it takes them
    (`takes_inputs`: a transformers block needs the attention mask)."""

    def __init__(self, stages: list[nn.Module], first: bool):
        super().__init__()
        self.chain = nn.ModuleList(stages)
        self.first = first

    def stages(self) -> list[nn.Module]:
        """Its stages: fsdp's units when a Part is sharded as its own root."""
        return list(self.chain)

    def forward(self, *args, **inputs):
        stages = list(self.chain)
        if self.first:
            x, stages = stages[0](*args, **inputs), stages[1:]
        else:  # the activation the stage before sent
            x = args[0]
        for stage in stages:
            x = stage(x, **inputs) if getattr(stage, "takes_inputs", False) else stage(x)
        return x


def units(model: nn.Module, names: list[str] | None = None) -> list[nn.Module] | None:
    """The modules fsdp shards and activation checkpointing wraps one by one: the stages,
    else a transformers model's blocks (the classes its _no_split_modules names), which need
    not chain into the forward."""
    from parallab.models import hf

    return find(model, names) or hf.blocks(model)


def source(model: nn.Module, names: list[str] | None) -> str:
    """Where find() takes the stages from, for messages."""
    if names:
        return "parallel.stages"
    if callable(getattr(model, "stages", None)):
        return "the model's stages()"
    return "the nn.Sequential's children" if isinstance(model, nn.Sequential) else "nowhere"


@torch.no_grad()
def chain_differs(model: nn.Module, stages: list[nn.Module], inputs: torch.Tensor) -> str | None:
    """None if running `stages` one after the other gives the model's own forward on
    `inputs` (eval mode, so dropout draws nothing), else what differs."""
    was_training = model.training
    model.eval()
    try:
        expected = model(inputs)
        chained = inputs
        for stage in stages:
            chained = stage(chained)
    except Exception as error:  # noqa: BLE001 - a stage that cannot take its input
        return f"a stage fails on the previous one's output ({type(error).__name__}: " \
               f"{(str(error).splitlines() or [''])[0]})"
    finally:
        model.train(was_training)
    if not isinstance(expected, torch.Tensor):
        return f"the forward returns {type(expected).__name__}, not one tensor"
    if not isinstance(chained, torch.Tensor) or chained.shape != expected.shape:
        shape = getattr(chained, "shape", type(chained).__name__)
        return f"the stages give {shape} where the forward gives {tuple(expected.shape)}"
    if not torch.allclose(chained.float(), expected.float(), rtol=1e-4, atol=1e-5):
        return "the stages in order compute something else than the forward"
    return None


def holders(stages: list[nn.Module]) -> dict[int, list[int]]:
    """Parameter id -> the indices of the stages holding it (more than one: shared, such as
    tied embeddings)."""
    held: dict[int, list[int]] = {}
    for index, stage in enumerate(stages):
        for param in stage.parameters():
            held.setdefault(id(param), []).append(index)
    return held
