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
    auto = "auto"  # memory when the set fits, no per-sample augmentation (data.resolve_loader)
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


@dataclass
class LstmConfig:
    name: str = "lstm"
    vocab_size: Optional[int] = None  # null = the data's vocabulary
    embedding_dim: int = 64
    hidden_dim: int = 128
    num_layers: int = 1
    num_classes: Optional[int] = None  # null = the data's classes
    dropout: float = 0.0  # between LSTM layers and before the head


@dataclass
class ResNet18Config:
    name: str = "resnet18"
    num_classes: Optional[int] = None  # null = the data's classes; the new fc's outputs
    in_channels: Optional[int] = None  # null = the data's; not 3: a new first conv
    weights: Optional[str] = None  # a state_dict file, or a torchvision name (IMAGENET1K_V1)
    freeze_backbone: bool = False  # train only the new head


@dataclass
class GptConfig:
    name: str = "gpt"
    vocab_size: int = 256
    context: int = 256  # the longest sequence it takes (learned position embeddings)
    layers: int = 4
    heads: int = 4
    width: int = 256
    dropout: float = 0.0


# --- data --------------------------------------------------------------------------------
@dataclass
class DataConfig:
    name: str = MISSING
    batch_size: int = 64  # per rank
    # set: batch_size = this / (data-parallel ranks x trainer.accumulate_grad_batches)
    global_batch_size: Optional[int] = None
    eval_batch_size: int = 1000  # per rank
    loader: Loader = Loader.auto
    num_workers: int = 0
    pin_memory: bool = False
    persistent_workers: bool = False
    prefetch_factor: Optional[int] = None  # batches each worker loads ahead; null = torch's 2


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

    @property
    def memory_bytes(self) -> int:
        return 70_000 * 28 * 28


@dataclass
class SyntheticDataConfig(DataConfig):
    name: str = "synthetic"
    train_size: int = 8192
    eval_size: int = 2048
    shape: list[int] = field(default_factory=lambda: [1, 28, 28])
    num_classes: int = 10
    noise: float = 1.0  # std of the noise around each class prototype
    vocab_size: Optional[int] = None  # set: token sequences (ids 1..vocab_size-1, 0 = padding)
    seq_len: int = 32  # token sequences: the longest (lengths vary from seq_len / 2 up)

    @property
    def input_shape(self) -> list[int]:
        return [self.seq_len] if self.vocab_size else list(self.shape)

    @property
    def memory_bytes(self) -> int:
        import math

        item = 8 if self.vocab_size else 4  # int64 ids, float32 values
        return (self.train_size + self.eval_size) * math.prod(self.input_shape) * item


@dataclass
class TextDataConfig(DataConfig):
    """Labelled text: train.tsv and test.tsv under data.path, one `label<TAB>text` a line."""

    name: str = "text"
    path: str = str(REPO_DIR / "data" / "text_cls")
    min_freq: int = 2  # rarer training tokens become <UNK>
    max_size: Optional[int] = 20_000  # vocabulary cap, <PAD> and <UNK> included; null = none
    max_len: Optional[int] = 64  # tokens kept per example; null = all
    lowercase: bool = True

    @property
    def vocab_size(self) -> int:
        from parallab.data import text

        return len(text.corpus(self).vocab)

    @property
    def num_classes(self) -> int:
        from parallab.data import text

        return len(text.corpus(self).classes)

    @property
    def input_shape(self) -> list[int]:
        from parallab.data import text

        return list(text.corpus(self).train.inputs.shape[1:])


@dataclass
class Cifar10DataConfig(DataConfig):
    name: str = "cifar10"
    root: str = str(REPO_DIR / "data")  # holds cifar-10-batches-py/
    download: bool = False
    augment: bool = True  # random crop (padding 4) + horizontal flip, per sample (DataLoader path)
    batch_size: int = 128

    @property
    def input_shape(self) -> list[int]:
        return [3, 32, 32]

    @property
    def num_classes(self) -> int:
        return 10

    @property
    def memory_bytes(self) -> int:
        return 60_000 * 3 * 32 * 32


@dataclass
class ImageFolderDataConfig(DataConfig):
    """Any folder of class subfolders (or train/ and val/ folders of them)."""

    name: str = "imagefolder"
    path: Optional[str] = None
    image_size: int = 224  # resized (shorter side) and cropped to image_size square
    eval_fraction: float = 0.2  # held out of each class when there is no train/ + val/
    augment: bool = True  # random resized crop + horizontal flip, per sample (DataLoader path)
    batch_size: int = 32
    eval_batch_size: int = 64

    @property
    def input_shape(self) -> list[int]:
        return [3, self.image_size, self.image_size]

    @property
    def num_classes(self) -> int:
        from parallab.data import images

        return len(images.folder_layout(self.path, self.eval_fraction).classes)

    @property
    def memory_bytes(self) -> int:
        from parallab.data import images

        return images.folder_layout(self.path, self.eval_fraction).size * 3 * self.image_size ** 2


@dataclass
class BytesDataConfig(DataConfig):
    """Byte-level text: every byte a token, windows of seq_len inputs and next-byte targets."""

    name: str = "bytes"
    path: Optional[str] = None  # a text file or a directory of *.txt; null = data/text/kjv.txt
    seq_len: int = 256
    eval_fraction: float = 0.1  # the tail of the text held out
    batch_size: int = 32
    eval_batch_size: int = 64

    @property
    def vocab_size(self) -> int:
        return 256

    @property
    def input_shape(self) -> list[int]:
        return [self.seq_len]

    @property
    def num_classes(self) -> int:
        return self.vocab_size


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


@dataclass
class FSDPConfig(ParallelConfig):
    name: str = "fsdp"
    world_size: Optional[int] = None
    reshard_after_forward: bool = True  # free gathered parameters after forward (ZeRO-3)


@dataclass
class ModelParallelConfig(ParallelConfig):
    name: str = "model"
    world_size: Optional[int] = None  # devices the stages are placed on
    split: Optional[list[int]] = None  # stage index where each part after the first starts


@dataclass
class PipelineConfig(ParallelConfig):
    name: str = "pipeline"
    world_size: Optional[int] = None  # ranks, one part of the model each
    split: Optional[list[int]] = None  # null = parts even by parameter count
    microbatches: int = 4  # per step: data.batch_size must divide by it
    schedule: str = "1f1b"  # gpipe | 1f1b


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
    keep_last_k: int = 3  # periodic checkpoints kept (last.pt / last.dcp always is)
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
    "model": {"mnist_cnn": MnistCnnConfig, "mlp": MlpConfig, "gpt": GptConfig,
              "lstm": LstmConfig, "resnet18": ResNet18Config},
    "data": {"mnist": MnistDataConfig, "synthetic": SyntheticDataConfig,
             "bytes": BytesDataConfig, "text": TextDataConfig, "cifar10": Cifar10DataConfig,
             "imagefolder": ImageFolderDataConfig},
    "parallel": {"none": ParallelConfig, "ddp": DDPConfig, "dp": DPConfig, "fsdp": FSDPConfig,
                 "model": ModelParallelConfig, "pipeline": PipelineConfig},
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
