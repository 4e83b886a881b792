"""Fail fast: every value and cross-field check, and the resolution of `auto` choices.

Runs once in the controlling process, before any worker starts. A problem is a ConfigError
whose message is one line: the key, its value, what is allowed, and the fix.
"""

from __future__ import annotations

import os

from omegaconf import OmegaConf
from parallab.config import Config, Device, MnistDataConfig
from parallab.launch import InPlace


class ConfigError(ValueError):
    """Bad input, stated in one line that names the key and the fix."""


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise ConfigError(message)


def _at_least(key: str, value, low, optional: bool = False) -> None:
    if optional and value is None:
        return
    _require(value >= low, f"{key}={value} is out of range: it must be >= {low}")


def check_values(cfg: Config) -> None:
    d, t, p = cfg.data, cfg.trainer, cfg.parallel
    _at_least("seed", cfg.seed, 0)
    _at_least("data.batch_size", d.batch_size, 1)
    _at_least("data.eval_batch_size", d.eval_batch_size, 1)
    _at_least("data.num_workers", d.num_workers, 0)
    _at_least("trainer.epochs", t.epochs, 0)
    _at_least("trainer.max_steps", t.max_steps, 1, optional=True)
    _at_least("trainer.log_every_n_steps", t.log_every_n_steps, 1)
    _at_least("trainer.eval_every_n_epochs", t.eval_every_n_epochs, 1)
    _at_least("trainer.warmup_steps", t.warmup_steps, 0)
    _at_least("parallel.world_size", p.world_size, 1, optional=True)
    _at_least("parallel.nnodes", p.nnodes, 1)
    _at_least("parallel.threads_per_worker", p.threads_per_worker, 1, optional=True)
    _at_least("parallel.max_restarts", p.max_restarts, 0)
    _at_least("trainer.accumulate_grad_batches", t.accumulate_grad_batches, 1)
    _require(t.clip_grad_norm is None or t.clip_grad_norm > 0,
             f"trainer.clip_grad_norm={t.clip_grad_norm} is out of range: it must be > 0 (or "
             "null for no clipping)")
    _require(cfg.precision.name in ("fp32", "amp", "bf16", "fp16"),
             f"precision.name={cfg.precision.name} is unknown: use precision=fp32, amp, bf16 "
             "or fp16")
    _require(t.max_memory_mb is None or t.max_memory_mb > 0, f"trainer.max_memory_mb="
             f"{t.max_memory_mb} is out of range: it must be > 0 (or null for no budget)")
    _at_least("trainer.checkpoint_every_n_steps", t.checkpoint_every_n_steps, 1, optional=True)
    _at_least("trainer.keep_last_k", t.keep_last_k, 1)
    _require(t.on_nan in ("stop", "skip"),
             f"trainer.on_nan={t.on_nan} is unknown: use trainer.on_nan=stop or skip")
    if t.quantize is not None:
        from parallab import quantize

        _require(t.quantize in quantize.METHODS, f"trainer.quantize={t.quantize} is unknown: "
                 f"use one of {', '.join(quantize.METHODS)} (or null)")
        _require(quantize.available(), f"trainer.quantize={t.quantize} needs torchao: "
                 "pip install 'parallab[quantize]'")
    _require(cfg.optim.lr > 0, f"optim.lr={cfg.optim.lr} is out of range: it must be > 0")
    _at_least("optim.weight_decay", cfg.optim.weight_decay, 0.0)
    _require(cfg.backend.timeout_s > 0,
             f"backend.timeout_s={cfg.backend.timeout_s} is out of range: it must be > 0")
    dropout = getattr(cfg.model, "dropout", 0.0)
    _require(0 <= dropout < 1, f"model.dropout={dropout} is out of range: it must be in [0, 1)")
    if cfg.data.name == "synthetic":
        _at_least("data.train_size", d.train_size, 1)
        _at_least("data.eval_size", d.eval_size, 1)
        _at_least("data.num_classes", d.num_classes, 2)
        _at_least("data.noise", d.noise, 0.0)
        _at_least("data.vocab_size", d.vocab_size, 2, optional=True)
        _at_least("data.seq_len", d.seq_len, 1)
    _at_least("data.prefetch_factor", d.prefetch_factor, 1, optional=True)
    if d.name in ("text", "cifar10", "imagefolder"):  # before the model's check reads the files
        from parallab.data import images, text

        problem = text.problem(d) if d.name == "text" else images.problem(d)
        _require(problem is None, problem)
    if cfg.model.name == "lstm":
        for key in ("embedding_dim", "hidden_dim", "num_layers"):
            _at_least(f"model.{key}", getattr(cfg.model, key), 1)


def resolve_loader(cfg: Config) -> None:
    """data.loader=auto: memory when the set fits, else dataloader (data.resolve_loader)."""
    from parallab.data import resolve_loader as pick

    cfg.data.loader = pick(cfg.data)


def check_model_fits_data(cfg: Config) -> None:
    from parallab.models import MODELS

    problem = MODELS[cfg.model.name].check_data(cfg.model, cfg.data)
    _require(problem is None, problem)


