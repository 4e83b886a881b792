"""What a rank builds before it trains: the model it starts from (trainer.init_from's
weights, adapters), its runtime under the layout, the data, the optimizer at its rate, the
batch the finder chooses, and the trainer over them (advise measures candidates with it)."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, Sequence

import torch

from parallab.config.schema import Config, TrainerConfig
from parallab.data import build_data
from parallab.launching import distributed
from parallab.launching.preemption import Preemption
from parallab.loss import build_loss
from parallab.models import adapters, build_model, tied_names
from parallab.observe import loggers
from parallab.observe.loggers import RunLogger
from parallab.optim import build_optimizer, scaled_lr
from parallab.parallel.layout import Layout
from parallab.parallel.parallelize import parallelize
from parallab.precision import Precision
from parallab.training import batch_size, checkpoint
from parallab.training.batch_size import global_batch_size
from parallab.training.checkpoint import Checkpointer
from parallab.training.trainer import Trainer

log = logging.getLogger(__name__)

STRICT_OFF = "trainer.init_strict=false"  # loads what fits of trainer.init_from's weights


def use_scaled_lr(cfg: Config, optimizer, global_batch_size: int, main: bool) -> float:
    """optim.scale_lr: the optimizer's rate scaled to the run's global batch (known only
    here, after the batch-size finder); the rate the run uses."""
    lr = scaled_lr(cfg.optim, global_batch_size)
    if lr != cfg.optim.lr:
        for group in optimizer.param_groups:
            group["lr"] = lr
        if main:
            log.info("optim.scale_lr=%s: lr %g for global batch %d (optim.lr=%g at %d)",
                     cfg.optim.scale_lr, lr, global_batch_size, cfg.optim.lr,
                     cfg.optim.base_batch_size)
    return lr


def tune_batch_size(model, runtime, optimizer, data, dist, cfg: TrainerConfig,
                    logger: RunLogger):
    """trainer.auto_batch_size: the training loader at the size the finder chose."""
    def step(batch) -> None:
        runtime.trial_step(model, batch)

    size, trials = batch_size.find_batch_size(runtime.unwrap(model), optimizer, step,
                                              data.train, dist, cfg.max_memory_mb,
                                              runtime.ranks.readers, cfg.compile)
    report = batch_size.table(trials, size)
    logger.text("batch_size_finder", report)
    if dist.is_main:
        log.info("batch-size finder chose %d per rank:\n%s", size, report)
    return data.train.resized(size)


def chosen_before(resume_from: Path | None, cfg: TrainerConfig, runtime, main: bool
                  ) -> int | None:
    """A resumed run's batch per rank as the finder chose it before (its checkpoint's global
    batch over these ranks): the finder, timed again, may choose another, which the
    checkpoint's place in its epoch does not take. None where nothing is resumed, or the
    saved batch does not split over these ranks (the finder runs; the resume's check says)."""
    if resume_from is None:
        return None
    saved = checkpoint.load_meta(resume_from).get("global_batch_size")
    split = cfg.accumulate_grad_batches * runtime.ranks.data.world_size
    if not saved or saved % split:
        return None
    if main:
        log.info("trainer.auto_batch_size: %d per rank, as the finder chose it for %s",
                 saved // split, resume_from)
    return saved // split


def start_model(cfg: Config, dist: distributed.Dist, layout: Layout, init_from: str | None
                ) -> tuple[torch.nn.Module, bool]:
    """The model this rank starts from, and whether its parameters are on meta, to be given
    their part of the weights at `init_from` once laid out (a layout that cuts the model,
    every weight required); else whole, with those weights (before any layout cuts it:
    every layout starts alike) and its adapters (adapter=lora: the base's weights load
    before them, a checkpoint or peft folder with adapters after)."""
    from parallab.training import weights

    if init_from is not None and cfg.trainer.init_strict and not \
            adapters.enabled(cfg.adapter) and layout.sharded:
        try:
            with weights.parameters_on_meta():
                return build_model(cfg.model, cfg.trainer.fused_norms), True
        except Exception:  # noqa: BLE001 - a model that must be built whole (from_pretrained)
            pass
    torch.manual_seed(cfg.seed)
    # identical initial weights (and adapters) on every rank
    model = build_model(cfg.model, cfg.trainer.fused_norms)
    adapted = init_from is not None and weights.holds_adapters(init_from)
    left = []
    if init_from is not None and not adapted:
        left = weights.load_into(model, init_from, cfg.trainer.init_strict, STRICT_OFF)
    elif adapted and adapters.is_folder(init_from) and \
            (base := weights.adapters_base(init_from, "trainer.init_from")) is not None:
        weights.load_into(model, base)  # the weights its adapters were trained on
    model = adapters.apply(model, cfg.adapter, dist.is_main)
    if adapted:  # a peft folder's adapters alone, or a whole model's with them
        left = weights.load_into(model, init_from, cfg.trainer.init_strict, STRICT_OFF)
    if init_from is not None and dist.is_main:
        log.info("started from the weights in %s%s", init_from, "; left at their initial "
                 f"values: {', '.join(left)}" if left else "")
    return model, False


def _base_of(init_from: str | None) -> str | None:
    """The weights a run's adapters sit on: trainer.init_from's, or, where it names an
    adapter folder, those that folder's adapters were trained on (its record)."""
    from parallab.training import weights

    if init_from is None or not adapters.is_folder(init_from):
        return init_from
    return weights.adapters_base(init_from, "trainer.init_from")


def build_trainer(cfg: Config, layout: Layout, dist: distributed.Dist, logger: RunLogger,
                  checkpoints: Path | None, preemption: Preemption,
                  init_from: str | None = None, observers: Sequence[Any] = (),
                  resume_from: Path | None = None) -> tuple[Trainer, float]:
    """Model, runtime, data, optimizer and trainer on this rank (a checkpointer saving
    into `checkpoints`, if given; the weights at `init_from`, if given); the trainer and the
    learning rate it uses; `observers` watch its steps beside its Meter)."""
    model, held_only = start_model(cfg, dist, layout, init_from)
    # the whole model's ties, before a cut leaves a part one name (its weights read after)
    ties = tied_names(model) if held_only else {}
    precision = Precision(cfg.precision, dist.device, sharded=layout.sharded)
    # fp8's Float8Linear in place of Linear, before any cut: a pipeline's runtime records the
    # model's modules when made, and puts those back when it cuts
    model = precision.convert(model)
    runtime = layout.plan.runtime(cfg.parallel, layout, dist, precision,
                                  build_loss(cfg.loss).bind(model), model)
    torch.manual_seed(cfg.seed + runtime.seed_rank)  # dropout masks differ between ranks
    model = parallelize(model, runtime, cfg.trainer, cfg.parallel.stages)
    if held_only:
        from parallab.training import weights

        weights.load_held(runtime.unwrap(model), init_from, dist.device, ties)
        if dist.is_main:
            log.info("started from the weights in %s, each rank reading its part", init_from)
    data = build_data(cfg.data, runtime.ranks.data, cfg.seed,
                      batch_scale=runtime.ranks.devices_per_process,
                      accumulate=cfg.trainer.accumulate_grad_batches)
    data.train.drop_last = runtime.layout.pipelined
    optimizer = build_optimizer(cfg.optim, model, runtime.tied_embeddings())
    if cfg.trainer.auto_batch_size:
        chosen = chosen_before(resume_from, cfg.trainer, runtime, dist.is_main)
        data.train = data.train.resized(chosen) if chosen else tune_batch_size(
            model, runtime, optimizer, data, dist, cfg.trainer, logger)
    lr = use_scaled_lr(cfg, optimizer, global_batch_size(data.train, cfg.trainer, runtime),
                       dist.is_main)
    checkpointer = None
    if checkpoints is not None:
        from parallab.training.weights import base_record

        # adapters' base (a resumed run's too), read by rank 0 alone: it writes the record
        base = _base_of(cfg.trainer.init_from) if adapters.enabled(cfg.adapter) and \
            dist.is_main else None
        checkpointer = Checkpointer(checkpoints, dist, loggers.as_run(cfg, layout),
                                    cfg.trainer.keep_last_k, sharded=runtime.layout.sharded,
                                    base=base_record(base) if base else None)
    trainer = Trainer(cfg.trainer, model, runtime, optimizer, data, dist, logger,
                      checkpointer, preemption, cfg.metrics, cfg.scheduler, observers)
    return trainer, lr
