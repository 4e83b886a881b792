"""A training step on a cluster, from one traced block: its time by part and its memory.

Compute: each traced op priced by costs.py (its roofline; compiled chains fused).

Communication, each collective by NCCL's model (cluster.py) over the ranks its group
spans, overlapped as each layout overlaps it:
- tensor parallel: the collectives the plan calls inside each block, exposed;
- FSDP2, for each accumulated micro-batch: each block's weights gathered (in the compute
  dtype) for its forward and again for its backward, the next block's gather beside this
  block's compute, and its gradients reduce-scattered (in float32) beside the previous
  block's backward, so that the shards accumulate; the root's (what the blocks leave)
  gathered at the start and reduced at the end; HSDP's all-reduce of each shard over the
  replicas only in the last micro-batch's backward. A pipeline's sharded part is gathered
  once a step and reduced once, after its last backward, the compute waiting for it
  (torch's REDUCE_GRAD action: FSDP2's finalize_backward waits for the reductions);
- DDP: the gradients all-reduced in buckets as backward makes them, exposed where they
  outlast it (the last bucket at least);
- a pipeline: each micro-batch's activations sent on and their gradients back at every
  cut, exposed; its schedule's own time a micro-batch's pass where a CPU pays it
  (Rates.stage_s); its idle slots (schedules.bubble); its replicas' gradient
  all-reduce once a step, in buckets, each part's from its last backward on (those of a
  schedule that adds its weight gradients by hand after the flush); and a tied
  embedding's, between the first and the last stage's ranks where they differ (each
  holds a copy: parallel/tied.py).
The optimizer's step moves each state once (a fused kernel's bytes) at the memory's
bandwidth.

Memory: the training state a rank holds (weights, gradients and optimizer state in
precision.state_dtype, float32 unless asked, sharded by FSDP2, cut by tensor and pipeline
parallel; a pipeline's sharded gradients only after its flush), FSDP2's gathered weights (this block's and the next
one's) and a block's whole gradient as it is reduced, in precision.reduce_dtype (a
pipeline part's weights and gradients all, till the flush), the activations each block
keeps for backward
times the micro-batches the schedule holds at once, and the peak of temporaries the
traced step reached beyond them (the loss's logits and their gradients).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from parallab.parallel.layout import Layout
from parallab.simulate import experts, float8
from parallab.simulate.cluster import Group, Rates
from parallab.simulate.costs import Costs
from parallab.simulate.experts import Split
from parallab.simulate.trace import Trace

# bytes a fused optimizer kernel reads and writes per element: weight, gradient and each
# state read, weight and each state written (float32; half of it in bfloat16)
OPTIMIZER_BYTES = {"adam": 28, "adamw": 28, "sgd_momentum": 20, "sgd": 12}
STATE_BYTES = {"adam": 8, "adamw": 8, "sgd_momentum": 4, "sgd": 0}  # per element, besides


@dataclass(frozen=True)
class Run:
    """What prices a step besides its layout (a parallel.Layout): the run's config, as
    the step model needs it."""

    seq_len: int = 1024
    compile: bool = False
    optimizer: str = "adamw"
    compute_bytes: int = 2  # a gathered weight's element (the compute dtype)
    reshard_after_forward: bool = True
    clip: bool = False
    bucket_mb: float = 25.0  # DDP's parallel.bucket_cap_mb
    tf32: bool = False  # float32 matmuls on TF32 tensor cores (precision.tf32)
    split: tuple[int, ...] | None = None  # a pipeline's cuts as parallel.split gives them
    experts: Split = Split()  # how expert parallelism splits an MoE block's experts
    float8_gathered: bool = False  # FSDP2 gathers the float8 layers' weights in float8
    reduce_bytes: int = 4  # a reduced gradient's element (precision.reduce_dtype)
    # a kept weight's, gradient's and optimizer state's element (precision.state_dtype)
    state_bytes: int = 4


@dataclass
class Prediction:
    step_time_s: float
    tokens_per_sec_per_gpu: float
    memory_per_gpu_gb: float
    mfu: float
    parts: dict[str, float] = field(default_factory=dict)
    memory: dict[str, float] = field(default_factory=dict)  # GiB by kind


@dataclass(frozen=True)
class Load:
    """What a pipeline rank holds: its blocks, the ends, its parts."""

    rank: int
    blocks: int
    before: bool  # the embeddings (the model's first stage)
    after: bool  # the head and the loss (its last)
    parts: int = 1

    @property
    def ends(self) -> list[str]:
        return [r for r, held in (("before", self.before), ("after", self.after)) if held]


def loads(blocks: int, layout: Layout, params: dict[str, float],
          split: tuple[int, ...] | None = None) -> list[Load]:
    """Each rank's load: without a pipeline, everything; with one, the model's stages (the
    embeddings, each block, the head) cut into pp x v parts where parallel.split cuts
    them, else at an even share of parameters (parallel/split.py's even_cuts), placed as
    the schedule places them (parallel/schedules.py: round-robin, or a V)."""
    from parallab.parallel import schedules
    from parallab.parallel.split import even_cuts

    if layout.pp == 1:
        return [Load(0, blocks, True, True)]
    sizes = [params["before"], *[params["block"]] * blocks, params["after"]]
    cuts = split or even_cuts(sizes, layout.pp * layout.stages_per_rank)
    bounds = [0, *cuts, len(sizes)]
    parts = [range(a, b) for a, b in zip(bounds, bounds[1:])]
    found = []
    for rank in range(layout.pp):
        held = [i for part in schedules.stages_of_rank(layout.schedule, layout.pp,
                                                       layout.stages_per_rank, rank)
                for i in parts[part]]
        found.append(Load(rank, sum(1 for i in held if 0 < i <= blocks), 0 in held,
                          blocks + 1 in held, layout.stages_per_rank))
    return found


def _ends(trace: Trace, load: Load) -> float:
    """Elements of the ends a rank holds: and a tied embedding's copy, on a last stage
    that does not hold the first (the head's weight is the embedding's, counted there)."""
    copy = trace.params.get("tied", 0.0) if load.after and not load.before else 0.0
    return sum(trace.params[r] for r in load.ends) + copy


def _compute(c: Costs, load: Load, phase: str) -> float:
    """A micro-batch's compute on a rank: its blocks', the ends' it holds."""
    return load.blocks * c.compute.get((phase, "block"), 0.0) + sum(
        c.compute.get((phase, region), 0.0) for region in load.ends)


def predict(trace: Trace, c: Costs, layout: Layout, run: Run, rates: Rates, blocks: int,
            flops_per_token: float = 0.0) -> Prediction:
    """The step of `layout` from its traced micro-batch priced on the cluster (`c`:
    costs(trace)); `blocks`: the model's; `flops_per_token`: its training FLOPs, for MFU.
    A pipeline's step is its busiest rank's."""
    c = experts.costs_under(c, c.experts, run.experts)
    ranks = loads(blocks, layout, trace.params, run.split)
    busiest = max(ranks, key=lambda load: _compute(c, load, "forward") +
                  _compute(c, load, "backward"))
    exposed: dict[str, float] = {}

    def expose(kind: str, seconds: float) -> None:
        if seconds > 0:
            exposed[kind] = exposed.get(kind, 0.0) + seconds

    m, k = layout.passes, busiest.blocks
    compute = {phase: _compute(c, busiest, phase) for phase in ("forward", "backward")}
    for phase in ("forward", "backward"):
        for region in ["block", *busiest.ends]:
            times = k if region == "block" else 1
            for kind, seconds in c.collectives.get((phase, region), {}).items():
                expose(f"tp_{kind}", times * seconds * m)
    parts = {"compute_s": m * (compute["forward"] + compute["backward"])}
    recompute = layout.checkpointing != "none"  # the forward's all-to-alls run again
    expose("all_to_all", m * k * experts.all_to_all_s(run.experts, rates, layout.tp,
                                                      layout.pp, recompute))
    _data_parallel(trace, c, layout, run, rates, busiest, compute, expose)
    if layout.pp > 1:  # the sends at each of its parts' cuts, and the schedule's idle slots
        G = rates.gpus_per_node
        hop = Group(2, 2 if Group.of(layout.pp, layout.tp, G).nodes > 1 else 1)
        send = rates.collective_s("p2p", trace.boundary_bytes, hop) * busiest.parts
        expose("p2p", 2 * send * m)
        schedule = rates.stage_s * busiest.parts  # its own time a pass (0 on a GPU: hidden)
        expose("schedule", schedule * m)
        slot = compute["forward"] + compute["backward"] + 2 * send + schedule + sum(
            v for kind, v in exposed.items() if kind.startswith("tp_")) / m
        parts["bubble_s"] = (layout.bubble - 1) * m * slot
    if layout.pp > 1 and trace.params.get("tied") and not any(
            load.before and load.after for load in ranks):
        apart = Group.of(layout.pp, layout.tp, rates.gpus_per_node).nodes > 1
        expose("all_reduce", rates.collective_s(
            "all_reduce", 4 * trace.params["tied"] / layout.dp_shard, Group(2, 1 + apart)))
    held = (k * _stored(trace, run) + _ends(trace, busiest)) / layout.dp_shard
    parts["optimizer_s"] = held * (OPTIMIZER_BYTES[run.optimizer] + 4 * run.clip) / \
        rates.hbm * run.state_bytes / 4
    parts.update({f"{kind}_s": seconds for kind, seconds in sorted(exposed.items())})
    step = sum(parts.values())
    tokens = layout.rows * run.seq_len * m * layout.dp
    memory = max((_memory(trace, layout, run, load) for load in ranks),
                 key=lambda found: sum(found.values()))
    per_gpu = tokens / step / layout.world_size
    peak = rates.half_peak(trace.shape.precision) if run.compute_bytes == 2 else \
        rates.fp32_peak(run.tf32)
    return Prediction(step, per_gpu, sum(memory.values()), per_gpu * flops_per_token / peak,
                      parts, memory)


def _data_parallel(trace: Trace, c: Costs, layout: Layout, run: Run, rates: Rates,
                   busiest: Load, compute: dict[str, float], expose) -> None:
    """FSDP2's gathers and reductions (HSDP's all-reduce with them), or DDP's buckets, as
    they are left exposed beside the busiest rank's compute."""
    k = busiest.blocks
    held_ends = _ends(trace, busiest)
    if layout.dp_shard > 1:
        units = experts.units(trace.params["block"], trace.params.get("experts", 0.0),
                              run.experts, layout.dp_shard)
        _sharded(layout, run, rates, units, held_ends, k, (
            c.seconds("forward", "block"), c.seconds("backward", "block")), expose,
            _gathered_bytes(trace, run))
    elif layout.dp_replicate > 1:
        r = layout.dp_replicate
        replicas = Group.of(r, layout.tp * layout.pp, rates.gpus_per_node)
        grads = (k * _stored(trace, run) + held_ends) * run.reduce_bytes
        buckets = max(1, math.ceil(grads / (run.bucket_mb * 2**20)))
        one = rates.collective_s("all_reduce", 2 * (r - 1) / r * grads / buckets, replicas)
        if layout.pp > 1:  # beside the first rank's last backwards
            expose("all_reduce", _settling(layout, one, buckets,
                                           compute["backward"] / busiest.parts, rates))
        else:
            expose("all_reduce", max(one, rates.hidden(one * buckets, compute["backward"])))


def _settling(layout: Layout, bucket_s: float, buckets: int, backward: float,
              rates: Rates) -> float:
    """What of a pipeline rank's replicas' all-reduce (`buckets` of `bucket_s` seconds)
    outlasts its compute (parallel/replicas.py): each part's buckets start as its last
    backward (`backward` seconds, a part's of a micro-batch) makes their gradients, that
    backward the schedule's settled slots before the end, one bucket at a time on the
    links; the zero-bubble schedules' all after the flush."""
    from parallab.parallel.schedules import SCHEDULES

    settled = SCHEDULES[layout.schedule].settled(layout.pp, layout.stages_per_rank,
                                                 layout.microbatches)
    if settled is None or rates.overhead_adds:
        return bucket_s * buckets
    each = max(1, math.ceil(buckets / len(settled)))  # a part's buckets
    seconds = bucket_s * buckets / (each * len(settled))
    end = -math.inf  # the links' last bucket's end, from the compute's (0)
    for slots in sorted(settled, reverse=True):  # the part done first, first
        for i in range(1, each + 1):
            end = max(end, -slots * backward - backward * (1 - i / each)) + seconds
    return max(end, 0.0)


def _sharded(layout: Layout, run: Run, rates: Rates, units: list[tuple[float, int]],
             held_ends: float, k: int, block: tuple[float, float], expose,
             element: float) -> None:
    """FSDP2 over dp_shard ranks (HSDP: and dp_replicate replicas) of `k` blocks, each of
    its units (`units`: elements gathered whole, ranks sharding them: experts.units) and
    the root unit (`held_ends`: what the blocks leave), `block`'s forward and backward
    seconds beside them; a block's weights gathered in `element` bytes each."""
    r, m, inner = layout.dp_replicate, layout.passes, layout.tp * layout.pp

    def collectives(params: float, n: int, element: float = run.compute_bytes
                    ) -> tuple[float, float, float]:
        """A unit's gather (compute dtype), reduce-scatter and replicas' all-reduce (the
        reduce dtype)."""
        shard = Group.of(n, inner, rates.gpus_per_node)
        replicas = Group.of(r, layout.dp_shard * inner, rates.gpus_per_node)
        reduced = params * run.reduce_bytes
        return (rates.collective_s("all_gather", (n - 1) / n * params * element, shard),
                rates.collective_s("reduce_scatter", (n - 1) / n * reduced, shard),
                rates.collective_s("all_reduce", 2 * (r - 1) / r * reduced / n, replicas))

    gather, scatter, reduce = (sum(each) for each in zip(*(collectives(*u, element)
                                                            for u in units)))
    # every micro-batch's forward gathers (FSDP2 reshards after each backward), the next
    # block's beside this one's compute; a pipeline's part once a pass of its schedule,
    # kept till its flush, its gradients kept whole till then and reduced (torch's stages
    # reshard and reduce, the replicas' all-reduce too, at every flush: an accumulated
    # pass's as well)
    passes = m if layout.pp == 1 else layout.accumulation
    expose("all_gather", passes * (gather + (k - 1) * rates.hidden(gather, block[0])))
    if layout.pp > 1:  # a part's reductions once its last backward is done, waited for
        # by the compute (torch's REDUCE_GRAD action, FSDP2's finalize_backward)
        expose("reduce_scatter", passes * k * (scatter + reduce))
    else:  # beside the backward (again: its gathers, where freed after the forward)
        again = gather if run.reshard_after_forward else 0.0
        _beside_backward(passes, k, again, scatter, reduce, block[1], rates, expose)
    # FSDP2's hooks around each unit (the blocks and the root), forward and backward
    expose("fsdp_hooks", m * (k * len(units) + 1) * rates.fsdp_unit_s)
    root_gather, root_scatter, root_reduce = collectives(held_ends, layout.dp_shard)
    expose("all_gather", passes * root_gather)
    # the replicas' all-reduce of the root: the last pass's where the mesh's no_sync holds
    # it back (parallel/mesh.py), every flush's in a pipeline
    expose("reduce_scatter", passes * root_scatter +
           (passes if layout.pp > 1 else 1) * root_reduce)


def _beside_backward(passes: int, k: int, again: float, scatter: float, reduce: float,
                     backward: float, rates: Rates, expose) -> None:
    """Each pass's backward gathers (`again`) and reductions (the replicas' `reduce` only
    in the last) share the links beside each of the `k` blocks' `backward`; the first
    block's reduction is left after it."""
    for times, reduced in ((passes - 1, scatter), (1, scatter + reduce)):
        beside = rates.hidden(again + reduced, backward)
        share = again / (again + reduced) if again + reduced else 0.0
        expose("all_gather", times * k * beside * share)
        expose("reduce_scatter", times * (reduced + (k - 1) * beside * (1 - share)))


def _gathered_bytes(trace: Trace, run: Run) -> float:
    """Bytes of a gathered block weight's element: float8.gathered_bytes."""
    share = trace.params.get("float8", 0.0) / trace.params["block"] \
        if run.float8_gathered and trace.params["block"] else 0.0
    return float8.gathered_bytes(run.compute_bytes, share)


def _stored(trace: Trace, run: Run) -> float:
    """Elements of a block a rank keeps before FSDP2 shards them (experts.stored)."""
    return experts.stored(trace.params["block"], trace.params.get("experts", 0.0),
                          run.experts)


def _memory(trace: Trace, layout: Layout, run: Run, load: Load) -> dict[str, float]:
    """GiB the rank of `load` holds at the step's peak, by kind (see the module's
    docstring)."""
    from parallab.parallel import schedules

    block = _stored(trace, run)
    held_ends = _ends(trace, load)
    held = (load.blocks * block + held_ends) / layout.dp_shard
    # a pipeline's sharded parts reduce their gradients at the flush, when its activations
    # are gone: till then the float32 shards are not there (zero_grad sets them to None)
    grads = 0 if layout.pp > 1 and layout.dp_shard > 1 else 1
    state = held * (1 + grads + STATE_BYTES[run.optimizer] / 4) * run.state_bytes
    gathered = 0.0
    if layout.dp_shard > 1:  # this block's and the next one's weights (every block's where
        # they stay gathered from the forward) and the root's; of its experts, this rank's
        # ep share
        block = sum(elements for elements, _ in experts.units(
            trace.params["block"], trace.params.get("experts", 0.0), run.experts,
            layout.dp_shard))
        blocks_held = 2 if run.reshard_after_forward else load.blocks
        gathered = blocks_held * block * _gathered_bytes(trace, run) + \
            held_ends * run.compute_bytes
        if layout.pp > 1:  # a part's gradients whole till the flush, in the reduce dtype
            gathered += (load.blocks * block + held_ends) * run.reduce_bytes
        else:  # a block's as it is reduced; the root's in the compute dtype, as much of it
            # as the traced step had made at its peak (a head's backward follows the loss's)
            gathered += block * run.reduce_bytes + trace.ends_grads / 4 * run.compute_bytes
    saved = trace.saved_compiled if run.compile else trace.saved

    def held(by_region: dict[str, float]) -> float:
        return load.blocks * by_region.get("block", 0.0) + sum(by_region.get(r, 0.0)
                                                               for r in load.ends)

    in_flight = 1.0 if layout.pp == 1 else schedules.activations_held(
        layout.schedule, layout.pp, layout.stages_per_rank, layout.microbatches, load.rank)
    # autocast's copies of weights: one a step, its cache every pass's (compiled, the
    # partitioner makes them again in backward, a memory-bound op, not kept)
    casts = 0.0 if run.compile else held(trace.casts)
    kept = held(saved) - casts
    if run.state_bytes == run.compute_bytes:  # weights kept in the compute dtype: no copy
        casts = 0.0
    eager = sum(trace.saved.values())
    # (blend stores its peak as what goes beyond the eager saved bytes plus them: this
    # subtraction is what it counts on)
    temporary = max(0.0, trace.peak_transient - eager) if load.after else 0.0
    return {name: value / 2**30 for name, value in (
        ("state", state), ("gathered", gathered), ("activations", in_flight * kept + casts),
        ("temporary", temporary))}
