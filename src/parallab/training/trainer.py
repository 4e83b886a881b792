"""The training loop: steps, periodic logging, evaluation, and the run's final figures."""

from __future__ import annotations

import contextlib
import logging
import math
from collections import deque
from typing import Any

import torch
from torch import nn

from parallab import batch as batch_of
from parallab import metrics, schedule
from parallab.config.errors import ConfigError, OneLineError
from parallab.config.schema import TrainerConfig
from parallab.data import Data
from parallab.data.loaders import micro_batches
from parallab.data.stream import run_length
from parallab.launching.distributed import Dist
from parallab.launching.preemption import Preemption
from parallab.metrics import evaluate
from parallab.observe import memory
from parallab.observe.meter import Meter
from parallab.observe.loggers import RunLogger
from parallab.observe.profiling import profiled
from parallab.observe.progress import Progress
from parallab.parallel.base import Strategy
from parallab.precision import Precision
from parallab.training import checkpoint
from parallab.training.checkpoint import Checkpointer
from parallab.training.monitor import Monitor

log = logging.getLogger(__name__)


class Diverged(OneLineError, RuntimeError):
    """The train loss went NaN or inf under trainer.on_nan=stop."""


Batch = Any  # as the data gives it (batch.py): an (inputs, targets) pair, a dict, ...
SKIP_HORIZON = 20  # on_nan=skip stops when it drops over half of this many recent steps


def global_batch_size(loader, cfg: TrainerConfig, strategy: Strategy) -> int:
    """Samples per optimizer step, over all ranks."""
    return loader.batch_size * cfg.accumulate_grad_batches * strategy.data_dist.world_size


