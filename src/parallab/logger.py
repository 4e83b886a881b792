"""Rank 0's record of a run: TensorBoard event files and metrics.json in the run dir."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf


def config_yaml(cfg: Any) -> str:
    return OmegaConf.to_yaml(OmegaConf.structured(cfg))


class RunLogger:
    """Writes only where `active` (rank 0); every rank may call it alike."""

    def __init__(self, run_dir: str | Path, active: bool):
        self.run_dir = Path(run_dir)
        self.writer = None
        if active:
            from torch.utils.tensorboard import SummaryWriter

            self.writer = SummaryWriter(log_dir=str(self.run_dir))

    def scalars(self, values: dict[str, float], step: int) -> None:
        if self.writer:
            for tag, value in values.items():
                self.writer.add_scalar(tag, value, step)

    def text(self, tag: str, markdown: str) -> None:
        if self.writer:
            self.writer.add_text(tag, markdown, 0)

    def config(self, cfg: Any) -> None:
        self.text("config", f"```yaml\n{config_yaml(cfg)}\n```")

    def finish(self, metrics: dict[str, Any], hparams: dict[str, Any], step: int) -> None:
        """metrics.json, and hparams against the final figures for TensorBoard's HParams tab."""
        if not self.writer:
            return
        from torch.utils.tensorboard.summary import hparams as hparams_summary

        # JSON has no NaN: a figure that is not finite is null
        finite = {k: None if isinstance(v, float) and not math.isfinite(v) else v
                  for k, v in metrics.items()}
        (self.run_dir / "metrics.json").write_text(
            json.dumps(finite, indent=2, allow_nan=False) + "\n")
        final = {f"final/{k}": v for k, v in metrics.items()
                 if isinstance(v, (int, float)) and not isinstance(v, bool)}
        self.scalars(final, step)
        for summary in hparams_summary(hparams, final):
            self.writer.file_writer.add_summary(summary)
        self.writer.flush()

    def close(self) -> None:
        if self.writer:
            self.writer.close()
