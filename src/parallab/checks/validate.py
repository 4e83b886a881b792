"""Fail fast: the checks and `auto` resolutions of a whole config, run in order.

Runs once in the controlling process, before any worker starts. Each part checks its own
config (a data set's problem(), a model's check_data, a plan's check); this module runs
them in order and checks the keys that belong to no one part (trainer, optim, backend). A
problem is a ConfigError whose message is one line: the key, its value, what is allowed,
and the fix.
"""

from __future__ import annotations

import logging
import math
import os

from parallab import models, optim, precision, schedule
from parallab.models import adapters
from parallab.checks import starts, trial
from parallab.config.errors import (ConfigError, environment_kept_if_refused, refuse,
                                    require)
from parallab.config.schema import Config, Device, Loader
from parallab.launching.distributed import cpu_cores, interfaces_problem
from parallab.launching import slurm
from parallab.launching.in_place import InPlace
from parallab.launching.launch import hidden_module_problem, master_port_problem
from parallab.observe import loggers, memory
from parallab.parallel import activations, parallelize
from parallab.parallel.layout import Layout
from parallab.training import monitor

__all__ = ["ConfigError", "prepare"]
log = logging.getLogger(__name__)
MIN_TIMEOUT_S, MAX_TIMEOUT_S = 1.0, 7 * 24 * 3600.0


def _at_least(key: str, value, low, optional: bool = False) -> None:
    if optional and value is None:
        return
    require(value >= low, f"{key}={value} is out of range: it must be >= {low}")


def check_values(cfg: Config) -> None:
    """The keys of the trainer, optimizer, backend and launcher, and the seed."""
    t, p = cfg.trainer, cfg.parallel
    _at_least("seed", cfg.seed, 0)
    require(t.epochs >= 1, f"trainer.epochs={t.epochs} is out of range: it must be >= 1 "
            "(to score a saved model without training, run evaluate.py ckpt=<checkpoint>)")
    _at_least("trainer.max_steps", t.max_steps, 1, optional=True)
    _at_least("trainer.log_every_n_steps", t.log_every_n_steps, 1)
    require(t.warmup_steps is None, f"trainer.warmup_steps={t.warmup_steps} is renamed: "
            "trainer.timing_skip_steps leaves the first steps out of throughput figures, "
            "scheduler.warmup_steps warms the learning rate up; set the one you mean")
    _at_least("trainer.eval_every_n_epochs", t.eval_every_n_epochs, 1)
    _at_least("trainer.eval_every_n_steps", t.eval_every_n_steps, 1, optional=True)
    _at_least("trainer.timing_skip_steps", t.timing_skip_steps, 0)
    _at_least("parallel.world_size", p.world_size, 1, optional=True)
    _at_least("parallel.nnodes", p.nnodes, 1)
    _at_least("parallel.threads_per_worker", p.threads_per_worker, 1, optional=True)
    _at_least("parallel.max_restarts", p.max_restarts, 0)
    require(p.rendezvous_timeout > 0, f"parallel.rendezvous_timeout={p.rendezvous_timeout} "
            "is out of range: it must be > 0 (seconds a rank waits to reach rank 0)")
    slurm.parse_signal(t.requeue_signal)
    _at_least("trainer.accumulate_grad_batches", t.accumulate_grad_batches, 1)
    require(not (t.overwrite and t.resume is not None), f"trainer.overwrite=true starts "
            f"afresh, deleting the run dir's checkpoints, and trainer.resume={t.resume} "
            f"continues {'from them' if t.resume == 'auto' else 'the run it saved'}: drop one")
    require(t.clip_grad_norm is None or t.clip_grad_norm > 0,
            f"trainer.clip_grad_norm={t.clip_grad_norm} is out of range: it must be > 0 (or "
            "null for no clipping)")
    refuse(precision.problem(cfg.precision))
    require(t.max_memory_mb is None or t.max_memory_mb > 0, f"trainer.max_memory_mb="
            f"{t.max_memory_mb} is out of range: it must be > 0 (or null for no budget)")
    _at_least("trainer.checkpoint_every_n_steps", t.checkpoint_every_n_steps, 1, optional=True)
    _at_least("trainer.keep_last_k", t.keep_last_k, 1)
    require(t.on_nan in ("stop", "skip"),
            f"trainer.on_nan={t.on_nan} is unknown: use trainer.on_nan=stop or skip")
    if t.quantize is not None:
        from parallab import quantize

        require(t.quantize in quantize.METHODS, f"trainer.quantize={t.quantize} is unknown: "
                f"use one of {', '.join(quantize.METHODS)} (or null)")
        require(quantize.available(), f"trainer.quantize={t.quantize} needs torchao: "
                "pip install 'parallab[quantize]'")
        require(cfg.precision.name != "fp8", f"trainer.quantize={t.quantize} with "
                "precision=fp8: the trained Linear layers are float8 ones, which int8 "
                "quantization does not take: use precision=bf16")
    refuse(activations.problem(t.activation_checkpointing, t.activation_checkpointing_every))
    refuse(optim.problem(cfg.optim))
    refuse(schedule.problem(cfg.scheduler))
    refuse(loggers.problem(cfg.logger))
    timeout = cfg.backend.timeout_s
    require(math.isfinite(timeout) and MIN_TIMEOUT_S <= timeout <= MAX_TIMEOUT_S,
            f"backend.timeout_s={timeout} is out of range: a collective may wait between "
            f"{MIN_TIMEOUT_S:g} s and {MAX_TIMEOUT_S:g} s (a week) before the job fails")
    require(cfg.seed < 2**63, f"seed={cfg.seed} is out of range: it must be < 2**63 (torch "
            "seeds take 64 bits, and each rank adds its rank)")
    refuse(parallelize.compile_problem(t))


