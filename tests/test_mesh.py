"""Layouts from one device mesh: degrees, tensor parallel plans, pp x dp, pp x tp,
and each layout training as one device does (real gloo processes)."""

from __future__ import annotations

import itertools

import pytest
import torch
from conftest import FAST, checked, losses, read_metrics

from parallab.config.errors import ConfigError
from parallab.models.gpt import GPT
from parallab.models.mlp import MLP
from parallab.parallel.layout import resolve_degrees
from parallab.parallel.mesh import tp_problem
from parallab.testing import textbook_volume
from parallab.training import checkpoint, weights


def degrees(world_size, dp_replicate=1, dp_shard=None, tp=1):
    given = dict(dp_replicate=dp_replicate, dp_shard=dp_shard, tp=tp)
    resolved = resolve_degrees(given, world_size)
    assert given == dict(dp_replicate=dp_replicate, dp_shard=dp_shard, tp=tp)  # left as given
    return resolved["dp_replicate"], resolved["dp_shard"], resolved["tp"]


def test_one_null_degree_is_inferred_and_a_mismatch_is_one_line():
    assert degrees(8, dp_replicate=2, tp=2) == (2, 2, 2)
    assert degrees(4, dp_shard=1, tp=None) == (1, 1, 4)
    assert degrees(4, dp_shard=2, tp=2) == (1, 2, 2)
    for bad, message in [
        (dict(world_size=4, dp_replicate=3), "parallel.dp_replicate=3, parallel.dp_shard=null, "
                                             "parallel.tp=1 multiply to 3 x ?, but "
                                             "parallel.world_size=4"),
        (dict(world_size=4, dp_shard=2, tp=1), "multiply to 2, but parallel.world_size=4"),
        (dict(world_size=4, dp_replicate=None, tp=None), "at most one degree may be null"),
        (dict(world_size=4, tp=0), "parallel.tp=0 is out of range"),
    ]:
        with pytest.raises(ConfigError, match=message.replace("?", r"\?")):
            degrees(**bad)


@pytest.mark.parametrize("overrides, shape, dp, properties", [
    (["parallel=none"], (), 1, set()),
    (["parallel=ddp", "parallel.world_size=4"], (4, 1, 1), 4, {"replicas_only"}),
    (["parallel=fsdp", "parallel.world_size=4"], (1, 4, 1), 4, {"sharded"}),
    (["parallel=hsdp", "parallel.world_size=4"], (2, 2, 1), 4, {"sharded"}),
    (["parallel=fsdp_tp", "parallel.world_size=4", "model=mlp"], (1, 2, 2), 2, {"sharded"}),
    (["parallel=pipeline", "parallel.world_size=4", "parallel.pp=2", "model=mlp",
      "model.hidden=[64,64,64]", "parallel.microbatches=2"], (2, 1, 2, 1), 2,
     {"sharded", "cuts_model", "pipelined"}),
    (["parallel=pipeline", "parallel.world_size=4", "parallel.pp=2", "parallel.tp=2",
      "model=gpt", "data=bytes", "model.layers=2", "model.heads=4", "model.width=32",
      "model.context=32"], (1, 1, 2, 2), 1, {"sharded", "cuts_model", "pipelined"}),
    (["parallel=model", "parallel.world_size=2", "model=mlp"], (2,), 1, {"cuts_model"}),
])
def test_a_layout_is_resolved_once_and_says_what_its_degrees_imply(overrides, shape, dp,
                                                                     properties):
    """The controller resolves each preset's null degree; the Layout it carries to the
    workers says what each part of parallab asks of it."""
    from parallab.parallel import PLANS

    cfg, layout = checked(*overrides)
    assert layout.plan is PLANS[cfg.parallel.name]
    assert layout.shape == shape and layout.dp == dp
    assert layout.processes == (cfg.parallel.name not in ("none", "model"))
    # what the controller reads before torch loads to start the workers' fork server early
    assert type(cfg.parallel).processes == layout.plan.processes
    said = {"replicas_only", "sharded", "cuts_model", "pipelined"}
    assert {name for name in said if getattr(layout, name)} == properties
    assert layout.uses_stages == (layout.processes or layout.cuts_model)
    # each rank's pipeline part (advise times each rank's own): its mesh coordinate on pp
    coordinates = list(itertools.product(*map(range, layout.shape)))
    assert [layout.part_of(rank) for rank in range(len(coordinates))] == [
        c[layout.dims.index("pp")] if layout.cuts_model else 0 for c in coordinates]


