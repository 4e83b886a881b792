"""A multilayer perceptron over any input, flattened: the small model of tests and benchmarks."""

from __future__ import annotations

import math
from typing import Any

from torch import nn

from parallab.models.base import Model, fits_classes, in_range, token_ids_problem


class MLP(Model):
    def __init__(self, input_dim: int, hidden: list[int] = (256, 128), num_classes: int = 10,
                 dropout: float = 0.0):
        super().__init__()
        widths = [input_dim, *hidden]
        self.layers = nn.ModuleList(
            nn.Sequential(nn.Flatten() if i == 0 else nn.Identity(), nn.Linear(w_in, w_out),
                          nn.ReLU(), nn.Dropout(dropout))
            for i, (w_in, w_out) in enumerate(zip(widths, widths[1:])))
        self.head = nn.Sequential(nn.Flatten() if not hidden else nn.Identity(),
                                  nn.Linear(widths[-1], num_classes))

    def stages(self) -> list[nn.Module]:
        return [*self.layers, self.head]

    def tp_plan(self) -> dict[str, Any]:
        """Tensor parallel in pairs, as Megatron's MLP: a linear split by columns (its
        output stays split through the activation), the next by rows (one all-reduce); an
        odd last linear split by columns and gathered."""
        from torch.distributed.tensor import Replicate
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

        names = [f"layers.{i}.1" for i in range(len(self.layers))] + ["head.1"]
        plan = {name: ColwiseParallel() if i % 2 == 0 else RowwiseParallel()
                for i, name in enumerate(names)}
        if len(names) % 2:
            plan[names[-1]] = ColwiseParallel(output_layouts=Replicate())
        return plan

    @classmethod
    def check_data(cls, cfg, data) -> str | None:
        problem = in_range(cfg, {"input_dim": 1, "num_classes": 1}, below_one=("dropout",))
        if problem:
            return problem
        if any(width < 1 for width in cfg["hidden"]):
            return f"model.hidden={cfg['hidden']} holds a width < 1: every width must be >= 1"
        problem = token_ids_problem("mlp", "numeric features", data)
        if problem:
            return problem
        if data.input_shape is None:
            return f"model=mlp: data={data.name} does not say its sample shape: set model.input_dim"
        features = math.prod(data.input_shape)
        if cfg["input_dim"] is None:
            cfg["input_dim"] = features
        if cfg["input_dim"] != features:
            return (f"model.input_dim={cfg['input_dim']} does not fit data={data.name}, whose "
                    f"samples have {features} values: set model.input_dim={features} (or null)")
        return fits_classes(cfg, data)
