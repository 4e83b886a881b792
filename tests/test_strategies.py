"""FSDP, model parallelism and pipelines: the same training as one device, a pipeline's
replicas averaging their gradients, and checkpoints that move between strategies."""

from __future__ import annotations

import pickle
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import FAST, read_metrics, scalars

from parallab.cli import train_in_process
from parallab.commands import _export, evaluate_in_process
from parallab.models.mlp import MLP
from parallab.parallel.split import even_cuts, part_ranges
from parallab.testing import textbook_volume
from parallab.training import checkpoint, weights

BIN = Path(sys.executable).parent
# the equivalence setting: mlp on synthetic data, no dropout, every step logged
EQUIVALENCE = [*FAST, "model=mlp", "model.hidden=[64,64,32]", "data.shape=[1,8,8]",
               "trainer.max_steps=20", "trainer.log_every_n_steps=1", "optim.lr=0.05"]


def test_even_cuts_balance_parameters_and_keep_every_part_non_empty():
    assert even_cuts([10, 10, 10, 10], 2) == [2]
    assert even_cuts([100, 1, 1, 1], 2) == [1]  # the big stage alone
    assert even_cuts([1, 1, 1, 100], 4) == [1, 2, 3]  # one stage each, whatever the sizes
    assert even_cuts([5, 5, 5, 5, 5, 5], 3) == [2, 4]
    model = MLP(input_dim=64, hidden=[64, 64, 32])
    assert [list(r) for r in part_ranges(model.stages(), 2, [3])] == [[0, 1, 2], [3]]


def test_clip_grad_norm_null_measures_without_touching_the_gradients():
    from parallab.parallel.base import Runtime

    model = MLP(input_dim=64, hidden=[8])
    model(torch.randn(4, 64)).sum().backward()
    grads = [p.grad for p in model.parameters()]
    versions = [g._version for g in grads]  # bumped by any in-place write
    expected = torch.linalg.vector_norm(torch.cat([g.flatten() for g in grads]))
    runtime = Runtime.__new__(Runtime)
    assert runtime.clip_grad_norm(model, None) == pytest.approx(expected.item(), rel=1e-6)
    assert [g._version for g in grads] == versions
    runtime.clip_grad_norm(model, expected.item() / 2)
    assert torch.linalg.vector_norm(torch.cat([g.flatten() for g in grads])).item() == \
        pytest.approx(expected.item() / 2, rel=1e-4)


def final_weights(run_dir) -> dict[str, torch.Tensor]:
    """The run's last checkpoint read into a plain single-device model."""
    ckpt = checkpoint.latest(run_dir / "checkpoints")
    model = MLP(input_dim=64, hidden=[64, 64, 32])
    return weights.model_from(ckpt, model).state_dict()


# trainer.accumulate_grad_batches and clip_grad_norm: the same global batch in two
# micro-batches, each step's gradient norm cut to 0.1 (it is larger in these runs)
ACCUMULATE_AND_CLIP = ["trainer.accumulate_grad_batches=2", "trainer.clip_grad_norm=0.1"]


@pytest.fixture(scope="module")
def single_device(tmp_path_factory):
    """The reference runs on one device: plain, and accumulating with clipping."""
    runs = {}
    for name, extra in [("plain", ["data.batch_size=64"]),
                        ("accumulate-clip", ["data.batch_size=32", *ACCUMULATE_AND_CLIP])]:
        runs[name] = tmp_path_factory.mktemp(name) / "run"
        train_in_process([*EQUIVALENCE, *extra], runs[name])  # what the train_here fixture runs
    return runs


@pytest.mark.slow
@pytest.mark.xdist_group("single_device")
def test_clipping_is_active_in_the_reference(single_device):
    plain, clipped = (scalars(single_device[name], "train/loss") for name in single_device)
    assert max(abs(a - b) for (_, a), (_, b) in zip(plain, clipped)) > 1e-2


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.xdist_group("single_device")  # one reference per run, not per xdist worker
@pytest.mark.parametrize("layout", [
    ["parallel=fsdp", "parallel.world_size=2", "data.batch_size=32"],  # same global batch
    ["parallel=fsdp", "parallel.world_size=2", "data.batch_size=16", *ACCUMULATE_AND_CLIP],
    ["parallel=fsdp", "parallel.world_size=2", "data.batch_size=32",
     "parallel.reshard_after_forward=false"],
    ["parallel=model", "parallel.world_size=2", "data.batch_size=32", *ACCUMULATE_AND_CLIP],
    ["parallel=pipeline", "parallel.world_size=2", "parallel.schedule=gpipe", "data.batch_size=64"],
    ["parallel=pipeline", "parallel.world_size=2", "parallel.schedule=1f1b", "data.batch_size=32",
     *ACCUMULATE_AND_CLIP],
], ids=["fsdp", "fsdp-accumulate-clip", "fsdp-keep-gathered", "model-accumulate-clip",
        "pipeline-gpipe", "pipeline-1f1b-accumulate-clip"])
