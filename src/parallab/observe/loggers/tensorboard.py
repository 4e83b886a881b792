"""TensorBoard event files in the run dir: scalars, the config as text, and the run's
hyperparameters against its final figures for the HParams tab."""

from __future__ import annotations

from typing import Any

from parallab.observe.loggers.base import Logger, RunInfo


class TensorBoardLogger(Logger):
    def __init__(self) -> None:
        self.writer = None

    @classmethod
    def writes(cls, **config: Any) -> list[str]:
        return ["events.out.tfevents.*"]

    def start(self, run: RunInfo) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(log_dir=str(run.run_dir))
        self.text("config", f"```yaml\n{run.config_yaml}\n```")

    def scalars(self, values: dict[str, float], step: int) -> None:
        for tag, value in values.items():
            self.writer.add_scalar(tag, value, step)

    def histogram(self, tag: str, counts: list[float], step: int) -> None:
        # bin i holds what fell on i: its edges i - 0.5 and i + 0.5, its count the weight
        total = sum(counts)
        self.writer.add_histogram_raw(
            tag, min=0, max=len(counts) - 1, num=total,
            sum=sum(i * c for i, c in enumerate(counts)),
            sum_squares=sum(i * i * c for i, c in enumerate(counts)),
            bucket_limits=[i + 0.5 for i in range(len(counts))], bucket_counts=counts,
            global_step=step)

    def text(self, tag: str, markdown: str) -> None:
        self.writer.add_text(tag, markdown, 0)

    def finish(self, final: dict[str, float], hparams: dict[str, Any], step: int) -> None:
        from torch.utils.tensorboard.summary import hparams as hparams_summary

        self.scalars(final, step)
        for summary in hparams_summary(hparams, final):
            self.writer.file_writer.add_summary(summary)
        self.writer.flush()

    def close(self, status: str) -> None:
        if self.writer is not None:
            self.writer.close()
