"""Numeric precision of the training step: the dtype compute runs in, and its switches."""

from __future__ import annotations

import contextlib

import torch

from parallab.config import PrecisionConfig

DTYPES = {"fp32": torch.float32}


class Precision:
    def __init__(self, cfg: PrecisionConfig, device: torch.device):
        self.dtype = DTYPES[cfg.name]
        if device.type == "cuda":
            torch.backends.cuda.matmul.allow_tf32 = cfg.tf32
            torch.backends.cudnn.allow_tf32 = cfg.tf32

    @property
    def dtype_name(self) -> str:
        return str(self.dtype).removeprefix("torch.")

    def autocast(self) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()
