"""Faults a new user meets: diverging runs, reused and shared run dirs, runs
continued past max_steps, sweep bookkeeping on bad files; each ends in one line or is
survived, and nothing a user wrote is overwritten."""

from __future__ import annotations

import json
import logging
import math
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from conftest import FAST, REPO, losses, output, read_metrics, run_entry

from parallab.cli import JobFailed
from parallab.observe import summary
from parallab.observe.loggers import RunLogger

DIVERGE = [*FAST, "optim.lr=1e6", "trainer.log_every_n_steps=10",
           "trainer.checkpoint_every_n_steps=5"]


def finite_checkpoints(run_dir) -> list[bool]:
    return [all(torch.isfinite(v).all() for v in torch.load(f, weights_only=True)["model"].values())
            for f in sorted((run_dir / "checkpoints").glob("*.pt"))]


def test_a_diverging_run_keeps_no_nan_checkpoint_and_ends_in_one_line(train_here, tmp_path):
    """Steps 1-5 hold a NaN loss, the periodic checkpoint falls at step 5, the log window at
    10: the checkpoint is not written."""
    with pytest.raises(JobFailed) as failed:
        train_here(*DIVERGE, name="run")
    assert "train loss is nan at step 5" in str(failed.value) and "\n" not in str(failed.value)
    assert finite_checkpoints(tmp_path / "run") == []  # none at all: every one would be NaN


@pytest.mark.slow
@pytest.mark.distributed
def test_a_diverging_ddp_run_ends_in_one_line(train):
    result, run_dir = train(*DIVERGE, "parallel=ddp", "parallel.world_size=2")
    assert result.returncode == 1, output(result)
    assert "Traceback" not in output(result)
    assert re.search(r"rank \d: train loss is nan at step 5", output(result)), output(result)
    assert all(finite_checkpoints(run_dir))


def worker_failed(tmp_path, record: str):
    """The elastic agent's report of rank 1 failing with the error record `record` (what
    torch's error handler writes: "Type: message" and the traceback)."""
    from torch.distributed.elastic.multiprocessing.errors import (
        ChildFailedError,
        ProcessFailure,
    )

    error_file = tmp_path / "error.json"
    error_file.write_text(json.dumps({"message": {"message": record, "extraInfo": {
        "py_callstack": f"Traceback (most recent call last):\n  ...\n{record}\n",
        "timestamp": "0"}}}))
    return ChildFailedError("worker_main", {1: ProcessFailure(1, 4242, 1, str(error_file))})


def test_a_workers_failure_is_told_apart_by_its_type(tmp_path):
    """The line a worker left for an error whose type says it is the whole story ends the
    job with that error's status; an error whose text only reads like one keeps its
    traceback (the worker side: test_a_diverging_ddp_run_ends_in_one_line)."""
    from parallab.cli import worker_failure
    from parallab.launching import worker

    error = worker_failed(tmp_path, "RuntimeError: a wrapped failure:\n"
                                    "ConfigError: only its text says so")
    with pytest.raises(type(error)), worker.one_line_failures():  # no line left: as it came
        raise error
    kept = worker_failure(error)
    assert kept.status == 1 and "Traceback" in str(kept)
    assert kept.line == "rank 1: ConfigError: only its text says so"
    with pytest.raises(worker.LeftByWorker) as told, worker.one_line_failures() as failures:
        Path(failures, "rank1.json").write_text(json.dumps(
            {"status": 2, "message": "data.x=1 is wrong here: use data.x=2"}))
        raise error
    assert (told.value.status, str(told.value)) == (
        2, "rank 1: data.x=1 is wrong here: use data.x=2")


def test_skipping_most_steps_stops_and_metrics_never_hold_nan(train_here, tmp_path):
    with pytest.raises(JobFailed, match="trainer.on_nan=skip dropped"):
        train_here(*DIVERGE, "trainer.on_nan=skip")
    logger = RunLogger(tmp_path, True, {})  # metrics.json alone
    logger.finish({"eval_loss": math.nan, "train_loss": math.inf, "steps": 3}, {"a": 1}, 3)
    logger.close()
    assert json.loads((tmp_path / "metrics.json").read_text()) == {
        "eval_loss": None, "train_loss": None, "steps": 3}


