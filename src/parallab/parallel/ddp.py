"""DistributedDataParallel: one process per rank, gradients all-reduced in buckets."""

from __future__ import annotations

from torch import nn
from torch.nn.parallel import DistributedDataParallel

from parallab.errors import ConfigError
from parallab.parallel.base import Strategy


class DDPStrategy(Strategy):
    launches_workers = True
    uses_process_group = True
    shards_data = True

    @classmethod
    def check(cls, cfg) -> None:
        super().check(cfg)
        if not cfg.parallel.bucket_cap_mb > 0:
            raise ConfigError(f"parallel.bucket_cap_mb={cfg.parallel.bucket_cap_mb} is out of "
                              "range: it must be > 0 (DDP's default is 25)")

    def wrap(self, model: nn.Module) -> nn.Module:
        model = self.on_device(model)
        device_ids = [self.dist.device] if self.dist.device.type == "cuda" else None
        return DistributedDataParallel(
            model, device_ids=device_ids,
            bucket_cap_mb=self.cfg.bucket_cap_mb,
            find_unused_parameters=self.cfg.find_unused_parameters,
            gradient_as_bucket_view=self.cfg.gradient_as_bucket_view)

    def unwrap(self, model: nn.Module) -> nn.Module:
        return model.module

    def no_sync(self, model: nn.Module):
        return model.no_sync()
