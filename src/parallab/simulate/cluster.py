"""The cluster group (cluster=NAME): a GPU and how GPUs are connected, the rates a simulated
step is made of, and NCCL's cost model of a collective over them.

Link rates are in gigabits per second, as advise's are, and per GPU, one direction: what
one GPU can move to its peers inside a node (NVLink) and between nodes (its NIC). A
collective's time is NCCL's own model (src/graph/tuning.cc, ncclTopoTuneModel and
ncclTopoGetAlgoTime): a fixed latency per call, plus one per step of its algorithm (a ring
of n ranks takes 2(n-1) steps to all-reduce, n-1 to gather or scatter; a tree's depth is
log2 of the nodes), the steps inside a node and between nodes at their own latency, plus
the bytes each rank sends (comm.py's bus bytes) over the slowest link the group crosses:
NVLink inside a node; between nodes the NICs of the group's ranks on each node, its rings
spread over them (a group of one rank a node gets that rank's NIC; a node's 8 ranks, 8).
NCCL takes the fastest of its algorithms and protocols; so does this: ring or tree for an
all-reduce, and the Simple protocol or LL (a quarter of the bandwidth, a tenth of the
latency) for small messages.
"""

from __future__ import annotations

import functools
import math
import sys
from dataclasses import dataclass
from typing import Any

from omegaconf import MISSING

from parallab.config.errors import ConfigError
from parallab.config.planning import ClusterConfig, NcclLatency

GBIT = 1e9 / 8  # bytes per second in a gigabit per second
THIS = "this"  # cluster.gpu: this machine, its rates measured (simulate/this_machine.py)


RATES = ("memory_gb", "hbm_gbps", "gpus_per_node", "intra_node_gbps", "inter_node_gbps",
         "matmul_efficiency", "op_overhead_us")


def problem(cfg: ClusterConfig) -> str | None:
    """None if the cluster's keys can be used, else one line naming the key and the fix."""
    from omegaconf import OmegaConf

    for key in ("name", "gpu", *RATES):
        if OmegaConf.is_missing(cfg, key) if OmegaConf.is_config(cfg) else \
                getattr(cfg, key) == MISSING:
            return f"cluster.{key} is missing: set it (docs/parallel.md: planning for a cluster)"
    measured = cfg.gpu == THIS
    if cfg.remeasure and not measured:
        return (f"cluster.remeasure=true: cluster={cfg.name}'s rates are given, not measured: "
                "only cluster=this measures them (again)")
    for key in RATES:
        value = getattr(cfg, key)
        if value is None and not measured:
            return (f"cluster.{key}=null: only cluster.gpu=this measures its rates; give "
                    f"cluster={cfg.name} a value")
        if value is not None and not (value > 0 or key == "op_overhead_us" and value == 0):
            return f"cluster.{key}={value} is out of range: it must be > 0"
        # infinite, or so small a step takes forever (its seconds infinite, its figures 0
        # and Infinity, which JSON does not hold)
        if value is not None and not (math.isfinite(value) and (
                value == 0 or value >= sys.float_info.min)):
            return (f"cluster.{key}={value} is out of range: give a finite rate (a GPU's "
                    "figure in the key's unit)")
    if cfg.matmul_efficiency is not None and cfg.matmul_efficiency > 1:
        return (f"cluster.matmul_efficiency={cfg.matmul_efficiency} is out of range: it is a "
                "share of the peak, in (0, 1]")
    for key, value in cfg.gemm_peak_share.items():
        if key not in ("bf16", "fp8") or not 0 < value <= 1:
            return (f"cluster.gemm_peak_share.{key}={value} is out of range: give bf16's and "
                    "fp8's shares of their peaks, each in (0, 1]")
    for key, value in vars(cfg.nccl).items() if not OmegaConf.is_config(cfg.nccl) else \
            cfg.nccl.items():
        if not value >= 0:
            return f"cluster.nccl.{key}={value} is out of range: it must be >= 0"
    for key, value in cfg.peak_tflops.items():
        if key not in PRECISIONS:
            return (f"cluster.peak_tflops.{key} names no precision: give the GPU's dense "
                    f"TFLOP/s by {', '.join(PRECISIONS)}")
        if not 0 < value < math.inf:
            return (f"cluster.peak_tflops.{key}={value} is out of range: give the GPU's dense "
                    f"TFLOP/s by precision ({', '.join(PRECISIONS)}), each > 0")
    peaks = {} if measured else peaks_of(cfg)
    if not measured and not peaks:
        return (f"cluster.gpu={cfg.gpu} is not in observe/gpus.yaml's peak FLOP/s: name a GPU "
                "it lists (H100 SXM, H200, B200, A100, ...), `this`, or give the GPU's "
                "cluster.peak_tflops (bf16 and fp32 at least)")
    if not measured and not peaks.get("bf16"):  # Volta, Turing: listed, fp16 alone
        return (f"cluster.gpu={cfg.gpu} has no bf16 peak in observe/gpus.yaml (no bf16 tensor "
                "cores), which simulate prices every 16-bit op against: give it as "
                "+cluster.peak_tflops.bf16=TFLOPS (for a float16 run, its fp16 peak)")
    if not measured and not peaks.get("fp32"):  # it had ended in a KeyError traceback
        return (f"cluster.peak_tflops.fp32 is not given for cluster.gpu={cfg.gpu}: give its "
                "dense float32 TFLOP/s too (float32 ops, such as norms and softmax, are priced "
                "at it), e.g. +cluster.peak_tflops.fp32=67")
    return None


