"""parallab simulate: a step on a cluster from one block traced on fake tensors. A block's
FLOPs against hand-computed values, memory at world size 64 against the model laid out on
fake tensors, the cluster presets, the command as a user runs it, and its refusals (an
op's, a collective's and a pipeline's time by hand: test_simulate_costs.py)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from parallab.config.errors import ConfigError
from parallab.parallel.layout import Layout
from parallab.testing import REPO, run_entry

# a gpt whose every weight splits evenly over 64 ranks (FSDP2 pads nothing)
GPT = ["model=gpt", "model.layers=2", "model.heads=4", "model.width=64", "model.context=64",
       "data.seq_len=32", "data.batch_size=2", "optim=adamw"]


def configured(*overrides: str):
    from parallab.commands import compose
    from parallab.config.hydra_app import typed_config

    return typed_config(compose(list(overrides), None, "simulate"), list(overrides))


def traced(shape, *overrides: str, base: list[str] = GPT):
    from parallab.simulate import Facts, trace

    cfg = configured(*base, *overrides)
    facts = Facts.of(cfg)
    facts.cut()
    return trace.trace(cfg, facts.model, facts.block, facts.vocab, shape)


def flops(found, phase: str, region: str, kind: str) -> float:
    return sum(op.flops for op in found.ops
               if (op.phase, op.region, op.kind) == (phase, region, kind))


def test_a_traced_block_counts_its_matmuls_and_attention_as_by_hand():
    from parallab.simulate.trace import Shape

    tokens, width, heads, seq = 2 * 32, 64, 4, 32
    plain = traced(Shape(rows=2, seq_len=seq, precision="fp32"))
    # qkv, proj and the MLP's two: 2 FLOPs a weight a token
    assert flops(plain, "forward", "block", "matmul") == 2 * tokens * 12 * width**2
    assert flops(plain, "backward", "block", "matmul") == 2 * 2 * tokens * 12 * width**2
    # causal attention: QK^T and PV, each 2·b·h·s·t·d, half of them masked
    attention = 2 * 2 * 2 * heads * seq * seq * (width // heads) / 2
    assert flops(plain, "forward", "block", "attention") == attention
    assert flops(plain, "backward", "block", "attention") == attention * 5 / 2
    # the head: 2·tokens·width·vocab forward, twice that backward
    assert flops(plain, "forward", "after", "matmul") == 2 * tokens * width * 256
    # full checkpointing recomputes the forward in backward (but its last op, whose output
    # no gradient needs), and keeps only the block's input
    full = traced(Shape(rows=2, seq_len=seq, checkpointing="full", precision="fp32"))
    again = flops(full, "backward", "block", "matmul") - flops(plain, "backward", "block",
                                                                "matmul")
    assert again == 2 * tokens * 8 * width**2  # qkv, proj, the MLP's first
    assert full.saved["block"] == tokens * width * 4 < plain.saved["block"]


def test_float8_prices_the_linear_layers_train_converts_and_nothing_else(tmp_path):
    """precision=fp8, traced as its bf16 step: the block's Linear matmuls (forward, input
    and weight gradients) marked float8, attention and the output layer not; priced at
    the fp8 peak with their casts beside, the step comes out faster than bf16's but not
    twice; FSDP2's fp8_all_gather gathers those weights in one byte; a GPU without
    float8 tensor cores, and tp (which train's float8 layers refuse), are refused."""
    from parallab.commands import simulate_in_process
    from parallab.simulate.trace import Shape

    found = traced(Shape(rows=2, seq_len=32, precision="fp8"))
    marked = [op for op in found.ops if op.fp8]
    assert {(op.phase, op.region, op.kind) for op in marked} == {
        ("forward", "block", "matmul"), ("backward", "block", "matmul")}
    linear = 2 * 64 * 12 * 64**2  # qkv, proj and the MLP's two: as counted above
    assert sum(op.flops for op in marked) == 3 * linear
    assert not [op for op in found.ops if op.kind == "matmul" and op.region == "after" and
                op.fp8]
    assert found.params["float8"] == 12 * 64**2
    wide = ["model.width=2048", "model.heads=16", "model.context=1024", "data.seq_len=1024",
            "data.batch_size=8",
            "parallel=fsdp", "parallel.world_size=8", "cluster=h100"]
    step = {}
    for name in ("bf16", "fp8"):
        answer = simulate_in_process([*GPT, *wide, f"precision={name}"], tmp_path / name)
        step[name] = answer["layouts"][0]["parts"]
    assert 1.1 < step["bf16"]["compute_s"] / step["fp8"]["compute_s"] < 2
    gathered = simulate_in_process([*GPT, *wide, "precision=fp8", "precision.fp8_all_gather=true"],
                                   tmp_path / "gathered")["layouts"][0]["parts"]
    assert gathered["all_gather_s"] < step["fp8"]["all_gather_s"]
    with pytest.raises(ConfigError, match="has no float8 tensor cores"):
        simulate_in_process([*GPT, *wide, "precision=fp8", "cluster=a100"], tmp_path / "no")
    # float8 under tp, as train splits it (torchao's float8 styles): its matmuls too
    split = {name: simulate_in_process([*GPT, *wide, f"precision={name}", "parallel=fsdp_tp",
                                        "parallel.tp=2"], tmp_path / f"tp_{name}")
             ["layouts"][0]["parts"] for name in ("bf16", "fp8")}
    assert 1.1 < split["bf16"]["compute_s"] / split["fp8"]["compute_s"] < 2


def test_float16_pipelines_are_simulated_as_train_runs_them():
    """precision=fp16 under a pipeline (train scales the schedule's loss): parallel=auto's
    grid holds pipeline layouts beside the others, no longer leaving them out."""
    from parallab.simulate import Facts, rates_of, run

    cfg = configured(*GPT, "parallel=auto", "parallel.world_size=2", "precision=fp16")
    run.check(cfg)
    found, notes = run.candidates_of(cfg, None, Facts.of(cfg), rates_of(cfg.cluster, 2))
    assert [c for c in found if c.layout.pp == 2 and c.reason is None]
    assert not [n for n in notes if n.startswith("No pipeline layouts")]


def test_autocasts_copies_of_weights_are_held_once_a_step_however_many_passes_fly():
    """A pipeline rank holds each in-flight micro-batch's activations, but autocast's bf16
    copies of its weights once: its cache serves every pass of the step (train's count,
    parallel/activations.py). Counted per pass, a deep interleaved pipeline held its
    weights again for every micro-batch in flight."""
    from parallab.simulate import step
    from parallab.simulate.trace import Shape

    found = traced(Shape(rows=2, seq_len=32, precision="bf16"))
    assert found.casts["block"] == 12 * 64**2 * 2  # qkv, proj and the MLP's two, in bf16
    assert traced(Shape(rows=2, seq_len=32, precision="bf16", gathered=True)
                  ).casts["block"] == 0  # FSDP2 gathers them in bf16: nothing to cast
    layout = Layout.planned(4, pp=4, microbatches=8, batch_size=16, schedule="1f1b")
    held = step._memory(found, layout, step.Run(seq_len=32),
                        step.Load(0, 1, True, False))["activations"]
    kept = sum(found.saved[r] for r in ("block", "before"))
    casts = sum(found.casts[r] for r in ("block", "before"))
    assert held * 2**30 == pytest.approx(4 * (kept - casts) + casts)  # 1F1B's first: 4


def test_a_tied_head_is_held_once():
    """model.tie_embeddings=true: the head's matrix is the embedding's, held (and so
    gathered, reduced and stepped) once, where laying the model out on fake tensors had
    made it two."""
    from parallab.simulate.trace import Shape

    shape = Shape(rows=2, seq_len=32, precision="fp32")
    untied, tied = traced(shape), traced(shape, "model.tie_embeddings=true")
    held = lambda found: sum(v for k, v in found.params.items() if k != "tied")  # noqa: E731
    assert held(untied) - held(tied) == 256 * 64  # vocabulary x width
    assert tied.params["block"] == untied.params["block"]
    # a pipeline whose first and last stage are on different ranks: the last keeps a copy
    # (parallel/tied.py), whose gradient the two all-reduce once a step
    assert tied.params["tied"] == 256 * 64 and untied.params["tied"] == 0
    from parallab.simulate import costs, rates_of, step

    cfg = configured(*GPT, "model.tie_embeddings=true", "parallel=pipeline",
                     "parallel.world_size=2")
    rates = rates_of(cfg.cluster, 2)
    layout = Layout.planned(2, pp=2, microbatches=4, batch_size=4, schedule="1f1b")
    predicted = {name: step.predict(found, costs.costs(found, rates, False, False), layout,
                                    step.Run(), rates, 2)
                 for name, found in (("untied", untied), ("tied", tied))}
    assert predicted["tied"].parts["all_reduce_s"] > 0
    assert "all_reduce_s" not in predicted["untied"].parts


def test_a_compiled_step_keeps_and_pays_what_its_eager_loss_does():
    """trainer.compile compiles the model, not the loss: the loss's ops (outside the model)
    are priced one by one and what they keep for backward, the log-probabilities over the
    vocabulary, a compiled step keeps too; the model's own pointwise outputs it recomputes."""
    from parallab.simulate import costs
    from parallab.simulate.cluster import Rates
    from parallab.simulate.trace import Shape

    found = traced(Shape(rows=2, seq_len=32, precision="fp32"))
    loss_ops = [op for op in found.ops if not op.in_model]
    assert loss_ops and {op.region for op in loss_ops} == {"after"}
    assert all(op.in_model for op in found.ops if op.region == "block")
    # a loss of one's own that is a module is no part of the model either
    own = traced(Shape(rows=2, seq_len=32, precision="fp32"),
                 "loss._target_=own_parts.TokenCrossEntropy")
    scoring = [op for op in own.ops if "log_softmax" in str(op.replay[0])]
    assert scoring and not [op for op in scoring if op.in_model]
    log_probabilities = 2 * 32 * 256 * 4
    assert found.saved_compiled["after"] >= log_probabilities
    assert found.saved_compiled["block"] < found.saved["block"]
    rates = Rates.of(configured("cluster=a100").cluster)
    alone = [costs.op_seconds(op, rates, rates.peaks["fp32"]) for op in found.ops
             if (op.phase, op.region) == ("forward", "after")
             and (not op.in_model or op.kind == "matmul")]  # the loss's and the head's
    compiled = costs.costs(found, rates, True, False).compute["forward", "after"]
    assert len(alone) > 2 and compiled >= sum(alone)


@pytest.mark.distributed
def test_this_machines_measured_costs_stand_for_nccls_and_a_gpus():
    """cluster=this: a collective at the fixed cost and rate its kind was measured at, and
    a pipeline's schedule paying its own time on each pass through a stage (and in the
    idle slots, which last as long as a busy one); the figures measured for real by two
    processes over gloo."""
    from parallab.config.schema import NcclLatency
    from parallab.simulate import costs, step, rank_costs
    from parallab.simulate.cluster import Group, Rates
    from parallab.simulate.trace import Op, Shape, Trace

    links = {"all_reduce": (1e-3, 1e9), "p2p": (0.0, 2e9)}
    rates = Rates({"bf16": 1e12, "fp32": 1e12}, 1.0, 1e18, 1e12, 1e12, 1, 2**40, 0.0,
                  NcclLatency(), overhead_adds=True, stage_s=5e-3, links=links)
    assert rates.collective_s("all_reduce", 4e6, Group(2, 2)) == pytest.approx(1e-3 + 4e-3)
    found = Trace(Shape(), ops=[Op("forward", "block", "matmul", 1e9, (), ()),
                                Op("backward", "block", "matmul", 2e9, (), ())],
                  params={"before": 0.0, "block": 10.0, "after": 0.0}, boundary_bytes=2e6)
    layout = Layout.planned(2, pp=2, microbatches=4, batch_size=4, schedule="gpipe")
    predicted = step.predict(found, costs.costs(found, rates, False, False), layout,
                             step.Run(), rates, 4)
    assert predicted.parts["schedule_s"] == pytest.approx(4 * 5e-3)
    assert predicted.parts["p2p_s"] == pytest.approx(4 * 2 * 2e6 / 2e9)
    slot = 2 * 3e9 / 1e12 + 2 * 2e6 / 2e9 + 5e-3
    assert predicted.parts["bubble_s"] == pytest.approx(slot)

    # measured for real by two processes: every kind a rate, every cost a figure (what a
    # loaded machine leaves of a difference may be nothing, never less)
    measured = rank_costs.measure(2, 1, 5e-6)
    assert set(measured["links"]) == set(rank_costs.KINDS)
    # a real collective between two processes costs something, whatever the machine's load
    # (a send's fixed cost is the stage's: stage_s)
    assert all(measured["links"][kind][0] > 0 for kind in rank_costs.KINDS if kind != "p2p")
    assert all(rate > 0 and fixed >= 0 for fixed, rate in measured["links"].values())
    assert all(measured[key] >= 0 for key in ("fsdp_unit_s", "dtensor_op_s", "stage_s"))
    assert measured["in_step"] >= 1


def test_rates_measured_while_the_machine_was_busy_are_measured_again_once_it_is_idle(
        monkeypatch, tmp_path):
    """cluster=this under load: other processes spinning on every core are seen as busy;
    figures kept from a busy hour are served while the machine stays busy and measured
    again, for real, once it is idle (rates 2.4x low otherwise, for good); the answer says
    when and under what load they were measured."""
    import subprocess
    import sys

    from parallab.simulate import this_machine, report

    spinning = [subprocess.Popen([sys.executable, "-c", "while True: pass"])
                for _ in range(os.cpu_count() or 1)]
    try:
        assert this_machine.busy(0.5) > this_machine.BUSY
    finally:
        for p in spinning:
            p.kill()
            p.wait()

    monkeypatch.setattr(this_machine, "FILE", tmp_path / "cluster_this.json")
    monkeypatch.setattr(this_machine, "CACHE", tmp_path)
    cores = len(os.sched_getaffinity(0))
    kept = {"cores": cores, "fp32_1": 1.0, "ranks": {}, "at": "earlier", "busy": 0.9}
    this_machine.FILE.write_text(json.dumps({this_machine._key(cores): kept}))
    for load, served in ((0.6, "kept"), (0.0, "measured")):
        monkeypatch.setattr(this_machine, "busy", lambda seconds=0.3, load=load: load)
        this_machine.measured.cache_clear()
        this_machine._idle.cache_clear()
        figures = this_machine.measured()
        assert (figures == kept) == (served == "kept")
    assert figures["busy"] == 0.0 and figures["fp32_1"] > 1e6 and figures["at"] != "earlier"
    kept_now = json.loads(this_machine.FILE.read_text())
    assert kept_now[this_machine._key(cores)]["at"] == figures["at"]
    said = report._measured_when({"at": "earlier", "busy": 0.9})[0]
    assert "measured earlier, while other work took 90% of its cores: the rates may be low" \
        in said
    this_machine.measured.cache_clear()
    this_machine._idle.cache_clear()


def test_this_machine_shares_its_cores_among_more_ranks_than_it_measured(monkeypatch):
    """cluster=this past the rank counts measured together (twice the cores): an op run
    for real slows as the cores' share a rank gets does, as the rates' peaks do, so that a
    step never computes faster than its peak (an MFU beyond 100%)."""
    from parallab.config.schema import ClusterConfig
    from parallab.simulate import this_machine

    four = {"links": {}, "fsdp_unit_s": 0.0, "dtensor_op_s": 0.0, "stage_s": 0.0,
            "in_step": 1.5}
    figures = {"cores": 2, "memory_bytes": 2**34, "in_step": 1.2, "fp32_1": 1e10,
               "fp32_all": 2e10, "bf16_1": 1e10, "bf16_all": 2e10, "copy": 1e10,
               "op_s": 1e-5, "ranks": {"4": four}}
    monkeypatch.setattr(this_machine, "measured", lambda again=False: figures)
    cluster = ClusterConfig(name="this", gpu="this", memory_gb=None, hbm_gbps=None,
                            gpus_per_node=None, intra_node_gbps=None, inter_node_gbps=None,
                            matmul_efficiency=None, op_overhead_us=None)
    at4, at64 = this_machine.rates(cluster, 4), this_machine.rates(cluster, 64)
    assert at4.timed.slower == pytest.approx(1.5)  # as measured: four ranks, two cores
    assert at4.peaks["fp32"] / at64.peaks["fp32"] == pytest.approx(16)
    assert at64.timed.slower / at4.timed.slower == pytest.approx(16)


def test_a_pipelines_given_split_is_the_one_simulated():
    """parallel.split cuts the simulated pipeline where train cuts it, not evenly."""
    from parallab.simulate import step

    params = {"before": 1.0, "block": 1.0, "after": 1.0}
    layout = Layout.planned(2, pp=2, schedule="1f1b")
    even, given = step.loads(8, layout, params), step.loads(8, layout, params, (2,))
    assert [load.blocks for load in even] == [4, 4]
    assert [load.blocks for load in given] == [1, 7] and given[0].ends == ["before"]


def test_a_given_split_moves_the_simulated_step(tmp_path):
    from parallab.commands import simulate_in_process

    def step_s(*split: str) -> float:
        run = tmp_path / str(len(split))
        simulate_in_process([*GPT, "parallel=pipeline", "parallel.world_size=2",
                             "parallel.pp=2", "parallel.microbatches=2", *split], run)
        return json.loads((run / "simulate.json").read_text())["layouts"][0]["step_time_s"]

    # the embedding alone on the first rank, both blocks and the head on the second
    assert step_s("parallel.split=[1]") > step_s()


def test_measured_points_come_from_each_readable_metrics_file(tmp_path):
    """simulate.measured: a run's tokens/s per GPU beside the predictions; a metrics.json cut
    short (a run still writing it) is left out, not the end of the simulation."""
    from parallab.simulate.run import _measured

    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "metrics.json").write_text(json.dumps(
        {"tokens_per_sec": 800.0, "world_size": 4}))
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "metrics.json").write_text('{"tokens_per_sec": 8')
    # another file of that name: a list, a string, a figure not finite or negative
    for name, text in (("c", "[1, 2]"), ("d", '"runs"'),
                       ("e", '{"tokens_per_sec": NaN, "world_size": 2}'),
                       ("f", '{"tokens_per_sec": -5.0, "world_size": 2}')):
        (tmp_path / name).mkdir()
        (tmp_path / name / "metrics.json").write_text(text)
    assert _measured(str(tmp_path)) == [(4, 200.0, "a (measured)")]