def test_layout_trains_as_one_device_does(train_here, single_device, layout):
    _, run_dir = train_here(*EQUIVALENCE, *layout)
    reference = single_device["accumulate-clip" if "trainer.clip_grad_norm=0.1" in layout
                              else "plain"]
    expected, got = scalars(reference, "train/loss"), scalars(run_dir, "train/loss")
    assert [step for step, _ in got] == list(range(1, 21))
    assert [v for _, v in got] == pytest.approx([v for _, v in expected], rel=1e-4, abs=1e-5)
    expected_weights, weights = final_weights(reference), final_weights(run_dir)
    assert weights.keys() == expected_weights.keys()
    for name in expected_weights:
        torch.testing.assert_close(weights[name], expected_weights[name], rtol=1e-4, atol=1e-5)
    metrics = read_metrics(run_dir)
    assert metrics["global_batch_size"] == 64 and metrics["world_size"] == 2
    if layout[0] == "parallel=fsdp":  # each micro-batch's gradients reduce-scattered: the
        # shards accumulate, not the whole model's gradients
        params = 4 * sum(w.numel() for w in weights.values())
        micro = 2 if ACCUMULATE_AND_CLIP[0] in layout else 1
        assert metrics["comm_reduce_scatter_mb"] * 2**20 == pytest.approx(
            textbook_volume(params, shards=2, micro=micro)["reduce_scatter"], rel=1e-6)
    assert metrics["eval_accuracy"] == pytest.approx(read_metrics(reference)["eval_accuracy"])


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize("parallel,kind", [("fsdp", "reduce_scatter"), ("ddp", "all_reduce")])
def test_gradients_reduce_in_bfloat16_when_asked(train_here, parallel, kind):
    """precision.reduce_dtype=bfloat16 under bf16: FSDP2's reduce-scatter, and DDP's
    all-reduce (torch's bf16 compression hook), send half the float32 reduction's bytes,
    and the run trains as it does but for bfloat16's rounding of the reduced gradients."""
    runs = {dtype: train_here(*EQUIVALENCE, "precision=bf16", f"parallel={parallel}",
                              "parallel.world_size=2", "data.batch_size=32",
                              f"precision.reduce_dtype={dtype}", name=dtype)[1]
            for dtype in ("float32", "bfloat16")}
    numel = sum(w.numel() for w in final_weights(runs["float32"]).values())
    metrics = {dtype: read_metrics(run_dir) for dtype, run_dir in runs.items()}
    layout = {"shards": 2} if parallel == "fsdp" else {"replicas": 2}
    for dtype, size in (("float32", 4), ("bfloat16", 2)):
        assert metrics[dtype][f"comm_{kind}_mb"] * 2**20 == pytest.approx(
            textbook_volume(size * numel, **layout)[kind], rel=1e-6)
    gathered = "comm_all_gather_mb"  # FSDP2's weights, gathered in bf16 either way
    assert metrics["bfloat16"].get(gathered) == metrics["float32"].get(gathered)
    wide, narrow = (scalars(runs[dtype], "train/loss") for dtype in runs)
    assert [v for _, v in narrow] == pytest.approx([v for _, v in wide], rel=1e-2)
    assert narrow != wide  # the reduction's rounding is bfloat16's


def test_a_pipelines_replicas_send_their_buckets_in_the_reduce_dtype():
    """precision.reduce_dtype=bfloat16 under a pipeline's replicas: each bucket all-reduced
    in bfloat16, the averages written back into the float32 gradients (the fake group's
    all-reduce sums this rank's alone: halved)."""
    from parallab.launching.distributed import fake_group
    from parallab.parallel.replicas import Replicas

    with fake_group(2):
        part = torch.nn.Linear(4, 4)
        replicas = Replicas([part], None, 2, microbatches=1, bucket_mb=25.0,
                            dtype=torch.bfloat16)
        replicas.arm()
        part(torch.randn(2, 4)).sum().backward()
        assert [flat.dtype for _, flat, _, _ in replicas.launched] == [torch.bfloat16]
        whole = [p.grad.clone() for p in part.parameters()]
        replicas.finish()
        for param, grad in zip(part.parameters(), whole):
            assert param.grad.dtype == torch.float32
            torch.testing.assert_close(param.grad, grad.bfloat16().float() / 2)