PRECISIONS = ("fp32", "tf32", "bf16", "fp16", "fp8")  # cluster.peak_tflops's keys


def peaks_of(cfg: ClusterConfig) -> dict[str, float]:
    """The cluster GPU's dense peaks by precision, FLOP/s: gpus.yaml's entry for its name,
    each of its own peak_tflops over the entry's (empty: neither knows it)."""
    from parallab.observe import mfu

    own = {k: float(v) * 1e12 for k, v in (cfg.peak_tflops or {}).items()}
    return mfu.filled({**(mfu.peaks_of(cfg.gpu, listed=True) or {}), **own})


def per_node(world_size: int, gpus_per_node: int) -> int:
    """The ranks a node holds in the allocation a job of `world_size` GPUs is given
    (allocation.spread, the sbatch lines' rule: as few nodes as hold it, the same count on
    each): a job smaller than a node sits on one, and 12 GPUs on 8-GPU nodes are 2 x 6,
    where a tp group of ranks 4-7 crosses nodes (it had been priced on nodes of 8). A count
    no node count splits evenly, which no allocation takes, is priced on full nodes."""
    from parallab.launching.allocation import spread

    try:
        return spread(world_size, None, None, gpus_per_node, "").tasks_per_node
    except ConfigError:
        return gpus_per_node


@dataclass(frozen=True)
class Group:
    """Where a collective's ranks sit: how many, over how many nodes."""

    ranks: int
    nodes: int

    @classmethod
    def of(cls, size: int, stride: int, gpus_per_node: int) -> "Group":
        """A mesh dimension of `size` ranks `stride` apart (the product of the inner
        dimensions' degrees), over the nodes its most spread group spans: neighbours share
        a node while the stride is below a node's GPUs, and a group that does not sit
        evenly on nodes (tp 4 on 6 GPUs a node: ranks 4-7) crosses one."""
        return cls(size, _nodes_spanned(size, stride, gpus_per_node))


@functools.lru_cache(maxsize=None)
def _nodes_spanned(size: int, stride: int, gpus_per_node: int) -> int:
    """The most nodes a group spans, over the groups of one period of the layout (after
    which groups and nodes line up again as they began)."""
    span = size * stride
    worst = 1
    for block in range(0, math.lcm(span, gpus_per_node), span):
        for inner in range(stride):
            worst = max(worst, len({(block + inner + j * stride) // gpus_per_node
                                    for j in range(size)}))
    return worst


