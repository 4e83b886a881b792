"""`parallab simulate`: memory and tokens/s per GPU of a layout on a cluster parallab does
not have, or of every layout at that GPU count ranked (parallel=auto), from the model laid
out on fake tensors.

The model is built once on meta: its facts (blocks, heads, the tensor-parallel plan, the
stages a pipeline cuts) come from there. Each distinct shape a rank computes (its
tensor-parallel degree, micro-batch, sequence, activation checkpointing) is traced once,
on one block (trace.py); each candidate's step is composed from its trace on the cluster's
rates (step.py), so the 405B model's whole grid at 16,384 GPUs costs a handful of traces.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from dataclasses import dataclass, field
from typing import Any

from torch import nn

from parallab.config.errors import ConfigError, refuse
from parallab.parallel import options_of
from parallab.parallel.layout import Layout
from parallab.simulate import cluster as clusters
from parallab.simulate import costs, experts, step, trace
from parallab.parallel.grid import Candidate

log = logging.getLogger("parallab")


@dataclass
class Facts:
    """What the model says of itself, read once from it on meta."""

    cfg: Any
    model: nn.Module  # on meta; cut() leaves its first block alone in it
    block: str  # the kept block's name, once cut
    blocks: int
    vocab: int
    flops_per_token: float
    chain: list[nn.Module] | None  # its stages (a pipeline's cut points), where it has them,
    # kept whole when cut() cuts the model
    params: float  # elements of the model's parameters
    takes_sequence_parallel: bool
    checkpoint_problem: str | None  # why activation checkpointing cannot wrap its units
    mix: experts.Mix | None = None  # its mixture of experts (None: dense)
    dense_model: nn.Module | None = None  # a mixture's, cut to its first dense block
    dense_block: str = ""
    _tp: dict[int, str | None] = field(default_factory=dict)
    _shared: dict[tuple[int, int], str | None] = field(default_factory=dict)
    _sp: dict[int, str | None] = field(default_factory=dict)

    @classmethod
    def of(cls, cfg) -> "Facts":
        from parallab.models import build_on_meta
        from parallab.observe import mfu
        from parallab.parallel import activations, tp_plans
        from parallab.parallel import stages as stages_of

        from parallab.models import hf

        model = build_on_meta(cfg.model, cfg.trainer.fused_norms)
        problem = hf.positions_problem(model, cfg.data)  # as train's trial refuses it
        if problem:
            raise ConfigError(problem)
        blocks = trace.blocks_of(model, cfg.parallel.stages)
        if len(blocks) < 1:
            raise ConfigError(f"model {type(model).__name__} declares no repeated blocks for "
                              "parallab simulate to trace (a transformers model's "
                              "_no_split_modules, a stages() method, or parallel.stages)")
        stages = stages_of.chain(model, cfg.parallel.stages)
        given = options_of(cfg.parallel).tp_plan
        return cls(cfg, model, "", len(blocks), vocab_of(model, cfg),
                   mfu.flops_per_token(model, cfg.data.seq_len),
                   stages or None,
                   float(sum(p.numel() for p in model.parameters())),
                   tp_plans.takes_sequence_parallel(model, given),
                   activations.units_problem(model, cfg.parallel.stages),
                   experts.mix_of(model, blocks))

    @property
    def stages(self) -> int | None:
        """How many stages a pipeline may cut the model at (None: it declares none)."""
        return len(self.chain) if self.chain else None

    def split_problem(self) -> str | None:
        """None unless parallel.split cuts a chain simulate does not lay out as its stages
        (step.loads: the embeddings, each block, the head)."""
        split = options_of(self.cfg.parallel).split
        if not split or self.stages == self.blocks + 2:
            return None
        return (f"parallel.split={list(split)}: parallab simulate cuts a model whose stages "
                f"are its embeddings, each block and its head, where this one has "
                f"{self.stages} stages for {self.blocks} blocks: leave parallel.split out")

    def tp_problem(self, tp: int) -> str | None:
        from parallab.parallel.mesh import tp_problem

        if tp == 1:
            return None
        if tp not in self._tp:
            self._tp[tp] = tp_problem(self.model, tp, options_of(self.cfg.parallel).tp_plan)
        return self._tp[tp]

    def sp_problem(self, tp: int) -> str | None:
        from parallab.parallel.mesh import sp_problem

        if tp not in self._sp:  # a transformers model's plan is built to check it
            self._sp[tp] = sp_problem(self.model, self.cfg.data, tp,
                                      options_of(self.cfg.parallel).tp_plan)
        return self._sp[tp]

    def pipeline_problem(self, pp: int) -> str | None:
        if self.stages is None:
            return ("the model declares no stages a pipeline could cut it at (a stages() "
                    "method, or parallel.stages)")
        if pp > self.stages:
            return f"parallel.pp={pp} is more parts than the model's {self.stages} stages"
        return None

    def parts_problem(self, layout: Layout) -> str | None:
        """train's refusal of a pipeline whose rank holds parts sharded apart that share a
        parameter (tied embeddings under dp_shard > 1, several parts a rank)."""
        from parallab.parallel import schedules
        from parallab.parallel.split import part_ranges, refuse_shared_parts

        if layout.dp_shard == 1 or layout.stages_per_rank == 1 or not self.chain:
            return None
        pp, v, schedule = layout.pp, layout.stages_per_rank, layout.schedule
        key = (pp, v, schedule, layout.dp_shard)  # the same for every layout of these parts
        if key not in self._shared:
            try:
                refuse_shared_parts(layout, self.chain, part_ranges(
                    self.chain, pp * v, options_of(self.cfg.parallel).split),
                    lambda part: schedules.rank_of(schedule, pp, v, part))
                self._shared[key] = None
            except ConfigError as error:
                self._shared[key] = str(error)
        return self._shared[key]

    def cut(self) -> None:
        """Keep the first block only (after every check that needs the whole model): of a
        mixture of experts, its first MoE block, and in a copy its first dense one where it
        has dense blocks too."""
        import copy

        blocks = trace.blocks_of(self.model, self.cfg.parallel.stages)
        if self.mix is not None:
            moe, dense = experts.first_of_each(self.model, blocks)
            if dense is not None:
                self.dense_model = copy.deepcopy(self.model)
                index = blocks.index(dense)
                copies = trace.blocks_of(self.dense_model,
                                         self.cfg.parallel.stages)
                self.dense_block = trace.cut_to_one_block(
                    self.dense_model, [copies[index], *copies[:index], *copies[index + 1:]])
            blocks = [moe, *(b for b in blocks if b is not moe)]
        self.block = trace.cut_to_one_block(self.model, blocks)


def rates_of(cluster, world_size: int = 1) -> clusters.Rates:
    """The cluster's rates; this machine's measured (this_machine.py) for ranks sharing its cores
    `world_size` ways, a figure the cluster's YAML gives kept over the measured one."""
    if cluster.gpu != clusters.THIS:
        rates = clusters.Rates.of(cluster)
        held = clusters.per_node(world_size, rates.gpus_per_node)
        return rates if held == rates.gpus_per_node else \
            dataclasses.replace(rates, gpus_per_node=held)
    from parallab.simulate import this_machine

    return this_machine.rates(cluster, world_size)


