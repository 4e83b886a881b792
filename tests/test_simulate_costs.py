"""What parallab simulate makes a step of, against values computed by hand: an op's
roofline, NCCL's time for a collective, a pipeline's bubble."""

from __future__ import annotations

import pytest

from parallab.parallel.layout import Layout


def test_a_matmul_pays_its_bytes_beside_its_flops_where_other_ops_pay_the_longer():
    """A matmul's time is its FLOPs at the peak x the efficiency plus its bytes at the
    memory's bandwidth (its kernel hides neither its first tiles' load nor its output's
    write); a memory-bound op's, and fused attention's, the longer of the two; none
    shorter than a launch."""
    from parallab.config.planning import NcclLatency
    from parallab.simulate import costs
    from parallab.simulate.cluster import Rates
    from parallab.simulate.ops import Op

    rates = Rates({"bf16": 1e15, "fp32": 1e14}, 0.5, 2e12, 1e12, 1e11, 8, 2**40, 5e-6,
                  NcclLatency())
    moved = ((0, 2 * 10**9), (1, 10**9))
    flops = 1e12  # 2 ms at half the bf16 peak; its 3 GB, 1.5 ms at 2 TB/s
    matmul = Op("forward", "block", "matmul", flops, moved[:1], moved[1:])
    assert costs.op_seconds(matmul, rates, 1e14) == pytest.approx(2e-3 + 1.5e-3)
    attention = Op("forward", "block", "attention", flops, moved[:1], moved[1:])
    assert costs.op_seconds(attention, rates, 1e14) == pytest.approx(2e-3)
    wide = Op("forward", "block", "matmul", flops, moved[:1], moved[1:], wide=True)
    assert costs.op_seconds(wide, rates, 1e14) == pytest.approx(20e-3 + 1.5e-3)
    memory = Op("forward", "block", "memory", 0.0, moved[:1], moved[1:])
    assert costs.op_seconds(memory, rates, 1e14) == pytest.approx(1.5e-3)
    tiny = Op("forward", "block", "matmul", 1e3, ((0, 64),), ((1, 64),))
    assert costs.op_seconds(tiny, rates, 1e14) == pytest.approx(5e-6)


def test_a_collective_takes_nccls_time():
    from parallab.config.planning import NcclLatency
    from parallab.simulate.cluster import Group, Rates

    rates = Rates({"bf16": 1e15, "fp32": 1e14}, 1.0, 3e12, 450e9, 50e9, 8, 80 * 2**30, 0.0,
                  NcclLatency())
    sent = 2 * 7 / 8 * 2**30  # a 1 GiB tensor all-reduced by 8 ranks: its bus bytes
    ring = (8.4 + 14 * 3.4) * 1e-6 + sent / 450e9
    assert rates.collective_s("all_reduce", sent, Group(8, 1)) == pytest.approx(ring)
    small = 2 * 7 / 8 * 1024  # LL: a tenth of the latency, a quarter of the bandwidth
    assert rates.collective_s("all_reduce", small, Group(8, 1)) == pytest.approx(
        (3.6 + 14 * 0.47) * 1e-6 + small / (450e9 / 4))
    # 16 ranks over 2 nodes: 2 of its 30 ring steps cross the network, over the 8 NICs of
    # each node's 8 ranks; a tree (log2 of the nodes deep) is no faster for a large tensor
    sent = 2 * 15 / 16 * 2**30
    across = (8.4 + 28 * 3.4 + 2 * 9.6) * 1e-6 + sent / (8 * 50e9)
    assert rates.collective_s("all_reduce", sent, Group(16, 2)) == pytest.approx(across)
    # a gather of 1024 ranks one a node: its ring's 1023 steps, each over the network
    assert rates.collective_s("all_gather", 1e6, Group(1024, 1024)) == pytest.approx(
        min((8.4 + 1023 * 9.6) * 1e-6 + 1e6 / 50e9, (3.6 + 1023 * 2.7) * 1e-6 + 4e6 / 50e9))
    # tp's ranks are neighbours: 8 of them in a node of 8; a data-parallel group 8 apart,
    # one per node
    assert Group.of(8, 1, 8) == Group(8, 1) and Group.of(16, 8, 8) == Group(16, 16)
    assert Group.of(4, 2, 8) == Group(4, 1) and Group.of(8, 2, 8) == Group(8, 2)
    # groups that do not sit evenly on nodes: tp 4 on 6 GPUs a node puts ranks 4-7 on two,
    # and that group's links are the slowest
    assert Group.of(4, 1, 6) == Group(4, 2) and Group.of(2, 2, 6) == Group(2, 2)


def test_a_pipelines_step_is_its_bubble_times_its_slots():
    from parallab.config.planning import NcclLatency
    from parallab.simulate import costs, step
    from parallab.simulate.cluster import Rates
    from parallab.simulate.trace import Op, Shape, Trace

    rates = Rates({"bf16": 1e12, "fp32": 1e12}, 1.0, 1e18, 1e12, 1e12, 8, 2**40, 0.0,
                  NcclLatency())
    found = Trace(Shape(), ops=[Op("forward", "block", "matmul", 1e9, (), ()),
                                Op("backward", "block", "matmul", 2e9, (), ())],
                  params={"before": 0.0, "block": 10.0, "after": 0.0})
    layout = Layout.planned(2, pp=2, microbatches=4, batch_size=4, schedule="1f1b")
    predicted = step.predict(found, costs.costs(found, rates, False, False), layout,
                             step.Run(), rates, 4)
    slot = 2 * (1e9 + 2e9) / 1e12  # two blocks a stage, forward and backward
    assert predicted.parts["compute_s"] == pytest.approx(4 * slot)
    assert predicted.parts["bubble_s"] == pytest.approx(slot * 1)  # (pp - 1) slots
    assert predicted.step_time_s == pytest.approx(1.25 * 4 * slot, rel=1e-6)
    assert sum(predicted.parts.values()) == pytest.approx(predicted.step_time_s)


