"""Step time beyond this machine: a first-order model from what advise measured.

    t(n) = compute(n) + sum over collective kinds of bytes_kind(n) / bandwidth_kind

compute(n): the step's training FLOPs (counted on fake tensors with torch's
FlopCounterMode) shared by the n ranks, at the target GPU's peak (mfu.py's table) times an
assumed utilisation (advise.mfu); a pipeline adds its bubble, (pp - 1) / microbatches.
bytes_kind(n): the bytes a rank sent per step by kind (comm.py), measured at the world size
advise ran, rescaled by the ring factor (g - 1) / g of the data-parallel group size g at n
(the payload, a gradient or parameter shard, stays the same). bandwidth_kind: the
intra-node link while the group fits in one node (advise.gpus_per_node), else the
inter-node one, except for the kinds the layout keeps in a node (Strategy.node_local_kinds:
hsdp's shard collectives; its replicas' all-reduce crosses nodes). A collective's fixed
cost per call is not measured for a target cluster and is left out there; on this machine
each call is replayed (below). Every figure it gives is labelled a prediction.

On this machine, validate() predicts each candidate's step at its launched world size
from the parts its job measured (advise/parts.py): its compute share (its layout's own work
over a one-rank group; a pipeline's through its schedule, where ranks that share cores lend
them in the bubble), what its collectives and sends add to a replay of its step, and the
loop's own time between steps, timed in the run.
"""

from __future__ import annotations

from typing import Any, Callable

from parallab.observe.comm import KINDS, MB


def ring(g: int) -> float:
    return (g - 1) / g if g > 1 else 0.0


def comm_seconds(figures: dict[str, Any], cfg, layout, n: int, gpus_per_node: int,
                 intra_gbps: float, inter_gbps: float) -> float:
    """The step's communication time at world size n (see the module's formula): each
    collective kind's bytes over the link's bandwidth."""
    d_now = layout.dp
    d_then = max(1, d_now * n // cfg.parallel.world_size)
    scale = ring(d_then) / ring(d_now) if ring(d_now) else 1.0
    local = layout.plan.node_local_kinds(cfg)
    seconds = 0.0
    for kind in KINDS:
        megabytes = figures.get(f"comm_{kind}_mb") or 0.0
        gbps = inter_gbps if n > gpus_per_node and kind not in local else intra_gbps
        factor = scale if kind != "p2p" else 1.0
        seconds += megabytes * factor * MB * 8 / (gbps * 1e9)
    return seconds


def step_flops(cfg, batch) -> float:
    """Training FLOPs of one optimizer step at the candidate's global batch: one micro-batch's
    forward and backward on fake tensors (its adapters on), times the micro-batches of a
    step."""
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.utils.flop_counter import FlopCounterMode

    from parallab import batch as batches
    from parallab.advise.memory import fake_model
    from parallab.loss import build_loss

    fake = FakeTensorMode(allow_non_fake_inputs=True)
    # with adapters, the frozen base's weight gradients are not computed, nor counted
    model = fake_model(cfg, fake, torch.device("cpu"))
    with fake:
        loss = build_loss(cfg.loss).bind(model)
        batch = batches.apply(batch, fake.from_tensor)
        with FlopCounterMode(display=False) as counter:
            loss.step_loss(model, batch, 1)[1].backward()
    micro = batches.rows(batch)
    return counter.get_total_flops() * (cfg.data.global_batch_size / micro)


def predict_target(figures: dict[str, Any], cfg, layout, flops: float, options,
                   peak: float) -> float:
    """Predicted step time (s) at advise.target_world_size on the target GPUs."""
    n = options.target_world_size
    compute = flops / n / (peak * options.mfu) * layout.plan.bubble(cfg)
    return compute + comm_seconds(figures, cfg, layout, n, options.gpus_per_node,
                                  options.intra_node_gbps, options.inter_node_gbps)


def pipeline_s(together_s: list[float], alone_s: list[float], ranks: int, micro: int,
               rate: Callable[[int], float]) -> float:
    """A pipeline's compute from each part's step (one per part, each held by ranks / pp
    ranks), measured with every rank computing (`together_s`) and each rank alone
    (`alone_s`): the schedule's micro + pp - 1 slots, each as long as the slowest part
    then busy takes for a micro-batch. A slot where every part computes takes what they
    took together (ranks sharing cores, memory and caches); one its bubble leaves
    part-empty, their time alone at the speed `rate(busy ranks)` leaves a rank. With a
    device per rank, rate is 1 and this is about the bubble, (micro + pp - 1) / micro x
    the slowest part; where ranks share cores, a rank idle in the bubble lends its core
    to the busy ones."""
    pp, total = len(together_s), 0.0
    for slot in range(micro + pp - 1):
        busy = [part for part in range(pp) if 0 <= slot - part < micro]
        if len(busy) == pp:
            total += max(together_s) / micro
        else:
            total += max(alone_s[p] for p in busy) / micro / rate(ranks // pp * len(busy))
    return total


def cpu_rate(cores: int | None, threads: int) -> Callable[[int], float]:
    """The share of its own speed a rank of `threads` threads runs at while `busy` ranks
    compute on `cores` cores (None: a device per rank, always 1)."""
    return lambda busy: 1.0 if cores is None else min(1.0, cores / (busy * threads))


def validate(figures: dict[str, Any], cfg, layout, link, one_rank_step_s: float | None,
             devices: int) -> float | None:
    """This machine's step time at the candidate's world size n, from what its launched job
    measured (`link`: its cores and threads per rank; the figures: its compute share
    `share_s`, a pipeline's by part, together and alone `share_alone_s`; what its
    collectives and sends added to a replay of its step, `collectives_s`; the run's own
    `loop_time_ms`). A layout with a process per rank: its share (a pipeline's parts
    through its schedule, pipeline_s), what its collectives add, and the loop's own time
    between steps (its batch loaded, its loss logged: the meter's figure, timed in the
    run); one process driving n devices: world size 1's step shared by min(n, devices)
    devices (CPU ranks share one set of cores), and its bubble (None where that step was
    not measured)."""
    n = cfg.parallel.world_size
    share = figures.get("share_s")
    if share is None or not layout.processes:
        return one_rank_step_s and one_rank_step_s / min(n, devices) * layout.plan.bubble(cfg)
    if layout.cuts_model:
        share = pipeline_s(share, figures.get("share_alone_s") or share, n,
                           cfg.parallel.microbatches, cpu_rate(link.cores, link.threads))
    return share + (figures.get("collectives_s") or 0.0) + \
        (figures.get("loop_time_ms") or 0.0) / 1e3