def test_replicas_average_each_part_as_its_last_backward_lands():
    """A pipeline rank's replicas' all-reduce: each bucket launched once its gradients have
    taken the step's last micro-batch, the later part's first (while the earlier part still
    runs its backwards), never out of that order (a replica reaching another bucket first
    waits for it), the rest at the flush, each average written back (the fake group's
    all-reduce sums this rank's alone: halved); nothing before the step is armed."""
    from parallab.launching.distributed import fake_group
    from parallab.parallel.replicas import Replicas

    def backward(part):
        part(torch.ones(2, 4)).sum().backward()

    with fake_group(2):
        torch.manual_seed(0)
        parts = [torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)]
        replicas = Replicas(parts, None, 2, microbatches=2, bucket_mb=1e-6)  # a bucket each
        assert [len(b) for b in replicas.buckets] == [1, 1, 1, 1]
        backward(parts[1])  # not armed: a dry run's backward
        assert replicas.launched == []
        for part in parts:
            part.zero_grad()
        replicas.arm()
        for later_first in (parts[1], parts[1], parts[0]):
            backward(later_first)
        assert len(replicas.launched) == 2  # the later part's weight and bias, in flight
        backward(parts[0])
        assert len(replicas.launched) == 4
        summed = [p.grad.clone() for part in parts for p in part.parameters()]
        replicas.finish()
        for got, whole in zip([p.grad for part in parts for p in part.parameters()], summed):
            torch.testing.assert_close(got, whole / 2)

        replicas.arm()  # the earlier part's backwards first: held till the later one's land
        backward(parts[0])
        backward(parts[0])
        assert replicas.launched == []
        backward(parts[1])
        backward(parts[1])
        assert len(replicas.launched) == 4
        replicas.finish()
        replicas.arm()  # a step cut short (one micro-batch of two): all left to the flush
        backward(parts[1])
        assert replicas.launched == []
        replicas.finish()
        assert replicas.launched == [] and not replicas.armed

        shared = torch.nn.Linear(4, 4)  # one parameter in two parts (a V's tied ends)
        tied = Replicas([torch.nn.Sequential(shared), torch.nn.Sequential(shared)], None, 2,
                        microbatches=2, bucket_mb=1e-6)
        tied.arm()
        for _ in range(3):
            backward(shared)
        assert tied.launched == []  # 3 of its 2 parts x 2 micro-batches
        backward(shared)
        assert len(tied.launched) == 2
        tied.finish()


def _replicas_where_one_made_no_gradient(rank: int, store: str) -> None:
    """On one of 2 gloo replicas: a part's second layer reached by rank 0's graph only."""
    import torch.distributed as dist

    from parallab.parallel.replicas import Replicas

    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    torch.manual_seed(0)
    first, second = torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)
    part = torch.nn.Sequential(first, second)
    replicas = Replicas([part], None, 2, microbatches=1, bucket_mb=25.0)
    replicas.arm()
    x = torch.full((2, 4), float(rank + 1))
    (second(first(x)) if rank == 0 else first(x)).sum().backward()
    replicas.finish()
    grads = [torch.zeros(0) if p.grad is None else p.grad for p in part.parameters()]
    gathered = [None, None]
    dist.all_gather_object(gathered, grads)
    for mine, theirs in zip(*gathered):  # one model on both replicas
        torch.testing.assert_close(mine, theirs)
    assert second.weight.grad is not None and second.weight.grad.abs().sum() > 0
    dist.destroy_process_group()