class Trainer:
    def __init__(self, cfg: TrainerConfig, model: nn.Module, strategy: Strategy,
                 optimizer: torch.optim.Optimizer, precision: Precision, data: Data,
                 dist: Dist, logger: RunLogger, checkpointer: Checkpointer | None = None,
                 preemption: Preemption | None = None,
                 metric_specs: dict[str, Any] | None = None, scheduler_cfg: Any = None,
                 probe: Any = None):
        self.cfg = cfg
        self.metric_specs = metric_specs or {}
        self.checkpointer = checkpointer
        self.preemption = preemption or Preemption()
        self.model = model
        self.strategy = strategy
        self.eval_model = strategy.unwrap(model)  # same weights, fewest collectives
        self.data_world = strategy.data_dist.world_size  # ranks reading different samples
        # ranks reading each batch (a tp group's, a pipeline's): counts over the world / this
        self.readers = dist.world_size // self.data_world
        self.optimizer = optimizer
        self.precision = precision
        self.data = data
        self.dist = dist
        self.logger = logger
        self.step = 0
        self.epoch = 0
        self.epoch_step = 0  # optimizer steps done in the current epoch: where to resume
        self.stopped = False  # a signal asked the run to stop; its checkpoint is saved
        self.stop_agreed = False  # every rank has seen the stop request
        self.skipped_steps = 0  # trainer.on_nan=skip: steps dropped for non-finite gradients
        self.recent_skips: deque[bool] = deque(maxlen=SKIP_HORIZON)  # dropped or not, per step
        self.meter = Meter(cfg, dist, precision, strategy.world_size, self.data_world,
                           self.readers, logger)
        # each step's loss since the last log, summed there (an add per step costs more)
        self.window_losses: list[torch.Tensor] = []
        self.window_skipped = 0
        self.window_empty = 0  # of those, steps whose labels were all ignored
        self.epoch_loss = 0.0
        self.epoch_steps = 0
        self.last_train_loss = math.nan
        self.eval_metrics: dict[str, float] = {}
        self.eval_step = -1  # the step eval_metrics were measured at
        self.monitor = Monitor(cfg.monitor, cfg.monitor_mode, cfg.early_stop_patience)
        self.resume_monitor: dict[str, Any] | None = None  # set by an unscheduled evaluation
        self.step_lr: float | None = None  # the rate the last step used, before its schedule moved
        self.first_step = 0  # where this process's training starts (after a resume: later)
        self.probe = probe  # its counted_step(trainer, batches) wraps the counted step (advise)
        # fit()'s recorders stepped after each step (torch.profiler, the memory snapshot)
        self.recorders: list[Any] = []

        self.steps_per_epoch, self.total_steps = run_length(cfg, data.train)
        # the learning rate of each step: over this run's steps (a continued run's new horizon)
        self.scheduler = (schedule.build(scheduler_cfg, optimizer, self.total_steps)
                          if scheduler_cfg is not None else None)

    def done(self) -> bool:
        return self.step >= self.total_steps

    def train_step(self, batches: list[Batch]) -> torch.Tensor:
        """One optimizer step over `batches` (gradient accumulation when more than one);
        returns this rank's share of the step's loss, detached: the sum of its terms over
        the count of the global batch's terms (all micro-batches, all data-parallel ranks),
        times the data-parallel ranks, which average it."""
        items = self.items(batches)
        if isinstance(items, float) and not items:  # (a tensor on a GPU: no host check)
            return self.skip_empty()
        total = None
        for index, batch in enumerate(batches):
            if self.cfg.channels_last:
                batch = to_channels_last(batch)
            last = index == len(batches) - 1
            # reduce gradients across ranks once per step, on its last micro-batch
            with contextlib.nullcontext() if last else self.strategy.no_sync(self.model):
                loss = self.strategy.forward_backward(self.model, batch, self.precision, items)
            total = loss if total is None else total + loss
        skip = self.cfg.on_nan == "skip"
        if self.cfg.clip_grad_norm is not None or skip:
            self.precision.unscale_(self.optimizer)
            norm = self.strategy.clip_grad_norm(self.model, self.cfg.clip_grad_norm)
            # gradients are already reduced, so every rank decides alike
            dropped = skip and not bool(torch.isfinite(norm))
            if dropped:
                self.skipped_steps += 1
                self.window_skipped += 1
                total = torch.zeros_like(total)
                if not self.precision.scaler.is_enabled():  # a scaler skips it by itself
                    self.optimizer.zero_grad(set_to_none=True)
            # a GradScaler's overflow steps are its calibration, not divergence
            if skip and not self.precision.scaler.is_enabled():
                self.recent_skips.append(dropped)
                self.check_skips()
        self.precision.step(self.optimizer)
        self.optimizer.zero_grad(set_to_none=True)
        if self.scheduler is not None:
            self.step_lr = self.optimizer.param_groups[0]["lr"]  # the rate this step used
            self.scheduler.step()
        return total

    def items(self, batches: list[Batch]):
        """The global batch's loss terms (valid labels) per data-parallel rank: what each
        micro-batch's sum is divided by; 0 where there are none (the step is skipped); None
        where the one batch of a one-rank step holds every label (its own mean is the
        step's: no counting, as a hand-written loop)."""
        if len(batches) == 1 and self.data_world == 1 and self.data.train.all_valid:
            return None
        loss = self.strategy.loss
        counts = [loss.count(batch_of.labels_of(b)) for b in batches]
        n = counts[0] if len(counts) == 1 else sum(counts)
        if self.data.train.all_valid:  # every rank's shard of one split batched alike:
            n = n * self.data_world  # the global count follows from this rank's shapes
        elif self.data_world > 1:  # one all-reduce of a scalar; tp/pipeline ranks count alike
            n = self.dist.all_reduce_sum(torch.as_tensor(n, dtype=torch.float64,
                                                         device=self.dist.device))
            n = n / self.readers
        if isinstance(n, torch.Tensor) and n.device.type == "cpu":
            n = n.item()  # free on the CPU: an exact skip of an empty step, a plain divisor
        if isinstance(n, torch.Tensor):  # on a GPU: no sync; an empty step's gradients are 0
            return n.clamp(min=1).float() / self.data_world
        return n / self.data_world

    def skip_empty(self) -> torch.Tensor:
        """A global batch whose labels are all ignored (-100): nothing to learn; the
        optimizer does not step."""
        self.skipped_steps += 1
        self.window_skipped += 1
        self.window_empty += 1
        if self.dist.is_main:
            log.warning("step %d: no label of its global batch counts (all are -100): the "
                        "step is skipped", self.step + 1)
        return torch.zeros((), device=self.dist.device)

    def counted_step(self, batches: list[Batch]) -> torch.Tensor:
        """train_step; this process's second step (the first may set things up) also counts
        the bytes it sends (comm.py), and runs inside the probe's counted_step, if any; not
        under compile: a dispatch mode would trip its guards into recompiling."""
        if self.step != self.first_step + 1 or self.cfg.compile:
            return self.train_step(batches)
        probe = (self.probe.counted_step(self, batches) if self.probe is not None
                 else contextlib.nullcontext())
        with self.meter.counting(self.step + 1), probe:
            return self.train_step(batches)

    def fit(self, evaluate: bool = True, report: bool = True) -> dict[str, Any]:
        """Train to the end of the run; its final figures ({} if a signal stopped it).
        evaluate=False trains only (no evaluation by epoch or at the end, nothing
        quantized); report=False shows no progress (advise's candidates)."""
        self.first_step = self.step
        with Progress(self.total_steps, self.dist.is_main and report,
                      self.cfg.progress_bar) as progress, \
                profiled(self.cfg.profile, self.dist.device, self.logger.run_dir, self.dist.rank,
                         self.dist.is_main) as profiler, \
                memory.snapshot(self.cfg.memory_snapshot, self.logger.run_dir, self.dist.rank,
                                self.dist.is_main) as snapshot:
            self.recorders = [r for r in (profiler, snapshot) if r is not None]
            while self.epoch < self.cfg.epochs and not self.done():
                finished = self.train_epoch(progress)
                if self.stopped:
                    return {}
                if not finished or self.monitor.stopped_early:  # trainer.max_steps or
                    break  # early stopping ended it: resuming goes on from here
                self.epoch += 1
                self.epoch_step = 0
                if evaluate and self.cfg.eval_every_n_steps is None and \
                        self.epoch % self.cfg.eval_every_n_epochs == 0 and self.scheduled_eval():
                    break
                if not self.done():  # the last one is `last`, saved by the caller
                    self.save_checkpoint()
        if not evaluate:
            return self.summary()
        if self.eval_step != self.step or not self.eval_metrics:  # final weights unscored
            # off the evaluation schedule: a run resumed from here continues with the
            # monitor as it was, as the uninterrupted run never made this evaluation
            self.resume_monitor = self.monitor.state_dict()
            self.run_eval()
        summary = self.summary()
        if self.cfg.quantize:
            # metrics.evaluate: `evaluate` here is fit's own flag
            summary.update(self.meter.quantized(self.eval_model, lambda model: metrics.evaluate(
                model, self.data.eval, self.dist, None, self.strategy.loss),
                self.eval_metrics[metrics.LOSS], self.step))
        return summary

    def train_epoch(self, progress: Progress) -> bool:
        """Train to the end of the epoch, or until the run is done or stopped; True if the
        epoch's batches were all trained."""
        loader = self.data.train
        loader.set_epoch(self.epoch, skip_batches=self.epoch_step * self.cfg.accumulate_grad_batches)
        self.model.train()
        if self.epoch_step == 0:  # else resumed mid-epoch with these restored
            self.epoch_loss, self.epoch_steps = 0.0, 0
        self.meter.epoch_started()
        finished = False
        for batches in micro_batches(loader, self.cfg.accumulate_grad_batches):
            if self.epoch_step == 0 and len(batches) < self.cfg.accumulate_grad_batches:
                self.refuse_partial_epoch(len(batches))
            self.window_losses.append(self.counted_step(batches))
            self.step += 1
            self.epoch_step += 1
            self.preemption.step_done()
            self.meter.step_done(self.step, batches, self.eval_model, self.done())
            for recorder in self.recorders:
                recorder.step()
            progress.update()
            if self.step % self.cfg.log_every_n_steps == 0 or self.done():
                self.log_window(progress)
            if self.stop_requested():  # before the periodic save: it saves this step once
                self.stop()
                return False
            every = self.cfg.eval_every_n_steps
            if every and self.step % every == 0:
                stop = self.scheduled_eval()
                self.meter.resume_clock()  # an evaluation is no step's time
                if stop:
                    break  # early stopping: fit() ends the run
            every = self.cfg.checkpoint_every_n_steps
            if every and self.step % every == 0 and not self.done():
                self.save_checkpoint()
            if self.done():
                break
        else:
            finished = True
        if self.window_losses:
            self.log_window(progress)
        self.meter.epoch_done()
        # a loss only where a step computed one: none where every label was ignored
        self.last_train_loss = (self.epoch_loss / self.epoch_steps if self.epoch_steps
                                else math.nan)
        return finished or self.epoch_step == self.steps_per_epoch

    def refuse_partial_epoch(self, batches: int) -> None:
        """A stream of unknown length whose epoch gives each rank fewer batches than one step
        accumulates (a sized one is refused before: run_length): every step would be short
        of the samples asked for."""
        raise ConfigError(
            f"trainer.accumulate_grad_batches={self.cfg.accumulate_grad_batches} is more than "
            f"the {batches} batches an epoch of the data gives each rank: set it to at most "
            f"{batches}, or lower data.batch_size")

    def stop_requested(self) -> bool:
        """One process stops as soon as it is signalled; several stop together, when the
        next log step has shared the request (no extra collective per step)."""
        return self.stop_agreed or (self.dist.world_size == 1 and self.preemption.requested)

    def stop(self) -> None:
        if self.window_losses:  # so the checkpoint holds no half-reduced window
            self.log_window(None)
        self.save_checkpoint()
        self.stopped = True

    def save_checkpoint(self, name: str | None = None) -> None:
        """Save, from finite weights only: a NaN loss in any step since the last log window
        (on any rank) means the weights may be NaN too (one all-reduce per checkpoint)."""
        if self.checkpointer is None:
            return
        if self.window_losses:
            bad = torch.tensor(float(not torch.isfinite(self.window_loss())),
                               device=self.dist.device)
            if self.dist.all_reduce_sum(bad).item() > 0:
                self.diverged(math.nan)
        with self.preemption.busy():
            self.checkpointer.save(self.state_dict(), name or checkpoint.periodic_name(self.step))

    def stop_early(self) -> None:
        self.monitor.stopped_early = True
        if self.dist.is_main:
            m = self.monitor
            log.info("early stop: %s has not improved for %d evaluations (best %.6g at step %s)",
                     m.name, m.stale, m.best, m.best_step)

    def check_skips(self) -> None:
        """on_nan=skip that drops most of the recent steps learns nothing: stop as `stop`."""
        recent = self.recent_skips
        if len(recent) >= SKIP_HORIZON // 2 and sum(recent) * 2 > len(recent):
            raise Diverged(f"trainer.on_nan=skip dropped {sum(recent)} of the last "
                           f"{len(recent)} steps (non-finite gradients) at step {self.step}: "
                           "stopped, every checkpoint kept holds finite weights; lower "
                           "optim.lr or set trainer.clip_grad_norm")

    def diverged(self, loss: float) -> None:
        raise Diverged(f"train loss is {loss} at step {self.step}: stopped; every checkpoint "
                       "kept holds finite weights; lower optim.lr, set trainer.clip_grad_norm, "
                       "or set trainer.on_nan=skip to drop such steps")

    def window_loss(self) -> torch.Tensor:
        """This rank's summed loss of the steps since the last log window."""
        if not self.window_losses:
            return torch.zeros((), device=self.dist.device)
        return torch.stack(self.window_losses).float().sum()


    def log_window(self, progress: Progress | None) -> None:
        """Train loss averaged over the steps since the last log and over all ranks; the
        same all-reduce shares any stop request and a language model's token count."""
        steps = len(self.window_losses)
        shared = torch.stack([self.window_loss(),
                              torch.tensor(float(self.preemption.requested),
                                           device=self.dist.device),
                              torch.as_tensor(self.meter.take_window_tokens(),
                                              dtype=torch.float32, device=self.dist.device)])
        loss_sum, stops, tokens = self.dist.all_reduce_sum(shared).tolist()
        self.stop_agreed = self.stop_agreed or stops > 0
        loss = self.window_mean(loss_sum, steps)
        figures = self.meter.window(steps, tokens, self.global_batch_size)
        self.logger.scalars({
            **({"train/loss": loss} if loss is not None else {}),
            "train/lr": self.step_lr or self.optimizer.param_groups[0]["lr"],
            **{f"train/{k}": v for k, v in figures.items()},
            "train/epoch": self.epoch,
            "train/skipped_steps": self.skipped_steps,
        }, self.step)
        if progress is not None:
            shown = "-" if loss is None else f"{loss:.4f}"
            progress.line(f"epoch {self.epoch + 1} step {self.step}/{self.total_steps} "
                          f"loss {shown} {figures['samples_per_sec']:,.0f} samples/s",
                          loss=shown, epoch=str(self.epoch + 1))
        if loss is not None and math.isfinite(loss):
            self.epoch_loss += loss * (steps - self.window_skipped)
            self.epoch_steps += steps - self.window_skipped
        self.window_losses.clear()
        self.window_skipped = self.window_empty = 0

    def window_mean(self, loss_sum: float, steps: int) -> float | None:
        """The mean train loss of the window's trained steps over all ranks; None where
        every step had nothing to learn from (all labels ignored); Diverged where it is not
        finite under on_nan=stop."""
        counted = (steps - self.window_skipped) * self.strategy.loss_ranks
        if not counted and self.window_empty == steps:
            return None
        loss = loss_sum / counted if counted else math.nan
        if not math.isfinite(loss) and self.cfg.on_nan == "stop":
            self.diverged(loss)
        return loss

    @property
    def global_batch_size(self) -> int:
        return global_batch_size(self.data.train, self.cfg, self.strategy)

    def run_eval(self) -> None:
        with self.preemption.busy():
            self.eval_metrics = evaluate(self.eval_model, self.data.eval, self.dist,
                                         self.precision, self.strategy.loss,
                                         self.metric_specs, self.strategy.eval_forward)
        self.eval_step = self.step
        if self.monitor.update(self.eval_metrics, self.step) and self.cfg.save_best:
            self.save_checkpoint("best")
        self.logger.scalars({"eval/" + k.removeprefix(metrics.PREFIX): v
                             for k, v in self.eval_metrics.items()}, self.step)
        if self.dist.is_main:
            # by step where evaluation is by step, or the run ended inside an epoch
            # (trainer.max_steps): the progress lines' numbering, not the epochs completed
            by_step = self.cfg.eval_every_n_steps or self.epoch_step
            when = f"step {self.step}" if by_step else f"epoch {self.epoch}"
            log.info("%s: %s", when, ", ".join(
                f"{k} {v:.4f}" for k, v in self.eval_metrics.items()))

    def scheduled_eval(self) -> bool:
        """A scheduled evaluation; True where early stopping ends the run here (every rank
        holds the same figures; at the run's end it just ends)."""
        self.run_eval()
        if self.monitor.exhausted and not self.done():
            self.stop_early()
            return True
        return False

    def summary(self) -> dict[str, Any]:
        """The final figures; None where the run was too short to measure one."""
        return {
            "train_loss": None if math.isnan(self.last_train_loss) else self.last_train_loss,
            **self.eval_metrics,
            **self.meter.summary(self.step, self.global_batch_size, self.model,
                                 self.optimizer),
            **self.monitor.summary(),
            **self.meter.comm,
        }

    def base_rate(self) -> float:
        """The learning rate the optimizer's schedule starts from: after a resume, the
        checkpoint's (optim.scale_lr at another global batch would give another)."""
        group = self.optimizer.param_groups[0]
        return group.get("initial_lr", group["lr"])

    def state_dict(self) -> dict[str, Any]:
        """All a run needs to continue exactly: weights, optimizer, scaler, position."""
        model_state, optimizer_state = self.strategy.state_dict(self.model, self.optimizer)
        return {"model": model_state, "optimizer": optimizer_state,
                "grad_scaler": self.precision.state_dict(), "step": self.step,
                "epoch": self.epoch, "epoch_step": self.epoch_step,
                "epoch_loss": self.epoch_loss, "epoch_steps": self.epoch_steps,
                "skipped_steps": self.skipped_steps,
                "monitor": self.resume_monitor or self.monitor.state_dict(),
                "scheduler": self.scheduler.state_dict() if self.scheduler else None,
                "total_steps": self.total_steps}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.strategy.load_state_dict(self.model, self.optimizer, state["model"],
                                      state["optimizer"])
        self.precision.load_state_dict(state["grad_scaler"])
        self.step, self.epoch, self.epoch_step = state["step"], state["epoch"], state["epoch_step"]
        self.epoch_loss, self.epoch_steps = state["epoch_loss"], state["epoch_steps"]
        self.skipped_steps = state["skipped_steps"]
        self.monitor.load_state_dict(state.get("monitor"))
        if self.scheduler is not None and state.get("scheduler"):  # its step count
            schedule.resume(self.scheduler, self.optimizer, state["scheduler"],
                            state.get("total_steps"), self.total_steps, self.step,
                            self.dist.is_main)
        rng = state.get("rng", [])
        if len(rng) == self.dist.world_size:
            torch.set_rng_state(rng[self.dist.rank])
        else:
            log.warning("the checkpoint holds RNG states for %d ranks, this run has %d: "
                        "dropout draws will differ from the original run", len(rng),
                        self.dist.world_size)


def to_channels_last(batch: Batch) -> Batch:
    """trainer.channels_last: a pair's image inputs (N, C, H, W) in NHWC memory format."""
    if batch_of.is_pair(batch) and isinstance(batch[0], torch.Tensor) and batch[0].dim() == 4:
        return batch[0].contiguous(memory_format=torch.channels_last), batch[1]
    return batch
