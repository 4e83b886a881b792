"""The step-time model's parts, measured on this machine by a launched job's ranks
(advise/scaling.py's validate() adds them up): each candidate's compute share, its layout's
own work over a one-rank group; and what its collectives add to a replay of its step, where
ranks that share cores also wait for each other to be scheduled.
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from typing import Any, Callable

import torch

from parallab.launching import distributed
from parallab.observe.comm import KINDS, MB
from parallab.precision import Precision
from parallab.training import run


def max_over_ranks(dist: distributed.Dist, value: float) -> float:
    return dist.all_reduce_max(torch.tensor([value], dtype=torch.float64,
                                            device=dist.device)).item()


def _alone(model: torch.nn.Module, spec: run.RunSpec, dist: distributed.Dist, one, loss,
           precision: Precision) -> tuple[torch.nn.Module, bool]:
    """`model` laid out as parallelize() lays out the candidate's (tensor parallel, then
    activation checkpointing, then FSDP2 in `precision`'s dtypes, or DDP), but over the
    one-rank group `one`: the layout's own work (FSDP2's copies and hooks, DTensor's
    dispatch per op, DDP's buckets, recomputation), no peer; and whether its logits stay
    cut by vocabulary, as the trainer leaves them for `loss`. A pipeline's parts
    (_own_parts) are run by a schedule (_forward_backward). Not compiled: that would be a
    second compile per candidate."""
    from torch.distributed.device_mesh import DeviceMesh

    from parallab.parallel import tp_plans
    from parallab.parallel.fsdp import mixed_precision, shard
    from parallab.parallel.parallelize import speed_up

    cfg, layout, p = spec.cfg, spec.layout, spec.cfg.parallel
    cut = layout.processes and not layout.cuts_model
    mesh = DeviceMesh.from_group([one, one], dist.device.type, mesh=[[dist.rank]],
                                 mesh_dim_names=("dp_shard", "tp")) if layout.sharded and cut \
        else None
    sharded = False
    if cut and layout.tp > 1:
        sharded = tp_plans.split(model, mesh["tp"], p.tp_plan or None, p.sequence_parallel,
                                 loss, regather=p.regather_in_backward)
    model = speed_up(model, dataclasses.replace(cfg.trainer, compile=False), p.stages)
    if cut and layout.replicas_only:
        from torch.nn.parallel import DistributedDataParallel

        return DistributedDataParallel(model, process_group=one,
                                       bucket_cap_mb=p.bucket_cap_mb,
                                       find_unused_parameters=p.find_unused_parameters,
                                       gradient_as_bucket_view=p.gradient_as_bucket_view), False
    if cut:
        policy = mixed_precision(precision.dtype, precision.reduce_dtype)
        shard(model, mesh["dp_shard"], p, policy, False, p.reshard_after_forward)
    return model, sharded


def _own_parts(model: torch.nn.Module, spec: run.RunSpec, dist: distributed.Dist,
               inputs: Any, precision):
    """Keep this rank's parts of a pipeline's model, as parallel/pipeline.py cuts it (its
    other stages nn.Identity); the cut, and what each of its parts receives for `inputs`:
    the batch through the parts before it."""
    from parallab.parallel.split import Cut

    cut = Cut(model, spec.cfg.parallel, spec.layout, spec.layout.part_of(dist.rank))
    with precision.autocast():
        received = cut.inputs(inputs)
    cut.keep(model)
    return cut, received


def _forward_backward(model: torch.nn.Module, spec: run.RunSpec, loss, precision,
                      dist: distributed.Dist, one, cut=None, sharded: bool = False
                      ) -> Callable[[Any], None]:
    """A rank's forward and backward of one batch: each pipeline part it holds (of `cut`)
    through a schedule of one stage over the one-rank group `one` (the schedule's work
    per micro-batch, no sends; a batch: what each part receives); any other layout's as the
    trainer's step runs it (`sharded`: its loss over logits cut by vocabulary)."""
    from parallab import batch as batches
    from parallab.parallel import tp_plans

    p = spec.cfg.parallel
    if not spec.layout.cuts_model:
        def step(batch: Any) -> None:
            with tp_plans.loss_context(sharded):
                with precision.autocast():
                    value = loss.step_loss(model, batch, None)[1]
                value.backward()
        return step
    import torch.distributed.pipelining as pipelining

    from parallab.parallel.schedules import SCHEDULES

    # one stage: the run's schedule where it holds one, 1F1B's order of the same work else
    one_stage = SCHEDULES[p.schedule if not SCHEDULES[p.schedule].multi else "1f1b"]
    # a part's output before the last is an activation, not a score: a scalar of it to run
    # backward from (the last part's loss costs the same order)
    schedules = [getattr(pipelining, one_stage.torch_class)(
        pipelining.PipelineStage(part, 0, 1, dist.device, group=one),
        n_microbatches=p.microbatches, scale_grads=False,
        loss_fn=lambda output, target: output.float().square().mean())
        for part in cut.parts(model)]

    def piped(received: list) -> None:
        for schedule, (args, kwargs) in zip(schedules, received):
            # its only stage is the last: the schedule wants a target, which the scalar ignores
            target = torch.zeros(batches.rows(args or kwargs), device=dist.device)
            with precision.autocast():
                schedule.step(*args, **kwargs, target=target)
    return piped