def test_this_machine_runs_only_an_op_it_can_afford():
    """cluster=this runs a traced op for real only where it is quick and small; one that
    this machine's rates say would take minutes, or whose tensors would fill its memory,
    is left to the rates (None: the roofline of them), not run."""
    import torch

    from parallab.config.schema import NcclLatency
    from parallab.simulate import costs
    from parallab.simulate.cluster import Rates
    from parallab.simulate.ops import Op, _spec
    from parallab.simulate.op_times import Timer

    a = torch.randn(64, 64)
    op = Op("forward", "block", "matmul", 2 * 64.0**3, ((0, a.nbytes), (1, a.nbytes)),
            ((2, a.nbytes),), replay=(torch.ops.aten.mm.default, (_spec(a), _spec(a)), {}))
    calls = []

    def timed(found):
        calls.append(found)
        return Timer(1)(found)

    def rates(flops=1e12, bytes_per_s=1e12, memory=2.0**40):
        return Rates({"bf16": flops, "fp32": flops}, 1.0, bytes_per_s, 1e9, 1e9, 1, memory,
                     0.0, NcclLatency(), overhead_adds=True, timed=timed)

    def ran(given) -> bool:
        calls.clear()
        costs.op_seconds(op, given, given.peaks["fp32"])
        return bool(calls)

    assert ran(rates()) and Timer(1)(op) > 0
    assert not ran(rates(flops=1e3))  # 9 minutes at a thousand FLOP/s
    assert not ran(rates(bytes_per_s=1e3))
    assert not ran(rates(memory=a.nbytes))  # three of them


