"""The planners' keys: `parallab advise` (advise/), the cluster a step is predicted on
(cluster=NAME, simulate/cluster.py) and `parallab simulate`'s own; the run's Config
(schema.py) holds each as a group."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from omegaconf import MISSING


@dataclass
class AdviseConfig:
    """`parallab advise` (advise/): candidate layouts, how long each is measured, and the
    hardware its step-time prediction is for."""

    run: bool = False  # true (experiment=advise, parallab advise): advise instead of training
    steps: int = 10  # optimizer steps measured per candidate, after warmup_steps
    warmup_steps: int = 3  # steps per candidate left out of its figures
    # null = 1 and each divisor of parallel.world_size (CPU: 2 if unset)
    world_sizes: Optional[list[int]] = None
    # parallel options to try, e.g. [ddp,fsdp]; null = every one that fits
    layouts: Optional[list[str]] = None
    # null = fp32 and bf16 (CPU); fp32, bf16, amp and, with float8 tensor cores, fp8 (CUDA)
    precisions: Optional[list[str]] = None
    # the trainer.activation_checkpointing modes tried (selective_alternate where listed)
    activation_checkpointing: list[str] = field(
        default_factory=lambda: ["none", "selective", "full"])
    max_accumulation: int = 4  # gradient accumulation tried: 1, 2, 4 ... up to this
    microbatches: list[int] = field(default_factory=lambda: [2, 4])  # pipeline candidates'
    # pipeline's (the multi-stage ones at 2 stages per rank, where the model has them);
    # null = every schedule parallab has (parallel/schedules.py)
    schedules: Optional[list[str]] = None
    # true: a memory saver (activation checkpointing, accumulation) is measured only where
    # the candidate without it is predicted not to fit; false: the whole grid
    only_needed: bool = True
    rtol: float = 1e-3  # a candidate matches its reference when every loss is this close
    budget_mb: Optional[float] = None  # per rank; null = trainer.max_memory_mb, else the device's
    # each measured layout's step simulated on this many GPUs of the cluster group's
    # (cluster=NAME; null = none), as parallab simulate predicts it
    target_world_size: Optional[int] = None


# --- cluster: the GPUs parallab simulate predicts a step on (simulate/cluster.py) ---
@dataclass
class NcclLatency:
    """NCCL's latency constants (its tuning.cc): microseconds per call and per ring step,
    inside a node (NVLink) and between nodes (the network), for its Simple protocol and its
    low-latency LL protocol."""

    base_us: float = 8.4
    intra_hop_us: float = 3.4
    inter_hop_us: float = 9.6
    ll_base_us: float = 3.6
    ll_intra_hop_us: float = 0.47
    ll_inter_hop_us: float = 2.7


@dataclass
class ClusterConfig:
    name: str = MISSING
    # the GPU, as observe/gpus.yaml names it (its peak FLOP/s per precision); `this` = this
    # machine, its rates measured
    gpu: str = MISSING
    # its dense peaks by precision (fp32, tf32, bf16, fp16, fp8), TFLOP/s, each over
    # gpus.yaml's entry for the GPU (`+cluster.peak_tflops.fp8=...` adds one): a GPU it
    # does not list needs its cluster YAML alone
    peak_tflops: dict[str, float] = field(default_factory=dict)
    memory_gb: Optional[float] = MISSING  # a GPU's memory, GiB
    hbm_gbps: Optional[float] = MISSING  # its memory bandwidth, Gbit/s (H100 SXM: 26,800)
    gpus_per_node: Optional[int] = MISSING
    intra_node_gbps: Optional[float] = MISSING  # a GPU to its node's peers, one direction
    inter_node_gbps: Optional[float] = MISSING  # a GPU to other nodes (its NIC's share)
    nccl: NcclLatency = field(default_factory=NcclLatency)
    # the share of the peak a large matmul reaches: the one constant fitted per GPU kind,
    # from the one published run its YAML names
    matmul_efficiency: Optional[float] = MISSING
    # the largest share of each precision's peak (bf16, fp8) a GEMM reached in a published
    # sweep of shapes on this GPU: a float8 matmul runs at matmul_efficiency x fp8's share /
    # bf16's (none given: at matmul_efficiency)
    gemm_peak_share: dict[str, float] = field(default_factory=dict)
    op_overhead_us: Optional[float] = 4.0  # the least time an eager kernel takes (its launch)
    source: str = ""  # where the figures come from
    # cluster=this: measure this machine's rates again, not the ones kept (~/.cache/parallab)
    remeasure: bool = False


@dataclass
class SimulateConfig:
    """parallab simulate's own keys (the layouts, the cluster and the shapes are the
    parallel, cluster and data groups')."""

    rows: int = 20  # layouts simulate.md lists, fastest first (simulate.json holds every one)
    plotted: int = 4  # the best layouts simulate.png draws against the GPU count
    # GPU counts simulate.png draws them at; null = powers of 2 from 8 up to parallel.world_size
    world_sizes: Optional[list[int]] = None
    # a dir of runs measured here (an advise run dir, a sweep's dir): its figures drawn
    # beside the predictions
    measured: Optional[str] = None
    # how an MoE model's tokens pick their experts (each expert an even share either way):
    # random (each token's top_k at random) | round_robin (token t's top_k are neighbours,
    # t*k ... t*k+k-1: the forced balance of torchtitan's and NeMo's benchmarks), which
    # sets the ranks a token is sent to under parallel.ep
    routing: str = "random"