@dataclass(frozen=True, eq=False)  # hashed by identity: a Traces' priced costs key on it
class Rates:
    """A cluster's figures in the units the step model uses (seconds, bytes per second)."""

    peaks: dict  # dtype name -> FLOP/s
    matmul_efficiency: float
    hbm: float
    intra: float
    inter: float
    gpus_per_node: int
    memory_bytes: float
    op_overhead_s: float
    nccl: NcclLatency
    # an op's own time comes on top of its work (a CPU, whose cores do both), not beside it
    # (a GPU's kernels, launched ahead while the previous ones run); so do collectives,
    # which the same cores run: nothing overlaps
    overhead_adds: bool = False
    dtensor_op_s: float = 0.0  # there: what DTensor's dispatch adds to an op
    fsdp_unit_s: float = 0.0  # there: what FSDP2's hooks add to a unit's forward and backward
    stage_s: float = 0.0  # there: what a pipeline's schedule adds to a micro-batch's pass
    # there: each collective kind's (fixed seconds, bus bytes per second) as measured,
    # which stand for NCCL's model (a CPU's gloo follows none of its rules)
    links: Any = None
    # an op's seconds measured by running it (cluster=this), None where it cannot be
    timed: Any = None
    float8_efficiency: float | None = None  # a float8 matmul's (None: matmul_efficiency)

    def fp32_peak(self, tf32: bool) -> float:
        """A float32 matmul's peak: TF32's tensor cores where asked and the GPU has them."""
        return self.peaks["tf32" if tf32 and self.peaks.get("tf32") else "fp32"]

    def half_peak(self, precision: str) -> float:
        """A 16-bit matmul's peak under the precision group's `precision`: float16's for
        fp16 and amp (float16 on CUDA), bfloat16's for the rest (fp16 had been priced at
        bf16's, a GPU's own fp16 peak taken and not used)."""
        import torch

        from parallab.precision import compute_dtype

        half = compute_dtype(precision, "cuda") == torch.float16
        return self.peaks["fp16" if half and self.peaks.get("fp16") else "bf16"]

    def hidden(self, seconds: float, beside: float) -> float:
        """What of a collective of `seconds` run beside `beside` seconds of compute is left
        exposed: what outlasts it, or all of it where the same cores do both."""
        return seconds if self.overhead_adds else max(0.0, seconds - beside)

    @classmethod
    def of(cls, cfg: ClusterConfig) -> "Rates":
        peaks = peaks_of(cfg)
        nccl = cfg.nccl if isinstance(cfg.nccl, NcclLatency) else NcclLatency(**cfg.nccl)
        share = cfg.gemm_peak_share
        float8 = cfg.matmul_efficiency * share["fp8"] / share["bf16"] \
            if {"fp8", "bf16"} <= set(share) else None
        return cls(peaks, cfg.matmul_efficiency, cfg.hbm_gbps * GBIT, cfg.intra_node_gbps * GBIT,
                   cfg.inter_node_gbps * GBIT, cfg.gpus_per_node, cfg.memory_gb * 2**30,
                   cfg.op_overhead_us * 1e-6, nccl, float8_efficiency=float8)

    def collective_s(self, kind: str, sent: float, group: Group) -> float:
        """Seconds of one collective of `kind` (comm.KINDS) in which each rank sends `sent`
        bytes (comm.py's bus bytes), over `group`: NCCL's fastest algorithm and protocol;
        where this machine's kind was measured (links), its fixed cost and rate at the job's
        rank count, whatever the group (its ranks share the same cores) and the YAML's
        link keys."""
        if group.ranks < 2 or sent <= 0:
            return 0.0
        if self.links and kind in self.links:
            fixed, rate = self.links[kind]
            return fixed + sent / rate
        n, nodes = group.ranks, group.nodes
        if kind == "all_to_all":
            return self._all_to_all_s(sent, n, nodes)
        # over nodes, NCCL's rings (a channel a NIC) cross the network at every node's
        # edge: a rank gets its node's share of the NICs its group uses there
        bandwidth = self.intra if nodes == 1 else min(self.intra, n // nodes * self.inter)
        steps = {"all_reduce": 2 * (n - 1), "p2p": 1}.get(kind, n - 1)
        inter_steps = {"all_reduce": 2 * (nodes - 1), "p2p": int(nodes > 1)}.get(kind, nodes - 1)
        options = []
        for base, intra_hop, inter_hop, share in (
                (self.nccl.base_us, self.nccl.intra_hop_us, self.nccl.inter_hop_us, 1.0),
                (self.nccl.ll_base_us, self.nccl.ll_intra_hop_us, self.nccl.ll_inter_hop_us, 0.25)):
            ring = base + (steps - inter_steps) * intra_hop + inter_steps * inter_hop
            options.append(ring * 1e-6 + sent / (bandwidth * share))
            if kind == "all_reduce" and nodes > 1:  # a tree over the nodes, a chain in each
                per_node = n // nodes
                tree = base + 2 * ((per_node - 1) * intra_hop + math.log2(nodes) * inter_hop)
                # the tree moves the whole tensor twice, where the ring's bus bytes are
                # 2(n-1)/n of it
                options.append(tree * 1e-6 + sent * n / (n - 1) / (bandwidth * share))
        return min(options)

    def _all_to_all_s(self, sent: float, n: int, nodes: int) -> float:
        """NCCL's all-to-all: each rank's sends to every peer at once, its bus bytes
        ((n-1)/n of its input) to its node's other ranks over NVLink and to the other nodes'
        through its own NIC, the longer of the two; one step's latency, over the network
        where it crosses it."""
        whole = sent * n / (n - 1)
        per_node = n // nodes
        inside = whole * (per_node - 1) / n / self.intra
        outside = whole * (n - per_node) / n / self.inter
        hop = self.nccl.inter_hop_us if nodes > 1 else self.nccl.intra_hop_us
        return (self.nccl.base_us + hop) * 1e-6 + max(inside, outside)