def test_a_pipelines_replicas_average_beside_the_first_ranks_last_backwards():
    """The replicas' all-reduce of a pipeline rank's gradients starts, part by part, as the
    part's last backward makes them (parallel/replicas.py): under interleaved 1F1B the
    later part's runs beside the pp backwards after its last one, so that less outlasts
    the compute than under 1F1B's one part; a zero-bubble schedule's waits for the flush."""
    from parallab.config.planning import NcclLatency
    from parallab.simulate import costs, step
    from parallab.simulate.cluster import Rates
    from parallab.simulate.trace import Op, Shape, Trace

    rates = Rates({"bf16": 1e12, "fp32": 1e12}, 1.0, 1e18, 1e12, 1e10, 8, 2**40, 0.0,
                  NcclLatency())
    found = Trace(Shape(), ops=[Op("forward", "block", "matmul", 1e9, (), ()),
                                Op("backward", "block", "matmul", 2e9, (), ())],
                  params={"before": 0.0, "block": 5e6, "after": 0.0})

    def exposed(schedule: str, v: int) -> float:
        layout = Layout.planned(32, dp_replicate=4, pp=8, microbatches=16, batch_size=16,
                                schedule=schedule, stages_per_rank=v)
        predicted = step.predict(found, costs.costs(found, rates, False, False), layout,
                                 step.Run(bucket_mb=1.0), rates, 16)
        return predicted.parts["all_reduce_s"]

    whole = exposed("interleaved_zb", 2)  # every bucket after the flush
    assert whole > 2 * 3 / 4 * (2 * 5e6 * 4) / 1e10  # a ring over 4 replicas, float32
    one_part, interleaved = exposed("1f1b", 1), exposed("interleaved_1f1b", 2)
    backward = 2e9 / 1e12  # a block's backward of a micro-batch
    # 1F1B: the rank's one part (two blocks) beside its last backward, a bucket at a time
    assert one_part == pytest.approx(whole - 2 * backward, rel=0.1)
    # interleaved, a block a part: the later part's half beside the pp = 8 backwards after
    # its last one (hidden), the first part's half beside its own last backward
    assert interleaved == pytest.approx(whole / 2 - backward, rel=0.1)


def test_a_pipelines_sharded_part_reduces_after_its_last_backward_not_beside_it():
    """FSDP2 under torch's schedules reduces a part's shards once its last backward is done
    and makes the compute wait for them (REDUCE_GRAD, finalize_backward): a longer backward
    hides none of it, where fsdp's blocks reduce beside the backward of the next."""
    from parallab.config.planning import NcclLatency
    from parallab.simulate import costs, step
    from parallab.simulate.cluster import Rates
    from parallab.simulate.trace import Op, Shape, Trace

    rates = Rates({"bf16": 1e12, "fp32": 1e12}, 1.0, 1e18, 1e12, 1e10, 8, 2**40, 0.0,
                  NcclLatency())

    def reduced(layout: Layout, backward_flops: float) -> float:
        found = Trace(Shape(), ops=[Op("forward", "block", "matmul", 1e9, (), ()),
                                    Op("backward", "block", "matmul", backward_flops, (), ())],
                      params={"before": 0.0, "block": 5e6, "after": 0.0})
        return step.predict(found, costs.costs(found, rates, False, False), layout,
                            step.Run(), rates, 4).parts["reduce_scatter_s"]

    part = Layout.planned(4, dp_shard=2, pp=2, microbatches=4, batch_size=4, schedule="1f1b")
    assert reduced(part, 2e11) == pytest.approx(reduced(part, 2e6))
    fsdp = Layout.planned(2, dp_shard=2, batch_size=4)
    assert reduced(fsdp, 2e11) < reduced(fsdp, 2e6) / 2


def test_a_freed_storage_takes_its_record_with_it():
    """The trace knows what made each storage by its address; a storage the step frees
    takes that record with it, so that the next storage at its address (made by an op the
    trace does not record, an empty one) is not taken for the freed one: a compiled step's
    activations hung on what had run in the process before (one NeMo row 51-62 GiB)."""
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed._tools.mod_tracker import ModTracker

    from parallab.simulate.ops import Recorder

    recorder = Recorder(ModTracker(), "block", causal_lm=False)
    with FakeTensorMode(), recorder:
        ones = torch.ones(1024)
        doubled = ones * 2  # a memory-bound op's output: recorded as made by it
        key = doubled.untyped_storage()._cdata
        assert recorder.produced[key][1] == "memory"
        del doubled
        assert key not in recorder.produced and key not in recorder.held
        assert recorder.live == 1024 * 4  # the ones alone