def test_fsdp_reduces_each_accumulated_micro_batch_and_keeps_only_shards():
    """Gradient accumulation under FSDP2: each micro-batch's gradients reduce-scattered, the
    blocks' and the root's (with no compute to hide behind, every gather and reduction
    exposed: 2 gathers and one reduction a block and micro-batch, one of each for the
    root), HSDP's all-reduce over the replicas once, and no whole gradients kept."""
    from parallab.config.schema import NcclLatency
    from parallab.simulate import costs, step
    from parallab.simulate.cluster import Rates
    from parallab.simulate.trace import Shape, Trace

    rates = Rates({"bf16": 1e12, "fp32": 1e12}, 1.0, 1e18, 1e9, 1e9, 8, 2**40, 0.0,
                  NcclLatency(0, 0, 0, 0, 0, 0))
    found = Trace(Shape(), ops=[], params={"before": 1e5, "block": 1e6, "after": 0.0})
    # half of it each over 2 ranks: gathered in bf16, reduced in float32; HSDP's replicas
    # (2) all-reduce each shard's half, 2 x 1/2 of it in float32
    gather, scatter, reduce = 1e6 / 2 * 2 / 1e9, 1e6 / 2 * 4 / 1e9, 1e6 / 2 * 4 / 1e9
    root = 0.1  # the root's share of a block's
    one = None
    for m in (1, 4):
        for r in (1, 2):
            layout = Layout.planned(2 * r, r, 2, accumulation=m, batch_size=m)
            predicted = step.predict(found, costs.costs(found, rates, False, False), layout,
                                     step.Run(), rates, 3)
            assert predicted.parts["all_gather_s"] == pytest.approx(
                m * (2 * 3 + root) * gather)
            assert predicted.parts["reduce_scatter_s"] == pytest.approx(
                m * (3 + root) * scatter + (r - 1) * (3 + root) * reduce)
            one = one or predicted.memory
            assert predicted.memory == one or r > 1
    # a pipeline's sharded part (torch's stages) keeps its weights and gradients whole from
    # the first micro-batch to the flush, and reduces them once
    found = Trace(Shape(), ops=[], params={"before": 0.0, "block": 1e6, "after": 0.0})
    layout = Layout.planned(4, dp_shard=2, pp=2, microbatches=4, batch_size=4, schedule="1f1b")
    predicted = step.predict(found, costs.costs(found, rates, False, False), layout,
                             step.Run(reshard_after_forward=False), rates, 4)
    assert predicted.parts["reduce_scatter_s"] == pytest.approx(2 * scatter)  # its 2 blocks
    assert predicted.parts["all_gather_s"] == pytest.approx(2 * gather)
    assert predicted.memory["gathered"] * 2**30 == pytest.approx(2 * 1e6 * (2 + 4))