def _step_times(step: Callable[[Any], None], batch: Any, optimizer, accumulate: int,
                steps: int, together: bool) -> list[float]:
    """Each of `steps` optimizer steps' time over `batch` (after one more: allocation,
    kernel choice, a schedule's shapes); `together`: every rank starts each step at once,
    as the run's ranks do."""
    import torch.distributed as torch_dist

    times = []
    for _ in range(steps + 1):
        if together:
            torch_dist.barrier()
        start = time.perf_counter()
        for _ in range(accumulate):
            step(batch)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - start)
    return times[1:]


def _by_part(times: list[float], layout, together: bool) -> list[float]:
    """Each part's step from every rank's `times` (one part but in a pipeline): with its
    ranks together, the median over steps of the slowest rank's step (a step waits for
    it); each alone, the slowest rank's median."""
    import torch.distributed as torch_dist

    each: list[Any] = [None] * torch_dist.get_world_size()
    torch_dist.all_gather_object(each, times)
    ranks = [[r for r in range(len(each)) if layout.part_of(r) == part]
             for part in range(layout.pp)]
    if together:
        return [statistics.median(max(each[r][i] for r in mine) for i in range(len(times)))
                for mine in ranks]
    return [max(statistics.median(each[r]) for r in mine) for mine in ranks]


