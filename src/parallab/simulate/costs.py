"""What a traced micro-batch's ops cost on a cluster: each compute op its roofline, a
compiled run's chains of memory-bound ops fused, tensor parallelism's collectives by
NCCL's model (step.py makes a step of them).

Compute: each traced op as a roofline, the longer of its FLOPs at the GPU's peak (the op's
precision) x cluster.matmul_efficiency and its bytes at the memory's bandwidth (a matmul:
the two added, its kernel not hiding its tiles' first load and its output's write behind
its multiplies), and no shorter than a kernel's launch (cluster.op_overhead_us). With
trainer.compile, a chain of the model's memory-bound ops in a row is one kernel that
reads what the chain takes in and writes what it hands on, once (the loss, outside the
model, runs eager). A rank's micro-batch is its blocks' forward and backward (activation
checkpointing's recompute inside) and the embeddings', the head's and the loss's where
the rank holds them.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from parallab.simulate import float8
from parallab.simulate.cluster import Group, Rates
from parallab.simulate.trace import Op, Trace

LONGEST_S = 0.5  # an op run for real here at most this long by its roofline, ...
MEMORY_SHARE = 0.25  # ... its tensors at most this share of a rank's memory


def op_seconds(op: Op, rates: Rates, fp32_peak: float, experts_held: float = 1.0,
               half_peak: float | None = None) -> float:
    """One op's roofline: its FLOPs at the peak of its precision x the matmul efficiency,
    or its bytes at the memory's bandwidth, whichever is longer; a matmul (every op with a
    FLOP formula) both, added: a bound, chosen on the published runs, for a GEMM kernel
    hides only part of what it moves behind its multiplies (not its first tiles' load nor
    its output's write), the more of it the less work a byte has (a narrow model's small
    inner dimension). With the longer-of, published runs of models from 125M to 18B came
    out the further over the narrower the model (10-20% at the narrowest); summed, 3-10%
    (docs/benchmarks.md: "parallab simulate against published runs"). At least a launch.
    Where
    the cluster is this machine, the op run for real (this_machine.py), its roofline the fallback;
    an op the roofline says would run over LONGEST_S, or whose tensors would take over
    MEMORY_SHARE of the memory, is not run: at that size a CPU runs at the measured rates
    the roofline prices it by, and a model too large for the machine ends in its refusal,
    not in hours of ops or an exhausted memory. An experts' op moves `experts_held` of the
    experts' weights it was traced with (expert parallelism's share of them)."""
    moved = sum(b for _, b in op.reads) + sum(b for _, b in op.writes) - \
        op.weight_bytes * (1 - experts_held)
    seconds = moved / rates.hbm
    if op.flops:
        peak = fp32_peak if op.wide else half_peak or rates.peaks["bf16"]
        multiplies = op.flops / (peak * rates.matmul_efficiency)
        seconds = seconds + multiplies if op.kind == "matmul" else max(seconds, multiplies)
    if rates.timed is not None and seconds <= LONGEST_S and \
            moved <= MEMORY_SHARE * rates.memory_bytes:
        timed = rates.timed(op)
        if timed is not None:
            return timed + rates.op_overhead_s + rates.dtensor_op_s * op.dtensor
    return _with_overhead(seconds, rates) + rates.dtensor_op_s * op.dtensor


def _with_overhead(seconds: float, rates: Rates) -> float:
    if rates.overhead_adds:
        return seconds + rates.op_overhead_s
    return max(seconds, rates.op_overhead_s)


def fused_seconds(chain: list[Op], later_reads: set[int], rates: Rates) -> float:
    """A chain of memory-bound ops as one compiled kernel: what it reads from before it and
    what it writes that is read after it, once each."""
    written = {serial for op in chain for serial, _ in op.writes}
    reads = {serial: b for op in chain for serial, b in op.reads if serial not in written}
    writes = {serial: b for op in chain for serial, b in op.writes if serial in later_reads}
    return _with_overhead((sum(reads.values()) + sum(writes.values())) / rates.hbm, rates)


@dataclass
class Costs:
    """A traced micro-batch's seconds by (phase, region): compute, and the tensor-parallel
    collectives inside it."""

    compute: dict[tuple[str, str], float] = field(default_factory=dict)
    collectives: dict[tuple[str, str], dict[str, float]] = field(default_factory=dict)
    experts: dict[str, float] = field(default_factory=dict)  # of compute, the experts' by phase

    def seconds(self, phase: str, region: str) -> float:
        return self.compute.get((phase, region), 0.0) + sum(
            self.collectives.get((phase, region), {}).values())


def _mix(a: dict, b: dict, share: float) -> dict:
    return {key: _mix(a.get(key, {}), b.get(key, {}), share) if isinstance(
        a.get(key, b.get(key)), dict) else share * a.get(key, 0.0) + (1 - share) * b.get(key, 0.0)
        for key in a.keys() | b.keys()}


def blend(checkpointed: tuple[Trace, Costs], plain: tuple[Trace, Costs], share: float
          ) -> tuple[Trace, Costs]:
    """A block as `share` of the blocks checkpointed and the rest plain cost and keep on
    average (trainer.activation_checkpointing_every: every Nth checkpointed, the others
    keeping all); as well, `share` of a mixture's blocks holding experts, the others
    dense."""
    (a, a_costs), (b, b_costs) = checkpointed, plain
    saved = _mix(a.saved, b.saved, share)
    # the peak's temporaries beyond what is kept (the larger of the two) on the blend's
    beyond = max(x.peak_transient - sum(x.saved.values()) for x in (a, b))
    found = dataclasses.replace(a, saved=saved,
                                saved_compiled=_mix(a.saved_compiled, b.saved_compiled, share),
                                casts=_mix(a.casts, b.casts, share),
                                peak_transient=beyond + sum(saved.values()),
                                params=_mix(a.params, b.params, share))
    return found, Costs(_mix(a_costs.compute, b_costs.compute, share),
                        _mix(a_costs.collectives, b_costs.collectives, share),
                        _mix(a_costs.experts, b_costs.experts, share))


def costs(trace: Trace, rates: Rates, compile: bool, tf32: bool, ep: int = 1) -> Costs:
    """The trace's ops priced on the cluster: each compute op its roofline (a compiled run's
    chains of memory-bound ops fused; an experts' op with a rank's 1/ep of their weights),
    each collective NCCL's time over the tp group."""
    fp32_peak, half_peak = rates.fp32_peak(tf32), rates.half_peak(trace.shape.precision)
    found = Costs()
    tp_group = Group.of(trace.shape.tp, 1, rates.gpus_per_node)
    ops = trace.ops
    read_at: dict[int, int] = {}  # each tensor's last reader
    for index, op in enumerate(ops):
        for serial, _ in op.reads:
            read_at[serial] = index
    chain: list[Op] = []

    def close(end: int) -> None:
        if chain:
            later = {s for op in chain for s, _ in op.writes if read_at.get(s, -1) >= end}
            key = (chain[0].phase, chain[0].region)
            found.compute[key] = found.compute.get(key, 0.0) + fused_seconds(chain, later, rates)
            chain.clear()

    for index, op in enumerate(ops):
        key = (op.phase, op.region)
        if op.kind == "collective":
            close(index)
            kinds = found.collectives.setdefault(key, {})
            kinds[op.collective] = kinds.get(op.collective, 0.0) + rates.collective_s(
                op.collective, op.sent, tp_group)
            continue
        if compile and op.kind == "memory" and op.in_model and rates.timed is None:
            if chain and (chain[0].phase, chain[0].region) != key:
                close(index)
            chain.append(op)
            continue
        close(index)
        seconds = float8.seconds(op, rates, compile, lambda s: _with_overhead(s, rates),
                                 trace.shape.fp8_recipe) if op.fp8 else \
            op_seconds(op, rates, fp32_peak, 1 / ep if op.experts else 1.0, half_peak)
        found.compute[key] = found.compute.get(key, 0.0) + seconds
        if op.experts:
            found.experts[op.phase] = found.experts.get(op.phase, 0.0) + seconds
    close(len(ops))
    return found
