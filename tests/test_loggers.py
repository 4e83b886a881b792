"""Where runs are compared: CSV, MLflow (a real `mlflow server`) and W&B (offline files) each
get the run's hyperparameters, train figures, evaluations by step and final figures."""

from __future__ import annotations

import contextlib
import csv
import json
import os
import re
import logging
import struct
import socket
import time
from pathlib import Path

import pytest
from conftest import FAST, assert_ok, free_port, read_metrics, run_entry, scalars

from parallab import testing
from parallab.checks import validate

EVAL = ["trainer.max_steps=12", "trainer.eval_every_n_steps=4", "trainer.log_every_n_steps=3"]


def test_csv_and_wandb_get_the_same_figures_at_the_same_steps(train_here, tmp_path,
                                                              monkeypatch):
    # nothing set up for W&B here (no key, no `wandb login`): it writes offline files
    for name in ("WANDB_MODE", "WANDB_API_KEY"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    metrics, run_dir = train_here(*FAST, *EVAL, "logger=[tensorboard,csv,wandb]",
                                  "optim.lr=0.02")
    rows = list(csv.DictReader(open(run_dir / "metrics.csv")))
    steps = [int(r["step"]) for r in rows]
    assert steps == sorted(set(steps))  # one row per logged step
    evals = [(int(r["step"]), float(r["eval/loss"])) for r in rows if r["eval/loss"]]
    assert [s for s, _ in evals] == [4, 8, 12]  # every 4 optimizer steps
    assert evals[-1][1] == pytest.approx(metrics["eval_loss"])
    assert float(rows[-1]["final/samples_per_sec"]) == pytest.approx(metrics["samples_per_sec"])
    # TensorBoard got the same evaluations
    assert [s for s, _ in scalars(run_dir, "eval/loss")] == [4, 8, 12]

    (log,) = run_dir.glob("wandb/offline-run-*/run-*.wandb")
    records = finished_wandb_records(log)
    run = next(r.run for r in records if r.WhichOneof("record_type") == "run")
    config = {u.key: json.loads(u.value_json) for u in run.config.update}
    assert config["optim.lr"] == 0.02 and config["parallel.name"] == "none"
    assert set(run.tags) >= {"parallel=none", "world_size=1", "precision=fp32"}
    history = [{i.nested_key[0] if i.nested_key else i.key: json.loads(i.value_json)
                for i in r.history.item} for r in records
               if r.WhichOneof("record_type") == "history"]
    assert [h["_step"] for h in history if "eval/loss" in h] == [4, 8, 12]
    assert [h["train/loss"] for h in history if "train/loss" in h] == pytest.approx(
        [float(r["train/loss"]) for r in rows if r["train/loss"]])
    assert any(h.get("final/eval_loss") == pytest.approx(metrics["eval_loss"]) for h in history)
    assert records[-1].exit.exit_code == 0


def finished_wandb_records(path: Path, within_s: float = 60) -> list:
    """A W&B run file's records once they end in its exit record: W&B's own process may
    still be writing the file when the run's finish returns, on a loaded machine."""
    deadline = time.monotonic() + within_s
    while True:
        records = list(wandb_records(path))
        if records and records[-1].WhichOneof("record_type") == "exit":
            return records
        assert time.monotonic() < deadline, [r.WhichOneof("record_type") for r in records]
        time.sleep(0.5)


def wandb_records(path: Path):
    """The records of a W&B run file (its transaction log: 32 KiB blocks of checksummed
    chunks, each record one or several chunks), as W&B's protobuf Records."""
    from wandb.proto import wandb_internal_pb2

    data, block = path.read_bytes(), 32768
    assert data[:4] == b":W&B"
    pos, parts = 7, b""
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a header is padding
            pos += block - pos % block
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if kind == 0 and length == 0:
            pos += block - pos % block
            continue
        parts += data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # a whole record, or a record's last chunk
            record = wandb_internal_pb2.Record()
            record.ParseFromString(parts)
            parts = b""
            yield record


# one real server for this module's MLflow tests, on one worker: its start takes seconds
ON_THE_SERVERS_WORKER = pytest.mark.xdist_group("mlflow_server")


@pytest.fixture(scope="module")
def mlflow_server(tmp_path_factory):
    with testing.mlflow_server(tmp_path_factory.mktemp("mlflow"), free_port()) as uri:
        yield uri


@pytest.mark.slow
@ON_THE_SERVERS_WORKER
def test_a_sweep_is_one_view_in_an_mlflow_server(mlflow_server, tmp_path):
    from mlflow import MlflowClient

    sweep_dir = tmp_path / "sweep"
    result = run_entry("train.py", [
        "-m", *FAST, *EVAL, "logger=[tensorboard,mlflow]", "optim.lr=0.01,0.03",
        f"logger.mlflow.tracking_uri={mlflow_server}", "logger.mlflow.experiment_name=sweeps",
        f"hydra.sweep.dir={sweep_dir}"], timeout=240)
    assert_ok(result)
    client = MlflowClient(mlflow_server)
    experiment = client.get_experiment_by_name("sweeps").experiment_id
    runs = client.search_runs([experiment])
    (parent,) = [r for r in runs if r.data.tags.get("parallab.parent") == "true"]
    jobs = sorted((r for r in runs if r is not parent), key=lambda r: r.data.params["optim.lr"])
    assert [r.data.params["optim.lr"] for r in jobs] == ["0.01", "0.03"]
    for job, job_dir in zip(jobs, sorted(sweep_dir.glob("[0-9]_*"))):
        assert job.info.status == "FINISHED"
        assert job.data.tags["mlflow.parentRunId"] == parent.info.run_id
        assert job.info.run_name == job_dir.name
        assert (job.data.tags["parallel"], job.data.tags["world_size"],
                job.data.tags["precision"]) == ("none", "1", "fp32")
        assert job.data.params["data.batch_size"] == "64"
        history = client.get_metric_history(job.info.run_id, "eval/loss")
        assert sorted(m.step for m in history) == [4, 8, 12]
        metrics = read_metrics(job_dir)
        assert job.data.metrics["final/eval_loss"] == pytest.approx(metrics["eval_loss"])
        train = sorted((m.step, m.value) for m in
                       client.get_metric_history(job.info.run_id, "train/loss"))
        board = scalars(job_dir, "train/loss")  # TensorBoard: the same figures, float32
        assert [s for s, _ in train] == [s for s, _ in board] == [3, 6, 9, 12]
        assert [v for _, v in train] == pytest.approx([v for _, v in board], rel=1e-6)


@ON_THE_SERVERS_WORKER
def test_a_run_in_this_process_gives_mlflows_own_http_settings_back(mlflow_server, train_here,
                                                                    monkeypatch):
    """The run shortens MLflow's HTTP retries for itself (a tracker that stops answering
    costs seconds); a process that goes on (a notebook, the user's own MLflow calls) has
    MLflow's own settings again, and a value the user set is kept."""
    from mlflow import MlflowClient

    from parallab.observe.loggers.mlflow import HTTP_DEFAULTS, MLflowLogger

    monkeypatch.delenv("MLFLOW_HTTP_REQUEST_TIMEOUT", raising=False)
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "7")
    during, start = {}, MLflowLogger.start

    def started(self, run):  # what the run's own requests go by
        start(self, run)
        during.update({name: os.environ.get(name) for name in HTTP_DEFAULTS})

    monkeypatch.setattr(MLflowLogger, "start", started)
    metrics, _ = train_here(*FAST, "trainer.max_steps=2", "logger=[mlflow]",
                            f"logger.mlflow.tracking_uri={mlflow_server}",
                            "logger.mlflow.experiment_name=in_process")
    assert during == {"MLFLOW_HTTP_REQUEST_MAX_RETRIES": "7", "MLFLOW_HTTP_REQUEST_TIMEOUT": "10"}
    assert "MLFLOW_HTTP_REQUEST_TIMEOUT" not in os.environ
    assert os.environ["MLFLOW_HTTP_REQUEST_MAX_RETRIES"] == "7"
    client = MlflowClient(mlflow_server)
    [run] = client.search_runs([client.get_experiment_by_name("in_process").experiment_id])
    assert run.data.metrics["final/train_loss"] == pytest.approx(metrics["train_loss"])