def vocab_of(model: nn.Module, cfg) -> int:
    config = getattr(model, "config", None)
    return getattr(config, "vocab_size", None) or getattr(getattr(model, "cfg", None),
                                                            "vocab_size", None) or \
        cfg.data.vocab_size


class Traces:
    """Each shape's trace, made once."""

    def __init__(self, cfg, facts: Facts):
        self.cfg, self.facts = cfg, facts
        self.found: dict[trace.Shape, trace.Trace] = {}
        self.costs: dict[tuple, costs.Costs] = {}

    def of(self, shape: trace.Shape, rates: clusters.Rates, compile: bool = False,
           tf32: bool = False, ep: int = 1) -> tuple[trace.Trace, costs.Costs]:
        """The shape's trace (made once), and its ops priced on the cluster (its experts'
        weights a rank's 1/ep of them)."""
        if shape not in self.found:
            facts = self.facts
            model, block = (facts.dense_model, facts.dense_block) if shape.dense else \
                (facts.model, facts.block)
            self.found[shape] = _traced(self.cfg, model, block, facts.vocab, shape)
        key = (shape, rates, compile, tf32, ep)
        if key not in self.costs:
            self.costs[key] = costs.costs(self.found[shape], rates, compile, tf32, ep)
        return self.found[shape], self.costs[key]


