"""parallab simulate under tensor parallelism: a traced block's split matmuls and its
collectives, the logits cut by vocabulary, a transformers model's plan made sequence
parallel, and where auto tries it."""

from __future__ import annotations

import dataclasses

import pytest
from conftest import TINY_LLAMA
from test_simulate import configured, flops, traced


def test_tensor_parallel_halves_a_blocks_matmuls_and_adds_its_all_reduces():
    from parallab.simulate.trace import Shape

    tokens, width = 64, 64
    split = traced(Shape(tp=2, rows=2, seq_len=32, precision="fp32"))
    assert flops(split, "forward", "block", "matmul") == 2 * tokens * 12 * width**2 / 2
    sends = [op for op in split.ops if op.kind == "collective" and op.region == "block"]
    forward = [op for op in sends if op.phase == "forward"]
    # the two row-wise layers' outputs, all-reduced over the pair: 2(n-1)/n of each
    assert [op.collective for op in forward] == ["all_reduce", "all_reduce"]
    assert all(op.sent == tokens * width * 4 and op.group == 2 for op in forward)
    assert split.params["block"] == pytest.approx(12 * width**2 / 2 + 13 * width, rel=0.1)


def test_tensor_parallel_keeps_the_logits_cut_by_vocabulary():
    """The head's logits stay cut over the tp ranks and the cross-entropy runs on each
    rank's slice (loss_parallel): the loss reads half the logits a rank of tp 1 reads, and
    nothing gathers them; a label-smoothed cross-entropy, which loss_parallel does not
    compute, gets them gathered whole."""
    from parallab.simulate.trace import Shape

    shape = Shape(rows=2, seq_len=32, precision="fp32")
    whole, split = traced(shape), traced(dataclasses.replace(shape, tp=2))
    smoothed = traced(dataclasses.replace(shape, tp=2), "loss=cross_entropy",
                      "+loss.label_smoothing=0.1")
    read = lambda found: sum(b for op in found.ops if not op.in_model  # noqa: E731
                             and op.phase == "forward" for _, b in op.reads)
    gathers = lambda found: [op for op in found.ops  # noqa: E731
                             if op.collective == "all_gather" and op.region == "after"]
    logits = 2 * 32 * 256 * 4
    assert read(whole) > 2 * logits and read(split) == pytest.approx(read(whole) / 2, rel=0.05)
    assert not gathers(split)
    assert [op.sent for op in gathers(smoothed)] == [logits / 2]


LLAMA = [*TINY_LLAMA, "data.seq_len=32", "data.batch_size=2"]


def test_a_transformers_model_under_sequence_parallel_gathers_each_input_once():
    """Its own plan made sequence parallel (sequence_parallel.sequence_plan): a block's attention
    and MLP each gather the sequence once and reduce-scatter their output, and backward
    reduce-scatters each input's gradient once, where the plain plan all-reduces the
    gradient of q, k, v, gate and up one by one (5 a block) besides the two outputs. A
    column-split output the plan gathers stays gathered (OLMo 2's q and k, normed whole)."""
    from parallab.simulate.trace import Shape

    def block(sequence_parallel: bool, kind: str = "Llama") -> list[tuple[str, str]]:
        found = traced(Shape(tp=2, sequence_parallel=sequence_parallel, rows=2, seq_len=32,
                             precision="fp32"), f"model._target_=transformers.{kind}ForCausalLM",
                       f"model.config._target_=transformers.{kind}Config", base=LLAMA)
        return [(op.phase, op.collective) for op in found.ops
                if op.kind == "collective" and op.region == "block"]

    plain, cut, olmo = block(False), block(True), block(True, "Olmo2")
    assert plain.count(("backward", "all_reduce")) == 5
    assert plain.count(("forward", "all_reduce")) == 2
    assert sorted(cut) == sorted([("forward", "all_gather")] * 2 +
                                 [("forward", "reduce_scatter")] * 2 +
                                 [("backward", "all_gather")] * 2 +
                                 [("backward", "reduce_scatter")] * 2)
    # OLMo 2's plan gathers q, k and v whole (its norms read them so): they stay gathered
    assert olmo.count(("forward", "all_gather")) == 2 + 3 and ("backward", "all_reduce") \
        not in olmo