def test_a_run_stopped_by_max_steps_continues_as_if_uninterrupted(train_here):
    common = [*FAST, "data.train_size=1024", "trainer.epochs=3", "trainer.log_every_n_steps=1",
              "trainer.checkpoint_every_n_steps=null"]
    whole, whole_dir = train_here(*common, name="whole")
    train_here(*common, "trainer.max_steps=10", name="parts")
    parts, parts_dir = train_here(*common, "trainer.max_steps=48", "trainer.resume=auto",
                                  name="parts")
    assert whole["steps"] == parts["steps"] == 48
    assert losses(parts_dir) == losses(whole_dir)  # steps 11.. from mid-epoch 1
    assert parts["eval_loss"] == whole["eval_loss"]


@pytest.mark.slow
def test_a_fresh_run_in_a_used_dir_is_refused_and_leaves_it_as_it_was(train_here):
    # the refusal from the command line (the dir quoted there); the runs around it in-process
    _, run_dir = train_here(*FAST, "trainer.max_steps=3", name="a run with spaces")
    record = {p: p.read_bytes() for p in run_dir.rglob("*") if p.is_file() and p.name != "train.log"}
    for quoted in (f"hydra.run.dir='{run_dir}'",):  # quoted: a path with spaces
        result = run_entry("train.py", [*FAST, "trainer.max_steps=5", quoted])
        assert result.returncode == 2, output(result)
        assert "already holds a run (metrics.json, checkpoints/): continue it with " \
               "trainer.resume=auto" in output(result) and "Traceback" not in output(result)
        assert {p: p.read_bytes() for p in record} == record
    replaced, _ = train_here(*FAST, "trainer.max_steps=5", "trainer.overwrite=true",
                             name="a run with spaces")
    assert replaced["steps"] == read_metrics(run_dir)["steps"] == 5
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == ["best.pt", "last.pt"]


@pytest.mark.slow
def test_a_second_run_in_the_same_dir_at_once_is_refused(tmp_path):
    run_dir = tmp_path / "shared"
    first = subprocess.Popen([sys.executable, "train.py", *FAST, "trainer.epochs=50",
                              f"hydra.run.dir={run_dir}"], stdout=subprocess.DEVNULL,
                             stderr=subprocess.DEVNULL, cwd=REPO)
    try:
        deadline = time.time() + 60
        while not any((run_dir / "checkpoints").glob("step_*")) and time.time() < deadline:
            time.sleep(0.2)
        for second_args in (["trainer.overwrite=true"],):  # the one that would delete
            second = run_entry("train.py", [*FAST, *second_args], run_dir)
            assert second.returncode == 2, output(second)
            assert "is in use by a run still going: wait for it to end" in output(second)
            # refused before it could delete anything of the running one
            assert any((run_dir / "checkpoints").glob("step_*"))
    finally:
        first.kill()
        first.wait()


def write_job(sweep, name: str, metrics, status=None) -> None:
    job = sweep / name
    (job / ".hydra").mkdir(parents=True)
    (job / ".hydra" / "overrides.yaml").write_text(f"- data.batch_size={len(name)}\n")
    if metrics is not None:
        (job / "metrics.json").write_text(metrics)
    if status is not None:
        (job / summary.STATUS_FILE).write_text(status)


def test_the_summary_survives_bad_bookkeeping_files(tmp_path):
    good = json.dumps({"eval_loss": 0.5, "samples_per_sec": 10.0, "world_size": 1,
                       "global_batch_size": 8, "eval_accuracy": None})
    write_job(tmp_path, "0_good", good)
    write_job(tmp_path, "1_list", "[1, 2]")
    write_job(tmp_path, "2_nulls", json.dumps({"eval_loss": None, "samples_per_sec": None}))
    write_job(tmp_path, "3_corrupt_status", None, status="{not json")
    write_job(tmp_path, "4_advise", None)  # experiment=advise answers in advise.csv/.md
    (tmp_path / "4_advise" / "advise.csv").write_text("layout,verdict\n")
    rows = {r["job"]: r["status"] for r in summary.write(tmp_path)}
    assert rows == {"0_good": "completed", "1_list": "unreadable", "2_nulls": "unreadable",
                    "3_corrupt_status": "incomplete", "4_advise": "advised (advise.md)"}
    assert (tmp_path / "summary.png").stat().st_size > 0
    assert summary.read_metrics(tmp_path / "2_nulls") is None  # skip_completed reruns it


