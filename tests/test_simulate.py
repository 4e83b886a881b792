"""parallab simulate: a step on a cluster from one block traced on fake tensors. A block's
FLOPs against hand-computed values, memory at world size 64 against the model laid out on
fake tensors (an op's, a collective's and a pipeline's time by hand: test_simulate_costs.py;
cluster=this: test_simulate_this.py; precisions: test_simulate_precision.py; the answer:
test_simulate_answers.py; its commands and refusals: test_simulate_commands.py)."""

from __future__ import annotations

import json

import pytest

from parallab.parallel.layout import Layout

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


def test_the_weights_gradients_are_state_not_temporaries():
    """The step's peak of temporaries leaves out the weights' gradients (the training state
    holds them, or FSDP2's gathered ones): a vocabulary twice as large adds at most its
    8 tokens' logits, not its embedding's and head's gradients (512 x 256 float32 each,
    which the peak counted before)."""
    from parallab.simulate.trace import Shape

    shape, width = Shape(rows=1, seq_len=8, precision="fp32"), 512
    found = [traced(shape, f"model.vocab_size={vocab}", f"model.width={width}")
             for vocab in (256, 512)]
    assert 0 <= found[1].peak_transient - found[0].peak_transient < width * 256 * 4
    # which of the gradients outside the block the peak saw (FSDP2's root holds them whole
    # in the compute dtype): this wide model's peak comes after its head's backward, a
    # narrow one's long sequence peaks at the loss, before any
    assert found[0].ends_grads == 4 * found[0].params["after"]
    assert traced(Shape(rows=1, seq_len=512, precision="fp32")).ends_grads == 0


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


def test_fsdp_reduces_each_accumulated_micro_batch_and_keeps_only_shards():
    """Gradient accumulation under FSDP2: each micro-batch's gradients reduce-scattered, the
    blocks' and the root's (with no compute to hide behind, every gather and reduction
    exposed: 2 gathers and one reduction a block and micro-batch, one of each for the
    root), HSDP's all-reduce over the replicas once, and no whole gradients kept."""
    from parallab.config.planning import NcclLatency
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
    # DDP's all-reduce in the reduce dtype too (no latency here: exactly half in bf16)
    ddp = Layout.planned(2, 2, 1, accumulation=1, batch_size=1)
    exposed = [step.predict(found, costs.costs(found, rates, False, False), ddp,
                            step.Run(reduce_bytes=size), rates, 3).parts["all_reduce_s"]
               for size in (4, 2)]
    assert exposed[1] == pytest.approx(exposed[0] / 2)
    # the root's gradients the traced peak saw (float32 there), whole in bf16 under FSDP2
    fsdp = Layout.planned(2, 1, 2, accumulation=1, batch_size=1)
    gathered = [step.predict(t, costs.costs(t, rates, False, False), fsdp, step.Run(), rates,
                             3).memory["gathered"]
                for t in (found, Trace(Shape(), ops=[], params=found.params, ends_grads=4e5))]
    assert (gathered[1] - gathered[0]) * 2**30 == pytest.approx(2e5)
    # a pipeline's sharded part (torch's stages) keeps its weights and gradients whole from
    # the first micro-batch to the flush, and reduces them once; its float32 shards of the
    # gradients come after the flush, when the activations are gone: not held beside them
    found = Trace(Shape(), ops=[], params={"before": 0.0, "block": 1e6, "after": 0.0})
    layout = Layout.planned(4, dp_shard=2, pp=2, microbatches=4, batch_size=4, schedule="1f1b")
    for reduced in (4, 2):  # precision.reduce_dtype=float32, bfloat16: half the bytes
        predicted = step.predict(found, costs.costs(found, rates, False, False), layout,
                                 step.Run(reshard_after_forward=False, reduce_bytes=reduced),
                                 rates, 4)
        assert predicted.parts["reduce_scatter_s"] == pytest.approx(  # its 2 blocks
            2 * scatter * reduced / 4)
        assert predicted.parts["all_gather_s"] == pytest.approx(2 * gather)
        assert predicted.memory["gathered"] * 2**30 == pytest.approx(2 * 1e6 * (2 + reduced))
        assert predicted.memory["state"] * 2**30 == pytest.approx(2 * 1e6 / 2 * (4 + 8))


@pytest.mark.parametrize("layout", [
    ["parallel=fsdp", "parallel.world_size=64"],
    ["parallel=tp", "parallel.world_size=2"],
    ["parallel=fsdp_tp", "parallel.world_size=4", "parallel.sequence_parallel=true"],
    ["parallel=fsdp_tp", "parallel.world_size=4", "parallel.sequence_parallel=true",
     "parallel.regather_in_backward=true"],
    ["parallel=pipeline", "parallel.world_size=2", "parallel.schedule=interleaved_1f1b",
     "parallel.stages_per_rank=2", "parallel.microbatches=4", "data.batch_size=8",
     "model.layers=4"]], ids=["fsdp", "tp", "fsdp_tp_sp", "fsdp_tp_sp_regather", "interleaved"])
def test_memory_is_the_fake_tensor_layouts(layout):
    """The composed figure (a block's state and activations, times the blocks) against
    the whole model laid out on fake tensors, as advise predicts a rank's memory (the
    busiest rank's): by FSDP2 at world size 64; split by tensor parallelism, whose
    weights' shards autograd saves for backward are the state's, not activations, and with
    the sequence cut between tp's ranks (its gathered inputs kept, or gathered again in
    backward); a rank of an interleaved pipeline, its parts'
    micro-batches in flight as torch's schedule holds them."""
    from conftest import checked

    from parallab.advise import memory
    from parallab.checks import trial
    from parallab.simulate import run, search

    cfg, layout_here = checked(*GPT, "data=bytes", *layout, "device=cpu")
    batch = trial.one_batch(cfg, cfg.data.batch_size)
    ranks = range(layout_here.world_size) if layout_here.cuts_model else [0]
    state_mb, activations_mb = max((memory.predict(cfg, layout_here, batch, rank)
                                    for rank in ranks), key=sum)
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


def test_a_transformers_models_trace_warns_the_user_of_nothing_of_its_own():
    """transformers' hub kernels (the kernels package) call its functions, rotary
    embedding's among them, through modules nested in modules of one class, which torch's
    ModTracker takes for a broken module hierarchy: it warns that it may be "messed up",
    asking for a bug report, and swaps the process's warning format. Neither reaches the
    user of a simulation."""
    import importlib.util
    import warnings

    from conftest import TINY_LLAMA

    from parallab.simulate.trace import Shape

    if importlib.util.find_spec("kernels") is None:  # no nesting to keep quiet
        pytest.skip("needs transformers' kernels package (installed with transformers 5.25)")
    kept = warnings.formatwarning
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        found = traced(Shape(rows=2, seq_len=32, precision="fp32"), base=[
            *TINY_LLAMA, "data.seq_len=32", "data.batch_size=2"])
    assert found.ops  # traced
    assert not [w for w in said if "hierarchy" in str(w.message)], [str(w.message) for w in said]
    assert warnings.formatwarning is kept