def test_gathering_again_in_backward_keeps_a_blocks_slice_of_each_gathered_input():
    """parallel.regather_in_backward=true (Megatron-LM's sequence parallelism): a block's
    attention and MLP each save their rank's slice of the sequence in place of the whole
    input they gathered, and gather it again in backward. The block keeps half of two
    gathered inputs less at tp 2 (both the float32 stream's and FSDP's bf16 one), backward
    all-gathers twice more, and its matmuls are the same. Where the stream is float32 under
    bf16's autocast (a pipeline's parts not sharded), what the split layers keep is
    autocast's copy of it, one each (q, k, v, gate, up): those are made again from the
    gathered input too, and the block keeps two float32 slices in place of five copies."""
    from parallab.simulate.trace import Shape

    whole = 2 * 32 * 64  # a gathered input's elements: rows x sequence x hidden
    for precision, gathered, kept_bytes in (("fp32", False, 2 * whole * 4),
                                           ("bf16", True, 2 * whole * 2),
                                           ("bf16", False, 5 * whole * 2)):
        shape = Shape(tp=2, sequence_parallel=True, rows=2, seq_len=32, precision=precision,
                      gathered=gathered)
        kept, again = (traced(dataclasses.replace(shape, regather=r), base=LLAMA)
                       for r in (False, True))
        itemsize = 2 if gathered else 4  # the stream's
        assert kept.saved["block"] - again.saved["block"] == kept_bytes - 2 * whole * \
            itemsize / 2
        gathers = lambda found: [op.sent for op in found.ops  # noqa: E731
                                 if op.collective == "all_gather" and op.region == "block"
                                 and op.phase == "backward"]
        assert len(gathers(again)) == len(gathers(kept)) + 2
        assert sorted(gathers(again))[-2:] == [whole * itemsize / 2] * 2
        for phase in ("forward", "backward"):
            assert flops(again, phase, "block", "matmul") == flops(kept, phase, "block",
                                                                   "matmul")


def test_gathering_again_is_refused_where_torchaos_styles_gather_in_float8():
    """precision=fp8's tensorwise recipe splits its Linear layers by torchao's styles,
    which gather in float8 and keep that: refused with regather_in_backward (simulate runs
    train's checks); the rowwise recipe gathers bf16, which is gathered again."""
    from parallab.config.errors import ConfigError
    from parallab.simulate.run import check

    layout = [*LLAMA, "parallel=tp", "parallel.world_size=2", "parallel.sequence_parallel=true",
              "parallel.regather_in_backward=true", "precision=fp8", "cluster=h100"]
    with pytest.raises(ConfigError, match="precision=fp8's tensorwise recipe"):
        check(configured(*layout))
    assert check(configured(*layout, "precision.fp8_recipe=rowwise")).regather


def test_auto_cuts_a_transformers_models_sequence_under_tp_pipelines_too():
    """parallel=auto tries sequence parallelism with a transformers model's own plan
    wherever tp splits it, a pipeline's too (each part hands on its slice of the
    sequence), and the pipeline's sends are that slice: a tp-th of a block's input."""
    from parallab.simulate import Facts, search
    from parallab.simulate.trace import Shape

    cfg = configured(*LLAMA, "parallel=auto", "parallel.world_size=8", "cluster=h100")
    found = search.grid(cfg, Facts.of(cfg), 8)
    cut = [c.layout for c in found if c.layout.sequence_parallel]
    assert cut and all(x.tp > 1 for x in cut) and any(x.pp > 1 for x in cut)
    # those whose blocks are not checkpointed twice: their gathered inputs kept, and
    # gathered again in backward; not compiled (train refuses both), never without the
    # sequence cut, nor where each block is checkpointed (it keeps no gathered input)
    again = [x for x in cut if x.regather]
    assert again and all(x.checkpointing == "none" for x in again)
    assert sorted(map(repr, (dataclasses.replace(x, regather=False) for x in again))) == \
        sorted(repr(x) for x in cut if x.checkpointing == "none" and not x.regather)
    assert not any(c.layout.regather for c in found if not c.layout.sequence_parallel)
    for given, twins in ((["trainer.compile=true"], False), (["precision=fp8"], False),
                         (["precision=fp8", "precision.fp8_recipe=rowwise"], True)):
        # torchao's tensorwise styles gather in float8 and keep that: nothing to regather
        other = configured(*LLAMA, "parallel=auto", "parallel.world_size=8", "cluster=h100",
                           *given)
        found = search.grid(other, Facts.of(other), 8)
        assert any(c.layout.sequence_parallel for c in found)
        assert any(c.layout.regather for c in found) == twins, given
    whole, sliced = (traced(Shape(tp=2, sequence_parallel=sp, rows=2, seq_len=32,
                                  precision="fp32"), base=LLAMA).boundary_bytes
                     for sp in (False, True))
    assert whole > 0 and sliced == whole / 2


