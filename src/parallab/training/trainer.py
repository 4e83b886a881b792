"""The training loop, read top to bottom: fit, its epochs, an epoch's steps, and each
optimizer step (the global batch's loss terms counted, each micro-batch's forward and
backward, clipping and trainer.on_nan=skip, the optimizer and the learning-rate schedule);
then log steps, stopping, checkpoints and the run's final figures. Each evaluation is
evaluation.py's, the train loss between log steps and the steps dropped loss_window.py's,
the global batch's loss terms batch_size.py's, and what the loop counts and reports
observe/meter.py's. A step is told to the loop's observers at two points
(started, done; observe/observer.py), and the one it counts runs inside each's `counting`."""

from __future__ import annotations

import contextlib
import logging
import math
from typing import Any, Sequence

import torch
from torch import nn

from parallab import batch as batch_of
from parallab import metrics, schedule
from parallab.config.schema import TrainerConfig
from parallab import data as data_of
from parallab.data import Data
from parallab.data.loaders import micro_batches, to_channels_last
from parallab.data.stream import refuse_partial_epoch, run_length
from parallab.launching.distributed import Dist
from parallab.launching.preemption import Preemption
from parallab.models import moe
from parallab.observe import memory
from parallab.observe.experts import ExpertLoad
from parallab.observe.meter import Meter
from parallab.observe.observer import StepObserver, Stepped
from parallab.observe.loggers import RunLogger
from parallab.observe.profiling import profiled
from parallab.observe.progress import Progress
from parallab.parallel.base import Runtime
from parallab.training import checkpoint, loop_state
from parallab.training.batch_size import global_batch_size, loss_terms
from parallab.training.checkpoint import Checkpointer
from parallab.training.evaluation import Evaluation
from parallab.training.loss_window import LossWindow, diverged
from parallab.training.stop_vote import SHARED, StopVote

log = logging.getLogger(__name__)

Batch = Any  # as the data gives it (batch.py): an (inputs, targets) pair, a dict, ...