@pytest.mark.distributed
def test_replicas_agree_where_one_replicas_graph_made_no_gradient(tmp_path):
    """A parameter one replica's graph did not reach (a branch its data did not take):
    its place in the bucket is zeros there, so the buffers match (no hang), and it takes
    the average the other replica's gradient gives, so that both stay one model."""
    import torch.multiprocessing as mp

    mp.spawn(_replicas_where_one_made_no_gradient, args=(str(tmp_path / "store"),), nprocs=2)


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize("parallel", ["fsdp", "pipeline"])
def test_sharded_checkpoint_evaluates_and_exports_on_one_device(tmp_path, train_here, parallel):
    _, run_dir = train_here(*EQUIVALENCE, f"parallel={parallel}", "parallel.world_size=2",
                            "trainer.max_steps=10")
    ckpt = run_dir / "checkpoints" / "last.dcp"
    assert len(list(ckpt.glob("*.distcp"))) == 2  # each rank wrote its own part
    accuracy = read_metrics(run_dir)["eval_accuracy"]
    data = EQUIVALENCE[:3] + ["data.shape=[1,8,8]"]
    evaluate_in_process([f"ckpt={ckpt}", *data], tmp_path / "eval")
    assert read_metrics(tmp_path / "eval")["eval_accuracy"] == pytest.approx(accuracy)

    full = tmp_path / "full.pt"
    _export(ckpt, full)
    state = torch.load(full, weights_only=True)
    assert state["step"] == 10
    for name, tensor in final_weights(run_dir).items():
        torch.testing.assert_close(state["model"][name], tensor)
    evaluate_in_process([f"ckpt={full}", *data], tmp_path / "eval_full")
    assert read_metrics(tmp_path / "eval_full")["eval_accuracy"] == pytest.approx(accuracy)
    again = subprocess.run([str(BIN / "parallab"), "export", str(ckpt), str(full)],
                           capture_output=True, text=True)
    assert again.returncode == 2 and "exists" in again.stderr  # nothing overwritten
    assert again.stderr.count("\n") == 1


def test_export_of_a_project_that_does_not_import_is_one_line(tmp_path):
    from parallab.commands import _export
    from parallab.config.errors import ConfigError
    from parallab.training import checkpoint

    ckpt = tmp_path / "last.pt"
    checkpoint.save(ckpt, {"model": {}, "step": 3, "config": {
        "model": {"_target_": "gone_project.model.Net"}}})
    with pytest.raises(ConfigError, match="model._target_=gone_project.model.Net does not "
                                          "import"):
        _export(ckpt, tmp_path / "out.pt")
    assert not (tmp_path / "out.pt").exists()


@pytest.mark.slow
def test_export_from_a_projects_directory_imports_the_projects_model(tmp_path):
    """As train and evaluate do, `parallab export` imports a project's modules from where it
    is run."""
    (tmp_path / "tiny_project.py").write_text(
        "import torch\nclass Net(torch.nn.Module):\n    def __init__(self):\n"
        "        super().__init__()\n        self.fc = torch.nn.Linear(2, 2)\n")
    checkpoint.save(tmp_path / "last.pt", {"model": {"fc.weight": torch.ones(2, 2),
                                                     "fc.bias": torch.zeros(2)},
                                           "step": 3, "config": {"model": {
                                               "_target_": "tiny_project.Net"}}})
    done = subprocess.run([str(Path(sys.executable).parent / "parallab"), "export", "last.pt",
                           "out.safetensors"], cwd=tmp_path, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    from safetensors.torch import load_file

    assert torch.equal(load_file(tmp_path / "out.safetensors")["fc.weight"], torch.ones(2, 2))


def test_a_sharded_index_naming_other_code_is_refused(tmp_path):
    """torch's own reader unpickles .metadata whole; ours admits checkpoint metadata only."""
    ckpt = tmp_path / "evil.dcp"
    ckpt.mkdir()
    checkpoint.save(ckpt / checkpoint.SHARDED_META, {"step": 1, "config": {}})
    (ckpt / ".metadata").write_bytes(pickle.dumps(print))  # a global outside the allow-list
    with pytest.raises(checkpoint.CheckpointError, match="builtins.print"):
        checkpoint.read_state(ckpt, {"model": {}})


def test_one_process_layouts_place_their_parts_by_the_devices_named():
    """parallel.devices as CUDA ordinals among the GPUs validate made visible (each id
    once, in order): a repeated id is the same GPU again, at most world_size of them."""
    from types import SimpleNamespace

    from parallab.parallel.base import Plan

    def gpus(devices, world_size):
        return list(Plan.gpus_of(SimpleNamespace(devices=devices), world_size))

    assert gpus(None, 3) == [0, 1, 2]
    assert gpus([0, 0], 2) == [0, 0]
    assert gpus([3, 1, 3], 3) == [0, 1, 0]
    assert gpus([2, 3, 4], 2) == [0, 1]
