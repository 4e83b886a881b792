"""What a run counts and reports, in one place the Trainer calls at fixed points (as
torchtitan's trainer calls its MetricsProcessor): each step's time and samples, a language
model's tokens and MFU, the bytes its counted step sends, the figures of a log window and of
the run's summary, and the quantization report (Meter: a step observer, as
observe/observer.py's protocol has it; the loss it logs is training/loss_window.py's)."""

from __future__ import annotations

import contextlib
import logging
import statistics
import time
from typing import Any, Iterator

import torch

from parallab import batch as batch_of
from parallab.observe import mfu
from parallab.observe.comm import CommCounter
from parallab.observe.memory import held_state_mb, peak_memory_mb
from parallab.observe.observer import StepObserver

log = logging.getLogger("parallab.training.trainer")  # its lines read as the loop's


class Meter(StepObserver):
    """Timing, throughput and memory of one rank's run (cfg: the trainer config; runtime:
    the run's layout at run time, whose devices MFU counts, whose data-parallel ranks read
    different samples and whose readers read each batch; model: the unwrapped model, whose
    shape gives a language model's FLOPs)."""

    def __init__(self, cfg, dist, runtime, model, logger):
        self.cfg, self.dist, self.model, self.logger = cfg, dist, model, logger
        ranks = runtime.ranks
        self.world_size, self.readers, self.data_world = (ranks.world_size, ranks.readers,
                                                          ranks.data.world_size)
        self.step_times: list[float] = []  # seconds per step, data loading included
        # of each, the loop's own: from the last step's end to this one's start (the batch
        # loaded, the last log step's figures and checkpoint): no layout changes it
        self.loop_times: list[float] = []
        self.measured_samples = 0  # global samples in steps after warm-up
        self.epoch_times: list[float] = []
        self.comm: dict[str, float] = {}  # bytes sent in one step, by kind (counting)
        # a language model's batches (set at the first step): tokens counted per step
        self.counts_tokens: bool | None = None
        self.window_tokens: list[torch.Tensor | int] = []
        self.tokens_per_sample = 0.0  # over the logged windows: tokens / samples
        self.flops_per_token = 0.0  # for MFU; 0 where the model cannot say
        self.peak_flops = (mfu.peak_flops_of(dist.device, runtime.precision)
                           if dist.device.type == "cuda" else None)
        self.started = self.tick = time.perf_counter()

    def epoch_started(self) -> None:
        self.started = self.tick = time.perf_counter()

    def resume_clock(self) -> None:
        """After an evaluation: it is no step's time."""
        self.tick = time.perf_counter()

    def step_started(self) -> None:
        """The optimizer step begins: the loop's own time since the last one ends."""
        self.loop_times.append(time.perf_counter() - self.tick)

    def step_done(self, step: int, batches: list, last: bool) -> None:
        """A step over `batches` (this rank's micro-batches) ended (`last`: the run's)."""
        if self.dist.device.type == "cuda" and last:
            # steps are timed as the host queues them: the last one's kernels must end
            # inside the timed span (each log step's loss read waits for its own)
            torch.cuda.synchronize(self.dist.device)
        now = time.perf_counter()
        self.step_times.append(now - self.tick)
        self.tick = now
        if step > self.cfg.timing_skip_steps:
            self.measured_samples += sum(batch_of.rows(b) for b in batches) * self.data_world
        if self.counts_tokens is None:  # a language model's: tokens counted, FLOPs known
            self.counts_tokens = batch_of.is_sequence(batches[0])
            if self.counts_tokens:
                self.flops_per_token = mfu.flops_per_token(self.model,
                                                           batch_of.seq_len(batches[0]))
        if self.counts_tokens:  # summed at the log step (a sum per step costs more)
            self.window_tokens.extend(batch_of.tokens(b) for b in batches)

    def epoch_done(self) -> None:
        self.epoch_times.append(time.perf_counter() - self.started)

    @contextlib.contextmanager
    def counting(self, trainer, batches: list) -> Iterator[None]:
        """The counted step: the bytes it sends, by kind (comm.py), logged at its step."""
        step = trainer.step + 1
        with CommCounter() as counter:
            yield
        self.comm = counter.figures()
        self.logger.scalars({"comm/" + k.removeprefix("comm_"): v
                             for k, v in self.comm.items()}, step)

    def take_window_tokens(self) -> float:
        """This rank's tokens since the last log window (for its all-reduce)."""
        tokens = sum(self.window_tokens) if self.window_tokens else 0
        self.window_tokens.clear()
        return tokens

    def log_figures(self, steps: int, tokens: float, global_batch: int) -> dict[str, float]:
        """A log window's figures over its `steps`: step time, samples/s, memory, and a
        language model's tokens/s and MFU (`tokens`: over every rank)."""
        step_time = sum(self.step_times[-steps:]) / steps
        samples_per_sec = global_batch / step_time
        per_sample = None
        if tokens:  # per sample, over the window's global batches (each counted once)
            per_sample = tokens / self.readers / (global_batch * steps)
            self.tokens_per_sample = per_sample
        return {"samples_per_sec": samples_per_sec, "step_time_ms": step_time * 1e3,
                "peak_memory_mb": peak_memory_mb(self.dist.device),
                **self.throughput(samples_per_sec, per_sample)}

    def throughput(self, samples_per_sec: float, tokens_per_sample: float | None = None
                   ) -> dict[str, float]:
        """Tokens/s of a language model (counted: padding and ignored labels left out), and
        MFU where the device's peak is known."""
        tokens = self.tokens_per_sample if tokens_per_sample is None else tokens_per_sample
        if not tokens:
            return {}
        figures = {"tokens_per_sec": samples_per_sec * tokens}
        if self.peak_flops and self.flops_per_token:
            figures["mfu"] = (figures["tokens_per_sec"] * self.flops_per_token
                              / (self.peak_flops * self.world_size))
        return figures

    def summary(self, steps: int, global_batch: int, model, optimizer) -> dict[str, Any]:
        """The run's timing, throughput, memory and comm figures; None where the run was
        too short to measure one."""
        measured = self.step_times[self.cfg.timing_skip_steps:]
        loop = self.loop_times[self.cfg.timing_skip_steps:]
        samples_per_sec = self.measured_samples / sum(measured) if measured else None
        if not measured and self.dist.is_main:
            log.info("samples_per_sec and step_time_ms are null: this run's %d steps are all "
                     "within trainer.timing_skip_steps=%d, left out of timing (lower it, or "
                     "train longer)", len(self.step_times), self.cfg.timing_skip_steps)
        return {
            "samples_per_sec": samples_per_sec,
            **(self.throughput(samples_per_sec) if samples_per_sec else {}),
            "step_time_ms": statistics.median(measured) * 1e3 if measured else None,
            "loop_time_ms": statistics.median(loop) * 1e3 if loop else None,
            "epoch_time_s": statistics.median(self.epoch_times) if self.epoch_times else None,
            "steps": steps,
            "global_batch_size": global_batch,
            "peak_memory_mb": peak_memory_mb(self.dist.device),
            "state_memory_mb": held_state_mb(model, optimizer) if steps else None,
        }

    def quantized(self, model, score, eval_loss: float, step: int) -> dict[str, float]:
        """trainer.quantize: sizes and eval figures of `model` before and after (`score`:
        a model's eval figures)."""
        from parallab import quantize

        summary = quantize.compare(model, score)
        self.logger.scalars({f"quantize/{k}": v for k, v in summary.items()}, step)
        if self.dist.is_main:
            log.info("%s: %.3f MB -> %.3f MB, eval loss %.4f -> %.4f", self.cfg.quantize,
                     summary["model_size_mb"], summary["quantized_size_mb"], eval_loss,
                     summary["quantized_eval_loss"])
        return summary