def resolve_device(cfg: Config) -> None:
    import torch

    if cfg.parallel.devices is not None:
        # before the first CUDA call, so this process sees the same GPUs as its workers
        os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(str(i) for i in cfg.parallel.devices)
    has_cuda = torch.cuda.is_available()
    if cfg.device is Device.auto:
        cfg.device = Device.cuda if has_cuda else Device.cpu
    _require(cfg.device is Device.cpu or has_cuda,
             "device=cuda but PyTorch sees no CUDA device: use device=cpu (or device=auto)")
    _require(cfg.parallel.devices is None or cfg.device is Device.cuda,
             f"parallel.devices={cfg.parallel.devices} picks GPUs, but device=cpu: "
             "drop parallel.devices or run on CUDA")


def resolve_parallel(cfg: Config, in_place: InPlace | None) -> None:
    import torch

    from parallab.parallel import STRATEGIES

    p = cfg.parallel
    strategy = STRATEGIES[p.name]
    gpus = torch.cuda.device_count() if cfg.device is Device.cuda else 0
    if in_place is not None:
        _require(strategy.launches_workers or in_place.world_size == 1, f"parallel={p.name} "
                 f"runs one process, but {in_place.launcher} started {in_place.world_size}: "
                 "use parallel=ddp, fsdp or pipeline, or launch one process")
        p.world_size, p.nnodes = in_place.world_size, in_place.nnodes
    elif p.world_size is None:
        several = strategy.launches_workers or strategy.splits_model
        p.world_size = gpus or (2 if several else 1)
    _require(p.name != "none" or p.world_size == 1,
             f"parallel.world_size={p.world_size} needs several workers, but parallel=none runs"
             " one: use parallel=ddp (processes) or parallel=dp (GPUs of one process)")
    _require(p.world_size % p.nnodes == 0, f"parallel.world_size={p.world_size} does not split "
             f"evenly over parallel.nnodes={p.nnodes}: use a multiple of {p.nnodes}")
    _require(in_place is not None or p.nnodes == 1,
             f"parallel.nnodes={p.nnodes}: start one agent per node with torchrun, SLURM or "
             "mpirun (README: multi-node); the built-in launcher starts one node")
    per_node = p.world_size // p.nnodes
    if gpus:
        _require(per_node <= gpus, f"parallel.world_size={p.world_size} needs {per_node} GPUs "
                 f"per node but {gpus} are visible: set parallel.world_size<={gpus * p.nnodes}")


def resolve_global_batch(cfg: Config) -> None:
    """data.global_batch_size: the per-rank data.batch_size that gives it, so strategies
    compare at equal samples per optimizer step."""
    from parallab.parallel import STRATEGIES

    d, p = cfg.data, cfg.parallel
    if d.global_batch_size is None:
        return
    on_cpu_dp = p.name == "dp" and cfg.device is not Device.cuda  # one device
    ranks = p.world_size if STRATEGIES[p.name].shards_data and not on_cpu_dp else 1
    per_step = ranks * cfg.trainer.accumulate_grad_batches
    _require(d.global_batch_size % per_step == 0 and d.global_batch_size > 0,
             f"data.global_batch_size={d.global_batch_size} does not split over {ranks} "
             f"data-parallel ranks x trainer.accumulate_grad_batches="
             f"{cfg.trainer.accumulate_grad_batches}: use a positive multiple of {per_step}")
    d.batch_size = d.global_batch_size // per_step


def check_split(cfg: Config) -> None:
    """parallel=model/pipeline: the model has stages enough for parallel.world_size parts."""
    import torch

    from parallab.models import build_model
    from parallab.parallel import STRATEGIES
    from parallab.parallel.split import check_cuts

    p = cfg.parallel
    if not STRATEGIES[p.name].splits_model:
        return
    with torch.device("meta"):  # the structure without allocating the weights
        model = build_model(cfg.model)
    stages = len(model.stages())  # every Model declares them (an abstract method)
    _require(p.world_size >= 2,
             f"parallel.world_size={p.world_size}: parallel={p.name} needs at least 2 parts; "
             "use parallel=none for one")
    _require(p.world_size <= stages, f"parallel.world_size={p.world_size} is more parts than "
             f"the {stages} stages of model={cfg.model.name}: set parallel.world_size<={stages}")
    if p.split is not None:
        problem = check_cuts(list(p.split), stages, p.world_size)
        _require(problem is None, problem)
    if p.name == "pipeline":
        _require(p.schedule in ("gpipe", "1f1b"), f"parallel.schedule={p.schedule} is unknown: "
                 "use parallel.schedule=gpipe or 1f1b")
        _at_least("parallel.microbatches", p.microbatches, p.world_size if
                  p.schedule == "1f1b" else 1)
        _require(cfg.data.batch_size % p.microbatches == 0, f"data.batch_size="
                 f"{cfg.data.batch_size} does not split into parallel.microbatches="
                 f"{p.microbatches} equal micro-batches: use a multiple of {p.microbatches}")


