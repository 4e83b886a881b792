"""advise's grid and its step-time model: the layouts each preset offers and simulate's
products of them, the candidates tried (float8 where the device has it, the cheapest
memory saver that fits), and a step predicted from the parts a job measured (the bubble,
cores shared, parts that could not be measured)."""

from __future__ import annotations

import dataclasses

import pytest
from test_advise import TINY


def test_the_grid_comes_from_each_layout():
    from parallab.advise.candidates import enumerate_grid
    from parallab.config.planning import AdviseConfig

    options = AdviseConfig(precisions=["fp32"], activation_checkpointing=["none"],
                           max_accumulation=1, schedules=["1f1b"], microbatches=[4])
    labels = {c.label for c in enumerate_grid(options, [1, 4], "cpu")}
    assert "none(1) b1 ac=none fp32" in labels
    assert "hsdp(R2xF2) b1 ac=none fp32" in labels
    assert "fsdp_tp(F2xT2) b1 ac=none fp32" in labels
    assert "pipeline(R2xP2) 1f1b m4 b1 ac=none fp32" in labels
    assert not any(label.startswith(("dp(", "model(")) for label in labels)  # GPUs only
    # one process's GPUs: its preset fixes the degrees, the command says the world size
    on_gpus = {c.label: c.overrides for c in enumerate_grid(options, [2], "cuda")}
    assert on_gpus["model(P2) b1 ac=none fp32"][:2] == ["parallel=model", "parallel.world_size=2"]
    assert on_gpus["dp(R2) b1 ac=none fp32"][:2] == ["parallel=dp", "parallel.world_size=2"]


def test_a_users_setting_of_a_key_a_layout_sets_gives_way_in_each_planners_command():
    """Every key a layout's command sets is one a user's own setting of gives way to, in
    advise's commands and simulate's alike; what each planner alone decides stays its own."""

    from parallab.advise.candidates import user_overrides as advise_keeps
    from parallab.parallel import grid
    from parallab.simulate.search import user_overrides as simulate_keeps

    everything = grid.Space(grid.powers_of_two_dividing, max_tp=8, mixed=True,
                            ways=lambda pp, dp: [{"schedule": "interleaved_1f1b",
                                                  "stages_per_rank": 4, "microbatches": 8,
                                                  "accumulation": 2}])
    found = grid.layouts(16, everything)
    found += [dataclasses.replace(lay, sequence_parallel=True, ep=2) for lay in found
              if lay.tp > 1 and lay.dp_shard > 1]
    said = {o for lay in found for o in [*lay.overrides(), *lay.overrides(global_batch=True)]}
    assert {o.split("=")[0] for o in said} >= {"parallel.stages_per_rank", "parallel.ep",
                                                "parallel.sequence_parallel", "data.batch_size"}
    for keeps in (advise_keeps, simulate_keeps):
        assert keeps(sorted(said)) == []
    user = ["model.width=64", "parallel.bucket_cap_mb=10", "precision=bf16", "cluster=h100",
            "simulate.rows=5", "advise.steps=3", "parallel.threads_per_worker=1"]
    assert advise_keeps(user) == ["model.width=64", "cluster=h100", "simulate.rows=5",
                                  "parallel.threads_per_worker=1"]
    assert simulate_keeps(user) == ["model.width=64", "parallel.bucket_cap_mb=10",
                                    "precision=bf16", "parallel.threads_per_worker=1"]


