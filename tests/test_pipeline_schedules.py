"""The pipeline's schedules (torch.distributed.pipelining's): their idle share and held
activations as torch orders them, the stages they place on each rank, the micro-batch
counts they take, bad input refused in one line, and every schedule of several stages per
rank training as one device does (real gloo processes). A transformers model's own chain
of stages: tests/test_transformers.py; the replicas' gradient average:
tests/test_strategies.py."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from conftest import FAST, checked, losses, read_metrics

from parallab.config.errors import ConfigError
from parallab.parallel import schedules
from parallab.parallel.schedules import SCHEDULES, activations_held, bubble

MULTI = [name for name, s in SCHEDULES.items() if s.multi]


def built(name: str, pp: int, v: int, m: int):
    """torch's schedule `name` of pp x v stages over m micro-batches, as built on any rank
    (its order is every rank's), its stages stand-ins: no process group is needed."""
    import torch.distributed.pipelining as pipelining

    stage = lambda: SimpleNamespace(group_rank=0, group_size=pp, num_stages=pp * v,  # noqa: E731
                                    submod=None)
    return getattr(pipelining, SCHEDULES[name].torch_class)(
        [stage() for _ in range(v)] if SCHEDULES[name].multi else stage(), m)


def timeline(name: str, pp: int, v: int, m: int) -> tuple[float, list[float], list[float]]:
    """torch's own order of the schedule on each rank, run with a forward, an input- and
    a weight-gradient each one unit (a full backward two), every action as soon as its rank
    is free and its inputs are there: the step's length over the busiest rank's work, each
    rank's most micro-batches in flight (from a stage's forward to its backward's end, in
    units of the rank's v stages), and the time from each of the first rank's stages' last
    backward to the step's end, in full backwards."""
    from torch.distributed.pipelining.schedules import _ComputationType as C

    kind = {C.FORWARD: "F", C.FULL_BACKWARD: "B", C.BACKWARD_INPUT: "B",
            C.BACKWARD_WEIGHT: "W"}
    cost = {C.FORWARD: 1, C.FULL_BACKWARD: 2, C.BACKWARD_INPUT: 1, C.BACKWARD_WEIGHT: 1}
    ops = [[a for action in rank if action is not None
            for a in (action.sub_actions or [action])]
           for rank in built(name, pp, v, m).pipeline_order.values()]
    last, done, free, at, ends = pp * v - 1, {}, [0] * pp, [0] * pp, {}

    def needs(a) -> list:
        s, i = a.stage_index, a.microbatch_index
        if kind[a.computation_type] == "F":
            return [(s - 1, "F", i)] if s else []
        if kind[a.computation_type] == "W":
            return [(s, "B", i)]
        return [(s, "F", i)] + ([(s + 1, "B", i)] if s < last else [])

    while any(at[r] < len(ops[r]) for r in range(pp)):
        moved = False
        for r in range(pp):
            while at[r] < len(ops[r]) and all(d in done for d in needs(ops[r][at[r]])):
                a = ops[r][at[r]]
                free[r] = max([free[r]] + [done[d] for d in needs(a)]) + cost[a.computation_type]
                done[(a.stage_index, kind[a.computation_type], a.microbatch_index)] = free[r]
                if kind[a.computation_type] != "F":
                    ends[a.stage_index] = free[r]
                at[r], moved = at[r] + 1, True
        assert moved, "torch's order deadlocks"
    held = []
    for rank in ops:
        flight = [0]
        for a in rank:
            step = {"F": 1, "W": -1}.get(kind[a.computation_type], 0)
            if a.computation_type == C.FULL_BACKWARD:
                step = -1
            flight.append(flight[-1] + step)
        held.append(max(flight) / v)
    settled = [(max(free) - ends[s]) / 2 for s in schedules.stages_of_rank(name, pp, v, 0)]
    return max(free) / (3 * v * m), held, settled


GRID = [(name, pp, v, m) for name in MULTI for pp in (2, 3, 4)
        for v in ([2] if SCHEDULES[name].v_shape else [2, 3]) for m in range(1, 3 * pp + 1)
        if not schedules.microbatches_problem(name, pp, v, m)]
# the deep pipelines of the largest published runs (Megatron-LM's v 12 over 8 ranks, Llama
# 3's 16 ranks), whose held activations decide whether they fit
GRID += [("interleaved_1f1b", 8, 12, 16), ("interleaved_1f1b", 16, 4, 32),
         ("interleaved_1f1b", 12, 5, 24), ("interleaved_zb", 8, 4, 16), ("zbv", 8, 2, 16),
         ("dualpipev", 8, 2, 16)]


def test_each_schedules_idle_share_and_held_activations_are_torchs_own():
    """bubble() and activations_held() in closed form equal what torch's orders give, for
    every schedule of several stages per rank at the micro-batch counts each takes (fewer
    than pp too, where torch adds bubbles); gpipe's and 1f1b's are the textbook's."""
    for name, pp, v, m in GRID:
        ratio, held, _ = timeline(name, pp, v, m)
        assert bubble(name, pp, v, m) == pytest.approx(ratio), (name, pp, v, m)
        assert [activations_held(name, pp, v, m, r) for r in range(pp)] == \
            pytest.approx(held), (name, pp, v, m)
        assert activations_held(name, pp, v, m) == max(held)
    assert bubble("interleaved_1f1b", 4, 2, 8) == 1 + 3 / 16  # (p - 1) / (v m)
    assert bubble("interleaved_zb", 4, 2, 8) == 1 + 3 / 48  # a third of that
    for name in ("gpipe", "1f1b"):
        assert bubble(name, 4, 1, 8) == 1 + 3 / 8
    assert activations_held("gpipe", 4, 1, 8) == 8
    assert [activations_held("1f1b", 4, 1, 8, r) for r in range(4)] == [4, 3, 2, 1]


def test_the_first_ranks_stages_settle_their_gradients_as_torch_orders_them():
    """Schedule.settled, how long before the step's end each of the first rank's stages
    takes its last backward (its replicas' average runs beside the rest), equals torch's
    order: an interleaved schedule's later stages pp backwards apart, looped BFS's a
    stage's micro-batches apart; None where W adds the weight gradients by hand."""
    for name, pp, v, m in GRID:
        settled = SCHEDULES[name].settled(pp, v, m)
        if SCHEDULES[name].splits_backward:
            assert settled is None
            continue
        assert settled == pytest.approx(timeline(name, pp, v, m)[2]), (name, pp, v, m)
    assert SCHEDULES["interleaved_1f1b"].settled(8, 12, 16)[-1] == 88  # 11 stages x pp
    assert SCHEDULES["1f1b"].settled(4, 1, 8) == [0.0]


def test_advise_replays_the_replicas_average_beside_the_backwards_it_settles_before():
    """advise's replay runs a pipeline's replicas' all-reduce beside its compute where the
    schedule settles some part before the step's end, as the replicas launch it; exposed
    where it waits for the flush (one part a rank, W by hand) or no replicas average."""
    from parallab.parallel.layout import Layout
    from parallab.parallel.pipeline import PipelinePlan

    def kinds(schedule: str, v: int, replicas: int = 2, shards: int = 1) -> tuple[str, ...]:
        layout = Layout.planned(4 * replicas * shards // 2, dp_replicate=replicas,
                                dp_shard=shards, pp=2, schedule=schedule, stages_per_rank=v,
                                microbatches=4)
        return PipelinePlan.overlapped_kinds(layout)

    assert kinds("interleaved_1f1b", 2) == kinds("looped_bfs", 2) == ("all_reduce",)
    assert kinds("1f1b", 1) == kinds("gpipe", 1) == kinds("interleaved_zb", 2) == ()
    assert kinds("interleaved_1f1b", 2, replicas=1) == ()
    assert kinds("interleaved_1f1b", 2, shards=2) == ()


def test_stages_are_placed_and_microbatches_taken_as_torch_does():
    from torch.distributed.pipelining._utils import generate_stage_to_rank_mapping

    for pp, v in ((2, 2), (4, 2), (3, 3)):
        for name, style in (("interleaved_1f1b", "loop"), ("zbv", "v")):
            if SCHEDULES[name].v_shape and v != 2:
                continue
            placed = generate_stage_to_rank_mapping(pp, pp * v, style)
            assert {s: r for r in range(pp)
                    for s in schedules.stages_of_rank(name, pp, v, r)} == placed
    for name, s in SCHEDULES.items():
        for pp in (2, 4):
            v = schedules.stages_per_rank(name, None)
            for m in range(1, 3 * pp + 2):
                try:
                    built(name, pp, v, m)
                    takes = True
                except ValueError:
                    takes = False
                assert takes == (schedules.microbatches_problem(name, pp, v, m) is None), \
                    (name, pp, m)


GPT = ["model=gpt", "data=bytes", "model.layers=2", "device=cpu"]
PIPE = ["parallel=pipeline", "parallel.world_size=2"]
BAD = [
    ([*PIPE, "parallel.schedule=zb"], "parallel.schedule=zb is unknown: use one of gpipe, "
     "1f1b, interleaved_1f1b, looped_bfs, interleaved_zb, zbv, dualpipev"),
    ([*PIPE, *GPT, "parallel.schedule=1f1b", "parallel.stages_per_rank=2"],
     "parallel.stages_per_rank=2 with parallel.schedule=1f1b, which runs one stage per rank: "
     "drop it (null)"),
    ([*PIPE, *GPT, "parallel.schedule=zbv", "parallel.stages_per_rank=3"],
     "whose V holds exactly 2 stages per rank: set it to 2"),
    ([*PIPE, *GPT, "parallel.schedule=interleaved_1f1b", "parallel.stages_per_rank=3"],
     "parallel.world_size=2 x parallel.stages_per_rank=3 is 6 parts, more than the 4 stages "
     "of the model: make pp x stages_per_rank at most 4"),
    ([*PIPE, *GPT, "parallel.schedule=dualpipev", "parallel.microbatches=2"],
     "parallel.microbatches=2 does not suit parallel.schedule=dualpipev at parallel.pp=2: "
     "DualPipeV needs at least as many micro-batches as stages (4); use "
     "parallel.microbatches=4 or 8"),  # those that also cut data.batch_size=32 evenly
    # none that the schedule takes cuts a batch of 2: the count, and a batch it cuts (it
    # had named 4 or 5, which the next check refused)
    ([*PIPE, *GPT, "parallel.schedule=dualpipev", "parallel.microbatches=2",
      "data.batch_size=2"],
     "use parallel.microbatches=4 with a batch per rank it splits (a multiple of 4; "
     "data.batch_size=2 splits into none the schedule takes)"),
    ([*PIPE, *GPT, "parallel.schedule=1f1b", "parallel.microbatches=1", "data.batch_size=6"],
     "1F1B needs at least as many micro-batches as stages (2); use parallel.microbatches=2 "
     "or 3"),
    (["parallel=pipeline", "parallel.world_size=4", *GPT, "model.layers=6",
      "parallel.schedule=interleaved_zb", "parallel.microbatches=9", "data.batch_size=18"],
     "runs them in max(1, microbatches // pp) = 2 rounds, so it needs a multiple of 2; use "
     "parallel.microbatches=3 or 6"),
    ([*PIPE, *GPT, "parallel.schedule=zbv", "trainer.compile=true"],
     "trainer.compile=true with parallel.schedule=zbv: it splits each backward"),
    ([*PIPE, *GPT, "parallel.schedule=interleaved_zb",
      "trainer.activation_checkpointing=selective"],
     "trainer.activation_checkpointing=selective with parallel.schedule=interleaved_zb"),
    ([*PIPE, *GPT, "parallel.schedule=zbv", "trainer.activation_checkpointing=selective_alternate"],
     "trainer.activation_checkpointing=selective_alternate with parallel.schedule=zbv"),
    (["parallel=pipeline", "parallel.world_size=4", "parallel.pp=2", "parallel.dp_shard=2",
      "parallel.dp_replicate=1", *GPT, "parallel.schedule=zbv", "model.tie_embeddings=true"],
     "parallel.dp_shard=2 shards each of a rank's parts apart, but stages 0 and 3, both on "
     "pipeline rank 0, share a parameter"),
]


@pytest.mark.parametrize("overrides,message", BAD, ids=[" ".join(o[2:]) for o, _ in BAD])
def test_bad_schedule_settings_are_one_line(overrides, message):
    with pytest.raises(ConfigError) as error:
        checked(*overrides)
    assert message in str(error.value) and "\n" not in str(error.value)


def test_a_v_shape_holds_tied_embeddings_on_one_rank():
    """zbv's first and last stage are one rank's: tied weights need no untying there."""
    cfg, layout = checked(*PIPE, *GPT, "parallel.schedule=zbv", "model.tie_embeddings=true")
    assert layout.stages_per_rank == 2
    assert layout.bubble == bubble("zbv", 2, 2, 4)


# a gpt whose head is its embedding, in float16 with its scale and clipping
TIED = [*GPT, "data.eval_fraction=0.002", "model.heads=2", "model.width=32",
        "model.context=32", "model.tie_embeddings=true", "precision=fp16",
        "trainer.clip_grad_norm=1.0", "trainer.log_every_n_steps=1", "optim=adamw",
        "trainer.checkpoint_every_n_steps=null", "trainer.save_best=false", "data.batch_size=8"]


@pytest.mark.slow
@pytest.mark.distributed
def test_tied_embeddings_and_float16_train_across_pipeline_ranks_as_one_device(train_here):
    """Megatron-LM's pipelines: the embedding on pipeline rank 0 and the head that shares it
    on rank 1 (interleaved, v 2; tp 2 within each, or each part sharded over dp_shard 2),
    each a copy whose gradients are summed,
    the norm counting it once, AdamW's decay leaving the head's copy as it leaves the
    embedding; float16's scale on the schedule's loss, resumed at a scale the gradients
    overflow at, so that steps are skipped, on every stage together (DTensor weights and
    plain norms alike), till it has come down. Both were refused."""
    _, start = train_here(*TIED, "trainer.max_steps=2", name="start")
    ckpt = start / "checkpoints" / "last.pt"
    state = torch.load(ckpt, weights_only=False)
    state["grad_scaler"]["scale"] = 2.0 ** 40
    torch.save(state, ckpt)
    resumed = [*TIED, "trainer.max_steps=8", f"trainer.resume={ckpt}"]
    _, one = train_here(*resumed, name="one")
    # each part split by tp 2 too, with sequence parallelism: the embedding's gradient
    # comes whole, the head's cut by vocabulary rows as their weights are
    _, pp = train_here(*resumed, "parallel=pipeline", "parallel.world_size=4", "parallel.pp=2",
                       "parallel.tp=2", "parallel.sequence_parallel=true",
                       "parallel.schedule=interleaved_1f1b", name="pp")
    # each part sharded over dp_shard 2 instead, a root of its own: the embedding's part
    # and the head's are on different ranks, each rank's copy sharded (the same global batch)
    _, sharded = train_here(*resumed, "data.batch_size=4", "parallel=pipeline",
                            "parallel.world_size=4", "parallel.pp=2", "parallel.dp_shard=2",
                            "parallel.schedule=interleaved_1f1b", name="sharded")
    scale = torch.load(one / "checkpoints" / "last.pt", weights_only=False)["grad_scaler"]
    assert scale["scale"] < 2.0 ** 40  # overflowed, and skipped
    assert losses(pp) == pytest.approx(losses(one), rel=1e-4)
    assert losses(sharded) == pytest.approx(losses(one), rel=1e-4)
    for run in (pp, sharded):
        log = (run / "train.log").read_text()
        assert "a pipeline's ranks holding parts [[0, 2], [1, 3]]" in log


@pytest.mark.slow
@pytest.mark.distributed
def test_tied_weights_started_from_a_file_stay_tied_under_every_pipeline(train_here,
                                                                         tmp_path):
    """A tied gpt's exported weights (the tied one written once, as embed.tokens.weight)
    under zbv, whose rank 0 holds both ends, and 1f1b, whose rank 1 holds the head alone:
    the losses of one device. zbv's two ends came apart when given storage (trained
    untied, without a word), and 1f1b's head found no weight of its name (after launch)."""
    from parallab.commands import _export

    tied = [*TIED[:-1], "precision=fp32", "data.batch_size=8", "trainer.max_steps=3"]
    tied.remove("precision=fp16")
    _, start = train_here(*tied, name="start")
    _export(start / "checkpoints" / "last.pt", tmp_path / "w.safetensors")
    begin = [*tied, f"trainer.init_from={tmp_path / 'w.safetensors'}"]
    _, one = train_here(*begin, name="one")
    for schedule in ("zbv", "1f1b"):
        _, run = train_here(*begin, *PIPE, f"parallel.schedule={schedule}", name=schedule)
        assert losses(run) == pytest.approx(losses(one), rel=1e-5), schedule


# parallab's mlp on synthetic data, no dropout, every step logged, a checkpoint at the end
MLP_RUN = [*FAST, "model=mlp", "model.hidden=[64,64,32]", "data.shape=[1,8,8]",
           "trainer.max_steps=10", "trainer.log_every_n_steps=1", "optim.lr=0.05",
           "trainer.checkpoint_every_n_steps=null", "trainer.save_best=false"]
@pytest.fixture(scope="module")
def one_device(tmp_path_factory):
    """The one-device reference, in-process: the mlp at the global batch of 64."""
    from parallab.cli import train_in_process

    run_dir = tmp_path_factory.mktemp("mlp") / "run"
    train_in_process([*MLP_RUN, "data.batch_size=64"], run_dir)
    return run_dir


def final_weights(run_dir) -> dict[str, torch.Tensor]:
    from parallab.models.mlp import MLP
    from parallab.training import checkpoint, weights

    model = MLP(input_dim=64, hidden=[64, 64, 32])
    return weights.model_from(checkpoint.latest(run_dir / "checkpoints"), model).state_dict()


# each schedule of several stages per rank at pp 2 x 2 stages per rank, two pipelines
# side by side: replicas, FSDP2 shards of each part, activation checkpointing around them
LAYOUTS = {
    "interleaved_1f1b": ["parallel.dp_replicate=2"],
    "looped_bfs": ["parallel.dp_shard=2", "parallel.dp_replicate=1",
                   "trainer.activation_checkpointing=selective"],
    "interleaved_zb": ["parallel.dp_replicate=2", "trainer.activation_checkpointing=full"],
    "zbv": ["parallel.dp_shard=2", "parallel.dp_replicate=1",
            "trainer.activation_checkpointing=full"],
    "dualpipev": ["parallel.dp_replicate=2"],
}


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.xdist_group("pipeline_schedules")  # one reference per run, not per xdist worker
@pytest.mark.parametrize("schedule", LAYOUTS)
def test_each_schedule_trains_as_one_device_does(train_here, one_device, schedule):
    metrics, run_dir = train_here(*MLP_RUN, "parallel=pipeline", "parallel.world_size=4",
                                  "parallel.pp=2", f"parallel.schedule={schedule}",
                                  "data.batch_size=32", *LAYOUTS[schedule])
    reference = one_device
    assert metrics["global_batch_size"] == 64
    assert losses(run_dir) == pytest.approx(losses(reference), rel=1e-4, abs=1e-5)
    assert len(losses(run_dir)) == 10
    expected, got = final_weights(reference), final_weights(run_dir)
    for name in expected:
        torch.testing.assert_close(got[name], expected[name], rtol=1e-4, atol=1e-5)
    assert metrics["eval_accuracy"] == pytest.approx(read_metrics(reference)["eval_accuracy"])
    log = (run_dir / "train.log").read_text()
    placed = [[0, 3], [1, 2]] if SCHEDULES[schedule].v_shape else [[0, 2], [1, 3]]
    assert f"a pipeline's ranks holding parts {placed}" in log


def test_advise_offers_each_schedule_and_replays_its_bubble():
    """advise's pipeline candidates: every schedule, the multi-stage ones at 2 stages per
    rank (the checks prune those the model has too few stages for); the step-time check
    replays the schedule's own idle slots (with a device per rank: bubble x the step)."""
    from parallab.advise import scaling
    from parallab.advise.candidates import enumerate_grid
    from parallab.config.planning import AdviseConfig

    options = AdviseConfig(layouts=["pipeline"], schedules=list(SCHEDULES), microbatches=[4],
                           precisions=["fp32"], activation_checkpointing=["none"],
                           max_accumulation=1)
    ways = {(c.layout.schedule, c.layout.stages_per_rank, c.layout.microbatches)
            for c in enumerate_grid(options, [2], "cpu")}
    assert ("zbv", 2, 4) in ways and ("1f1b", 1, 4) in ways
    assert len(ways) == len(SCHEDULES)
    devices = scaling.cpu_rate(None, 1)
    for name in ("1f1b", "interleaved_1f1b", "zbv"):
        v = schedules.stages_per_rank(name, None)
        assert scaling.pipeline_s([0.4, 0.4], [0.4, 0.4], 2, 4, devices,
                                  bubble(name, 2, v, 4)) == pytest.approx(
            0.4 * bubble(name, 2, v, 4))
    # a bubble of None: GPipe's and 1F1B's pp - 1 slots, as before
    assert scaling.pipeline_s([0.4, 0.4], [0.4, 0.4], 2, 4, devices) == pytest.approx(0.5)