def check_strategy_features(cfg: Config) -> None:
    """Switches a strategy cannot honour, refused before launch."""
    p, t = cfg.parallel, cfg.trainer
    if p.name in ("pipeline", "fsdp"):
        _require(cfg.precision.name != "fp16", f"precision=fp16 with parallel={p.name}: each "
                 "rank holds part of the gradients, and a GradScaler per rank could skip the "
                 "step on one rank only: use precision=bf16")
        _require(t.quantize is None, f"trainer.quantize={t.quantize} with parallel={p.name}: "
                 "quantize needs the whole model in one process: use parallel=none or ddp")
    if p.name in ("pipeline", "model"):
        _require(not t.auto_batch_size, f"trainer.auto_batch_size=true with parallel={p.name}: "
                 "the finder runs whole-model steps: use parallel=none, ddp or fsdp")


def resolve_backend(cfg: Config) -> None:
    import torch.distributed as dist

    name = cfg.backend.name
    if name == "auto":
        cfg.backend.name = name = "nccl" if cfg.device is Device.cuda else "gloo"
    _require(name in ("gloo", "nccl", "mpi"), f"backend={name} is unknown: use auto, gloo, "
             "nccl or mpi")
    _require(name != "nccl" or cfg.device is Device.cuda,
             "backend=nccl needs CUDA, but device=cpu: use backend=gloo (or backend=auto)")
    _require(name != "mpi" or dist.is_mpi_available(),
             "backend=mpi: this PyTorch was built without MPI (PyPI wheels are); build PyTorch "
             "from source with MPI, or run under mpirun with backend=gloo or backend=nccl")


def check_data(cfg: Config) -> None:
    if cfg.data.name == "cifar10":  # fetched here if asked, before any worker starts
        from parallab.data import images

        problem = images.cifar_problem(cfg.data)
        _require(problem is None, problem)
        return
    if cfg.data.name == "bytes":  # text on disk: data.path readable, enough bytes to split
        from parallab.data import bytetext

        problem = bytetext.problem(cfg.data)
        _require(problem is None, problem)
        return
    if not isinstance(cfg.data, MnistDataConfig):
        return
    from parallab.data import mnist

    missing = mnist.missing_files(cfg.data.root)
    if missing and cfg.data.download:
        try:
            mnist.download(cfg.data.root)
        except Exception as error:  # offline, mirror down, disk full: say so in one line
            reason = (str(error).splitlines() or [""])[0]
            raise ConfigError(f"data.root={cfg.data.root} has no MNIST files {missing} under "
                              f"MNIST/raw/ and data.download=true could not fetch them "
                              f"({type(error).__name__}: {reason}): copy them there by "
                              "hand") from None
        missing = mnist.missing_files(cfg.data.root)
    _require(not missing, f"data.root={cfg.data.root} has no MNIST files {missing} under "
             f"MNIST/raw/ (gzipped or not): copy them there, point data.root at them, or set "
             f"data.download=true")


def check_resume(cfg: Config, run_dir: str | None) -> None:
    """trainer.resume names a readable parallab checkpoint of this model (auto: if any)."""
    from pathlib import Path

    from parallab import checkpoint

    resume = cfg.trainer.resume
    if resume is None:
        return
    if resume == "auto":
        found = checkpoint.latest(Path(run_dir) / "checkpoints") if run_dir else None
        if found is None:
            return
        resume = str(found)
    from parallab.parallel import STRATEGIES

    try:
        state = checkpoint.load_meta(resume)  # of a sharded one, all but the tensors
    except checkpoint.CheckpointError as error:
        raise ConfigError(f"trainer.resume: {error}: give an existing checkpoint, or "
                          "trainer.resume=auto") from None
    saved = state.get("config", {}).get("model", {}) if isinstance(state, dict) else {}
    sharded = checkpoint.is_sharded(resume)
    _require("epoch_step" in state and (sharded or "optimizer" in state),
             f"trainer.resume={resume} is not a parallab training checkpoint (no optimizer or "
             "position in it): evaluate it with evaluate.py, or start afresh")
    _require(saved == OmegaConf.to_container(OmegaConf.structured(cfg.model), enum_to_str=True),
             f"trainer.resume={resume} was saved from model={saved.get('name')} with other "
             f"settings than model={cfg.model.name} here: resume with the same model config")
    saved_parallel = state["config"].get("parallel", {}).get("name")
    _require(sharded == STRATEGIES[cfg.parallel.name].sharded_checkpoint,
             f"trainer.resume={resume} was saved by parallel={saved_parallel} "
             f"({'sharded' if sharded else 'one file'}), which parallel={cfg.parallel.name} "
             f"cannot continue: resume with parallel={saved_parallel}")


def prepare(cfg: Config, in_place: InPlace | None, run_dir: str | None = None) -> Config:
    """Check `cfg` and fill in its `auto` values; raises ConfigError on the first problem."""
    check_values(cfg)
    resolve_loader(cfg)
    check_model_fits_data(cfg)
    resolve_device(cfg)
    resolve_parallel(cfg, in_place)
    resolve_global_batch(cfg)
    check_split(cfg)
    check_strategy_features(cfg)
    resolve_backend(cfg)
    check_data(cfg)
    check_resume(cfg, run_dir)
    return cfg
