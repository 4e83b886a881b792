"""One split of a data set held in memory, and how a batch of it becomes model input."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class Split:
    inputs: torch.Tensor  # (N, ...) uint8 pixels, or float features already scaled
    targets: torch.Tensor  # (N,) int64 class labels
    mean: float = 0.0  # uint8 inputs are scaled to [0, 1], then normalised by mean and std
    std: float = 1.0

    def __len__(self) -> int:
        return len(self.targets)

    def prepare(self, inputs: torch.Tensor) -> torch.Tensor:
        """A batch of raw inputs as normalised float32, on whatever device it already is."""
        if inputs.dtype != torch.uint8:
            return inputs
        # one fused pass: -mean/std + x / (255 std), the uint8 promoted to float32 on the way
        return torch.add(self._shift(inputs.device), inputs, alpha=1.0 / (255.0 * self.std))

    def _shift(self, device: torch.device) -> torch.Tensor:
        """-mean/std as a 0-dim float32 tensor on `device`, made once (a new tensor per
        batch cost as much as the add itself)."""
        cached = self.__dict__.get("_shifts", {})
        if device not in cached:
            cached[device] = torch.tensor(-self.mean / self.std, device=device)
            self.__dict__["_shifts"] = cached
        return cached[device]


class TokenSplit(Split):
    """Token sequences (N, T), stored as uint8 bytes or int64 ids, fed to the model as int64;
    targets are next tokens (N, T) or class labels (N,)."""

    def prepare(self, inputs: torch.Tensor) -> torch.Tensor:
        return inputs.long()