def check_config(cfg: Config) -> None:
    """The checks a config passes alone, needing neither its data, its model nor the machine
    it will run on (a few ms): its values, and its layout's degrees where its world size is
    set. Every job of a sweep passes them before the first one starts or is submitted
    (hydra_plugins/parallab_launchers), where a job of a world size of 0 failed in SLURM
    once submitted."""
    from parallab.parallel import PLANS

    check_values(cfg)
    p = cfg.parallel
    if p.world_size is not None and p.name in PLANS:
        PLANS[p.name].layout_of(p, p.world_size)


def check_data(cfg: Config) -> None:
    """The data set's own keys and files (fetched here if asked), and the loader keys."""
    from parallab.data import loader_problem, resolve_loader

    refuse(loader_problem(cfg.data) or cfg.data.problem())
    require(cfg.data.sized() or cfg.trainer.max_steps is not None, f"data={cfg.data.name} "
            "streams samples with no known length (an IterableDataset without __len__), so "
            "an epoch has no known number of steps: set trainer.max_steps")
    cfg.data.loader = resolve_loader(cfg.data)
    require(cfg.data.collate_fn is None or cfg.data.loader is not Loader.memory,
            f"data.collate_fn={cfg.data.collate_fn}: data={cfg.data.name} is held in memory "
            "and batched by slicing, with no collate function: set data.loader=dataloader "
            "to collate its samples, or drop data.collate_fn")


def check_objective(cfg: Config) -> None:
    """The loss, the extra metrics and the objective name a sweep optimises."""
    from parallab import loss, metrics

    loss.check(cfg.loss)
    metrics.check(cfg.metrics, loss.build_loss(cfg.loss))
    require(not (cfg.metrics and loss.from_model(cfg.loss)), "metrics with loss=model: the "
            "model returns its loss, not an output a metric could score: drop metrics, or "
            "use a loss of output and targets")
    names = metrics.names(loss.build_loss(cfg.loss), cfg.metrics)
    if cfg.objective is not None:
        require(cfg.objective in names, f"objective={cfg.objective} is not a figure this run "
                f"reports ({', '.join(names)}): pick one of them")
    refuse(monitor.problem(cfg.trainer, names))