@ON_THE_SERVERS_WORKER
def test_a_resumed_run_goes_on_in_its_mlflow_run_or_says_why_not(
        mlflow_server, train_here, caplog, tmp_path):
    """Stopped and resumed, a run's curves are one MLflow run's, its steps going on (as
    Lightning's MLFlowLogger given the run_id); a resume whose run was deleted on the
    tracker, or that logs to another experiment, logs into a new one, said in one line, and
    trains as ever."""
    from mlflow import MlflowClient

    run = [*FAST, "trainer.log_every_n_steps=2", "logger=[mlflow]",
           f"logger.mlflow.tracking_uri={mlflow_server}", "logger.mlflow.experiment_name=resumes"]
    train_here(*run, "trainer.max_steps=4")
    train_here(*run, "trainer.max_steps=8", "trainer.resume=auto")
    client = MlflowClient(mlflow_server)
    experiment = client.get_experiment_by_name("resumes").experiment_id
    [first] = client.search_runs([experiment])
    assert first.info.status == "FINISHED"
    assert first.data.params["trainer.max_steps"] == "4"  # MLflow keeps a param's first value
    steps = [m.step for m in client.get_metric_history(first.info.run_id, "train/loss")]
    assert sorted(steps) == [2, 4, 6, 8]

    client.delete_run(first.info.run_id)
    with caplog.at_level(logging.WARNING):
        metrics, _ = train_here(*run, "trainer.max_steps=12", "trainer.resume=auto")
    warned = [r.getMessage() for r in caplog.records if r.name.startswith("parallab.observe")]
    assert len(warned) == 1 and f"MLflow run {first.info.run_id} is deleted" in warned[0]
    [second] = client.search_runs([experiment])
    assert second.info.run_id != first.info.run_id and metrics["steps"] == 12
    steps = [m.step for m in client.get_metric_history(second.info.run_id, "train/loss")]
    assert sorted(steps) == [10, 12]

    # resumed into another experiment: a new run there, said; logger.mlflow.run_id given, a
    # run dir's start goes on in that run, as Lightning's
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        train_here(*run, "logger.mlflow.experiment_name=elsewhere", "trainer.max_steps=14",
                   "trainer.resume=auto")
    warned = [r.getMessage() for r in caplog.records if r.name.startswith("parallab.observe")]
    assert len(warned) == 1 and "is in experiment 'resumes' at" in warned[0]
    [_] = client.search_runs([client.get_experiment_by_name("elsewhere").experiment_id])
    train_here(*run, "trainer.max_steps=2", f"logger.mlflow.run_id={second.info.run_id}",
               name="another")
    [again] = client.search_runs([experiment])
    steps = [m.step for m in client.get_metric_history(again.info.run_id, "train/loss")]
    assert again.info.run_id == second.info.run_id and sorted(steps) == [2, 10, 12]

    # a sweep's job given the run id logs into its own run, said: every job had gone into
    # that one run, their steps over one another's
    from parallab.observe.loggers.base import RunInfo
    from parallab.observe.loggers.mlflow import MLflowLogger

    job = MLflowLogger(mlflow_server, "resumes", run_id=second.info.run_id)
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        job.start(RunInfo(tmp_path / "sweep" / "0_job", "0_job", str(tmp_path / "sweep"), {},
                          ""))
    job.close("finished")
    assert job.run_id != second.info.run_id
    assert any("names one MLflow run, and each job of a sweep logs into its own" in
               r.getMessage() for r in caplog.records)