def test_one_grid_spans_the_presets_for_advise_and_every_product_for_simulate():
    """parallel/grid.py: advise spans the presets' shapes over every divisor, simulate every
    product of powers of two with tp within a node; each layout names its preset's plan;
    advise crosses ep where it carves a layout's shards x tp, in the order of
    advise.layouts."""
    from parallab.advise.candidates import enumerate_grid
    from parallab.config.planning import AdviseConfig
    from parallab.parallel import PLANS, grid

    def degrees(space: grid.Space, n: int) -> list[tuple[int, ...]]:
        found = grid.layouts(n, space)
        assert all(layout.plan is PLANS[layout.preset] for layout in found)
        return [(lay.dp_replicate, lay.dp_shard, lay.tp, lay.pp) for lay in found]

    assert sorted(degrees(grid.Space(), 6)) == sorted([
        (6, 1, 1, 1), (3, 2, 1, 1), (2, 3, 1, 1), (1, 6, 1, 1), (1, 3, 2, 1), (1, 2, 3, 1),
        (1, 1, 6, 1), (3, 1, 1, 2), (2, 1, 1, 3), (1, 1, 1, 6)])
    everything = grid.Space(grid.powers_of_two_dividing, max_tp=4, mixed=True)
    assert degrees(everything, 8) == [  # by tp, then pp, then shards
        (8, 1, 1, 1), (4, 2, 1, 1), (2, 4, 1, 1), (1, 8, 1, 1), (4, 1, 1, 2), (2, 2, 1, 2),
        (1, 4, 1, 2), (2, 1, 1, 4), (1, 2, 1, 4), (1, 1, 1, 8), (4, 1, 2, 1), (2, 2, 2, 1),
        (1, 4, 2, 1), (2, 1, 2, 2), (1, 2, 2, 2), (1, 1, 2, 4), (2, 1, 4, 1), (1, 2, 4, 1),
        (1, 1, 4, 2)]
    options = AdviseConfig(layouts=["hsdp", "fsdp"], precisions=["fp32"],
                           activation_checkpointing=["none"], max_accumulation=1)
    labels = [c.label.split(" ")[0] for c in enumerate_grid(options, [8], "cpu", experts=8)]
    assert labels[0].startswith("hsdp(") and labels[-1].startswith("fsdp(")
    assert "hsdp(R2xF4xE4)" in labels
    assert "hsdp(R2xF4xE8)" not in labels  # 4 shards
    assert "fsdp(F8xE8)" in labels
    # the ep train takes (ep carved from tp's ranks first, then the shards), as simulate's
    # grid spans it: under tp 4 no ep of 2
    options = dataclasses.replace(options, layouts=["fsdp_tp"])
    carved = {(c.layout.tp, c.layout.dp_shard, c.layout.ep)
              for c in enumerate_grid(options, [8], "cpu", experts=8) if c.layout.ep > 1}
    assert carved == {(2, 4, 2), (2, 4, 4), (2, 4, 8), (4, 2, 4), (4, 2, 8)}


@pytest.mark.parametrize("fp8_problem", [None, "no float8 tensor cores"])
def test_fp8_is_tried_only_where_the_device_has_it(monkeypatch, fp8_problem):
    from parallab import precision
    from parallab.advise import default_precisions

    monkeypatch.setattr(precision, "device_problem", lambda cfg, device: fp8_problem)
    assert default_precisions("cpu") == ["fp32", "bf16"]
    assert default_precisions("cuda") == ["fp32", "bf16", "amp", *["fp8"] * (not fp8_problem)]


def test_only_needed_measures_the_cheapest_saver_that_fits():
    """advise.only_needed: once a layout fits without checkpointing or accumulation, its
    costlier variants are neither checked nor predicted."""
    from conftest import checked

    from parallab.advise import candidates as grid
    from parallab.config.planning import AdviseConfig

    options = AdviseConfig(precisions=["fp32"], layouts=["none"], max_accumulation=2)
    found = grid.enumerate_grid(options, [1], "cpu")
    grid.settle(found, lambda c: checked(*TINY, *c.overrides), lambda n: 1e6, True)
    kept = [c for c in found if c.reason is None]
    assert [c.label for c in kept] == ["none(1) b1 ac=none fp32"]
    assert kept[0].predicted_mb > 0
    others = [c for c in found if c is not kept[0]]
    assert len(others) == 5 and all(c.reason.startswith("not needed") and c.cfg is None
                                    and c.predicted_mb is None for c in others)
    # a budget below the plain layout's need: the savers are tried, cheapest first
    tight = grid.enumerate_grid(options, [1], "cpu")
    grid.settle(tight, lambda c: checked(*TINY, *c.overrides),
                lambda n: kept[0].predicted_mb * 0.99, True)
    assert "> budget" in tight[0].reason and tight[0].predicted_mb == pytest.approx(
        kept[0].predicted_mb)
    fits = [c for c in tight if c.reason is None]
    assert len(fits) == 1 and grid.cost(fits[0]) > 0 and fits[0].predicted_mb < kept[0].predicted_mb