def _traced(cfg, model: nn.Module, block: str, vocab: int, shape: trace.Shape) -> trace.Trace:
    """trace.trace; one line where the forward reads its tensors' values (a check of its
    inputs, a size computed from them), which fake tensors do not have."""
    from torch._subclasses.fake_tensor import (
        DataDependentOutputException,
        DynamicOutputShapeException,
    )

    try:
        return trace.trace(cfg, model, block, vocab, shape)
    except (DataDependentOutputException, DynamicOutputShapeException) as error:
        raise ConfigError(f"{type(model).__name__}'s forward reads its tensors' values "
                          f"({getattr(error, 'func', error)}: an assert on them, or a shape "
                          "computed from them), which parallab simulate cannot: it traces a "
                          "step on fake tensors, shapes without values; move the check out "
                          "of the forward to simulate it") from None


def shape_of(cfg, layout: Layout) -> trace.Shape:
    fp8 = cfg.precision.name == "fp8"
    return trace.Shape(layout.tp, layout.sequence_parallel, layout.regather, layout.rows,
                       cfg.data.seq_len,
                       layout.checkpointing, layout.gathered, cfg.precision.name,
                       cfg.precision.fp8_recipe if fp8 else "tensorwise",
                       experts_split=layout.ep > 1 and layout.tp > 1)


def run_of(cfg, layout: Layout, facts: Facts) -> step.Run:
    """What the step model needs of the config besides the layout (a pipeline's cuts
    parallel.split's, where given)."""
    from parallab.precision import compute_dtype, reduce_dtype, state_dtype

    dtype = compute_dtype(cfg.precision.name, "cuda")
    options = options_of(cfg.parallel)
    # a pipeline's sharded parts stay gathered from their forward to their backward (auto's
    # pipelines too)
    reshard = options.reshard_after_forward and layout.pp == 1
    split = experts.Split.of(facts.mix, layout.ep, layout.tp, layout.dp_shard, layout.rows,
                             cfg.data.seq_len, facts.blocks, dtype.itemsize,
                             cfg.simulate.routing)
    return step.Run(cfg.data.seq_len, cfg.trainer.compile, optimizer_of(cfg), dtype.itemsize,
                    reshard, cfg.trainer.clip_grad_norm is not None,
                    options.bucket_cap_mb, cfg.precision.tf32,
                    _split(options.split, layout, facts), split,
                    cfg.precision.name == "fp8" and cfg.precision.fp8_all_gather,
                    reduce_dtype(cfg.precision).itemsize,
                    state_dtype(cfg.precision).itemsize)


def _split(split: tuple[int, ...] | None, layout: Layout, facts: Facts
           ) -> tuple[int, ...] | None:
    if layout.pp == 1 or not split:
        return None
    problem = facts.split_problem()
    if problem:
        raise ConfigError(problem)
    return split


def optimizer_of(cfg) -> str:
    """The optimizer as step.py counts its bytes."""
    name = cfg.optim.name
    return "sgd_momentum" if name == "sgd" and getattr(cfg.optim, "momentum", 0) else name


def predict(cfg, layout: Layout, traces: Traces, rates: clusters.Rates) -> step.Prediction:
    facts = traces.facts
    priced = _block(cfg, shape_of(cfg, layout), traces, rates, layout.ep)
    if facts.dense_model is not None:  # a mixture's dense blocks beside its MoE ones
        dense = _block(cfg, dataclasses.replace(shape_of(cfg, layout), dense=True), traces,
                       rates)
        priced = costs.blend(priced, dense, facts.mix.moe_blocks / facts.blocks)
    return step.predict(*priced, layout, run_of(cfg, layout, facts), rates, facts.blocks,
                        facts.flops_per_token)


def _block(cfg, shape: trace.Shape, traces: Traces, rates: clusters.Rates, ep: int = 1):
    """A block of `shape` traced and priced (its experts ep's share); under
    activation_checkpointing_every, the 1st, the N+1th, ... checkpointed and the others
    not, blended."""
    every = cfg.trainer.activation_checkpointing_every
    priced = traces.of(shape, rates, cfg.trainer.compile, cfg.precision.tf32, ep)
    if every > 1 and shape.checkpointing != "none":
        plain = traces.of(dataclasses.replace(shape, checkpointing="none"), rates,
                          cfg.trainer.compile, cfg.precision.tf32, ep)
        blocks = traces.facts.blocks
        priced = costs.blend(priced, plain, math.ceil(blocks / every) / blocks)
    return priced