@pytest.mark.parametrize("listening", [False, True], ids=["nothing-listens", "never-answers"])
def test_a_tracker_that_is_down_is_one_warning_and_the_run_goes_on(train_here, caplog,
                                                                  listening):
    port = free_port()
    uri = f"http://127.0.0.1:{port}"
    with contextlib.ExitStack() as stack:
        if listening:  # the kernel accepts the connection; nothing ever reads or answers it
            server = stack.enter_context(socket.create_server(("127.0.0.1", port)))
            server.listen(8)
        started = time.monotonic()
        with caplog.at_level(logging.WARNING):
            metrics, run_dir = train_here(*FAST, "trainer.max_steps=4",
                                          "logger=[tensorboard,mlflow]",
                                          f"logger.mlflow.tracking_uri={uri}")
        took = time.monotonic() - started
    assert took < 30, took  # the health check's bound, not MLflow's minutes of retries
    warned = [r.getMessage() for r in caplog.records if r.name.startswith("parallab.observe.loggers")]
    assert len(warned) == 1 and f"no MLflow server answers at {uri}" in warned[0]
    assert "\n" not in warned[0]
    assert metrics["steps"] == 4 and (run_dir / "metrics.json").exists()
    assert [s for s, _ in scalars(run_dir, "eval/loss")] == [4]


