"""The training objective, shared by the trainer, the strategies and the batch-size finder."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def loss_fn(output: torch.Tensor, targets: torch.Tensor, reduction: str = "mean") -> torch.Tensor:
    """Cross-entropy of class scores (B, C) against labels (B,), or of per-position scores
    (B, T, V) against next tokens (B, T): every target position counts once."""
    return F.cross_entropy(output.flatten(0, -2).float(), targets.flatten(), reduction=reduction)
