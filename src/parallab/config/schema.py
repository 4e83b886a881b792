"""Typed configuration: the schema of the groups parallab owns (the planners' in
planning.py; the base of data sets, DataConfig, in data_config.py).

Groups whose options are parallab's own (parallel, precision, backend, optim, trainer) start
their defaults list with a schema from the ConfigStore (`/schema/<group>/<option>`), so
Hydra itself rejects an unknown key or a value of the wrong type and names it. `model`,
`data` and `loss` are `_target_` specs: a model or loss is checked against its signature
(targets.py), a data set against its own config class, a DataConfig subclass (data_config).
Value and cross-field checks live with their owners; validate.py runs them in order.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any, ClassVar, Optional

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING

# DataConfig and Loader are also named from here: a user's data set subclasses
# parallab.config.schema.DataConfig (docs/own-model.md)
from parallab.config.data_config import DataConfig, Loader, data_defaults  # noqa: F401
from parallab.config.planning import AdviseConfig, ClusterConfig, SimulateConfig


class Device(enum.Enum):
    auto = "auto"
    cpu = "cpu"
    cuda = "cuda"


# groups whose options each extend a schema (conf/GROUP/*.yaml's first default) and whose
# readers take the typed config alone (an adapter may stay a mapping: evaluate.py sets the
# checkpoint's)
TYPED_GROUPS = ("parallel", "precision", "backend", "optim", "scheduler", "trainer", "cluster")


# --- parallel ----------------------------------------------------------------------------
@dataclass
class ParallelConfig:
    # a process per rank, started by the launcher (the plan's own `processes`, known here
    # before torch loads, so that a job's fork server starts while its controller loads it)
    processes: ClassVar[bool] = False
    # none | dp | ddp | fsdp | model | pipeline | hsdp | tp | fsdp_tp (the group's option)
    name: str = "none"
    # processes (ddp) or devices (dp); null = one per visible GPU, or 2 on CPU
    world_size: Optional[int] = 1
    nnodes: int = 1  # hosts of a job started by the built-in launcher (torchrun/SLURM say theirs)
    threads_per_worker: Optional[int] = None  # null = cores / local workers
    max_restarts: int = 0  # elastic restarts of the worker group after a worker dies
    # in place (torchrun, SLURM, mpirun): seconds each rank waits to reach rank 0 (or
    # torchrun's agent), and rank 0 for every rank
    rendezvous_timeout: float = 60.0
    # GPU ids made visible to the workers; dp and model may name one twice ([0,0]: two
    # replicas or parts on one GPU, to try the layout there)
    devices: Optional[list[int]] = None
    # the model's stages by module name in forward order ("blocks.*": a ModuleList's
    # children); null = the model's stages(), or an nn.Sequential's children
    stages: Optional[list[str]] = None
    # expert parallelism: each MoE layer's experts split over ep ranks carved from the
    # data-parallel shard ranks (and tp's); 1: every rank holds every expert
    # (parallel/expert_parallel.py). The sharded layouts take it: fsdp, hsdp, tp, fsdp_tp, pipeline
    ep: int = 1


@dataclass
class DPConfig(ParallelConfig):
    name: str = "dp"
    world_size: Optional[int] = None


@dataclass
class MeshConfig(ParallelConfig):
    """One device mesh: dp_replicate x dp_shard x tp = world_size (parallel/mesh.py); the
    presets ddp (replicas), fsdp (shards), hsdp, tp and fsdp_tp set its degrees."""

    processes: ClassVar[bool] = True
    name: str = "ddp"
    world_size: Optional[int] = None
    dp_replicate: Optional[int] = None  # model replicas; gradients all-reduced across them
    dp_shard: Optional[int] = 1  # ranks each replica is sharded over (FSDP2)
    tp: Optional[int] = 1  # ranks each layer is split over (tensor parallel)
    # module pattern -> colwise | rowwise | ... (`*`: one name of a path, e.g.
    # model.layers.*.mlp.up_proj); null = the model's own plan (gpt's tp_plan(), a
    # transformers config's base_model_tp_plan). Any: a mapping given whole on the command
    # line (Hydra merges into an Optional dict that is null only with ++)
    tp_plan: Any = None
    # tp > 1: the activations between the split layers cut along the sequence too (gpt's
    # tp_plan(sequence_parallel=True), a transformers model's own plan made so)
    sequence_parallel: bool = False
    # sequence parallelism's gathered inputs freed after forward and gathered again in
    # backward (Megatron-LM's): a block keeps its slice of each, not the whole sequence
    regather_in_backward: bool = False
    reshard_after_forward: bool = True  # free gathered parameters after forward (ZeRO-3)
    # replicas only (dp_shard = tp = 1): DistributedDataParallel's settings
    bucket_cap_mb: float = 25.0
    find_unused_parameters: bool = False
    gradient_as_bucket_view: bool = True


@dataclass
class AutoConfig(ParallelConfig):
    # parallab simulate ranks every layout at parallel.world_size GPUs; training takes one
    # of them (the command simulate prints)
    name: str = "auto"
    # the parallel keys each of them sets itself (layout.SET_KEYS; given with auto: told so)
    decides: ClassVar[tuple[str, ...]] = (
        "dp_replicate", "dp_shard", "tp", "pp", "ep", "schedule", "microbatches",
        "stages_per_rank", "sequence_parallel", "regather_in_backward")
    world_size: Optional[int] = None  # GPUs of the cluster the layouts are ranked for
    # the tensor-parallel plan of the layouts with tp > 1, as the mesh's (null = the
    # model's own); their commands carry it
    tp_plan: Any = None
    # the gradient buckets of the layouts whose replicas average them (DDP's, a pipeline's
    # replicas'), as the mesh's and the pipeline's; their commands carry it where given
    bucket_cap_mb: float = 25.0
    # the sharded layouts without a pipeline: free gathered parameters after forward
    # (ZeRO-3), or keep them to backward (false), as the mesh's; their commands carry it
    reshard_after_forward: bool = True


@dataclass
class ModelParallelConfig(ParallelConfig):
    name: str = "model"
    world_size: Optional[int] = None  # devices the stages are placed on
    split: Optional[list[int]] = None  # stage index where each part after the first starts


@dataclass
class PipelineConfig(ParallelConfig):
    processes: ClassVar[bool] = True
    name: str = "pipeline"
    world_size: Optional[int] = None  # ranks: pp parts x dp_replicate pipelines x tp
    # null = parts even by parameter count; [i] = the second part starts at stage i
    split: Optional[list[int]] = None
    microbatches: int = 4  # per step: data.batch_size must divide by it
    # gpipe | 1f1b | interleaved_1f1b | looped_bfs | interleaved_zb | zbv | dualpipev
    schedule: str = "1f1b"
    # stages each rank holds (the model cut into pp x this); null = what the schedule
    # needs: 1 for gpipe and 1f1b, 2 for the others (zbv and dualpipev: exactly 2)
    stages_per_rank: Optional[int] = None
    # pipelines side by side (pp x dp), each reading its own shard; null = world_size / (pp x tp)
    dp_replicate: Optional[int] = None
    dp_shard: int = 1  # > 1: each part sharded by FSDP2 over this many pipelines
    pp: Optional[int] = None  # parts of one pipeline; null = world_size / (dp_replicate x tp)
    tp: int = 1  # ranks each part is split over by the model's tensor-parallel plan
    tp_plan: Any = None  # as the mesh's: null = the model's own
    sequence_parallel: bool = False  # tp > 1: activations cut along the sequence too
    regather_in_backward: bool = False  # as the mesh's: gathered inputs gathered again
    # replicas (dp_shard = 1): MiB of gradients each all-reduce carries, launched as their
    # last micro-batch's backward lands (parallel/replicas.py)
    bucket_cap_mb: float = 25.0


# --- adapter, precision, backend, optim, trainer ----------------------------------------
@dataclass
class AdapterConfig:
    name: str = "none"  # none | lora (low-rank adapters through peft; models/adapters.py)


@dataclass
class LoraConfig(AdapterConfig):
    name: str = "lora"
    imports: ClassVar[tuple[str, ...]] = ("peft",)  # what every rank imports for it
    r: int = 8  # the adapters' rank
    alpha: float = 16.0  # their output is scaled by alpha / r
    dropout: float = 0.0  # on the adapters' input
    # the layers adapted, as peft reads them: a list of names (a module's name or its last
    # parts: [qkv]), or one string, a regular expression a module's whole name matches
    # ('.*\.qkv') or all-linear; null = the model's own: peft's table for a transformers
    # model, lora_target_modules on the model's class (parallab's gpt: its attention's qkv)
    target_modules: Any = None


@dataclass
class PrecisionConfig:
    name: str = "fp32"  # fp32 | amp | bf16 | fp16 | fp8 (float8 Linear layers, CUDA)
    tf32: bool = False  # TF32 matmul/cuDNN on CUDA (Tensor Cores for fp32 models)
    # fp8's scales (torchao's recipes): tensorwise = one per tensor, the fastest; rowwise =
    # one per row, closer to bf16's accuracy, at some speed
    fp8_recipe: str = "tensorwise"
    # fp8 under fsdp/hsdp: FSDP2 all-gathers the weights in float8 (half bf16's bytes);
    # tensorwise scales only
    fp8_all_gather: bool = False
    # float32 | bfloat16: the dtype data-parallel ranks reduce gradients in (FSDP2's
    # reduce-scatter, torchtitan's mixed_precision_reduce; DDP's all-reduce; a pipeline's
    # replicas'), and a pipeline's sharded parts accumulate them in; bfloat16 halves the bytes
    reduce_dtype: str = "float32"
    # float32 | bfloat16: the dtype a rank keeps the weights, their gradients and the
    # optimizer's state in; bfloat16 halves them (Lightning's bf16-true, NeMo AutoModel's
    # runs), where an update smaller than a weight's bfloat16 spacing is lost. precision=bf16
    state_dtype: str = "float32"


@dataclass
class BackendConfig:
    name: str = "auto"  # auto = nccl with CUDA, gloo without
    timeout_s: float = 600.0  # bound on any one collective


@dataclass
class OptimConfig:
    name: str = "sgd"  # sgd | adam | adamw (the optim group's option)
    lr: float = 0.01  # the learning rate (peak, under a scheduler)
    weight_decay: float = 0.0  # L2 penalty (sgd, adam) or decoupled decay (adamw)
    # auto | foreach | fused | for_loop: torch's kernels for the update. auto = fused on
    # CUDA, else foreach (multi-tensor), which torch itself picks only on CUDA: on CPU too
    # it is the faster (bench/bench_loop.py); for_loop: one kernel per parameter
    implementation: str = "auto"
    # none | linear | sqrt: optim.lr is for a global batch of base_batch_size; the rate used
    # is scaled to the run's (Goyal et al.'s linear rule, or the square root's)
    scale_lr: str = "none"
    base_batch_size: int = 64  # the MNIST recipe's
    # true: weight decay on every parameter; false: on weight matrices only (no biases,
    # norm gains or embeddings), adamw's default
    decay_all: bool = True


@dataclass
class SGDConfig(OptimConfig):
    name: str = "sgd"
    lr: float = 0.01
    momentum: float = 0.5  # in [0, 1)
    nesterov: bool = False  # Nesterov momentum (needs momentum > 0)


@dataclass
class AdamConfig(OptimConfig):
    name: str = "adam"
    lr: float = 1e-3
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])  # moment decay rates
    eps: float = 1e-8  # added to the denominator


@dataclass
class AdamWConfig(AdamConfig):
    name: str = "adamw"
    weight_decay: float = 0.01
    decay_all: bool = False


@dataclass
class SchedulerConfig:
    name: str = "constant"  # constant | cosine | linear | step | wsd (schedule.py)
    warmup_steps: float = 0  # linear warmup: optimizer steps (>= 1) or a fraction of the run
    min_lr_ratio: float = 0.0  # cosine, linear, wsd: the final lr, as a fraction of optim.lr
    step_size: int = 1000  # step: optimizer steps between decays
    gamma: float = 0.1  # step: each decay multiplies the lr by this
    decay_steps: float = 0.2  # wsd: the last steps (>= 1) or fraction of the run that decay


@dataclass
class TrainerConfig:
    epochs: int = 10  # passes over the training set (trainer.max_steps may end it sooner)
    max_steps: Optional[int] = None  # stop after this many optimizer steps
    log_every_n_steps: int = 50  # train/* scalars; the ranks vote on a stop here too
    eval_every_n_epochs: int = 1  # and once at the end on the final weights
    # set: evaluate every this many optimizer steps instead of by epoch
    eval_every_n_steps: Optional[int] = None
    timing_skip_steps: int = 5  # first steps left out of throughput and step-time figures
    # renamed: trainer.timing_skip_steps (timing), scheduler.warmup_steps (learning rate)
    warmup_steps: Any = None
    progress_bar: Optional[bool] = None  # null = only on an interactive terminal
    # micro-batches per optimizer step (DDP reduces once per step; FSDP each micro-batch)
    accumulate_grad_batches: int = 1
    clip_grad_norm: Optional[float] = None  # max global gradient norm; null = no clipping
    channels_last: bool = False  # NHWC memory format for conv models (not under FSDP2 or pipeline)
    compile: bool = False  # torch.compile the model (before the parallel wrapper)
    # a transformers model's RMSNorm layers (Llama's, Qwen's, ...) as torch's nn.RMSNorm: one
    # kernel on a GPU, keeping its input alone for backward (models/norms.py)
    fused_norms: bool = False
    # null = torch's default; reduce-overhead, max-autotune, ...
    compile_mode: Optional[str] = None
    # torch.compile's backend: aot_eager (or eager) tells a tracing failure from inductor's
    compile_backend: str = "inductor"
    profile: bool = False  # torch.profiler trace of steps 3-5 into <run dir>/profiler/
    # CUDA: the allocator's history over the first 3 steps into
    # <run dir>/memory_snapshot/rank<r>.pickle, for pytorch.org/memory_viz
    memory_snapshot: bool = False
    # dynamic_int8: int8 Linear layers after training (torchao), evaluated too
    quantize: Optional[str] = None
    # double data.batch_size until out of memory, over budget, or <5% faster
    auto_batch_size: bool = False
    # the finder's memory budget per rank (CPU: peak RSS; CUDA: peak allocated)
    max_memory_mb: Optional[float] = None
    # atomic checkpoints/step_*.pt (.dcp), and one at each epoch end; null = epochs only
    checkpoint_every_n_steps: Optional[int] = 500
    # periodic checkpoints kept; checkpoints/last.pt (last.dcp) is written at the end
    keep_last_k: int = 3
    # auto: continue from the newest checkpoint in the run dir; or a checkpoint path
    resume: Optional[str] = None
    overwrite: bool = False  # a fresh run in a dir holding one: delete its checkpoints first
    # under SLURM: the time-limit warning (sbatch --signal=USR1@90): every rank saves, the job
    # requeues itself and continues its run; null = the signal's default (the job ends)
    requeue_signal: Optional[str] = "USR1"
    # weights only, from a .pt, .dcp, .safetensors or a (transformers) folder
    init_from: Optional[str] = None
    # every weight named and shaped as the model's; false: load those that match, keep the
    # others' initial values
    init_strict: bool = True
    # stop: end with a clear message, the last good checkpoint kept | skip: drop the step
    on_nan: str = "stop"
    # none | full | selective | selective_alternate: recompute activations in backward, per
    # stage (parallel/activations.py)
    activation_checkpointing: str = "none"
    # checkpoint every Nth stage only, the others keeping all (torchtitan's layer-level: 2)
    activation_checkpointing_every: int = 1
    # the eval figure that picks best.pt and early stopping: eval_loss, eval_accuracy, or any
    # eval_<metric> the run reports
    monitor: str = "eval_loss"
    monitor_mode: Optional[str] = None  # min | max; null = min for eval_loss, max for eval_accuracy
    save_best: bool = True  # checkpoints/best.pt (best.dcp) whenever the monitored figure improves
    # end the run after this many evaluations without improvement
    early_stop_patience: Optional[int] = None


@dataclass
class SweepConfig:
    # re-running a sweep: jobs whose dir holds a complete metrics.json (advise.md) are not rerun
    skip_completed: bool = False


@dataclass
class Config:
    model: Any = MISSING  # a _target_ spec: the model's class (or factory) and its arguments
    # the data set's config: a mapping until validate.prepare types it as its DataConfig
    data: Any = field(default_factory=data_defaults)
    loss: Any = MISSING  # a _target_ spec (loss.py)
    parallel: Any = MISSING
    adapter: Any = MISSING  # none, or lora: only low-rank adapters train (models/adapters.py)
    precision: Any = MISSING
    backend: Any = MISSING
    optim: Any = MISSING
    scheduler: Any = MISSING
    trainer: Any = MISSING
    # name -> _target_ spec of each logger (the logger group: tensorboard, csv, mlflow, wandb)
    logger: Any = field(default_factory=dict)
    # further evaluation metrics, name -> _target_ spec (e.g. a torchmetrics class):
    # reported as eval_<name> (not loss, nor accuracy under a classifying loss: the run's own)
    metrics: dict[str, Any] = field(default_factory=dict)
    # the figure a sweep's objective returns (Optuna); null = eval_accuracy where the loss
    # classifies, else eval_loss
    objective: Optional[str] = None
    seed: int = 42  # weights, data order, your Datasets as made, dropout (+ each rank)
    device: Device = Device.auto  # auto | cpu | cuda
    sweep: SweepConfig = field(default_factory=SweepConfig)  # multirun settings
    # parallab advise (= experiment=advise): which layout trains this model fastest
    # (docs/parallel.md)
    advise: AdviseConfig = field(default_factory=AdviseConfig)
    # the GPUs and links parallab simulate and advise.target_world_size predict a step on
    # (cluster=h100, a100, ...; docs/parallel.md: planning for a cluster)
    cluster: Any = MISSING
    # parallab simulate's own keys (docs/parallel.md: planning for a cluster)
    simulate: SimulateConfig = field(default_factory=SimulateConfig)


@dataclass
class EvalConfig(Config):
    ckpt: str = MISSING  # checkpoint to evaluate


SCHEMAS: dict[str, dict[str, type]] = {
    "parallel": {"none": ParallelConfig, "dp": DPConfig, "mesh": MeshConfig,
                 "model": ModelParallelConfig, "pipeline": PipelineConfig,
                 "auto": AutoConfig},
    "adapter": {"none": AdapterConfig, "lora": LoraConfig},
    "precision": {"default": PrecisionConfig},
    "backend": {"default": BackendConfig},
    "optim": {"sgd": SGDConfig, "adam": AdamConfig, "adamw": AdamWConfig},
    "scheduler": {"default": SchedulerConfig},
    "trainer": {"default": TrainerConfig},
    "cluster": {"default": ClusterConfig},
}


def register_configs() -> None:
    store = ConfigStore.instance()
    store.store(name="config_schema", node=Config)
    store.store(name="eval_schema", node=EvalConfig)
    for group, options in SCHEMAS.items():
        for name, node in options.items():
            store.store(group=f"schema/{group}", name=name, node=node)
