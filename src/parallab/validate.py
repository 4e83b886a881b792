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

    p = cfg.parallel
    gpus = torch.cuda.device_count() if cfg.device is Device.cuda else 0
    if in_place is not None:
        _require(p.name == "ddp" or in_place.world_size == 1, f"parallel={p.name} runs one "
                 f"process, but {in_place.launcher} started {in_place.world_size}: use "
                 "parallel=ddp or launch one process")
        p.world_size, p.nnodes = in_place.world_size, in_place.nnodes
    elif p.world_size is None:
        p.world_size = gpus or (2 if p.name == "ddp" else 1)
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
    try:
        state = checkpoint.load(resume)
    except checkpoint.CheckpointError as error:
        raise ConfigError(f"trainer.resume: {error}: give an existing checkpoint, or "
                          "trainer.resume=auto") from None
    saved = state.get("config", {}).get("model", {}) if isinstance(state, dict) else {}
    _require("epoch_step" in state and "optimizer" in state,
             f"trainer.resume={resume} is not a parallab training checkpoint (no optimizer or "
             "position in it): evaluate it with evaluate.py, or start afresh")
    _require(saved == OmegaConf.to_container(OmegaConf.structured(cfg.model), enum_to_str=True),
             f"trainer.resume={resume} was saved from model={saved.get('name')} with other "
             f"settings than model={cfg.model.name} here: resume with the same model config")


def prepare(cfg: Config, in_place: InPlace | None, run_dir: str | None = None) -> Config:
    """Check `cfg` and fill in its `auto` values; raises ConfigError on the first problem."""
    check_values(cfg)
    check_model_fits_data(cfg)
    resolve_device(cfg)
    resolve_parallel(cfg, in_place)
    resolve_backend(cfg)
    check_data(cfg)
    check_resume(cfg, run_dir)
    return cfg