class Trainer:
    def __init__(self, cfg: TrainerConfig, model: nn.Module, runtime: Runtime,
                 optimizer: torch.optim.Optimizer, data: Data,
                 dist: Dist, logger: RunLogger, checkpointer: Checkpointer | None = None,
                 preemption: Preemption | None = None,
                 metric_specs: dict[str, Any] | None = None, scheduler_cfg: Any = None,
                 observers: Sequence[StepObserver] = ()):
        self.cfg = cfg
        self.checkpointer = checkpointer
        self.preemption = preemption or Preemption()
        self.model = model
        self.runtime = runtime
        self.eval_model = runtime.unwrap(model)  # same weights, fewest collectives
        self.optimizer = optimizer
        self.precision = runtime.precision  # given to the runtime once, read from it
        self.data = data
        self.dist = dist
        self.logger = logger
        self.step = 0
        self.epoch = 0
        self.epoch_step = 0  # optimizer steps done in the current epoch: where to resume
        self.stopped = False  # a signal asked the run to stop; its checkpoint is saved
        self.vote = StopVote(self.preemption, dist)  # several ranks' stop, agreed
        self.window = LossWindow(dist.device)
        self.last_train_loss = math.nan
        self.evaluation = Evaluation(cfg, self.eval_model, runtime, data, dist,
                                     logger, metric_specs)
        self.first_step = 0  # where this process's training starts (after a resume: later)
        self.lr: float | None = None  # the rate the last step used, before its schedule moved

        self.steps_per_epoch, self.total_steps = run_length(cfg, data.train)
        # the learning rate of each step: over this run's steps (a continued run's new horizon)
        self.scheduler_cfg = scheduler_cfg
        self.scheduler = (schedule.build(scheduler_cfg, optimizer, self.total_steps)
                          if scheduler_cfg is not None else None)
        self.meter = Meter(cfg, dist, runtime, self.eval_model, logger)
        # a mixture of experts' layers on this rank: their balancing after each step, their
        # load at each log step
        self.routers = moe.layers(self.eval_model)
        self.expert_load = ExpertLoad.of(self.eval_model, runtime, runtime.loss)
        # told of every step, in this order (fit() adds its profiler and memory snapshot;
        # theirs is no counting of the counted step); the preemption's watchdog times steps
        self.observers: list[StepObserver] = [self.preemption, self.meter, *observers]

    def done(self) -> bool:
        return self.step >= self.total_steps

    def fit(self, evaluate: bool = True, report: bool = True) -> dict[str, Any]:
        """Train to the end of the run; its final figures ({} if a signal stopped it).
        evaluate=False trains only (no evaluation by epoch or at the end, nothing
        quantized); report=False shows no progress (advise's candidates)."""
        self.first_step = self.step
        if self.stop_before_start():
            return {}
        with Progress(self.total_steps, self.dist.is_main and report,
                      self.cfg.progress_bar) as progress, \
                profiled(self.cfg.profile, self.dist.device, self.logger.run_dir, self.dist.rank,
                         self.dist.is_main) as profiler, \
                memory.snapshot(self.cfg.memory_snapshot, self.logger.run_dir, self.dist.rank,
                                self.dist.is_main) as snapshot:
            recorders = [Stepped(r) for r in (profiler, snapshot) if r is not None]
            if not self.train_epochs(progress, evaluate, [*self.observers, *recorders]):
                return {}
        if not evaluate:
            return self.summary()
        if not self.evaluation.scored(self.step):  # the final weights, off the schedule
            self.evaluation.off_schedule()
            self.run_eval()
        if self.stop_after_training():
            return {}
        summary = self.summary()
        if self.cfg.quantize:  # long, not stuck: the watchdog waits for it as for a save
            with self.preemption.busy():  # (metrics.evaluate: `evaluate` is fit's flag)
                summary.update(self.meter.quantized(self.eval_model, lambda m: metrics.evaluate(
                    m, self.data.eval, self.dist, None, self.runtime.loss),
                    self.evaluation.figures[metrics.LOSS], self.step))
        return summary

    def train_epochs(self, progress: Progress, evaluate: bool,
                     observers: list[StepObserver]) -> bool:
        """Epoch after epoch to the end of the run, evaluating and saving between them, each
        step told to `observers`; False where a signal stopped it."""
        # a run resumed where it had ended (stopped at its last step) trains no epoch: its
        # train loss is the restored epoch's
        self.last_train_loss = self.window.epoch_mean()
        while self.epoch < self.cfg.epochs and not self.done():
            finished = self.train_epoch(progress, observers)
            if self.stopped:
                return False
            if not finished or self.evaluation.monitor.stopped_early:  # max_steps or
                break  # early stopping ended it: resuming goes on from here
            self.epoch += 1
            self.epoch_step = 0
            if evaluate and self.cfg.eval_every_n_steps is None and \
                    self.epoch % self.cfg.eval_every_n_epochs == 0 and self.scheduled_eval():
                break
            if not self.done():  # the last one is `last`, saved by the caller
                self.save_checkpoint()
        return True

    def train_epoch(self, progress: Progress,
                    observers: list[StepObserver] | None = None) -> bool:
        """Train to the end of the epoch, or until the run is done or stopped, each step told
        to `observers` (the trainer's own where None); True if the epoch's batches were all
        trained."""
        observers = self.observers if observers is None else observers
        loader = self.data.train
        loader.set_epoch(self.epoch,
                         skip_batches=self.epoch_step * self.cfg.accumulate_grad_batches)
        self.model.train()
        if self.epoch_step == 0:  # else resumed mid-epoch with its loss so far restored
            self.window.epoch_started()
        self.meter.epoch_started()
        finished = False
        for batches in micro_batches(loader, self.cfg.accumulate_grad_batches):
            if self.epoch_step == 0 and len(batches) < self.cfg.accumulate_grad_batches:
                refuse_partial_epoch(self.cfg.accumulate_grad_batches, len(batches))
            for observer in observers:
                observer.step_started()
            self.window.add(self.counted_step(batches))
            self.step += 1
            self.epoch_step += 1
            last = self.done()
            for observer in observers:
                observer.step_done(self.step, batches, last)
            progress.update()
            vote = self.vote.due()
            if self.step % self.cfg.log_every_n_steps == 0 or last:
                self.log_window(progress)  # the ranks vote in its all-reduce
            elif vote:
                self.vote.vote()
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
            if every and self.step % every == 0 and not last:
                self.save_checkpoint()
            if last:
                break
        else:
            finished = True
        if len(self.window):
            self.log_window(progress)
        self.meter.epoch_done()
        # a loss only where a step computed one: none where every label was ignored
        self.last_train_loss = self.window.epoch_mean()
        return finished or self.epoch_step == self.steps_per_epoch

    def counted_step(self, batches: list[Batch]) -> torch.Tensor:
        """train_step; this process's second step (the first may set things up) runs inside
        each observer's `counting` (the Meter's counts the bytes it sends); not under
        compile: a dispatch mode would trip its guards into recompiling."""
        if self.step != self.first_step + 1 or self.cfg.compile:
            return self.train_step(batches)
        with contextlib.ExitStack() as counting:
            for observer in self.observers:
                counting.enter_context(observer.counting(self, batches))
            return self.train_step(batches)

    def train_step(self, batches: list[Batch]) -> torch.Tensor:
        """One optimizer step over `batches` (gradient accumulation when more than one);
        returns this rank's share of the step's loss, detached: the sum of its terms over the
        count of the global batch's terms (all micro-batches, all data-parallel ranks), times
        the data-parallel ranks, which average it."""
        items = loss_terms(batches, self.data.train, self.runtime, self.dist)
        if isinstance(items, float) and not items:  # (a tensor on a GPU: no host check)
            return self.skip_empty()
        total = None
        rows = [batch_of.rows(b) for b in batches] if len(batches) > 1 else [1]
        for index, batch in enumerate(batches):
            if self.cfg.channels_last:
                batch = to_channels_last(batch)
            last = index == len(batches) - 1
            # the micro-steps before the last skip what the layout defers (runtime.no_sync);
            # a router loss counts each micro-batch by its share of the step's tokens
            with contextlib.nullcontext() if last else self.runtime.no_sync(self.model), \
                    moe.micro_batch(rows[index] / sum(rows), self.precision.loss_scale):
                loss = self.runtime.forward_backward(self.model, batch, items)
            total = loss if total is None else total + loss
        if self.cfg.clip_grad_norm is not None or self.cfg.on_nan == "skip":
            total = self.clip(total)
        self.precision.step(self.optimizer)
        self.optimizer.zero_grad(set_to_none=True)
        if self.routers:
            moe.step_done(self.routers)
        if self.scheduler is not None:
            self.lr = self.optimizer.param_groups[0]["lr"]  # the rate this step used
            self.scheduler.step()
        return total

    def clip(self, total: torch.Tensor) -> torch.Tensor:
        """Gradients clipped to trainer.clip_grad_norm; under on_nan=skip a step whose
        gradients are not finite is dropped (its loss 0 in the window); the step's loss."""
        skip = self.cfg.on_nan == "skip"
        self.precision.unscale_(self.optimizer)
        norm = self.runtime.clip_grad_norm(self.model, self.cfg.clip_grad_norm)
        # gradients are already reduced, so every rank decides alike
        dropped = skip and not bool(torch.isfinite(norm))
        if dropped:
            self.window.skip()
            total = torch.zeros_like(total)
            if not self.precision.scaler.is_enabled():  # a scaler skips it by itself
                self.optimizer.zero_grad(set_to_none=True)
        # a GradScaler's overflow steps are its calibration, not divergence
        if skip and not self.precision.scaler.is_enabled():
            self.window.judged(dropped, self.step)
        return total

    def skip_empty(self) -> torch.Tensor:
        """A global batch whose labels are all ignored (-100): nothing to learn; the
        optimizer does not step."""
        self.window.skip(empty=True)
        if self.dist.is_main:
            log.warning("step %d: no label of its global batch counts (all are -100): the "
                        "step is skipped", self.step + 1)
        return torch.zeros((), device=self.dist.device)

    def stop_requested(self) -> bool:
        """One process stops as soon as it is signalled; several stop together, once they
        have voted on it (stop_vote.py: within about AGREE_S)."""
        return self.vote.agreed or (self.dist.world_size == 1 and self.preemption.requested)

    def stop_before_start(self) -> bool:
        """A stop asked while the run was starting (building it, loading its checkpoint):
        every rank stops before its first step, with nothing trained to save (one
        all-reduce a run: the ranks agree)."""
        asked = torch.tensor(float(self.preemption.requested), device=self.dist.device)
        self.stopped = self.dist.all_reduce_sum(asked).item() > 0
        return self.stopped

    def stop_after_training(self) -> bool:
        """A stop asked during the last evaluation (the last step's check had passed) stops
        the run as one asked at its last step does: saved, and resumed it evaluates again
        and ends. Taken as done, it ended with exit status 0 and no word of the signal: a
        scheduler's preemption read as a finished run, a Ctrl-C as unheard (Lightning ends
        one interrupted in its validation as interrupted). The ranks agree in one vote. A run
        early stopping ended is done: resumed, it would train on (no checkpoint says so)."""
        if self.evaluation.monitor.stopped_early:
            return False
        if self.dist.world_size > 1:
            self.vote.vote()
        if not self.stop_requested():
            return False
        self.stop()
        return True

    def stop(self) -> None:
        if len(self.window):  # so the checkpoint holds no half-reduced window
            self.log_window(None)
        self.save_checkpoint()
        self.stopped = True

    def save_checkpoint(self, name: str | None = None) -> None:
        """Save, from finite weights only: a NaN loss in any step since the last log window
        (on any rank) means the weights may be NaN too (one all-reduce per checkpoint)."""
        if self.checkpointer is None:
            return
        self.window.check_finite(self.dist, self.step)
        with self.preemption.busy():
            self.checkpointer.save(self.state_dict(), name or checkpoint.periodic_name(self.step))

    def log_window(self, progress: Progress | None) -> None:
        """Train loss averaged over the steps since the last log and over all ranks; the
        same all-reduce holds the ranks' vote on a stop (stop_vote.py) and a language
        model's token count."""
        steps = len(self.window)
        shared = torch.cat([self.window.sum().reshape(1), self.vote.shared(),
                            torch.as_tensor(self.meter.take_window_tokens(),
                                            dtype=torch.float32,
                                            device=self.dist.device).reshape(1)])
        if self.expert_load is not None:  # the experts' load rides the same all-reduce
            shared = torch.cat([shared, self.expert_load.window(self.dist.device)])
        shared = self.dist.all_reduce_sum(shared)
        head = shared[:2 + SHARED].tolist()  # one host sync
        loss_sum, tokens = head[0], head[1 + SHARED]
        self.vote.take(head[1:1 + SHARED])
        loss = self.window.close(loss_sum, self.runtime.ranks.loss_ranks)
        if loss is not None and not math.isfinite(loss) and self.cfg.on_nan == "stop":
            raise diverged(loss, self.step)
        figures = self.meter.log_figures(steps, tokens, self.global_batch_size)
        experts, histograms = ({}, {}) if self.expert_load is None else \
            self.expert_load.figures(shared[2 + SHARED:], steps)
        self.logger.histograms(histograms, self.step)
        self.logger.scalars({
            **({"train/loss": loss} if loss is not None else {}),
            **experts,
            "train/lr": self.lr or self.optimizer.param_groups[0]["lr"],
            **{f"train/{k}": v for k, v in figures.items()},
            "train/epoch": self.epoch,
            "train/skipped_steps": self.window.run_skipped,
            **{f"data/tokens/{name}": n
               for name, n in data_of.source_tokens(self.data.train).items()},
        }, self.step)
        if progress is not None:
            shown = "-" if loss is None else f"{loss:.4f}"
            progress.line(f"epoch {self.epoch + 1} step {self.step}/{self.total_steps} "
                          f"loss {shown} {figures['samples_per_sec']:,.0f} samples/s",
                          loss=shown, epoch=str(self.epoch + 1))

    @property
    def global_batch_size(self) -> int:
        return global_batch_size(self.data.train, self.cfg, self.runtime)

    def run_eval(self) -> None:
        with self.preemption.busy():
            improved = self.evaluation.run(self.step, self.epoch, self.epoch_step)
        if improved and self.cfg.save_best:
            self.save_checkpoint("best")

    def scheduled_eval(self) -> bool:
        """A scheduled evaluation; True where early stopping ends the run here (every rank
        holds the same figures; at the run's end it just ends)."""
        self.run_eval()
        if self.evaluation.monitor.exhausted and not self.done():
            self.evaluation.stop_early()
            return True
        return False

    def summary(self) -> dict[str, Any]:
        """The final figures; None where the run was too short to measure one."""
        return {
            "train_loss": None if math.isnan(self.last_train_loss) else self.last_train_loss,
            **self.evaluation.figures,
            **self.meter.summary(self.step, self.global_batch_size, self.model,
                                 self.optimizer),
            **self.evaluation.monitor.summary(),
            **self.meter.comm,
            **(self.expert_load.summary() if self.expert_load is not None else {}),
            **({"source_tokens": tokens} if (tokens := data_of.source_tokens(self.data.train))
               else {}),
        }

    def state_dict(self) -> dict[str, Any]:
        return loop_state.state_of(self)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        loop_state.restore(self, state)