@pytest.mark.parametrize("layout", [["parallel=fsdp", "parallel.world_size=64"],
                                    ["parallel=tp", "parallel.world_size=2"]])
def test_memory_is_the_fake_tensor_layouts(layout):
    """The composed figure (a block's state and activations, times the blocks) against
    the whole model laid out on fake tensors, as advise predicts a rank's memory: by FSDP2
    at world size 64; split by tensor parallelism, whose weights' shards autograd saves
    for backward are the state's, not activations."""
    from conftest import checked

    from parallab.advise import memory
    from parallab.checks import trial
    from parallab.simulate import run, search

    cfg, layout_here = checked(*GPT, "data=bytes", *layout, "device=cpu")
    state_mb, activations_mb = memory.predict(cfg, layout_here, trial.one_batch(cfg, 2), 0)
    sim = configured(*GPT, *layout, "precision=fp32")
    candidate, _ = run.given(sim)
    assert isinstance(candidate, search.Candidate)
    assert candidate.layout.world_size == layout_here.world_size
    parts = candidate.prediction.memory  # GiB
    assert parts["state"] * 1024 == pytest.approx(state_mb, rel=0.01)
    assert parts["activations"] * 1024 == pytest.approx(activations_mb, rel=0.15)


def test_checkpointing_every_second_block_costs_and_keeps_the_mean():
    """trainer.activation_checkpointing_every=2: half the blocks recompute their forward and
    keep their input, half keep all: the step's compute and its activations the mean of the
    two."""
    from parallab.simulate import run

    def given(*overrides):
        return run.given(configured(*GPT, "model.layers=4", "parallel=fsdp",
                                    "parallel.world_size=8", "precision=bf16",
                                    *overrides))[0].prediction

    none, full = given(), given("trainer.activation_checkpointing=full")
    half = given("trainer.activation_checkpointing=full",
                 "trainer.activation_checkpointing_every=2")
    assert full.parts["compute_s"] > none.parts["compute_s"]
    assert half.parts["compute_s"] == pytest.approx(
        (none.parts["compute_s"] + full.parts["compute_s"]) / 2, rel=1e-6)
    assert full.memory["activations"] < half.memory["activations"] < none.memory["activations"]
    assert half.memory["activations"] == pytest.approx(
        (none.memory["activations"] + full.memory["activations"]) / 2, rel=1e-6)
    # the step's temporaries beyond them are no more than either kind of block's
    assert half.memory["temporary"] <= max(none.memory["temporary"],
                                           full.memory["temporary"]) * (1 + 1e-9)