def test_step_time_model_follows_the_bubble_and_the_measured_parts():
    """scaling.py's check on fixed figures: a pipeline's bubble, and here the parts a
    launched job measured."""
    from conftest import checked

    from parallab.advise import scaling
    from parallab.parallel import PLANS

    ddp = checked(*TINY, "parallel=ddp", "parallel.world_size=2")  # (config, layout)
    pipeline = checked(*TINY, "parallel=pipeline", "parallel.world_size=2",
                       "parallel.microbatches=4")
    assert pipeline[1].plan is PLANS["pipeline"] and ddp[1].plan is PLANS["ddp"]
    assert pipeline[1].bubble == 1 + 1 / 4
    assert ddp[1].bubble == 1.0
    # here, a layout with a process per rank computes the share its launched job measured
    # and waits what its collectives added to its replayed step, their bytes included, and
    # the loop's own time its run measured; one process driving the devices, world size
    # 1's step
    from parallab.advise.measure import Link

    link = Link(cores=None, threads=1)
    ran = {"comm_all_reduce_mb": 1.0, "comm_all_reduce_calls": 3, "share_s": 0.1,
           "collectives_s": 0.01, "loop_time_ms": 5.0}
    assert scaling.validate(ran, *ddp, link, 0.4, 1) == pytest.approx(0.1 + 0.01 + 0.005)
    # a pipeline: its parts through its schedule (4 micro-batches: 3 slots of 5 full),
    # what its sends added to its replayed step (their calls not charged a second time)
    sends = {"share_s": [0.12, 0.12], "share_alone_s": [0.1, 0.1], "comm_p2p_calls": 8,
             "collectives_s": 0.004}
    assert scaling.validate(sends, *pipeline, link, 0.4, 1) == pytest.approx(
        (0.1 + 3 * 0.12 + 0.1) / 4 + 0.004)
    model = checked(*TINY, "parallel=model", "parallel.world_size=2")
    assert scaling.validate({"share_s": 0.1}, *model, link, 0.4, 1) == pytest.approx(0.4)
    assert scaling.validate({}, *ddp, link, None, 1) is None  # nothing measured to go on


def test_a_pipelines_bubble_lends_its_cores_where_ranks_share_them():
    """The schedule's slots where every part computes take the parts' steps measured
    together; those the bubble leaves part-empty their steps alone, each slot the slowest
    busy part; with a device per rank at full speed, with 4 one-thread ranks on 2 cores at
    full speed while the bubble idles half of them."""
    from parallab.advise import scaling

    devices = scaling.cpu_rate(None, 1)
    parts, together = [0.1] * 4, [0.3] * 4  # each part's step alone, all ranks at once
    # 4 parts, 2 micro-batches: slots busy {0}, {0, 1}, {1, 2}, {2, 3}, {3}: none full
    assert scaling.pipeline_s(together, parts, 4, 2, devices) == pytest.approx(5 * 0.05)
    # 2 parts of 0.1 and 0.3 alone, 0.2 and 0.4 together: busy {0}, {0, 1}, {1}
    assert scaling.pipeline_s([0.2, 0.4], [0.1, 0.3], 2, 2, devices) == pytest.approx(
        0.05 + 0.2 + 0.15)
    shared = scaling.cpu_rate(2, 1)
    assert shared(4) == 0.5 and shared(2) == shared(1) == 1.0
    # 4 parts, one rank each: at most 2 busy at once (slots 1, 2, 2, 2, 1): full speed
    assert scaling.pipeline_s(together, parts, 4, 2, shared) == pytest.approx(5 * 0.05)
    # two pipelines side by side (dp 2 x pp 2) on 2 cores: 2 busy ranks at full speed,
    # then all 4 as measured together
    assert scaling.pipeline_s([0.25, 0.25], [0.1, 0.1], 4, 2, shared) == pytest.approx(
        0.05 + 0.125 + 0.05)


def test_a_candidate_whose_parts_cannot_be_measured_keeps_its_run(monkeypatch, caplog):
    """The step's parts serve the check here only: a failure to measure them is a warning
    and no prediction here, not a lost candidate (nor, for the others, a lost job)."""
    from parallab.advise import measure, parts

    def refuse(*args):
        raise ValueError("no schedule for this part\nsecond line")

    monkeypatch.setattr(parts, "share_s", refuse)
    spec = type("Spec", (), {"run_dir": "c0"})()
    with caplog.at_level("WARNING"):
        assert measure._step_parts(spec, None, {}, {1: None}) == {}
    assert "c0: its step's parts not measured: ValueError: no schedule for this part" in \
        caplog.text
    assert "second line" not in caplog.text