def share_s(spec: run.RunSpec, dist: distributed.Dist, one, steps: int = 5) -> dict[str, Any]:
    """One rank's share of the candidate's step on this machine: its model in its
    precision, laid out over a one-rank group (_alone), on global batch / n rows (the
    FLOPs a rank does) in its accumulation's micro-batches, forward, backward and the
    optimizer, nothing crossing ranks. Every rank at once, each step the slowest rank's,
    the median of `steps` (`share_s`): on a CPU the ranks' threads and the layout's own
    work per op, not the FLOPs, decide it. A pipeline's, by part (its replica's rows
    through its schedule, _own_parts): all ranks at once (`share_s`, its schedule's full
    slots) and each rank alone (`share_alone_s`, the slots its bubble leaves part-empty:
    scaling.pipeline_s)."""
    import torch.distributed as torch_dist

    from parallab import batch as batches
    from parallab.checks import trial
    from parallab.loss import build_loss
    from parallab.models import build_model
    from parallab.optim import build_optimizer

    cfg, layout = spec.cfg, spec.layout
    torch.manual_seed(cfg.seed)
    precision = Precision(cfg.precision, dist.device)
    model = precision.convert(build_model(cfg.model, cfg.trainer.fused_norms)).to(dist.device)
    accumulate = cfg.trainer.accumulate_grad_batches
    micro, parts = (cfg.parallel.microbatches, layout.pp) if layout.cuts_model else (1, 1)
    rows = max(1, cfg.data.global_batch_size // (dist.world_size // parts) // accumulate
               // micro) * micro
    batch = batches.apply(trial.one_batch(cfg, rows), lambda t: t.to(dist.device))
    cut = None
    if layout.cuts_model:
        cut, batch = _own_parts(model, spec, dist, batches.inputs_of(batch), precision)
    loss = build_loss(cfg.loss)
    model, sharded = _alone(model, spec, dist, one, loss, precision)
    loss = loss.bind(model)
    optimizer = build_optimizer(cfg.optim, model)
    step = _forward_backward(model, spec, loss, precision, dist, one, cut, sharded)
    together = _by_part(_step_times(step, batch, optimizer, accumulate, steps, True),
                        layout, True)
    if not layout.cuts_model:
        return {"share_s": together[0]}
    mine: list[float] = []
    for rank in range(dist.world_size):
        torch_dist.barrier()
        if rank == dist.rank:
            mine = _step_times(step, batch, optimizer, accumulate, steps, False)
    return {"share_s": together,
            "share_alone_s": _by_part(mine, layout, False)}


def _collective(kind: str, sent: float, n: int, device: torch.device, group,
                overlapped: bool = False):
    """A call of `kind` over `group`, of `n` ranks, sending `sent` bytes from each (comm.py's
    count). A gather's output is copied out and a scatter's input copied in, as FSDP2 does
    with each parameter and gradient, and as it does not over one rank (the share's).
    `overlapped`: an all-reduce started and left running, its work returned to be waited
    for at the step's end, as DDP's bucket all-reduces run beside the rest of backward."""
    import torch.distributed as torch_dist

    def ones(numel: float, times: int = 1) -> torch.Tensor:
        return torch.ones(max(1, round(numel)) * times, device=device)

    # torch 2.14 renames the tensor forms *_single, warning at each call of the old names
    if kind == "all_gather":
        gather = getattr(torch_dist, "all_gather_single", None) or \
            torch_dist.all_gather_into_tensor
        shard = ones(sent / (n - 1) / 4)
        out, held = ones(shard.numel(), n), ones(shard.numel(), n)
        return lambda: (gather(out, shard, group=group), held.copy_(out))
    if kind == "reduce_scatter":
        scatter = getattr(torch_dist, "reduce_scatter_single", None) or \
            torch_dist.reduce_scatter_tensor
        out = ones(sent / (n - 1) / 4)
        full, grads = ones(out.numel(), n), ones(out.numel(), n)
        return lambda: (full.copy_(grads), scatter(out, full, group=group))
    if kind == "broadcast":
        tensor = ones(sent / ((n - 1) / n) / 4)
        return lambda: torch_dist.broadcast(tensor, group=group, group_src=0)
    if kind == "all_to_all":  # expert parallelism's tokens, even splits
        tokens = ones(sent / ((n - 1) / n) / 4 / n, n)
        out = torch.empty_like(tokens)
        return lambda: torch_dist.all_to_all_single(out, tokens, group=group)
    tensor = ones(sent / (2 * (n - 1) / n) / 4)
    return lambda: torch_dist.all_reduce(tensor, group=group, async_op=overlapped)


def collectives_s(dist: distributed.Dist, figures: dict[str, Any], compute_s: float,
                  groups: dict[int, Any], overlapped: tuple[str, ...] = (),
                  repeats: int = 3) -> float:
    """What the candidate's collectives and a pipeline's sends add to its step, every
    rank computing: its step replayed, `compute_s` of busy work cut into as many pieces as
    it called them, each piece followed by one of them (each call its kind's share of the
    kind's bytes, over groups of its size: `groups`, made as needed; a send an all-reduce
    over a pair), against the same work unbroken; the median of `repeats`,
    the slowest rank's. Where ranks share cores, a collective also waits for each rank of
    its group to be scheduled again, a cost that depends on the compute around it: one
    collective timed back to back and the bandwidth of one large one do not see it. The
    kinds in `overlapped` (the layout's plan's overlapped_kinds: DDP's
    all-reduce) run beside the rest of the replay and are waited for at its end."""
    import torch.distributed as torch_dist

    # a pipeline's send as an all-reduce of its bytes within a pair of ranks: like a send
    # meeting its receive, it waits for both to run (a replayed isend and irecv exchange,
    # each rank's posted at once, waits for neither, and measured pipelines slower)
    counts = [(kind, int(figures.get(f"comm_{kind}_calls") or 0),
               (figures.get(f"comm_{kind}_mb") or 0.0) * MB,
               2 if kind == "p2p" else int(figures.get(f"comm_{kind}_ranks") or
                                           dist.world_size))
              for kind in KINDS]
    shared = [counts]
    torch_dist.broadcast_object_list(shared, src=0)  # every rank replays rank 0's calls
    for *_, ranks in shared[0]:  # every rank makes the same groups, in the same order
        if ranks not in groups:
            groups[ranks] = torch_dist.new_subgroups(group_size=ranks)[0]
    # one call of each kind, made once; its calls spread evenly over the step
    call_of = {kind: _collective(kind, sent / calls, ranks, dist.device, groups[ranks],
                                 kind in overlapped)
               for kind, calls, sent, ranks in shared[0] if calls}
    plan = [call_of[kind] for _, kind in sorted(
        ((i + 0.5) / calls, kind) for kind, calls, *_ in shared[0] for i in range(calls))]
    if not plan:
        return 0.0
    a = torch.randn(64, 64, device=dist.device)
    torch_dist.barrier()
    start = time.perf_counter()
    for _ in range(50):
        a @ a
    pieces = max(1, round(compute_s / len(plan) / ((time.perf_counter() - start) / 50)))

    def replay(communicate: bool) -> float:
        torch_dist.barrier()
        start = time.perf_counter()
        running = []
        for call in plan:
            for _ in range(pieces):
                a @ a
            if communicate:
                running.append(call())
        for work in running:
            if isinstance(work, torch_dist.Work):
                work.wait()
        torch_dist.barrier()
        return time.perf_counter() - start

    extra = [replay(True) - replay(False) for _ in range(repeats)]
    return max(0.0, max_over_ranks(dist, statistics.median(extra)))
