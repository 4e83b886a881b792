"""What the experts of an MoE model do while it trains. For each MoE layer: its tokens per
expert (a histogram, `expert/block<i>/tokens`), the load's max/mean ratio (1: balanced),
the share of (token, expert) pairs dropped past a capacity, and its router loss; beside the
task loss, the router loss the objective adds (`train/aux`). The run's are summarised in
metrics.json (train_aux, expert_max_mean, expert_dropped).

Each rank counts the MoE layers it holds (a pipeline's: its parts'). Their rows, by block,
ride the all-reduce that already shares the train loss at each log step, so that rank 0
logs every layer's, counted over every data-parallel rank, at no collective of their own.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from parallab.models import moe


class ExpertLoad:
    """The counts of the MoE layers a rank holds, read at each log step."""

    def __init__(self, model: nn.Module, runtime, loss=None):
        self.blocks, self.experts, self.coefficient = moe.shape_of(model)
        self.loads = moe.loads(model, self.experts)
        self.data_ranks, self.loss_ranks = runtime.ranks.data.world_size, runtime.ranks.loss_ranks
        self.loss = loss  # a transformers model's own router loss, which its loss takes
        self.run = torch.zeros(self.blocks, self.experts + 3)  # the run's sums, by block
        self.run_model_aux = 0.0
        self.steps = 0

    @classmethod
    def of(cls, model: nn.Module, runtime, loss=None) -> ExpertLoad | None:
        """Its counter where the model mixes experts, else None."""
        return cls(model, runtime, loss) if moe.shape_of(model) else None

    def window(self, device: torch.device) -> torch.Tensor:
        """This rank's counts since the last read, flat: per block its tokens per expert,
        pairs dropped, pairs routed, router loss, and 1 where this rank holds the block;
        last, the model's own router loss (its objective's term) summed over the window."""
        rows = torch.zeros(self.blocks, self.experts + 4, device=device)
        for block, load in self.loads:
            rows[block, :-1] = load.take_window().to(device)
            rows[block, -1] = 1
        taken = getattr(self.loss, "take_aux", None)
        model_aux = torch.as_tensor(taken() if taken else 0.0, dtype=rows.dtype, device=device)
        return torch.cat([rows.flatten(), model_aux.reshape(1)])

    def figures(self, reduced: torch.Tensor, steps: int
                ) -> tuple[dict[str, float], dict[str, list[float]]]:
        """The window's scalars and histograms from every rank's `window()` summed
        (`steps`: the optimizer steps it spans)."""
        reduced = reduced.cpu()
        model_aux = float(reduced[-1]) / self.loss_ranks  # each rank holding a loss, alike
        self.run_model_aux += model_aux
        rows = reduced[:-1].view(self.blocks, -1)
        held = rows[:, -1].clamp(min=1)[:, None]
        # a block's holders (its data-parallel ranks, each tp rank alike) averaged; its
        # tokens the sum over the data-parallel ranks
        rows = rows[:, :-1] / held
        rows[:, :self.experts + 2] *= self.data_ranks
        self.run += rows
        self.steps += steps
        scalars, histograms = {}, {}
        for block in self._moe_blocks(rows):
            tokens, name = rows[block, :self.experts], f"expert/block{block}"
            histograms[f"{name}/tokens"] = tokens.tolist()
            scalars[f"{name}/max_mean"] = _max_mean(tokens)
            scalars[f"{name}/dropped"] = _share(rows[block])
            if self.coefficient:
                scalars[f"{name}/aux"] = float(rows[block, -1]) / steps
        if self.coefficient:
            scalars["train/aux"] = self._aux(rows, steps) + model_aux / steps
        return scalars, histograms

    def summary(self) -> dict[str, Any]:
        """The run's: its router loss per step (what the objective added), the experts'
        max/mean load averaged over the MoE layers, the share of pairs dropped."""
        blocks = self._moe_blocks(self.run)
        if not blocks or not self.steps:
            return {}
        total = self.run[blocks].sum(0)
        aux = self._aux(self.run, self.steps) + self.run_model_aux / self.steps
        return {**({"train_aux": aux} if self.coefficient else {}),
                "expert_max_mean": sum(_max_mean(self.run[b, :self.experts])
                                       for b in blocks) / len(blocks),
                "expert_dropped": _share(total)}

    def state_dict(self) -> dict[str, Any]:
        """The run's sums so far: a resumed run's summary is the uninterrupted one's."""
        return {"run": self.run.clone(), "model_aux": self.run_model_aux, "steps": self.steps}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.run, self.run_model_aux = state["run"].clone(), state["model_aux"]
        self.steps = state["steps"]

    def _moe_blocks(self, rows: torch.Tensor) -> list[int]:
        return [b for b in range(self.blocks) if rows[b, self.experts + 1] > 0]

    def _aux(self, rows: torch.Tensor, steps: int) -> float:
        """The objective's router term per step from parallab's layers: the coefficient x
        their losses (each rank's is the global batch's: their mean over the data ranks is
        it; a transformers model's rows hold none, its loss's term is apart)."""
        return self.coefficient * float(rows[:, -1].sum()) / steps


def _max_mean(tokens: torch.Tensor) -> float:
    mean = float(tokens.mean())
    return float(tokens.max()) / mean if mean else 0.0


def _share(row: torch.Tensor) -> float:
    """Pairs dropped over pairs routed, of a row or a sum of rows (dropped, routed at -3, -2)."""
    return float(row[-3]) / float(row[-2]) if row[-2] > 0 else 0.0