def test_evaluate_without_ckpt_is_one_line():
    result = run_entry("evaluate.py", ["device=cpu"])
    assert result.returncode == 2 and "Traceback" not in output(result)
    assert "ckpt is not set" in output(result)


def test_evaluate_given_a_config_to_train_with_says_how_it_is_called(tmp_path):
    """`evaluate.py -cn <a config to train with>` had ended in OmegaConf's traceback (Key
    'ckpt' not in 'Config'), and with ckpt=... in Hydra's line that the config has no
    key ckpt: neither said that evaluate.py composes its own config."""
    (tmp_path / "conf").mkdir()
    (tmp_path / "conf" / "mine.yaml").write_text("defaults:\n  - config\n  - _self_\n")
    result = run_entry("evaluate.py", [f"--config-dir={tmp_path / 'conf'}", "-cn", "mine",
                                       "device=cpu"], tmp_path / "eval")
    assert result.returncode == 2 and "Traceback" not in output(result), output(result)
    assert output(result).strip().splitlines()[-1].endswith(
        "evaluate.py --config-name=mine: mine is a config to train with, which takes no ckpt; "
        "evaluate.py composes its own and takes the checkpoint (its model and data come from "
        "it): python evaluate.py ckpt=outputs/DATE/TIME/checkpoints/last.pt [overrides], no "
        "--config-name")
    given = run_entry("evaluate.py", ["-cn", "config", "ckpt=last.pt", "device=cpu"],
                      tmp_path / "given")
    assert given.returncode == 2 and "Traceback" not in output(given), output(given)
    assert "ckpt is the checkpoint evaluate.py takes, under its own config: python " \
        "evaluate.py ckpt=PATH [overrides], no --config-name" in output(given)


def test_peak_memory_is_the_runs_own_not_an_earlier_jobs(train_here):
    """A sweep's jobs share a process: a 1.2 GB job before must not be this run's peak
    (a short run adds far less than 600 MB to what the process already holds)."""
    import psutil

    held = psutil.Process().memory_info().rss / 2**20
    big = torch.ones(300_000_000)  # 1.2 GB resident
    del big
    metrics, _ = train_here(*FAST, "trainer.max_steps=3")
    assert 0 < metrics["peak_memory_mb"] < held + 600, (metrics["peak_memory_mb"], held)


def test_swept_keys_reach_the_hparams_as_numbers():
    from conftest import checked

    from parallab.observe.hparams import of as hparams

    cfg, _ = checked(*FAST)
    overrides = ["data.batch_size=32", "optim.lr=0.1", "trainer.compile=false", "+metrics.x=abc"]
    figures = {"world_size": 1, "global_batch_size": 32, "precision_dtype": "float32", "lr": 0.01}
    values = hparams(cfg, overrides, figures)
    assert (values["optim.lr"], values["trainer.compile"], values["metrics.x"]) == (
        0.01, False, "abc")  # the config's own values win where it names the key
    # the value the run took: YAML had read 9e-1 as text (TensorBoard sorted it as one)
    given = ["optim.momentum=9e-1", "trainer.max_steps=7", "parallel.world_size=1"]
    values = hparams(checked(*FAST, *given)[0], given, figures)
    assert (values["optim.momentum"], values["trainer.max_steps"],
            values["parallel.world_size"]) == (0.9, 7, 1)


