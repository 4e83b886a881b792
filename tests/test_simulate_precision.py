"""parallab simulate's precisions: float8's matmuls at the fp8 peak with their casts (and
rowwise scales' added pass), float16 under pipelines, and a float16 step at the GPU's own
float16 peak."""

from __future__ import annotations

import pytest
from test_simulate import GPT, configured, traced

from parallab.config.errors import ConfigError


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
    said = {name: (tmp_path / name / "simulate.md").read_text() for name in step}
    assert "kept for backward in bf16" in said["fp8"] and "Float8" not in said["bf16"]
    gathered = simulate_in_process([*GPT, *wide, "precision=fp8", "precision.fp8_all_gather=true"],
                                   tmp_path / "gathered")["layouts"][0]["parts"]
    assert gathered["all_gather_s"] < step["fp8"]["all_gather_s"]
    with pytest.raises(ConfigError, match="has no float8 tensor cores"):
        simulate_in_process([*GPT, *wide, "precision=fp8", "cluster=a100"], tmp_path / "no")
    with pytest.raises(ConfigError, match="^precision=fp8 with cluster=this: .* CUDA GPUs"):
        simulate_in_process([*GPT, "precision=fp8", "cluster=this"], tmp_path / "here")
    # float8 under tp, as train splits it (torchao's float8 styles): its matmuls too
    split = {name: simulate_in_process([*GPT, *wide, f"precision={name}", "parallel=fsdp_tp",
                                        "parallel.tp=2"], tmp_path / f"tp_{name}")
             ["layouts"][0]["parts"] for name in ("bf16", "fp8")}
    assert 1.1 < split["bf16"]["compute_s"] / split["fp8"]["compute_s"] < 2


@pytest.mark.parametrize("checkpointing", ["none", "full"])
def test_rowwise_scales_add_a_pass_over_each_gradient_matmuls_output(checkpointing):
    """precision.fp8_recipe=rowwise: torchao multiplies each gradient matmul's output by
    its scales after the kernel (one more read and write of it); the forward's matmuls,
    run again in backward by a checkpoint, take no such pass. Nothing else moves."""
    import dataclasses

    from parallab.simulate import costs, rates_of
    from parallab.simulate.trace import Shape

    rates = rates_of(configured("cluster=h100").cluster, 8)
    found = traced(Shape(rows=2, seq_len=32, precision="fp8", checkpointing=checkpointing))
    marked = [op for op in found.ops if op.fp8]
    again = [op for op in marked if op.recomputed]
    assert len(again) == (3 if checkpointing == "full" else 0)  # qkv, proj, the MLP's first
    assert all(op.phase == "backward" for op in again)
    gradients = [op for op in marked if op.phase == "backward" and not op.recomputed]
    assert len(gradients) == 8  # each of the block's four Linear layers: input and weight
    priced = {recipe: costs.costs(dataclasses.replace(
        found, shape=dataclasses.replace(found.shape, fp8_recipe=recipe)), rates, True, False)
        for recipe in ("tensorwise", "rowwise")}
    added = {key: priced["rowwise"].compute[key] - priced["tensorwise"].compute.get(key, 0)
             for key in priced["rowwise"].compute}
    passes = sum(costs._with_overhead(2 * sum(b for _, b in op.writes) / rates.hbm, rates)
                 for op in gradients)
    assert added[("backward", "block")] == pytest.approx(passes, rel=1e-9)
    assert added[("forward", "block")] == 0
    assert all(added[key] == 0 for key in added if key[1] != "block")


def test_float16_pipelines_are_simulated_as_train_runs_them():
    """precision=fp16 under a pipeline (train scales the schedule's loss): parallel=auto's
    grid holds pipeline layouts beside the others, no longer leaving them out."""
    from parallab.simulate import Facts, rates_of, run

    cfg = configured(*GPT, "parallel=auto", "parallel.world_size=2", "precision=fp16")
    run.check(cfg)
    found, notes = run.candidates_of(cfg, None, Facts.of(cfg), rates_of(cfg.cluster, 2))
    assert [c for c in found if c.layout.pp == 2 and c.reason is None]
    assert not [n for n in notes if n.startswith("No pipeline layouts")]


def test_a_float16_step_is_priced_at_the_gpus_float16_peak():
    """precision=fp16 and amp (float16 on CUDA) had been priced at bf16's peak whatever
    the GPU's own fp16 peak (+cluster.peak_tflops.fp16 taken and not used); bf16 still is."""
    from parallab.simulate import run

    def predicted(*overrides):
        return run.given(configured(*GPT, "parallel=fsdp", "parallel.world_size=8",
                                    "cluster=h100", *overrides))[0].prediction

    bf16, fp16 = predicted("precision=bf16"), predicted("precision=fp16")
    assert fp16.step_time_s == pytest.approx(bf16.step_time_s)  # H100: the same peak
    slow = "+cluster.peak_tflops.fp16=0.01"  # far below its bf16 peak: matmuls outlast all
    for precision in ("fp16", "amp"):
        half = predicted(f"precision={precision}", slow)
        assert half.step_time_s > bf16.step_time_s
        assert half.mfu > fp16.mfu  # its FLOPs over its own, lower, peak
    assert predicted("precision=bf16", slow).step_time_s == pytest.approx(bf16.step_time_s)
