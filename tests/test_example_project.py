"""examples/own_model as its user runs it: a copy outside the repository with its own model
(a plain nn.Module, stages named in YAML), its own Dataset and YAML, loss=mse, trained by the
installed `parallab` command under every layout, swept, and evaluated."""

from __future__ import annotations

import shutil

import pytest
from conftest import REPO, assert_ok, losses, output, read_metrics, run_entry

EXAMPLE = REPO / "examples" / "own_model"
# 20 steps, every loss logged, at one global batch whatever the layout
SAME = ["--config-dir", "conf", "experiment=waves", "trainer.max_steps=20",
        "trainer.log_every_n_steps=1", "data.global_batch_size=64", "device=cpu"]
ON_ONE_WORKER = pytest.mark.xdist_group("own_model")


@pytest.fixture(scope="module")
def project(tmp_path_factory):
    copy = tmp_path_factory.mktemp("elsewhere") / "own_model"
    shutil.copytree(EXAMPLE, copy, ignore=shutil.ignore_patterns("__pycache__", "outputs"))
    return copy


def parallab(project, *args: str, run_dir=None, timeout: float = 300):
    return run_entry("parallab", list(args), run_dir, timeout=timeout, cwd=project)


@pytest.fixture(scope="module")
def one_device(project):
    run_dir = project / "outputs" / "none"
    assert_ok(parallab(project, "train", *SAME, run_dir=run_dir))
    return run_dir


@pytest.mark.slow
@ON_ONE_WORKER
def test_the_project_trains_a_regression_without_accuracy(one_device):
    metrics = read_metrics(one_device)
    assert "eval_accuracy" not in metrics and metrics["eval_loss"] < 1.0
    assert metrics["steps"] == 20 and metrics["global_batch_size"] == 64
    steps = losses(one_device)
    assert len(steps) == 20 and steps[-1] < steps[0] / 2  # it learns


@pytest.mark.slow
@pytest.mark.distributed
@ON_ONE_WORKER
@pytest.mark.parametrize("layout", ["ddp", "fsdp", "pipeline"])
def test_every_layout_gives_the_one_device_losses(project, one_device, layout, monkeypatch):
    """The training function on the copy's config dir and modules, in this process (its
    workers import the project as the command's would): no interpreter start-up per run."""
    from parallab.cli import train_in_process

    monkeypatch.syspath_prepend(str(project))
    run_dir = project / "outputs" / layout
    metrics = train_in_process([*SAME[2:], f"parallel={layout}", "parallel.world_size=2"],
                               run_dir, project / "conf")
    assert metrics["world_size"] == 2
    assert losses(run_dir) == pytest.approx(losses(one_device), abs=1e-4)


@pytest.mark.slow
@ON_ONE_WORKER
def test_evaluate_reads_the_projects_checkpoint(project, one_device):
    run_dir = project / "outputs" / "eval"
    result = parallab(project, "evaluate", "--config-dir", "conf", "experiment=waves",
                      f"ckpt={one_device / 'checkpoints' / 'last.pt'}", "device=cpu",
                      run_dir=run_dir)
    assert_ok(result)
    scored = read_metrics(run_dir)
    assert scored["model"] == "own_model.model.ResMLP" and scored["step"] == 20
    assert scored["eval_loss"] == pytest.approx(read_metrics(one_device)["eval_loss"], rel=1e-5)


@pytest.mark.slow
@pytest.mark.distributed
@ON_ONE_WORKER
def test_a_sweep_over_batch_and_world_size_is_compared_in_its_summary_and_tensorboard(project):
    """A user's 2 x 2 sweep: parallab's summary, and the real TensorBoard server over the
    multirun dir (read through its HTTP API) showing the four runs side by side."""
    from parallab.observe.board import serve

    sweep = project / "outputs" / "sweep"
    result = parallab(project, "train", "-m", "--config-dir", "conf", "experiment=waves",
                      "parallel=ddp", "parallel.world_size=1,2", "data.batch_size=16,32",
                      "trainer.max_steps=4", "trainer.timing_skip_steps=1", "device=cpu",
                      f"hydra.sweep.dir={sweep}", timeout=400)
    assert_ok(result)
    rows = (sweep / "summary.csv").read_text().splitlines()
    assert len(rows) == 5 and all(",completed," in row for row in rows[1:]), rows
    assert (sweep / "summary.png").stat().st_size > 0
    assert "eval_loss" in (sweep / "summary.md").read_text()
    jobs = sorted(p.parent.name for p in sweep.glob("*/metrics.json"))
    assert len(jobs) == 4
    with serve(sweep, runs=4) as board:
        assert sorted(board.get("/data/runs")) == jobs  # run names read like the sweep
        tags = board.get("/data/plugin/scalars/tags")
        for job in jobs:
            assert {"train/loss", "train/samples_per_sec", "eval/loss"} <= set(tags[job])
        experiment = board.post("/data/plugin/hparams/experiment", {"experimentName": ""})
        hparams = {h["name"] for h in experiment["hparamInfos"]}
        assert {"parallel.world_size", "data.batch_size", "world_size", "global_batch_size",
                "precision_dtype"} <= hparams
        metrics = {m["name"]["tag"] for m in experiment["metricInfos"]}
        assert {"final/samples_per_sec", "final/eval_loss", "final/wall_time_s"} <= metrics


def test_bad_project_input_is_one_line_before_any_worker(project):
    result = parallab(project, "train", *SAME, "parallel=ddp", "+model.widht=3",
                      run_dir=project / "outputs" / "bad")
    assert result.returncode == 2, output(result)
    assert "Traceback" not in output(result) and "launching" not in output(result)
    assert "model.widht is not an argument of own_model.model.ResMLP" in output(result)