@pytest.mark.parametrize("name", sorted(p.stem for p in (REPO / "conf" / "cluster").glob("*.yaml")))
def test_every_cluster_preset_composes_and_is_sound(name):
    from parallab.simulate import cluster

    cfg = configured(f"cluster={name}")
    assert cfg.cluster.name == name and cluster.problem(cfg.cluster) is None
    if cfg.cluster.gpu != cluster.THIS:
        rates = cluster.Rates.of(cfg.cluster)
        assert rates.peaks["bf16"] > 1e14 and 0 < rates.matmul_efficiency <= 1
        assert cfg.cluster.source  # each names where its figures come from


def test_a_gpu_the_table_does_not_list_needs_its_cluster_yaml_alone():
    """A cluster's own peak_tflops stand for gpus.yaml's entry: a GPU it does not list is
    priced at them (fp16 at bf16's rate where not given), and the preset's peaks are the
    table's, the same that train's MFU reads."""
    import torch

    from parallab.observe import mfu
    from parallab.simulate import cluster

    own = configured("cluster.gpu=MI300X", "+cluster.peak_tflops={bf16: 1307.4, fp32: 163.4}")
    assert cluster.problem(own.cluster) is None
    rates = cluster.Rates.of(own.cluster)
    assert rates.peaks["bf16"] == rates.peaks["fp16"] == pytest.approx(1307.4e12)
    assert rates.fp32_peak(tf32=True) == pytest.approx(163.4e12)
    preset = cluster.Rates.of(configured("cluster=h100").cluster)
    assert preset.peaks["bf16"] == mfu.peak_flops("NVIDIA H100 80GB HBM3", torch.bfloat16)


def test_auto_ranks_every_layout_and_writes_its_answer(tmp_path):
    from parallab.commands import simulate_in_process

    answer = simulate_in_process([*GPT, "parallel=auto", "parallel.world_size=4",
                                  "data.batch_size=2", "cluster=a100",
                                  "cluster.gpus_per_node=2"], tmp_path)
    found = json.loads((tmp_path / "simulate.json").read_text())["layouts"]
    fits = [e for e in found if e["fits"]]
    assert fits and found[:len(fits)] == fits  # those that fit first, fastest first
    speeds = [e["tokens_per_sec_per_gpu"] for e in fits]
    assert speeds == sorted(speeds, reverse=True)
    kinds = {e["layout"].split("(")[0] for e in found}
    assert {"ddp", "fsdp", "hsdp", "fsdp_tp", "pipeline"} <= kinds
    best = fits[0]
    assert set(best) >= {"command", "tokens_per_sec_per_gpu", "step_time_s", "mfu",
                         "memory_per_gpu_gb", "fits", "parts"}
    assert best["command"] == answer["command"] and "parallel=auto" not in best["command"]
    assert best["command"].startswith("parallab train data=tokens model=gpt")
    assert sum(best["parts"].values()) == pytest.approx(best["step_time_s"])
    assert "#SBATCH --nodes=2" in answer["sbatch"] and "#SBATCH --gpus-per-node=2" in \
        answer["sbatch"]
    said = (tmp_path / "simulate.md").read_text()
    assert best["layout"] in said and "srun --kill-on-bad-exit=1 parallab train" in said
    assert (tmp_path / "simulate.png").stat().st_size > 0
    # none that train refuses: a zero-bubble schedule's split backward checkpointed selectively
    split = [e for e in found if any(f"parallel.schedule={s} " in e["command"]
                                     for s in ("interleaved_zb", "zbv", "dualpipev"))]
    assert split and not [e for e in split if "=selective" in e["command"]]
    # the command of the fastest of each kind passes train's checks as it is printed
    import shlex

    from conftest import checked

    for kind in sorted(kinds):
        first = next(e for e in found if e["layout"].startswith(kind + "(") and e["fits"])
        words = shlex.split(first["command"])
        assert words[:2] == ["parallab", "train"]
        cfg, layout = checked(*words[2:], "device=cpu")
        assert layout.world_size == 4 and cfg.parallel.name == kind