@ON_THE_SERVERS_WORKER
def test_a_tracker_gone_mid_run_is_one_line_not_a_retry_warning_each(mlflow_server, train_here,
                                                                   caplog, monkeypatch):
    """A tracker that goes away once the run is under way: parallab's one line, not urllib3's
    "Retrying (Retry(total=...))" at each retry of each request besides (nor a second line
    and a second wait, from the final params sent after the figures had failed)."""
    from parallab.observe.loggers.mlflow import MLflowLogger

    pool = logging.getLogger("urllib3.connectionpool")
    start, filters = MLflowLogger.start, list(pool.filters)
    with testing.relay(mlflow_server) as (uri, cut):
        def started(self, run):
            start(self, run)
            cut()

        monkeypatch.setattr(MLflowLogger, "start", started)
        with caplog.at_level(logging.WARNING):
            metrics, _ = train_here(*FAST, "trainer.max_steps=4", "logger=[mlflow]",
                                    f"logger.mlflow.tracking_uri={uri}")
    warned = [r.getMessage() for r in caplog.records
              if r.name.startswith(("parallab.observe", "urllib3", "mlflow"))]
    assert len(warned) == 1 and f"logger.mlflow: {uri} stopped answering" in warned[0], warned
    assert metrics["steps"] == 4
    # the run's own: the user's requests after it say their retries
    assert pool.filters == filters


def test_a_local_stores_artifacts_go_beside_its_database(train_here, tmp_path, monkeypatch):
    """MLflow's default artifact root is ./mlruns in the dir a run starts from (a checkout's,
    a project's): a local store's go beside its database instead."""
    started_in = tmp_path / "project"
    started_in.mkdir()
    monkeypatch.chdir(started_in)
    train_here(*FAST, "trainer.max_steps=1", "logger=[mlflow]",
               f"logger.mlflow.tracking_uri=sqlite:///{tmp_path / 'store' / 'mlflow.db'}")
    assert list(started_in.iterdir()) == []
    assert list((tmp_path / "store" / "mlruns").glob("*/artifacts/config.yaml"))


def test_a_logger_not_installed_is_one_line_naming_the_extra(monkeypatch):
    import importlib.util

    found = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "wandb" else found(name, *a))
    from conftest import typed

    with pytest.raises(validate.ConfigError,
                       match=r'logger=wandb needs wandb, which is not installed: '
                             r'pip install "parallab\[wandb\]"'):
        validate.prepare(typed("logger=wandb", "device=cpu"), in_place=None)


@pytest.mark.parametrize("filename,refusal", [
    ("metrics.json", "which is the run's own metrics.json"),
    ("train.log", "which is the run's own train.log"),
    ("train_rank1.log", "which is the run's own train_rank1.log"),
    ("checkpoints/rows.csv", "which is the run's own checkpoints"),
    ("../rows.csv", "outside the run dir"),
    ("/tmp/rows.csv", "outside the run dir"),
    ("''", "which names no file"),  # the run dir itself: it ended in an IndexError
    (".", "which names no file"),
])
def test_a_csv_file_on_the_runs_own_files_or_outside_its_dir_is_refused_before_launch(
        filename, refusal):
    import re

    from conftest import checked

    from parallab.config.errors import ConfigError

    said = repr(filename.strip("'")) if refusal == "which names no file" else filename
    with pytest.raises(ConfigError, match=re.escape(f"logger csv writes {said}, {refusal}")):
        checked("logger=csv", f"logger.csv.filename={filename}", "device=cpu")