def resolve_device(cfg: Config) -> None:
    import torch

    if cfg.parallel.devices is not None:
        # before the first CUDA call, so this process sees the same GPUs as its workers;
        # each once (CUDA sees none where one is named twice): dp and model may repeat one
        visible = dict.fromkeys(cfg.parallel.devices)
        os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(str(i) for i in visible)
    has_cuda = torch.cuda.is_available()
    if cfg.device is Device.auto:
        cfg.device = Device.cuda if has_cuda else Device.cpu
    require(cfg.device is Device.cpu or has_cuda,
            "device=cuda but PyTorch sees no CUDA device: use device=cpu (or device=auto)")
    require(cfg.parallel.devices is None or cfg.device is Device.cuda,
            f"parallel.devices={cfg.parallel.devices} picks GPUs, but device=cpu: "
            "drop parallel.devices or run on CUDA")


def visible_gpus(cfg: Config, plan) -> int:
    """The GPUs the run places ranks, replicas or parts on (0 on CPU): those of
    parallel.devices, each of which must exist, a repeated one counted again (dp and model
    may put two on one GPU; a process per GPU may not: NCCL takes one rank per GPU)."""
    import torch

    if cfg.device is not Device.cuda:
        return 0
    p, found = cfg.parallel, torch.cuda.device_count()
    if p.devices is None:
        return found
    named = list(dict.fromkeys(p.devices))
    require(len(named) <= found, f"parallel.devices={p.devices} names {len(named)} GPUs, but "
            f"{found} of them are visible here (CUDA counts ids up to the first one it does "
            "not have): name GPUs this machine has (nvidia-smi -L)")
    require(not plan.processes or len(named) == len(p.devices),
            f"parallel.devices={p.devices} names a GPU twice, and parallel={p.name} runs a "
            "process per GPU (NCCL takes one rank per GPU): name each once (parallel=dp and "
            "model may share one)")
    return len(p.devices)