def test_a_forward_that_reads_its_values_is_one_line(tmp_path):
    """A user's forward asserting on its token ids' values cannot run on fake tensors: one
    line saying so, not the fake tensor's traceback from inside the trace."""
    from parallab.commands import simulate_in_process

    with pytest.raises(ConfigError, match="^CheckedLM's forward reads its tensors' values "
                       r"\(aten._local_scalar_dense.default: an assert on them"):
        simulate_in_process(["model._target_=own_parts.CheckedLM", "~model.num_classes",
                             "~model.dropout", "data.vocab_size=64", "data.seq_len=32",
                             "parallel=fsdp", "parallel.world_size=4"], tmp_path)


def test_a_model_whose_stages_are_made_on_each_call_is_simulated_without_checkpointing(
        tmp_path):
    """A user's model whose stages() wraps a layer in a module made on each call: no
    checkpointed layout offered (train refuses one), the reason in the notes, its blocks
    the ones the model holds."""
    from parallab.commands import simulate_in_process

    simulate_in_process(["model._target_=own_parts.LooseStagesLM", "~model.num_classes",
                         "~model.dropout", "data.vocab_size=64", "data.seq_len=32",
                         "parallel=auto", "parallel.world_size=4"], tmp_path)
    found = json.loads((tmp_path / "simulate.json").read_text())["layouts"]
    assert found and all("activation_checkpointing=none" in e["command"] for e in found)
    assert "No activation checkpointing: trainer.activation_checkpointing=full: the " \
        "model's stages() gives Sequential, no submodule of the model" in \
        (tmp_path / "simulate.md").read_text()
    with pytest.raises(ConfigError, match="^trainer.activation_checkpointing=selective: the "
                       "model's stages.. gives Sequential, no submodule of the model"):
        simulate_in_process(["model._target_=own_parts.LooseStagesLM", "~model.num_classes",
                             "~model.dropout", "data.vocab_size=64", "data.seq_len=32",
                             "parallel=fsdp", "parallel.world_size=4",
                             "trainer.activation_checkpointing=selective"], tmp_path / "given")


def test_auto_splits_a_users_model_by_the_tensor_parallel_plan_given(tmp_path):
    """A user's model with no plan of its own: parallel=auto takes parallel.tp_plan as the
    mesh and the pipeline do, predicts its tp layouts (without it they carry the reason),
    and prints the plan in their commands alone, which train's checks pass as printed."""
    import shlex

    from conftest import checked

    from parallab.commands import simulate_in_process

    own = ["model._target_=own_parts.LooseStagesLM", "~model.num_classes", "~model.dropout",
           "data.vocab_size=64", "data.seq_len=32", "parallel=auto", "parallel.world_size=2"]
    plan = "parallel.tp_plan={blocks.*.0:colwise_rep}"
    for given, out in (([], "none"), ([plan], "given")):
        simulate_in_process([*own, *given], tmp_path / out)
    found = {out: json.loads((tmp_path / out / "simulate.json").read_text())["layouts"]
             for out in ("none", "given")}
    split = {out: [e for e in found[out] if "parallel.tp=1 " not in e["command"]]
             for out in found}
    assert split["none"] and not any(e["fits"] for e in split["none"])
    fitting = [e for e in split["given"] if e["fits"]]
    assert fitting and all(shlex.quote(plan) in e["command"] for e in split["given"])
    assert not any("tp_plan" in e["command"] for e in found["given"] if e not in split["given"])
    cfg, layout = checked(*shlex.split(fitting[0]["command"])[2:], "device=cpu")
    assert layout.tp > 1 and cfg.parallel.tp_plan == {"blocks.*.0": "colwise_rep"}


def test_auto_prices_and_carries_the_layout_keys_given(tmp_path):
    """parallel=auto takes the keys of the layouts it ranks, as the mesh and the pipeline
    do: the replicas' buckets (the smaller, the more all-reduces, each its latency) and
    FSDP's resharding (weights kept gathered to backward: more held), each priced and
    carried in the commands of the layouts that take it, which train's checks pass as
    printed."""
    import shlex

    from conftest import checked

    from parallab.commands import simulate_in_process

    auto = [*GPT, "model.layers=4", "parallel=auto", "parallel.world_size=2",
            "data.batch_size=2", "cluster=a100"]  # 4 blocks: more than FSDP's 2 gathered
    given = ["parallel.bucket_cap_mb=0.01", "parallel.reshard_after_forward=false"]
    for keys, out in (([], "default"), (given, "given")):
        simulate_in_process([*auto, *keys], tmp_path / out)
    found = {out: json.loads((tmp_path / out / "simulate.json").read_text())["layouts"]
             for out in ("default", "given")}

    def one(out: str, preset: str) -> dict:
        return next(e for e in found[out] if f"parallel={preset} " in e["command"] and
                    "accumulate_grad_batches=1 " in e["command"] and
                    "activation_checkpointing=none" in e["command"])

    assert one("given", "ddp")["parts"]["all_reduce_s"] > \
        one("default", "ddp")["parts"]["all_reduce_s"]
    assert one("given", "fsdp")["memory_gb"]["gathered"] > \
        one("default", "fsdp")["memory_gb"]["gathered"]
    meshes = [e for e in found["given"] if "parallel=pipeline" not in e["command"]]
    assert meshes and all(all(k in e["command"] for k in given) for e in meshes)
    pipelines = [e for e in found["given"] if e not in meshes]
    assert pipelines and not any("reshard" in e["command"] for e in pipelines)
    assert not any("bucket_cap_mb" in e["command"] for e in found["default"])
    for preset in ("ddp", "fsdp"):
        cfg, _ = checked(*shlex.split(one("given", preset)["command"])[2:], "device=cpu")
        assert cfg.parallel.bucket_cap_mb == 0.01 and not cfg.parallel.reshard_after_forward
    cfg, _ = checked(*shlex.split(pipelines[0]["command"])[2:], "device=cpu")
    assert cfg.parallel.bucket_cap_mb == 0.01