def test_overwrite_replaces_the_earlier_runs_rows_and_events_and_a_subfolder_is_made(
        train_here, tmp_path):
    run = [*FAST, "data.train_size=512", "logger=[tensorboard,csv]",
           "logger.csv.filename=tables/rows.csv"]
    _, run_dir = train_here(*run, "trainer.log_every_n_steps=1")  # 8 steps, a row each
    train_here(*run, "trainer.overwrite=true", "trainer.log_every_n_steps=8")
    with open(run_dir / "tables" / "rows.csv", newline="") as file:  # none of the first's
        assert [row["step"] for row in csv.DictReader(file)] == ["2", "8"]  # comm/*, the end
    assert len(list(run_dir.glob("events.out.tfevents.*"))) == 1
    # replaced by a run of other loggers: the replaced run's files go too (its checkpoint's
    # config names them), and a file of the user's own in checkpoints/ stays
    (run_dir / "checkpoints" / "notes.txt").write_text("mine")
    train_here(*FAST, "data.train_size=512", "logger=csv", "trainer.overwrite=true")
    assert not list(run_dir.glob("events.out.tfevents.*"))
    assert not (run_dir / "tables" / "rows.csv").exists() and (run_dir / "metrics.csv").exists()
    assert (run_dir / "checkpoints" / "notes.txt").read_text() == "mine"
    assert (run_dir / "checkpoints" / "last.pt").exists()


@pytest.mark.parametrize("overrides,refusal", [
    (["logger=mlflow", "logger.mlflow.tracking_uri=not-a-uri::://x"],
     "MLflow takes no 'not-a-uri' URI"),
    (["logger=mlflow", "logger.mlflow.tracking_uri=postgresql://u@h/db"],
     "needs the psycopg2 driver"),
    (["logger=mlflow", "logger.mlflow.experiment_name=''"], "experiment_name='' is empty"),
    (["logger=mlflow", f"logger.mlflow.experiment_name={'x' * 257}"],
     "is 257 characters, longer than MLflow's database stores keep (256)"),
    (["logger=mlflow", "logger.mlflow.tracking_uri=file:///tmp/mlruns"],
     "is a file store, which the installed MLflow refuses unless MLFLOW_ALLOW_FILE_STORE=true"),
    (["logger=mlflow", "logger.mlflow.tracking_uri=mlruns"], "is a file store"),
    (["logger=wandb", "logger.wandb.mode=loud"], "logger.wandb.mode=loud is not one of W&B's"),
    (["logger=wandb", "logger.wandb.project=a/b"], "is a name W&B refuses (it holds /)"),
    (["+logger.mine._target_=collections.OrderedDict"], "is not a logger"),
])
def test_values_a_tracker_would_refuse_are_refused_before_launch(overrides, refusal,
                                                                monkeypatch):
    from conftest import checked

    from parallab.config.errors import ConfigError

    monkeypatch.delenv("MLFLOW_ALLOW_FILE_STORE", raising=False)
    with pytest.raises(ConfigError, match=re.escape(refusal)):
        checked(*overrides, "device=cpu")


def test_a_file_store_is_taken_where_the_user_allows_it(monkeypatch):
    from conftest import checked

    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    checked("logger=mlflow", "logger.mlflow.tracking_uri=file:///tmp/mlruns", "device=cpu")


def test_a_sweep_is_one_group_however_its_dir_is_written(tmp_path, monkeypatch):
    """A sweep continued from its printed command (hydra.sweep.dir absolute) had become a
    second MLflow parent run and W&B group: the loggers are told the sweep by where it is."""
    from conftest import typed

    from parallab.observe import loggers

    monkeypatch.chdir(tmp_path)
    cfg = typed("device=cpu")
    given = [loggers.run_info(cfg, tmp_path / "sweep" / "0_a", [], sweep, 1).sweep
             for sweep in ("sweep", str(tmp_path / "sweep"), "./sweep/")]
    assert given == [str(tmp_path.resolve() / "sweep")] * 3
