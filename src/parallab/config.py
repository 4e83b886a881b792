"""Typed configuration: the schema every file in conf/ is checked against.

Each config group option in conf/ starts its defaults list with its schema from the
ConfigStore (`/schema/<group>/<option>`), so Hydra itself rejects an unknown key or a
value of the wrong type and names it. Value and cross-field checks live in validate.py.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING

REPO_DIR = Path(__file__).resolve().parents[2]


class Device(enum.Enum):
    auto = "auto"
    cpu = "cpu"
    cuda = "cuda"


class Loader(enum.Enum):
    memory = "memory"  # the whole split as one tensor, batches gathered by index
    dataloader = "dataloader"  # torch DataLoader over a per-sample Dataset


# --- model -------------------------------------------------------------------------------
@dataclass
class MnistCnnConfig:
    name: str = "mnist_cnn"
    num_classes: int = 10
    dropout: float = 0.5


@dataclass
class MlpConfig:
    name: str = "mlp"
    input_dim: Optional[int] = None  # null = inferred from the data
    hidden: list[int] = field(default_factory=lambda: [256, 128])
    num_classes: int = 10
    dropout: float = 0.0


# --- data --------------------------------------------------------------------------------
@dataclass
class DataConfig:
    name: str = MISSING
    batch_size: int = 64  # per rank
    eval_batch_size: int = 1000  # per rank
    loader: Loader = Loader.memory
    num_workers: int = 0
    pin_memory: bool = False
    persistent_workers: bool = False


@dataclass
class MnistDataConfig(DataConfig):
    name: str = "mnist"
    root: str = str(REPO_DIR / "data")
    download: bool = False

    @property
    def input_shape(self) -> list[int]:
        return [1, 28, 28]

    @property
    def num_classes(self) -> int:
        return 10


@dataclass
class SyntheticDataConfig(DataConfig):
    name: str = "synthetic"
    train_size: int = 8192
    eval_size: int = 2048
    shape: list[int] = field(default_factory=lambda: [1, 28, 28])
    num_classes: int = 10
    noise: float = 1.0  # std of the noise around each class prototype

    @property
    def input_shape(self) -> list[int]:
        return list(self.shape)


# --- parallel ----------------------------------------------------------------------------
@dataclass
class ParallelConfig:
    name: str = "none"
    # processes (ddp) or devices (dp); null = one per visible GPU, or 2 on CPU
    world_size: Optional[int] = 1
    nnodes: int = 1
    threads_per_worker: Optional[int] = None  # null = cores / local workers
    max_restarts: int = 0
    devices: Optional[list[int]] = None  # GPU ids made visible to the workers


@dataclass
class DDPConfig(ParallelConfig):
    name: str = "ddp"
    world_size: Optional[int] = None
    bucket_cap_mb: float = 25.0
    find_unused_parameters: bool = False
    gradient_as_bucket_view: bool = True


@dataclass
class DPConfig(ParallelConfig):
    name: str = "dp"
    world_size: Optional[int] = None


# --- precision, backend, optim, trainer -------------------------------------------------
@dataclass
class PrecisionConfig:
    name: str = "fp32"  # fp32 | amp | bf16 | fp16
    tf32: bool = False  # TF32 matmul/cuDNN on CUDA (Tensor Cores for fp32 models)


@dataclass
class BackendConfig:
    name: str = "auto"  # auto = nccl with CUDA, gloo without
    timeout_s: float = 600.0  # bound on any one collective


@dataclass
class SGDConfig:
    name: str = "sgd"
    lr: float = 0.01
    momentum: float = 0.5
    weight_decay: float = 0.0
    nesterov: bool = False


@dataclass
class AdamConfig:
    name: str = "adam"
    lr: float = 1e-3
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])
    eps: float = 1e-8
    weight_decay: float = 0.0


@dataclass
class AdamWConfig(AdamConfig):
    name: str = "adamw"
    weight_decay: float = 0.01


@dataclass
class TrainerConfig:
    epochs: int = 10
    max_steps: Optional[int] = None  # stop after this many optimizer steps
    log_every_n_steps: int = 50
    eval_every_n_epochs: int = 1
    warmup_steps: int = 5  # steps left out of throughput figures
    progress_bar: Optional[bool] = None  # null = only on an interactive terminal
    accumulate_grad_batches: int = 1  # micro-batches per optimizer step
    clip_grad_norm: Optional[float] = None  # max global gradient norm
    channels_last: bool = False  # NHWC memory format for conv models
    compile: bool = False  # torch.compile the model
    compile_mode: Optional[str] = None  # default | reduce-overhead | max-autotune...
    profile: bool = False  # torch.profiler trace of a few steps into the run dir
    quantize: Optional[str] = None  # dynamic_int8: quantize Linear layers after training
    auto_batch_size: bool = False  # double data.batch_size while it fits and pays
    max_memory_mb: Optional[float] = None  # the finder's memory budget per rank
    checkpoint_every_n_steps: Optional[int] = 500  # and at each epoch end; null = epochs only
    keep_last_k: int = 3  # periodic checkpoints kept (last.pt is always kept)
    resume: Optional[str] = None  # auto (newest in the run dir) or a checkpoint path
    on_nan: str = "stop"  # stop | skip: what a NaN/inf loss or gradient does


@dataclass
class SweepConfig:
    skip_completed: bool = False  # re-running a sweep: keep jobs that already finished


@dataclass
class Config:
    model: Any = MISSING
    data: Any = MISSING
    parallel: Any = MISSING
    precision: Any = MISSING
    backend: Any = MISSING
    optim: Any = MISSING
    trainer: Any = MISSING
    seed: int = 42
    device: Device = Device.auto
    sweep: SweepConfig = field(default_factory=SweepConfig)


@dataclass
class EvalConfig(Config):
    ckpt: str = MISSING  # checkpoint to evaluate


SCHEMAS: dict[str, dict[str, type]] = {
    "model": {"mnist_cnn": MnistCnnConfig, "mlp": MlpConfig},
    "data": {"mnist": MnistDataConfig, "synthetic": SyntheticDataConfig},
    "parallel": {"none": ParallelConfig, "ddp": DDPConfig, "dp": DPConfig},
    "precision": {"default": PrecisionConfig},
    "backend": {"default": BackendConfig},
    "optim": {"sgd": SGDConfig, "adam": AdamConfig, "adamw": AdamWConfig},
    "trainer": {"default": TrainerConfig},
}


def register_configs() -> None:
    store = ConfigStore.instance()
    store.store(name="config_schema", node=Config)
    store.store(name="eval_schema", node=EvalConfig)
    for group, options in SCHEMAS.items():
        for name, node in options.items():
            store.store(group=f"schema/{group}", name=name, node=node)


def model_config(saved: dict[str, Any]) -> Any:
    """A model config saved as a plain dict (in a checkpoint) back as its typed dataclass."""
    from omegaconf import OmegaConf

    schema = SCHEMAS["model"].get(saved.get("name"))
    if schema is None:
        raise ValueError(f"unknown model {saved.get('name')!r}")
    return OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(schema), saved))
