"""A multilayer perceptron over any input, flattened: the small model of tests and benchmarks."""

from __future__ import annotations

import math

from torch import nn

from parallab.config import MlpConfig
from parallab.models.base import Model, fits_classes


class MLP(Model):
    def __init__(self, cfg: MlpConfig):
        super().__init__()
        widths = [cfg.input_dim, *cfg.hidden]
        self.layers = nn.ModuleList(
            nn.Sequential(nn.Flatten() if i == 0 else nn.Identity(), nn.Linear(w_in, w_out),
                          nn.ReLU(), nn.Dropout(cfg.dropout))
            for i, (w_in, w_out) in enumerate(zip(widths, widths[1:])))
        self.head = nn.Sequential(nn.Flatten() if not cfg.hidden else nn.Identity(),
                                  nn.Linear(widths[-1], cfg.num_classes))

    def stages(self) -> list[nn.Module]:
        return [*self.layers, self.head]

    @classmethod
    def check_data(cls, cfg, data) -> str | None:
        if getattr(data, "vocab_size", None):
            return (f"model=mlp takes numeric features, but data={data.name} holds token ids: "
                    "use model=lstm or model=gpt")
        features = math.prod(data.input_shape)
        if cfg.input_dim is None:
            cfg.input_dim = features
        if cfg.input_dim != features:
            return (f"model.input_dim={cfg.input_dim} does not fit data={data.name}, whose "
                    f"samples have {features} values: set model.input_dim={features} (or null)")
        return fits_classes(cfg, data)
