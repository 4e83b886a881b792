"""Memory per rank, predicted before anything runs and measured the same way in a run.

The prediction lays the candidate out as a worker would (the runtime's split, activation
checkpointing, wrap, the optimizer and one step of it), but on fake tensors (torch's
FakeTensorMode) under torch's fake process group, as rank r of the candidate's world size:
no memory is allocated, no collective runs, and the shapes are exactly a worker's. From it:
the training state the rank holds (memory.held_state_mb: its parameters, gradients and
optimizer state) and the activations one training step keeps for backward
(activations.saved_for_backward over a forward and backward of one micro-batch). A run
measures the same two figures on its real second step (measure.ActivationCounter).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from torch import nn

from parallab import batch as batches
from parallab.launching.distributed import fake_group
from parallab.observe.comm import MB
from parallab.observe.memory import held_state_mb
from parallab.optim import build_optimizer
from parallab.parallel.activations import saved_for_backward
from parallab.parallel.parallelize import parallelize, speed_up


def fake_model(cfg, fake, device: torch.device) -> nn.Module:
    """The candidate's model (with its adapters) on fake tensors of `fake`, a FakeTensorMode;
    the wrappers and the mesh, built outside it, read real tensors."""
    from parallab.models import adapters, build_model, build_on_meta

    if not adapters.enabled(cfg.adapter):
        with fake:
            return build_model(cfg.model, cfg.trainer.fused_norms)
    # peft moves each adapter to its layer's device, which a fake parameter refuses: the
    # adapters go on the model on meta, given fake storage after
    model = adapters.apply(build_on_meta(cfg.model, cfg.trainer.fused_norms), cfg.adapter)
    with fake:
        return model.to_empty(device=device)


def predict(cfg, layout, batch: Any, rank: int) -> tuple[float, float]:
    """(state MB, activation MB) rank `rank` of the candidate `cfg` (checked, resolved)
    would hold, from fake tensors: `batch` is one real micro-batch of the data."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from parallab.launching.distributed import Dist
    from parallab.loss import build_loss
    from parallab.precision import Precision

    from parallab.models.experts import uniform_routing

    world = layout.world_size
    device = torch.device("cuda" if cfg.device.value == "cuda" else "cpu")
    fake = FakeTensorMode(allow_non_fake_inputs=True)
    # an MoE layer's router picks from values fake tensors do not have: each expert an even
    # share of the tokens (as simulate traces it)
    with fake_group(world, rank), uniform_routing():
        dist = Dist(rank, rank, world, world, device, "fake")
        # DDP's hook is _reduce_locally's, which takes no other (a cast copy of a bucket,
        # a moment's, is not counted)
        kept = dataclasses.replace(cfg.precision, reduce_dtype=cfg.precision.state_dtype) \
            if layout.replicas_only else cfg.precision
        precision = Precision(kept, device)
        # the mesh and wrappers are built outside; converted before the runtime, as train
        # converts it (a pipeline's runtime records the modules it cuts)
        model = precision.convert(fake_model(cfg, fake, device))
        runtime = layout.plan.runtime(cfg.parallel, layout, dist, precision,
                                      build_loss(cfg.loss).bind(model), model)
        # cloned: a batch sliced from a data set held in memory is a view of all of it
        batch = batches.apply(batch, lambda t: fake.from_tensor(t.clone()))
        if runtime.layout.cuts_model:
            return _predict_part(cfg, runtime, model, batch, precision)
        model = parallelize(model, runtime, cfg.trainer, cfg.parallel.stages)
        _reduce_locally(model)
        optimizer = build_optimizer(cfg.optim, model)
        with saved_for_backward(model) as saved:
            runtime.forward_backward(model, batch, 1)  # (the loss's scale)
            activations = saved()
        optimizer.step()  # its state, laid out like the parameters
        return held_state_mb(model, optimizer), activations / MB


def _reduce_locally(model: nn.Module) -> None:
    """DDP's all-reduce hook expects the reduced bucket back, which the fake group does not
    give: each bucket stays as it is (the memory is the same)."""
    from torch.nn.parallel import DistributedDataParallel

    def local(_, bucket):
        future = torch.futures.Future()
        future.set_result(bucket.buffer())
        return future

    if isinstance(model, DistributedDataParallel):
        model.register_comm_hook(None, local)


def _predict_part(cfg, runtime, model: nn.Module, batch: Any, precision
                  ) -> tuple[float, float]:
    """A pipeline rank: its parts of the model (as the runtime keeps them), the optimizer
    over them, and its parts' activations for one micro-batch, times the micro-batches it
    holds at once (its schedule's), plus one copy of its parameters' autocast casts. The
    stage-to-stage exchange needs real shapes, which the fake group does not pass on, so the
    earlier parts run here to give each of its parts its input."""
    p, cut = cfg.parallel, runtime.cut
    micro = batches.take(batch, batches.rows(batch) // p.microbatches)
    with precision.autocast():
        received = cut.inputs(batches.inputs_of(micro))
    model = speed_up(runtime.part(model), cfg.trainer, p.stages)
    optimizer = build_optimizer(cfg.optim, model)
    loss, targets = runtime.loss, batches.labels_of(micro)
    with saved_for_backward(model) as saved:
        for k, part, (args, kwargs) in zip(cut.held, runtime.runs(model), received):
            with precision.autocast():
                out = part(*args, **kwargs)
                out = loss(loss.scored(out), targets) if k == len(cut.ranges) - 1 else \
                    out.float().sum()
            out.backward()
    activations = saved.held(p.microbatches * runtime.activation_share)
    optimizer.step()
    return held_state_mb(model, optimizer), activations / MB