def test_auto_ranks_the_gathered_inputs_gathered_again_as_train_runs_them(tmp_path):
    """A layout of auto's with the inputs gathered again keeps less than its twin that
    keeps them gathered, and takes longer (the gathers again); its command says so and
    passes train's checks."""
    import json
    import shlex

    from conftest import checked

    from parallab.commands import simulate_in_process

    simulate_in_process([*LLAMA, "parallel=auto", "parallel.world_size=2", "cluster=h100",
                         "precision=bf16"], tmp_path)
    found = json.loads((tmp_path / "simulate.json").read_text())["layouts"]
    again = "parallel.regather_in_backward=true"
    twins = [(e, next(k for k in found if k["command"] == e["command"].replace(again + " ",
                                                                                "")))
             for e in found if again in e["command"]]
    assert twins
    for regathered, kept in twins:
        assert regathered["memory_gb"]["activations"] < kept["memory_gb"]["activations"]
        assert regathered["parts"]["tp_all_gather_s"] > kept["parts"]["tp_all_gather_s"]
    cfg, layout = checked(*shlex.split(twins[0][0]["command"])[2:], "device=cpu")
    assert cfg.parallel.regather_in_backward and layout.regather


def test_a_compiled_block_keeps_the_collective_outputs_it_is_made_again_from():
    """torch.compile's partitioner makes memory-bound chains again in backward but never a
    collective: a chain that starts from one keeps it. Under sequence parallelism a
    block's gathered input is its gather's output at one sequence a micro-batch and a
    copy of its chunks at more (which compiled backward would make again, from the
    gather's output it keeps): what a compiled block keeps grows with the sequences alike
    from 1 to 2 as from 2 to 4."""
    from parallab.simulate.trace import Shape

    kept = {rows: traced(Shape(tp=2, sequence_parallel=True, rows=rows, seq_len=32,
                               precision="bf16", gathered=True), base=LLAMA
                         ).saved_compiled["block"] for rows in (1, 2, 4)}
    assert kept[4] - kept[2] == 2 * (kept[2] - kept[1]) > 0


def test_a_chain_from_a_collective_keeps_the_cheaper_cut_once():
    """What a compiled step keeps for chains from a collective's output (sources.py): the
    cheaper of the output and what backward reads of them (a float32 gather's one bf16
    copy: the copy; its three: the gather), once; nothing where the output is saved as
    it is, or where the chain crosses the block's edge."""
    import torch

    from parallab.simulate.sources import Needed, Sources

    def kept(copies: int, saved_too: bool = False, region: str = "block") -> float:
        sources, needed = Sources(), Needed()
        gathered = torch.zeros(64, 32)  # float32: 8 KiB
        sources.collective(gathered, gathered.untyped_storage().nbytes(), True)
        waited = gathered.view(64, 32)
        sources.waited(gathered, waited)
        made = [waited.to(torch.bfloat16) for _ in range(copies)]  # 4 KiB each
        for copy in made:
            sources.passed([waited], [copy], in_block=True)
            needed.add(sources, copy, copy.untyped_storage().nbytes(), region, True)
        if saved_too:
            needed.add(sources, waited, 8192, region, False)
        return needed.kept(region)

    assert kept(1) == 4096 and kept(3) == 8192
    assert kept(3, saved_too=True) == 0 and kept(1, region="after") == 0


def test_a_storage_freed_leaves_its_address_to_a_storage_counted_again():
    """What the trace counts once per storage (what autograd saves) is keyed by the
    storage's lifetime, not its address: a saved tensor freed before backward (a branch
    the loss does not read) leaves its address to the next storage, which a key by address
    took for the first and left out (a DeepSeek-V3 MoE block's 0.44 GiB, by the order of a
    process's allocations)."""
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode

    from parallab.simulate.sources import Lifetimes

    lifetimes = Lifetimes()
    with FakeTensorMode():
        first = torch.empty(1024, 1024)
        address, key = first.untyped_storage()._cdata, lifetimes.of(first.untyped_storage())
        assert lifetimes.of(first[1:].untyped_storage()) == key  # a view: the same storage
        del first
        for _ in range(100):  # the allocator hands the address on within a few
            again = torch.empty(1024, 1024)
            if again.untyped_storage()._cdata == address:
                break
        assert again.untyped_storage()._cdata == address
        assert lifetimes.of(again.untyped_storage()) != key