def test_a_learned_position_table_shorter_than_the_sequence_is_refused(tmp_path):
    """The example's GPT-2 (64 learned positions) at data.seq_len=1024: refused as train
    refuses it, not predicted with a command that then fails."""
    from parallab.commands import simulate_in_process

    with pytest.raises(ConfigError, match=r"^data.seq_len=1024 is longer than the model's 64 "
                       r"learned positions \(model.config.n_positions\)"):
        simulate_in_process(["model=my_gpt2", "data.seq_len=1024", "data.vocab_size=256",
                             "parallel=fsdp",
                             "parallel.world_size=8"], tmp_path,
                            config_dir=REPO / "examples" / "hf_llama" / "conf")


@pytest.mark.parametrize("model", ["mnist_cnn", "resnet18"])
def test_a_model_of_images_is_told_simulate_traces_sequences(tmp_path, model):
    """Told at once, not sent round data keys (data.shape, data=cifar10) that simulate then
    refuses in turn."""
    from parallab.commands import simulate_in_process

    name = {"mnist_cnn": "MnistCNN", "resnet18": "ResNet18"}[model]
    with pytest.raises(ConfigError, match="^parallab simulate traces a language model's "
                       f"block on token sequences, which {name} does not take"):
        simulate_in_process([f"model={model}", "parallel=fsdp", "parallel.world_size=8"],
                            tmp_path)


@pytest.mark.parametrize("overrides, says", [
    (["cluster.hbm_gbps=-1"], "cluster.hbm_gbps=-1.0 is out of range: it must be > 0"),
    # infinite or vanishing rates: no step of infinite seconds, no Infinity in JSON
    (["cluster.op_overhead_us=inf"], "cluster.op_overhead_us=inf is out of range: give a "
                                     "finite rate"),
    (["cluster.hbm_gbps=1e-320"], "cluster.hbm_gbps=1e-320 is out of range"),
    (["cluster.hbm_gbps=null"], "cluster.hbm_gbps=null: only cluster.gpu=this measures"),
    (["cluster.memory_gb=???"], "cluster.memory_gb is missing: set it"),
    (["cluster.gpu=RTX-9090"], "cluster.gpu=RTX-9090 is not in observe/gpus.yaml's peak FLOP/s"),
    (["cluster.gpu=MI300X", "+cluster.peak_tflops={bf16: 1307, int4: 2}"],
     "cluster.peak_tflops.int4 names no precision: give the GPU's dense TFLOP/s by fp32"),
    (["cluster.gpu=MI300X", "+cluster.peak_tflops={bf16: -1}"],
     "cluster.peak_tflops.bf16=-1.0 is out of range: give the GPU's dense TFLOP/s"),
    (["cluster.remeasure=true"], "cluster.remeasure=true: cluster=h100's rates are given"),
    (["parallel=fsdp"], "parallel.world_size is not set: give the GPU count to simulate"),
    (["parallel=fsdp_tp", "parallel.world_size=8", "parallel.tp=3"],
     "multiply to 3 x ?, but parallel.world_size=8"),
    (["parallel=tp", "parallel.world_size=8"], "parallel.tp=8 does not divide model.heads=4"),
    (["parallel=pipeline", "parallel.world_size=16", "parallel.pp=16"],
     "is 16 parts, more than the 4 stages of the model"),
    (["parallel=auto", "parallel.world_size=1"], "parallel=auto with parallel.world_size=1"),
    (["parallel=auto", "parallel.world_size=8", "cluster.memory_gb=0.0001"],
     "no layout of parallel.world_size=8 GPUs fits GPT on cluster=h100: the smallest needs"),
    (["parallel=auto", "parallel.world_size=-8"],
     "parallel.world_size=-8 is out of range: it must be >= 1"),
    (["parallel=auto", "parallel.world_size=8", "data.global_batch_size=3"],
     "takes this model and batch: data.global_batch_size=3 does not split over 8 "
     "data-parallel ranks: give a multiple of 8"),
    (["parallel=auto", "parallel.world_size=8", "parallel.bucket_cap_mb=0"],
     "parallel.bucket_cap_mb=0.0 is out of range: it must be > 0"),
    (["parallel=auto", "parallel.world_size=8", "simulate.rows=0"],
     "simulate.rows=0 is out of range: it must be >= 1"),
    (["parallel=auto", "parallel.world_size=8", "simulate.world_sizes=[0,8]"],
     "simulate.world_sizes=[0, 8]: each must be a GPU count >= 1"),
    (["parallel=auto", "parallel.world_size=8", "simulate.measured=/no/such/runs"],
     "simulate.measured=/no/such/runs is not a directory"),
    # the printed command is one train takes: not both a fixed and a found batch
    (["parallel=auto", "parallel.world_size=8", "data.global_batch_size=64",
      "trainer.auto_batch_size=true"],
     "data.global_batch_size=64 fixes the samples of each step, which "
     "trainer.auto_batch_size=true would change: drop one of them"),
    (["adapter=lora", "parallel=fsdp", "parallel.world_size=8"],
     "adapter=lora: parallab simulate trains every weight"),
    # a sequence model's own limit, said as train says it (not "GPT does not take sequences")
    (["parallel=fsdp", "parallel.world_size=8", "data.seq_len=4096"],
     "data.seq_len=4096 is longer than model.context="),
    (["parallel=fsdp", "parallel.world_size=8", "trainer.fused_norms=true"],
     "trainer.fused_norms=true: GPT has no RMSNorm written out as torch's rms_norm"),
    # train's data on the cluster, not here: the way out named beside the data's own
    (["parallel=auto", "parallel.world_size=8", "data=bytes", "data.path=/on/the/cluster"],
     "no file /on/the/cluster: give a text file or a directory of *.txt files (or data.path="
     "null for the shipped text); or leave data= out: parallab simulate reads no data"),
])
def test_bad_input_ends_in_one_line(tmp_path, overrides, says):
    from parallab.commands import simulate_in_process

    with pytest.raises(ConfigError) as raised:
        simulate_in_process([*GPT, *overrides], tmp_path)
    assert says in str(raised.value) and "\n" not in str(raised.value)
    assert not (tmp_path / "simulate.json").exists()