def resolve_parallel(cfg: Config, in_place: InPlace | None) -> Layout:
    """The run's layout, resolved here once (the world size, the node count, the degrees,
    the plan, the GPUs) and carried to every rank; cfg.parallel keeps what the user
    composed (torchtitan's ParallelDims beside its job config)."""
    from parallab.parallel import PLANS

    p = cfg.parallel
    plan = PLANS[p.name]
    gpus = visible_gpus(cfg, plan)
    world, nnodes = p.world_size, p.nnodes
    if in_place is not None:
        launching = [name for name, kind in PLANS.items() if kind.processes]
        require(plan.processes or in_place.world_size == 1, f"parallel={p.name} "
                f"runs one process, but {in_place.launcher} started {in_place.world_size}: "
                f"use parallel={' or '.join(launching)}, or launch one process")
        require(world in (None, in_place.world_size), f"parallel.world_size="
                f"{world}, but {in_place.launcher} started {in_place.world_size} "
                f"tasks: drop parallel.world_size (each task is a rank) or start "
                f"{world} tasks")
        world, nnodes = in_place.world_size, in_place.nnodes
    elif world is None:
        world = plan.default_world_size(gpus)
    require(world % nnodes == 0, f"parallel.world_size={world} does not split "
            f"evenly over parallel.nnodes={nnodes}: use a multiple of {nnodes}")
    require(in_place is not None or nnodes == 1,
            f"parallel.nnodes={nnodes}: start one agent per node with torchrun, SLURM or "
            "mpirun (docs/parallel.md: several nodes); the built-in launcher starts one node")
    per_node = world // nnodes
    cores = cpu_cores()
    share = max(1, cores // per_node)  # null's: more workers than cores share one each
    if p.threads_per_worker is not None and p.threads_per_worker > share and plan.processes:
        log.warning("parallel.threads_per_worker=%d x %d workers per node is more threads than "
                    "the %d cores here: they will contend (null gives each its share, %d)",
                    p.threads_per_worker, per_node, cores, share)
    if gpus and not (in_place is not None and gpus == 1):  # in place: one GPU per task will do
        require(per_node <= gpus, f"parallel.world_size={world} needs {per_node} GPUs "
                f"per node but {gpus} are visible: set parallel.world_size<={gpus * nnodes}")
    return plan.resolve(p, cfg.device.value, world, nnodes)  # a null degree resolved, checked


def check_fixed_batch(cfg: Config) -> None:
    """data.global_batch_size and trainer.auto_batch_size are not both asked for."""
    d = cfg.data
    require(d.global_batch_size is None or not cfg.trainer.auto_batch_size,
            f"data.global_batch_size={d.global_batch_size} fixes the samples of each step, "
            "which trainer.auto_batch_size=true would change: drop one of them")


def resolve_global_batch(cfg: Config, layout: Layout) -> None:
    """data.global_batch_size: the per-rank data.batch_size that gives it, so layouts
    compare at equal samples per optimizer step."""
    d = cfg.data
    if d.global_batch_size is None:
        return
    check_fixed_batch(cfg)
    require(d.global_batch_size > 0, f"data.global_batch_size={d.global_batch_size} is out "
            "of range: it is the samples of each step, >= 1")
    ranks = layout.dp
    per_step = ranks * cfg.trainer.accumulate_grad_batches
    require(d.global_batch_size % per_step == 0,
            f"data.global_batch_size={d.global_batch_size} does not split over {ranks} "
            f"data-parallel ranks x trainer.accumulate_grad_batches="
            f"{cfg.trainer.accumulate_grad_batches}: use a multiple of {per_step}")
    d.batch_size = d.global_batch_size // per_step


def _peak_lr(cfg: Config, layout: Layout) -> float:
    """optim.lr as the run will scale it (optim.scale_lr) to its global batch."""
    from parallab.optim import scaled_lr

    d = cfg.data
    return scaled_lr(cfg.optim, d.global_batch_size or
                     d.batch_size * layout.dp * cfg.trainer.accumulate_grad_batches)


def check_run_length(cfg: Config, layout: Layout) -> None:
    """Where the training set's length is known here, the run's steps as the workers will
    count them (data.stream.run_length over each rank's batches): accumulation beyond an
    epoch's batches, or a warmup as long as the run, refused now rather than in the
    workers. Not with the batch-size finder, whose batch is chosen in the workers."""
    import math

    from parallab.data.stream import run_length

    samples = cfg.data.train_length()
    if samples is None or cfg.trainer.auto_batch_size:
        return
    accumulate = cfg.trainer.accumulate_grad_batches
    if cfg.data.whole_steps:  # counted as its loader counts them: full batches, whole steps
        batches = samples // (layout.dp * cfg.data.batch_size)
        batches = batches // accumulate * accumulate or batches  # (too few: run_length says)
    else:
        per_rank = math.ceil(samples / layout.dp)
        rounding = math.floor if layout.pipelined else math.ceil  # drop_last
        batches = rounding(per_rank / cfg.data.batch_size)
    # an epoch's batches, by their number
    _, total = run_length(cfg.trainer, range(batches), cfg.data.batch_said())
    schedule.multiplier(cfg.scheduler, total)  # ConfigError for a warmup or decay too long


def check_resolved(cfg: Config, layout: Layout, stages_of) -> None:
    """A resolved layout against the rest of the config, one check for a run train starts
    and a layout a simulation prices: the batch it splits, the data's rule for it, the
    plan's own checks (with the model's stages, `stages_of()`: train's trial, a
    simulation's model on meta) and what it rules out of the precision."""
    resolve_global_batch(cfg, layout)
    refuse(cfg.data.layout_problem(layout))  # before the stages: a trial runs them
    layout.plan.check(cfg, layout, stages_of())
    refuse(precision.layout_problem(cfg.precision, layout.dp_shard))


def check_layout(cfg: Config, layout: Layout, probe: trial.Probe) -> None:
    """The resolved layout's check, one batch tried where a user's part is in play; then
    what the tried model says of the tp plan and of activation checkpointing's stages."""
    check_resolved(cfg, layout, lambda: trial.run(cfg, layout, probe))
    refuse(trial.tp_split_problem(cfg, layout, probe))  # after the plan's: the tp plan divides
    refuse(activations.stages_problem(cfg))


def check_adapter(cfg: Config, layout: Layout) -> None:
    """adapter=lora: a layout that keeps every layer whole, peft installed, and target
    modules that match layers LoRA wraps (tried on the model built on meta)."""
    if not adapters.enabled(cfg.adapter):
        return
    require(not layout.cuts_model and layout.tp == 1,
            f"adapter=lora with parallel={cfg.parallel.name}: peft's adapter layers are not "
            "cut by a tensor-parallel plan or into pipeline stages: use a data-parallel "
            "layout (none, dp, ddp, fsdp, hsdp)")
    require(cfg.precision.name != "fp8", "adapter=lora with precision=fp8: float8 training "
            "swaps the Linear layers the adapters wrap: use precision=bf16")
    model = models.build_on_meta(cfg.model)
    refuse(adapters.problem(cfg.adapter, model))  # which puts them on `model`
    refuse(adapters.experts_problem(cfg.adapter, model, layout.ep))


def check_norms(cfg: Config) -> None:
    """trainer.fused_norms=true: the model has a written-out RMSNorm to fuse (built on meta)."""
    if cfg.trainer.fused_norms:
        models.build_on_meta(cfg.model, fused_norms=True)  # ConfigError where it has none


def resolve_backend(cfg: Config, layout: Layout) -> None:
    import torch.distributed as dist

    name = cfg.backend.name
    if name == "auto":
        cfg.backend.name = name = "nccl" if cfg.device is Device.cuda else "gloo"
    require(name in ("gloo", "nccl", "mpi"), f"backend={name} is unknown: use auto, gloo, "
            "nccl or mpi")
    require(name != "nccl" or cfg.device is Device.cuda,
            "backend=nccl needs CUDA, but device=cpu: use backend=gloo (or backend=auto)")
    require(name != "mpi" or dist.is_mpi_available(),
            "backend=mpi: this PyTorch was built without MPI (PyPI wheels are); build PyTorch "
            "from source with MPI, or run under mpirun with backend=gloo or backend=nccl")
    if name == "gloo" and layout.processes:
        refuse(interfaces_problem("GLOO_SOCKET_IFNAME"))


def prepare(cfg: Config, in_place: InPlace | None, run_dir: str | None = None
            ) -> tuple[Config, Layout]:
    """Check `cfg` and fill in its `auto` values; the config, and the layout resolved from
    it once; raises ConfigError on the first problem."""
    check_values(cfg)
    cfg.data.fit_model(cfg.model)  # before the data's checks: a vocabulary they check ids by
    check_data(cfg)
    cfg.model = models.check(cfg.model, cfg.data)
    probe = trial.Probe(cfg)  # the user's model and a batch, where a trial is needed
    trial.resolve_loss(cfg, probe)
    check_objective(cfg)
    with environment_kept_if_refused("CUDA_VISIBLE_DEVICES"):  # resolve_device sets it
        resolve_device(cfg)
        layout = resolve_parallel(cfg, in_place)
        if in_place is None and layout.processes:  # parallab's own launcher
            refuse(master_port_problem() or hidden_module_problem())
        refuse(precision.device_problem(cfg.precision, cfg.device.value, layout.dp_shard))
        if hint := precision.device_hint(cfg.precision, cfg.device.value):
            log.warning(hint)
        refuse(memory.snapshot_problem(cfg.trainer.memory_snapshot, cfg.device.value))
        check_layout(cfg, layout, probe)
        check_adapter(cfg, layout)
        check_norms(cfg)
        check_run_length(cfg, layout)
        for hint in precision.state_hints(cfg.precision, cfg.optim, _peak_lr(cfg, layout)):
            log.warning(hint)
        resolve_backend(cfg, layout)
        starts.check_resume(cfg, layout, run_dir)
        starts.check_init(cfg, probe)
    return cfg, layout
