"""parallab simulate cluster=this: this machine's measured rates (its cores, copies, ops and
collectives, measured again when stale or taken while busy) standing for a cluster's, and
runs measured here set beside the predictions (simulate.measured)."""

from __future__ import annotations

import json
import os

import pytest

from parallab.parallel.layout import Layout


@pytest.mark.distributed
def test_this_machines_measured_costs_stand_for_nccls_and_a_gpus():
    """cluster=this: a collective at the fixed cost and rate its kind was measured at, and
    a pipeline's schedule paying its own time on each pass through a stage (and in the
    idle slots, which last as long as a busy one); the figures measured for real by three
    processes over gloo."""
    from parallab.config.planning import NcclLatency
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

    # measured for real by three processes: every kind a rate, every cost a figure (what a
    # loaded machine leaves of a difference may be nothing, never less); an odd count, over
    # which DTensor's matmuls of 16 wide had not split (a traceback at cluster=this), and
    # whose odd rank out pipes nothing
    measured = rank_costs.measure(3, 1, 5e-6)
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
    from parallab.config.planning import ClusterConfig
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

    from parallab.config.planning import NcclLatency
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