@pytest.mark.parametrize("overrides, resolved", [
    (["parallel=ddp"], dict(world_size=2, dp_replicate=2, dp_shard=1, tp=1)),
    (["parallel=fsdp_tp", "parallel.world_size=4", "parallel.tp=2", "model=mlp"],
     dict(world_size=4, dp_replicate=1, dp_shard=2, tp=2)),
    (["parallel=pipeline", "parallel.schedule=zbv", "model=gpt", "data=bytes",
      "model.layers=2", "model.heads=2", "model.width=32", "model.context=32"],
     dict(world_size=2, dp_replicate=1, pp=2, stages_per_rank=2)),
    (["parallel=pipeline", "parallel.world_size=4", "parallel.dp_replicate=2", "model=mlp",
      "model.hidden=[64,64,64]", "parallel.microbatches=2"],
     dict(world_size=4, dp_replicate=2, pp=2, stages_per_rank=1)),
    (["parallel=model", "model=mlp"], dict(world_size=2, pp=2)),
])
def test_the_checks_leave_the_parallel_config_as_composed(overrides, resolved):
    """What the checks resolve (the world size, a null degree, a pipeline's stages per rank,
    the node count) is the Layout's alone, as torchtitan's ParallelDims holds it beside its
    job config: cfg.parallel after the checks is what the user composed."""
    import copy

    from conftest import typed

    from parallab.checks import validate

    cfg = typed(*overrides)
    composed = copy.deepcopy(cfg.parallel)
    assert composed.world_size is None or "parallel.world_size=4" in overrides
    cfg, layout = validate.prepare(cfg, in_place=None)
    assert cfg.parallel == composed
    assert {key: getattr(layout, key) for key in resolved} == resolved
    assert layout.nnodes == 1
    # what the run records (its checkpoints' config, its loggers' params) is what it ran at
    from parallab.observe import loggers

    ran = loggers.as_run(cfg, layout)["parallel"]
    assert {key: ran[key] for key in resolved if key in ran} == {
        key: value for key, value in resolved.items() if key in ran}
    assert ran["world_size"] == resolved["world_size"] and ran["nnodes"] == 1


def test_a_run_resolves_its_layout_once_and_trains_with_that_one(train_here, monkeypatch):
    """The checks resolve the layout (degrees, plan, GPUs) once; the run builds its
    runtime from that value, with no second lookup by parallel.name nor
    resolution."""
    from parallab.parallel.model import ModelParallelPlan, ModelParallelRuntime

    resolved, given = [], []
    layout_of, init = ModelParallelPlan.layout_of.__func__, ModelParallelRuntime.__init__

    def counted(cls, p, world_size):
        resolved.append(layout_of(cls, p, world_size))
        return resolved[-1]

    def kept(self, p, layout, *args):
        given.append(layout)
        init(self, p, layout, *args)

    monkeypatch.setattr(ModelParallelPlan, "layout_of", classmethod(counted))
    monkeypatch.setattr(ModelParallelRuntime, "__init__", kept)
    train_here(*FAST, "parallel=model", "parallel.world_size=2", "model=mlp",
               "trainer.max_steps=2")
    assert len(resolved) == 1 and len(given) == 1
    assert given[0].plan is ModelParallelPlan and given[0].shape == (2,)


def test_a_plan_is_checked_against_the_widths():
    with torch.device("meta"):
        assert tp_problem(GPT(heads=4, width=64), 2) is None
        assert "does not divide model.heads=4" in tp_problem(GPT(heads=4, width=96), 3)
        # a tied head and embedding, both cut by vocabulary, stay one parameter
        assert tp_problem(GPT(tie_embeddings=True), 2) is None
        assert "layers.0.1.out_features=63" in tp_problem(MLP(64, hidden=[63, 64]), 2)
        assert tp_problem(MLP(64, hidden=[64, 64, 32]), 2) is None