def state_gb(layout: Layout, facts: Facts, optimizer: str) -> float:
    """The least a rank of `layout` holds: its share of the float32 weights and gradients
    and the optimizer's states, before any activation."""
    per_element = 8 + step.STATE_BYTES[optimizer]
    routed = facts.mix.params if facts.mix else 0.0  # experts: whole on each tp rank but ep's
    tp, ep = layout.tp, layout.ep
    ep_tp = tp if ep > 1 and tp > 1 else 1
    held = (facts.params - routed) / tp + routed / ep_tp
    return held / (layout.pp * layout.dp_shard) * per_element / 2**30


def rank(candidates: list[Candidate], rates: clusters.Rates) -> list[Candidate]:
    """Those that fit first, fastest first; then those that do not, least memory first;
    then those that cannot run."""
    def key(c: Candidate):
        if c.fits(rates.memory_bytes):
            return (0, -c.prediction.tokens_per_sec_per_gpu)
        return (2, 0.0) if c.memory_gb is None else (1, c.memory_gb)
    return sorted(candidates, key=key)


def refuse_one_process(name: str) -> None:
    """A layout of one process driving several devices (its plan's dims without a process
    a rank: dp, model), which simulate's ranks-and-groups model does not price."""
    from parallab.parallel import PLANS

    plan = PLANS.get(name)
    if plan is not None and plan.dims and not plan.processes:
        raise ConfigError(f"parallel={name} drives several GPUs from one process, which "
                          "parallab simulate does not model: simulate parallel=ddp, fsdp, hsdp, "
                          "tp, fsdp_tp, pipeline or auto")


def refuse_no_sequences(data) -> None:
    if getattr(data, "seq_len", None) is None:
        raise ConfigError(f"{data.said()} holds no sequences (no data.seq_len): parallab "
                          "simulate traces a sequence model's block: use parallab's data=tokens "
                          "(its default) with a language model, or give your data a seq_len")


def trace_key(cfg) -> str:
    """What a trace reads of a config besides its shape: configs alike in it (differing in
    layout, precision or checkpointing) share their traces."""
    import json

    p = cfg.parallel
    return json.dumps([cfg.model, cfg.data.seq_len, cfg.data.vocab_size, cfg.loss, p.stages,
                       options_of(p).tp_plan], sort_keys=True, default=str)


@dataclass
class Predict:
    """simulate's judge of candidates (advise's measurement is the other, parallel/grid.py):
    a candidate's step (`of`: step.Prediction) on the GPUs of `cluster` (a cluster group's
    config, cluster=this included), from its config's traces (`traces`, by trace_key: made
    once) on the cluster's rates at its GPU count (`rates`). With `skim`, a candidate whose
    training state alone is over a GPU's memory is not traced (its memory_mb: that state).
    A cluster config with a bad key is refused when the judge is made, once."""

    cluster: Any
    traces: dict[str, Traces] = field(default_factory=dict)
    rates: dict[int, clusters.Rates] = field(default_factory=dict)
    skim: bool = False

    def __post_init__(self) -> None:
        refuse(clusters.problem(self.cluster))

    def of(self, c: Candidate, world_size: int | None = None) -> step.Prediction:
        """`c`'s step on its own GPU count, or on `world_size` GPUs (its layout grown as
        search.grown grows it: ConfigError where it does not grow so)."""
        from parallab.simulate import search

        refuse_no_sequences(c.cfg.data)
        refuse_one_process(c.cfg.parallel.name)
        layout = (c if world_size is None else search.grown(c, world_size)).layout
        return predict(c.cfg, layout, self._traces(c.cfg), self.rates_at(layout.world_size))

    def judge(self, candidates: list[Candidate]) -> None:
        """Each runnable candidate's prediction (grid.Judge)."""
        for c in (c for c in candidates if c.reason is None):
            floor = state_gb(c.layout, self._traces(c.cfg).facts, optimizer_of(c.cfg))
            if self.skim and floor * 2**30 > self.rates_at(c.layout.world_size).memory_bytes:
                c.memory_mb = (floor * 1024, None)  # cannot fit: not traced
            else:
                c.prediction = self.of(c)

    def rates_at(self, world_size: int) -> clusters.Rates:
        if world_size not in self.rates:
            self.rates[world_size] = rates_of(self.cluster, world_size)
        return self.rates[world_size]

    def _traces(self, cfg) -> Traces:
        key = trace_key(cfg)
        if key not in self.traces:
            facts = Facts.of(cfg)
            facts.cut()
            self.traces[key] = Traces(cfg, facts)
        return self.traces[key]
