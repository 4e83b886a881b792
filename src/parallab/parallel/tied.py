"""Parameters that stages on different ranks of a pipeline share: tied input and output
embeddings (gpt's model.tie_embeddings, GPT-2's and Gemma's own), the first stage on one
rank and the last on another.

Each rank holding such a parameter keeps its own copy. The copies are equal at the start,
as every rank builds the whole model from one seed before the cut, and stay equal: once
per optimizer step, before the optimizer reads them, their gradients are summed over the
ranks that hold them (Megatron-LM's embedding group), which gives each the gradient one
device's autograd sums into the one parameter. The gradient norm counts the parameter once,
on the first of those ranks, and its optimizer state goes by the first stage's name for it,
which one device's checkpoint holds. Under FSDP2 or tensor parallelism each holder's shard is the
same slice of it (the ranks share every other mesh coordinate, and the tied pair is split
alike: tp_plans), so the local tensors are summed."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from parallab import batch as batches
from parallab.parallel import schedules
from parallab.parallel import stages as stages_of


@dataclass
class TiedSet:
    """One shared parameter: the pipeline ranks holding it, and where this rank finds it
    (a module and its attribute: wrappers replace the Parameter, not the module)."""

    ranks: tuple[int, ...]  # pipeline positions, in order
    module: nn.Module | None  # None: this rank holds none of it
    name: str
    held_as: str = ""  # its name in the model where this rank holds it
    named: str = ""  # and where the first stage holding it does (a checkpoint's name for it)
    embedding: bool = False  # the first stage holds it in an embedding (optim: no decay)
    group: object = None

    def param(self) -> nn.Parameter | None:
        return None if self.module is None else getattr(self.module, self.name)


def tied_sets(stages: list[nn.Module], ranges: list[range], schedule: str, pp: int,
              v: int, position: int, names: dict[int, str]) -> list[TiedSet]:
    """The parameters stages on different pipeline ranks share, each with where the rank
    at `position` holds it (`names`: each module's name in the model, by id)."""
    part_of = {i: k for k, indices in enumerate(ranges) for i in indices}
    where: dict[int, list[tuple[int, nn.Module, str]]] = {}
    for index, stage in enumerate(stages):
        for module in stage.modules():
            for name, param in module.named_parameters(recurse=False):
                where.setdefault(id(param), []).append((index, module, name))
    found = []
    for key, indices in stages_of.holders(stages).items():
        ranks = sorted({schedules.rank_of(schedule, pp, v, part_of[i]) for i in indices})
        if len(ranks) < 2:
            continue
        mine = [(module, name) for index, module, name in where[key]
                if schedules.rank_of(schedule, pp, v, part_of[index]) == position]
        module, name = mine[0] if mine else (None, "")
        full = lambda m, n: f"{names[id(m)]}.{n}".lstrip(".")  # noqa: E731
        first = where[key][0][1:]
        found.append(TiedSet(tuple(ranks), module, name, full(module, name) if mine else "",
                             full(*first), isinstance(first[0], nn.Embedding)))
    return found


class Tied:
    """The tied parameters of a pipeline rank: their groups, made on every rank in one
    order (new_subgroups_by_enumeration: each group's ranks share every mesh coordinate
    but pp), their gradients summed, and those the norm leaves out."""

    def __init__(self, sets: list[TiedSet], mesh, position: int):
        self.sets = sets
        self.position = position
        names = mesh.mesh_dim_names
        pp = mesh.mesh.size(names.index("pp"))
        lines = mesh.mesh.movedim(names.index("pp"), -1).reshape(-1, pp)
        for tied in sets:  # every rank, in one order: each group is made collectively
            tied.group, _ = dist.new_subgroups_by_enumeration(
                lines[:, list(tied.ranks)].tolist())

    def reduce(self) -> None:
        """Each tied parameter's gradient summed over the ranks holding it."""
        for tied in self.sets:
            param = tied.param()
            if param is None:
                continue
            if param.grad is None:  # a holder whose copy took no gradient this step
                param.grad = torch.zeros_like(param)
            placements = getattr(param, "placements", None)
            if placements is not None and param.grad.placements != placements:
                # an embedding cut by rows takes its gradient whole (Replicate): each
                # holder's slice of it is its shard's (a slice, no communication)
                param.grad = param.grad.redistribute(placements=placements)
            dist.all_reduce(batches.local(param.grad), group=tied.group)

    def embeddings(self) -> set[int]:
        """The ids of the copies one device holds in an embedding."""
        return {id(tied.param()) for tied in self.sets
                if tied.module is not None and tied.embedding}

    def uncounted(self) -> set[int]:
        """The ids of the copies the gradient norm leaves out: all but the first holder's."""
        return {id(tied.param()) for tied in self.sets
                if tied.module is not None and self.position != tied.ranks[0]}

    def renamed(self, state: dict, back: bool = False) -> dict:
        """A flattened optimizer state with a copy's entries under the name the first stage
        holds it by (one device's, whose checkpoint names a tied parameter once), or, with
        `back`, under this rank's name again."""
        names = {t.held_as: t.named for t in self.sets if t.module is not None
                 and t.held_as != t.named}
        if back:
            names = {named: held for held, named in names.items()}
        if not names:
            return state
        renamed = {}
        for key, value in state.items():
            kind, _, rest = key.partition(".")
            for old, new in names.items():
                if rest.startswith(old + "."):
                    key = f"{kind}.{new}{rest[len(old):]}"
                    break
            renamed[key] = value
        return renamed