@pytest.mark.slow
@pytest.mark.distributed
def test_a_sharded_checkpoint_missing_or_truncating_a_shard_is_refused_before_launch(
        train_here, tmp_path):
    import shutil

    from conftest import checked

    from parallab.checks import validate
    from parallab.commands import evaluate_in_process
    from parallab.config.errors import OneLineError

    _, run_dir = train_here(*FAST, "parallel=fsdp", "parallel.world_size=2",
                            "trainer.max_steps=4", "model=mlp")
    whole = run_dir / "checkpoints" / "last.dcp"
    shard = sorted(whole.glob("*.distcp"))[-1].name
    missing, truncated = tmp_path / "missing.dcp", tmp_path / "truncated.dcp"
    unindexed = tmp_path / "unindexed.dcp"
    for broken in (missing, truncated, unindexed):
        shutil.copytree(whole, broken)
    (missing / shard).unlink()
    (truncated / shard).write_bytes((whole / shard).read_bytes()[:100])
    (unindexed / ".metadata").unlink()
    for broken, problem in ((missing, f"is missing its shard {shard}"),
                            (truncated, f"its shard {shard} is truncated (100 of"),
                            (unindexed, "has no .metadata")):
        # each names the key that named it, and one fix, that command's own
        for key, fix in (("trainer.resume", "give another checkpoint, or trainer.resume=auto"),
                         ("trainer.init_from", "start from other weights")):
            with pytest.raises(validate.ConfigError) as refused:
                checked(*FAST, "parallel=fsdp", "model=mlp", f"{key}={broken}")
            said = str(refused.value)
            assert said.startswith(f"{key}={broken}") and said.endswith(fix), said
            assert problem in said and "ckpt=" not in said and "\n" not in said, said
        with pytest.raises(OneLineError, match=re.escape(problem)):  # evaluate.py's exit 2
            evaluate_in_process([f"ckpt={broken}", "device=cpu"], tmp_path / "eval")
    exported = subprocess.run([str(Path(sys.executable).parent / "parallab"), "export",
                               str(missing), str(tmp_path / "out.pt")], capture_output=True,
                              text=True)
    assert exported.returncode == 2 and "is missing its shard" in exported.stderr
    assert "Traceback" not in exported.stderr


@pytest.fixture
def small_disk(tmp_path):
    """A 450 KB tmpfs: room for two checkpoints of the MNIST recipe's CNN (~180 KB each), not three."""
    disk = tmp_path / "disk"
    disk.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=450k", "tmpfs", str(disk)],
                             capture_output=True)
    if mounted.returncode:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.decode().strip()}")
    yield disk
    subprocess.run(["umount", "-l", str(disk)], check=False)


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["none", "fsdp"])
def test_a_full_disk_ends_in_one_line_and_keeps_the_earlier_checkpoints(small_disk, layout):
    from parallab.cli import train_in_process

    run_dir = small_disk / "run"
    with pytest.raises(JobFailed) as failed:
        train_in_process([*FAST, f"parallel={layout}", "trainer.max_steps=30",
                          "trainer.checkpoint_every_n_steps=5", "trainer.keep_last_k=5"], run_dir)
    said = str(failed.value)
    assert failed.value.status == 1 and "\n" not in said, said  # one line, no traceback
    assert "could not write checkpoint" in said and "the previous checkpoints are intact" in said
    kept = sorted(p.name for p in (run_dir / "checkpoints").iterdir())
    assert not [name for name in kept if name.endswith(".tmp")], kept  # nothing half-written
    assert kept and all(name.startswith("step_") for name in kept), kept
    from parallab.training import checkpoint

    newest = checkpoint.latest(run_dir / "checkpoints")
    assert checkpoint.load_meta(newest)["step"] == 5 * len(kept)  # readable, in order