def test_sbatch_lines_ask_for_what_the_slurm_launcher_asks_for():
    """One rule: 12 GPUs on 8-GPU nodes are 2 nodes x 6 (the launcher's), not 8 + 4; a
    world that no node count splits evenly gets no allocation, as the launcher refuses it."""
    from parallab.simulate.report import sbatch
    from parallab.parallel.grid import Candidate

    lines = sbatch(Candidate(Layout.planned(12, 12)), 8, "parallab train")
    assert "#SBATCH --nodes=2" in lines and "#SBATCH --ntasks-per-node=6" in lines
    assert "#SBATCH --gpus-per-node=6" in lines and lines[-1].endswith("parallab train")
    assert "#SBATCH --nodes=1" in sbatch(Candidate(Layout.planned(4, 4)), 8, "x")
    odd = sbatch(Candidate(Layout.planned(9, 9)), 8, "x")
    assert not [line for line in odd if line.startswith("#SBATCH")]
    assert "does not split evenly over the 2 nodes" in odd[-1]


def test_the_command_as_a_user_runs_it(tmp_path):
    """`parallab simulate` from a shell: the answer, its files; an unknown cluster refused in
    one line, exit status 2, before anything is traced."""
    run_dir = tmp_path / "sim"
    done = run_entry("parallab", ["simulate", *GPT, "parallel=fsdp", "parallel.world_size=64",
                                  "cluster=h100"], run_dir, timeout=180)
    assert done.returncode == 0, done.stderr[-3000:]
    said = done.stdout.strip().splitlines()
    assert said[-2].startswith("parallab simulate: fsdp(F64) b2 ac=none: ")
    assert said[-1].startswith("parallab train data=tokens model=gpt")
    assert "No artists with labels" not in done.stderr  # one layout: no empty legend
    layouts = json.loads((run_dir / "simulate.json").read_text())["layouts"]
    assert len(layouts) == 1 and layouts[0]["fits"]
    refused = run_entry("parallab", ["simulate", *GPT, "cluster=nope"], tmp_path / "bad",
                        timeout=120)
    assert refused.returncode == 2 and "Traceback" not in refused.stderr
    assert len(refused.stderr.strip().splitlines()) == 1 and "cluster" in refused.stderr
    assert not Path(tmp_path / "bad" / "simulate.json").exists()


def test_a_pipelines_accumulated_passes_are_each_priced_and_said(tmp_path):
    """Layout.accumulation apart from a pipeline's micro-batches: each of a step's passes
    runs the schedule (its compute, sends and idle slots) on its share of the batch, and
    its sharded parts are gathered and reduced at each flush, as torch's stages do; the
    memory stays one pass's, and the command says both, which train takes."""
    import dataclasses
    import shlex

    from conftest import checked

    from parallab.commands import simulate_in_process
    from parallab.parallel.grid import Candidate
    from parallab.simulate import Predict

    cfg = configured(*GPT, "cluster=h100", "precision=bf16")
    judge = Predict(cfg.cluster)
    for shards in (1, 2):
        one = Candidate(Layout.planned(2 * shards, dp_shard=shards, pp=2, schedule="1f1b",
                                       microbatches=2, batch_size=4), cfg=cfg)
        two = Candidate(dataclasses.replace(one.layout, accumulation=2, batch_size=8), cfg=cfg)
        once, twice = judge.of(one), judge.of(two)
        each = ("compute_s", "bubble_s", "p2p_s", *(("all_gather_s", "reduce_scatter_s")
                                                    if shards > 1 else ()))
        for part in each:
            assert twice.parts[part] == pytest.approx(2 * once.parts[part]), part
        assert twice.parts["optimizer_s"] == once.parts["optimizer_s"]  # once a step
        assert twice.memory == once.memory
    said = two.overrides
    assert {"parallel.microbatches=2", "trainer.accumulate_grad_batches=2",
            "data.batch_size=4"} <= set(said) and "accum2" in two.label
    answer = simulate_in_process([*GPT, "parallel=pipeline", "parallel.world_size=4",
                                  "parallel.pp=2", "parallel.dp_shard=2",
                                  "parallel.dp_replicate=1", "parallel.microbatches=2",
                                  "trainer.accumulate_grad_batches=2"], tmp_path)
    assert "trainer.accumulate_grad_batches=2" in answer["command"]
    ran, layout = checked(*shlex.split(answer["command"])[2:], "device=cpu")
    assert layout.pp == 2 and ran.trainer.accumulate_grad_batches == 2


def test_a_mesh_preset_on_one_gpu_prints_a_command_train_takes():
    """parallel=ddp at one GPU resolves to one process (parallel=none), whose config has no
    degrees to set: the command says the world size alone, and train composes and checks
    it."""
    from conftest import checked

    from parallab.simulate import run, search

    cfg = configured(*GPT, "parallel=ddp", "parallel.world_size=1")
    said = search.given(cfg, run.check(cfg)).overrides
    assert said[:2] == ["parallel=none", "parallel.world_size=1"] and \
        not any(o.startswith("parallel.dp_") for o in said)
    assert checked(*GPT, "data=bytes", "device=cpu", *said)[1].world_size == 1