def test_a_tied_head_and_embedding_split_by_tp_stay_one_parameter():
    """Split, each module would hold a parameter of its own; both cut by vocabulary rows,
    the head is given the embedding's back (the pair training as one, as on one device)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard

    from parallab.loss import CrossEntropy
    from parallab.parallel import tp_plans
    from parallab.launching.distributed import fake_group

    with fake_group(2):
        mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
        model = GPT(vocab_size=64, context=32, layers=1, heads=4, width=32,
                    tie_embeddings=True)
        assert tp_plans.split(model, mesh, None, False, CrossEntropy())  # logits left cut
        assert model.head.out.weight is model.embed.tokens.weight
        assert model.embed.tokens.weight.placements == (Shard(0),)


def test_a_pipeline_part_hands_on_its_slice_of_the_sequence():
    """Under a transformers model's sequence parallelism (its stream a DTensor) a pipeline
    part hands on its rank's slice as a plain tensor and takes what it is handed as the
    whole sequence's DTensor; token ids pass as they are; a sequence tp does not split
    evenly (a dataset's own length) ends in why, not in a send of a mismatched size."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    from parallab.parallel import tp_plans
    from parallab.launching.distributed import fake_group

    class Part(torch.nn.Module):
        def __init__(self, output=None):
            super().__init__()
            self.seen, self.output = [], output

        def forward(self, x):
            self.seen.append(x)
            return x * 2 if self.output is None else self.output

    with fake_group(2):
        mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
        part = Part()
        tp_plans.send_sequence_slices(part, mesh)
        sent = part(torch.ones(1, 4, 8))
        assert isinstance(part.seen[0], DTensor) and part.seen[0].shape == (1, 8, 8)
        assert not isinstance(sent, DTensor) and sent.shape == (1, 4, 8)
        part(torch.zeros(1, 8, dtype=torch.long))
        assert not isinstance(part.seen[1], DTensor)
        odd = Part(DTensor.from_local(torch.ones(1, 3, 8), mesh, [Shard(1)], run_check=False,
                                      shape=torch.Size([1, 5, 8]), stride=(40, 8, 1)))
        tp_plans.send_sequence_slices(odd, mesh)
        with pytest.raises(ValueError, match="5 tokens does not split evenly over tp=2"):
            odd(torch.zeros(1, 5, dtype=torch.long))


GPT_RUN = ["data=bytes", "data.eval_fraction=0.002", "model=gpt", "model.layers=2",
           "model.heads=4", "model.width=32", "model.context=32"]
MLP_RUN = [*FAST, "model=mlp", "model.hidden=[64,64,32]", "data.shape=[1,8,8]"]
STEPS = ["trainer.max_steps=10", "trainer.log_every_n_steps=1", "optim.lr=0.05",
         "trainer.checkpoint_every_n_steps=null", "trainer.save_best=false"]
BATCH = {"gpt": 16, "mlp": 64}  # global, the same for every layout
# the same global batch in two micro-batches, each step's gradient norm cut to 0.1 (a
# norm over tp slices, shards and pipeline parts)
ACCUMULATE_AND_CLIP = ["trainer.accumulate_grad_batches=2", "trainer.clip_grad_norm=0.1"]


@pytest.fixture(scope="module")
def one_device(tmp_path_factory):
    """The one-device references (in-process, ~3 s): built once per xdist worker, so the
    layouts' 4-rank runs spread over the workers rather than queue on one."""
    from parallab.cli import train_in_process

    runs = {}
    for name, run in (("gpt", GPT_RUN), ("mlp", MLP_RUN), ("gpt-clip", GPT_RUN)):
        runs[name] = tmp_path_factory.mktemp(name) / "run"
        extra = ACCUMULATE_AND_CLIP if name.endswith("clip") else []
        batch = BATCH[name.split("-")[0]] // (2 if extra else 1)
        train_in_process([*run, *STEPS, f"data.batch_size={batch}", *extra], runs[name])
    return runs


def final_weights(run_dir, model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return weights.model_from(checkpoint.latest(run_dir / "checkpoints"), model).state_dict()


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize("model,layout,data_ranks", [
    ("gpt", ["parallel=tp", "parallel.world_size=2"], 1),
    # 2 replicas x 2 shards, each micro-batch's gradients reduce-scattered, the replicas'
    # all-reduce once a step
    ("gpt", ["parallel=hsdp", "parallel.world_size=4", ACCUMULATE_AND_CLIP[0]], 4),
    ("mlp", ["parallel=fsdp_tp", "parallel.world_size=4"], 2),  # mlp's own plan, sharded
    ("mlp", ["parallel=pipeline", "parallel.world_size=4", "parallel.pp=2"], 2),
    ("gpt", ["parallel=fsdp_tp", "parallel.world_size=4", *ACCUMULATE_AND_CLIP],
     2),  # 2 shards x tp 2
    # pp2 x dp2, the replicas' average armed only at the step's last batch
    ("gpt", ["parallel=pipeline", "parallel.world_size=4", "parallel.pp=2",
             ACCUMULATE_AND_CLIP[0]], 2),
    ("gpt", ["parallel=pipeline", "parallel.world_size=4", "parallel.pp=2",
             "parallel.tp=2", "parallel.sequence_parallel=true", *ACCUMULATE_AND_CLIP],
     1),  # each part split by the plan's entries for it; slices of sequences between parts
    ("gpt", ["parallel=pipeline", "parallel.world_size=4", "parallel.pp=2",
             "parallel.dp_shard=2", "parallel.dp_replicate=1"], 2),  # each part FSDP2-sharded
], ids=["tp2-gpt", "hsdp2x2-gpt-accumulate", "fsdp_tp2x2-mlp", "pp2xdp2-mlp",
        "fsdp_tp2x2-gpt-accumulate-clip",
        "pp2xdp2-gpt-accumulate", "pp2xtp2sp-gpt-accumulate-clip", "pp2xfsdp2-gpt"])
def test_each_layout_trains_as_one_device_does(train_here, one_device, model, layout,
                                               data_ranks):
    run = GPT_RUN if model == "gpt" else MLP_RUN
    accumulate, clip = (setting in layout for setting in ACCUMULATE_AND_CLIP)
    batch = BATCH[model] // data_ranks // (2 if accumulate else 1)
    metrics, run_dir = train_here(*run, *STEPS, *layout, f"data.batch_size={batch}")
    reference = one_device[f"{model}-clip" if clip else model]
    if clip:  # the clipping changes the run
        assert losses(reference)[-1] != pytest.approx(losses(one_device[model])[-1], rel=1e-3)
    assert metrics["global_batch_size"] == BATCH[model]
    assert losses(run_dir) == pytest.approx(losses(reference), rel=1e-4, abs=1e-5)
    build = (lambda: GPT(layers=2, heads=4, width=32, context=32)) if model == "gpt" else (
        lambda: MLP(64, hidden=[64, 64, 32]))
    expected, got = final_weights(reference, build()), final_weights(run_dir, build())
    for name in expected:
        torch.testing.assert_close(got[name], expected[name], rtol=1e-4, atol=1e-5)
    assert read_metrics(run_dir)["eval_loss"] == pytest.approx(
        read_metrics(reference)["eval_loss"], rel=1e-4)
    if model == "gpt":
        assert_textbook_volume(metrics, layout[0].split("=")[1], batch, 2 if accumulate else 1)


MB = 2**20
GPT_BYTES = 4 * sum(p.numel() for p in GPT(layers=2, heads=4, width=32, context=32).parameters())


def assert_textbook_volume(metrics, layout: str, batch: int, micro: int) -> None:
    """comm_*_mb of the run against the volumes a textbook gives (ring algorithms; ddp's
    and fsdp's are test_activations'), of `micro` accumulated micro-batches a step."""
    sent = {k: metrics.get(f"comm_{k}_mb", 0.0) * MB for k in ("all_reduce", "all_gather",
                                                                 "reduce_scatter")}
    near = lambda expected: pytest.approx(expected, rel=0.01, abs=64)  # noqa: E731 - a loss
    expected = {  # 2 ranks each: tp 2 of 2 layers; hsdp 2 replicas x 2 shards
        "tp": textbook_volume(GPT_BYTES, tp=2, layers=2, activation=batch * 32 * 32 * 4),
        "hsdp": textbook_volume(GPT_BYTES, replicas=2, shards=2, micro=micro),
    }.get(layout)
    if layout == "pipeline":  # activations sent, and each stage's gradients reduced
        assert metrics["comm_p2p_mb"] > 0 and sent["all_reduce"] + sent["reduce_scatter"] > 0
        return
    if expected is None:  # fsdp_tp: both kinds of traffic, on their own groups
        assert all(sent.values()), sent
        return
    for kind, volume in expected.items():
        assert sent[kind] == near(volume), kind
    # each kind counted on the group it ran on: hsdp's 4 ranks reduce and gather in pairs
    assert {metrics[f"comm_{kind}_ranks"] for kind in expected if sent[kind]} == {2}


@pytest.mark.slow
@pytest.mark.distributed
def test_sequence_parallel_splits_the_blocks_under_activation_checkpointing(train_here,
                                                                            one_device):
    """tp first, then checkpointing wraps the split blocks (a plan applied after would miss
    the wrapped blocks' names and leave them whole). With sequence parallelism each split
    layer's input is all-gathered (forward; its gradient in backward) where plain tp sends
    nothing, and the output projections reduce-scatter: 2 layers x (4 gathers + 2 again in
    the forward full checkpointing recomputes), plus the head's input and the embedding's
    output gradient, of half a (B, T, C) activation each; the logits stay cut by
    vocabulary (no gather)."""
    metrics, run_dir = train_here(*GPT_RUN, *STEPS, "parallel=tp", "parallel.world_size=2",
                                  f"data.batch_size={BATCH['gpt']}",
                                  "trainer.activation_checkpointing=full",
                                  "parallel.sequence_parallel=true")
    assert losses(run_dir) == pytest.approx(losses(one_device["gpt"]), rel=1e-4, abs=1e-5)
    assert metrics["state_memory_mb"] < 0.6 * read_metrics(one_device["gpt"])["state_memory_mb"]
    assert "(sequence parallel)" in (run_dir / "train.log").read_text()
    batch = BATCH["gpt"]
    half = batch * 32 * 32 * 4 / 2
    assert metrics["comm_all_gather_mb"] * MB == pytest.approx(14 * half, rel=0.01)
    assert metrics["comm_reduce_scatter_mb"] > 0


# each leg: (layout, data-parallel ranks, the step it runs to)
RESUMES = {
    # DCP reshards; sequence parallelism makes the norms replicated DTensors
    "tp 2 to fsdp_tp 2x2 sp": [(["parallel=tp", "parallel.world_size=2"], 1, 5),
                               (["parallel=fsdp_tp", "parallel.world_size=4",
                                 "parallel.sequence_parallel=true"], 2, 10)],
    # a sharded checkpoint into a whole model, then a one-file one cut into tp slices
    "fsdp 2 to none to tp 2": [(["parallel=fsdp", "parallel.world_size=2"], 2, 4),
                               (["parallel=none"], 1, 7),
                               (["parallel=tp", "parallel.world_size=2"], 1, 10)],
    "pipeline 2 to ddp 2": [(["parallel=pipeline", "parallel.world_size=2"], 1, 5),
                            (["parallel=ddp", "parallel.world_size=2"], 2, 10)],
    # the parts placed in a V, then round-robin over two pipelines, then none
    "zbv 2 to interleaved_1f1b 2x2 to none": [
        (["parallel=pipeline", "parallel.world_size=2", "parallel.schedule=zbv"], 1, 4),
        (["parallel=pipeline", "parallel.world_size=4", "parallel.pp=2",
          "parallel.schedule=interleaved_1f1b"], 2, 7),
        (["parallel=none"], 1, 10)],
}


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize("legs", RESUMES.values(), ids=RESUMES)
def test_a_checkpoint_resumes_under_any_layout(train_here, one_device, legs):
    """A run continued under other layouts at the same global batch equals the one-device
    run's 10 steps: weights, optimizer moments, schedule and data position all carried."""
    run = [*GPT_RUN, *STEPS]
    for leg, (layout, ranks, until) in enumerate(legs):
        _, run_dir = train_here(*run, *layout, f"data.batch_size={BATCH['gpt'] // ranks}",
                                f"trainer.max_steps={until}",
                                *(["trainer.resume=auto"] if leg else []))
    assert losses(run_dir) == pytest.approx(losses(one_device["gpt"]), rel=1e-4, abs=1e-5)


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize("layout", ["tp", "pipeline"])
def test_the_batch_size_finder_agrees_across_a_tp_group_and_a_pipeline(train_here, layout,
                                                                       tmp_path):
    """The ranks of a tp group, or of a pipeline (trials run its whole schedule), read one
    batch and agree on each trial; the pipeline's trials leave nothing behind: its run
    trains as one started at the chosen size does."""
    from parallab.data.bytetext import DEFAULT_TEXT

    text = tmp_path / "text.txt"  # 1,700 sequences: the doubling ends by 256 (shard too small)
    text.write_bytes(DEFAULT_TEXT.read_bytes()[:64_000])
    run = [*GPT_RUN, "trainer.max_steps=3", f"parallel={layout}", "parallel.world_size=2",
           "trainer.log_every_n_steps=1", f"data.path={text}", "data.eval_fraction=0.1"]
    metrics, run_dir = train_here(*run, "data.batch_size=32", "trainer.auto_batch_size=true",
                                  "trainer.max_memory_mb=4000")
    chosen = metrics["global_batch_size"]  # one data-parallel rank: the per-rank batch
    assert chosen >= 32 and chosen & (chosen - 1) == 0  # kept or grown by doublings
    log = (run_dir / "train.log").read_text()
    assert "batch-size finder chose" in log and "| 64 |" in log  # a doubling was tried
    if layout == "pipeline":
        _, plain = train_here(*run, f"data.batch_size={chosen}", name="plain")
        assert losses(run_dir) == pytest.approx(losses(plain), rel=1e-5)