@pytest.mark.slow
def test_evaluate_follows_the_checkpoints_model_and_refuses_model_overrides(train_here, tmp_path):
    """A gpt trained with model.context=64: data=bytes takes its seq_len from that context
    (not the default model's), and a model.* override is refused, not dropped; so is a
    layout, evaluate.py scoring in one process (its threads are its to set)."""
    gpt = ["model=gpt", "data=bytes", "model.context=64", "model.layers=1", "model.width=32",
           "model.heads=2", "trainer.max_steps=3", "device=cpu"]
    _, run_dir = train_here(*gpt)
    ckpt = f"ckpt={run_dir / 'checkpoints' / 'last.pt'}"
    from parallab.commands import evaluate_in_process
    from parallab.config.errors import ConfigError

    evaluate_in_process([ckpt, "data=bytes", "device=cpu"], tmp_path / "eval")
    assert read_metrics(tmp_path / "eval")["step"] == 3
    refused = run_entry("evaluate.py", [ckpt, "data=bytes", "model.context=32"],
                        tmp_path / "eval2")
    assert refused.returncode == 2 and "Traceback" not in output(refused)
    assert "model.context=32: evaluate.py builds the model" in output(refused)
    with pytest.raises(ConfigError, match="model=gpt: evaluate.py builds the model"):
        evaluate_in_process([ckpt, "data=bytes", "model=gpt", "device=cpu"], tmp_path / "eval3")
    for layout in ("parallel=fsdp", "parallel.world_size=2"):
        with pytest.raises(ConfigError, match=f"{layout}: evaluate.py scores .* in one process"):
            evaluate_in_process([ckpt, "data=bytes", layout, "device=cpu"], tmp_path / "eval4")
    # a trainer key, read by no part of evaluate.py: the float model had been scored
    with pytest.raises(ConfigError, match="trainer.quantize=dynamic_int8: evaluate.py scores "
                       ".* as saved and trains nothing, so no trainer key is read: drop it"):
        evaluate_in_process([ckpt, "data=bytes", "trainer.quantize=dynamic_int8", "device=cpu"],
                            tmp_path / "eval7")
    evaluate_in_process([ckpt, "data=bytes", "parallel.threads_per_worker=1", "device=cpu"],
                        tmp_path / "eval5")
    with pytest.raises(ConfigError, match="picks GPUs, but device=cpu"):  # its GPU, on CUDA
        evaluate_in_process([ckpt, "data=bytes", "parallel.devices=[0]", "device=cpu"],
                            tmp_path / "eval6")


@pytest.mark.slow
def test_evaluates_refusals_name_only_fixes_it_takes(train_here, tmp_path):
    """The checks evaluate.py shares with train.py name their fix in train.py's keys: where
    that is a model or trainer key, which evaluate.py refuses, it says its own."""
    from parallab.commands import _export, evaluate_in_process
    from parallab.config.errors import OneLineError

    _, run_dir = train_here("model=gpt", "data=bytes", "model.context=32", "model.layers=1",
                            "model.width=32", "model.heads=2", "trainer.max_steps=1",
                            "device=cpu")
    last = run_dir / "checkpoints" / "last.pt"
    with pytest.raises(OneLineError) as refused:  # the trained context is the model's
        evaluate_in_process([f"ckpt={last}", "data.seq_len=64", "device=cpu"], tmp_path / "a")
    # its fix beside the model's, which evaluate.py does not take, is what it says
    assert str(refused.value).endswith("data.seq_len<=32 (evaluate.py takes no model, trainer "
                                       "or layout key)"), refused.value
    saved = torch.load(last, weights_only=True)  # weights its model's class no longer fits
    del saved["model"]["embed.positions.weight"]
    torch.save(saved, tmp_path / "short.pt")
    for call in (lambda: evaluate_in_process([f"ckpt={tmp_path / 'short.pt'}", "device=cpu"],
                                             tmp_path / "b"),
                 lambda: _export(tmp_path / "short.pt", tmp_path / "out.pt")):
        with pytest.raises(OneLineError) as refused:
            call()
        assert "embed.positions.weight unset" in str(refused.value), refused.value
        assert "trainer." not in str(refused.value)


def test_an_image_folder_of_one_class_is_refused(tmp_path):
    from PIL import Image

    from parallab.data.images import ImageFolder

    (tmp_path / "cats").mkdir()
    for i in range(5):
        Image.new("RGB", (8, 8)).save(tmp_path / "cats" / f"{i}.png")
    problem = ImageFolder(path=str(tmp_path)).problem()
    assert problem and "holds one class folder (cats)" in problem


def test_resume_auto_passes_over_a_truncated_newest_checkpoint(train_here, caplog):
    common = [*FAST, "trainer.max_steps=20", "trainer.checkpoint_every_n_steps=5"]
    _, run_dir = train_here(*common)
    last = run_dir / "checkpoints" / "last.pt"
    last.write_bytes(last.read_bytes()[:1000])  # a crash mid-write of a copy, say
    (run_dir / "metrics.json").unlink()
    with caplog.at_level(logging.INFO):
        metrics, _ = train_here(*common, "trainer.max_steps=25", "trainer.resume=auto")
    assert f"passing over {last}" in caplog.text
    # the newest readable one: last.pt held step 20, the newest periodic one step 15
    assert "step_00000015.pt at step 15" in caplog.text
    assert metrics["steps"] == 25
