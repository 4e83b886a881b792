"""How one process a signal stops ends: its exit status and its record (status.json), when
the stop is ended hard and when the signal comes after the last step."""

from __future__ import annotations

import json
import signal

import pytest
from conftest import FAST, inject, output, read_metrics, run_entry, sitecustomize

pytestmark = pytest.mark.slow
RUN = [*FAST, "trainer.max_steps=12", "trainer.checkpoint_every_n_steps=5"]


@pytest.mark.parametrize("action", [
    # a second request after the first (SAME_REQUEST_S to 0: the next one is a second)
    "preemption.SAME_REQUEST_S = 0.0; os.kill(os.getpid(), signal.SIGTERM); "
    "os.kill(os.getpid(), signal.SIGTERM); time.sleep(30)",
    # a stop that never reaches a step boundary: the watchdog ends it (MIN_STUCK_S after)
    "os.kill(os.getpid(), signal.SIGTERM); time.sleep(30)",
], ids=["second signal", "watchdog"])
def test_one_process_ended_hard_records_that_it_was_stopped(tmp_path, action):
    """Its record was left unwritten (os._exit runs nothing after it), where a launched
    job's controller, or a stop at a step, writes it: a script or a sweep's summary took
    the run for one still going, or one that never started."""
    run_dir = tmp_path / "run"
    action = "import time; import parallab.launching.preemption as preemption; " + action
    ended = run_entry("train.py", RUN, run_dir, timeout=120, env=inject(tmp_path, 7, action))
    assert ended.returncode == 128 + signal.SIGTERM, output(ended)[-3000:]
    said = [line for line in output(ended).splitlines() if "without saving" in line]
    assert len(said) == 1 and said[0].endswith(
        f"; resume from the last checkpoint with: python train.py {' '.join(RUN)} "
        f"hydra.run.dir={run_dir} trainer.resume=auto"), output(ended)[-3000:]
    assert json.loads((run_dir / "status.json").read_text()) == {
        "status": "stopped", "signal": "SIGTERM", "step": None}


# sitecustomize: the run signalled as its final evaluation begins, its training done
SIGNALLED_IN_THE_LAST_EVALUATION = """
import os, signal
import parallab.training.evaluation as evaluation

run = evaluation.Evaluation.run

def signalled(self, step, epoch, epoch_step):
    if step == {steps} and os.environ.get("RANK", "0") == "0":
        os.kill(os.getpid(), signal.{signal})
    return run(self, step, epoch, epoch_step)

evaluation.Evaluation.run = signalled
"""


@pytest.mark.parametrize("signum,parallel", [
    (signal.SIGTERM, ["parallel=none"]),
    # rank 0 alone signalled: the ranks agree on the stop in one vote after the evaluation
    pytest.param(signal.SIGINT, ["parallel=ddp", "parallel.world_size=2"],
                 marks=pytest.mark.distributed)], ids=["none", "ddp"])
def test_a_signal_in_the_last_evaluation_stops_the_run_as_at_its_last_step(
        tmp_path, signum, parallel):
    """It ended as finished, exit status 0, the request unheard: a scheduler's preemption
    read as a run done, a Ctrl-C as ignored. It stops as a signal at the last step stops it,
    saved; resumed, the run evaluates again and ends as the uninterrupted run."""
    from parallab.cli import train_in_process

    env = sitecustomize(tmp_path, SIGNALLED_IN_THE_LAST_EVALUATION.format(
        steps=12, signal=signum.name))
    run_dir = tmp_path / "run"
    stopped = run_entry("train.py", [*RUN, *parallel], run_dir, timeout=180, env=env)
    said = output(stopped) + ((run_dir / "train.log").read_text()  # rank 0's, where launched
                              if (run_dir / "train.log").exists() else "")
    assert stopped.returncode == 128 + signum, said[-3000:]
    assert f"stopped by {signum.name} at step 12, checkpoint saved; resume with:" in said
    assert not (run_dir / "metrics.json").exists()
    assert json.loads((run_dir / "status.json").read_text()) == {
        "status": "stopped", "signal": signum.name, "step": 12}
    if parallel == ["parallel=none"]:  # the others resume the same way
        metrics = train_in_process([*RUN, "trainer.resume=auto"], run_dir)
        assert metrics["steps"] == 12 and metrics["eval_loss"] is not None


def test_a_signal_in_the_evaluation_early_stopping_ends_the_run_at_leaves_it_finished(
        tmp_path):
    """That evaluation ended the run: stopped and resumed from there instead, the run would
    train on past where early stopping ended it (no checkpoint holds that it had)."""
    env = sitecustomize(tmp_path, SIGNALLED_IN_THE_LAST_EVALUATION.format(
        steps=24, signal="SIGTERM"))
    run_dir = tmp_path / "run"
    # an epoch of 8 steps evaluated; a falling loss monitored as if higher were better
    # stops the run early at its third evaluation (tests/test_early_stopping.py)
    ended = run_entry("train.py", [*FAST, "data.train_size=512", "trainer.epochs=6",
                                   "trainer.monitor_mode=max", "trainer.early_stop_patience=2"],
                      run_dir, timeout=120, env=env)
    assert ended.returncode == 0, output(ended)[-3000:]
    assert read_metrics(run_dir)["stopped_early"] is True
    assert read_metrics(run_dir)["steps"] == 24
    assert json.loads((run_dir / "status.json").read_text()) == {"status": "completed",
                                                                 "step": 24}


def test_a_stop_recorded_after_the_run_finished_leaves_it_completed(tmp_path):
    """A signal just after a finished run wrote its record (a second one ending the process
    at once, Ctrl-C reaching the controller as the workers end) had its status.json say
    stopped beside complete metrics: a script or a summary resumed a run with nothing left.
    The writers called in the order the race has them; a new start of the run (which
    deletes the record) still records its own stop."""
    from parallab.cli import train_in_process
    from parallab.invocation import Stopped
    from parallab.observe import summary

    run_dir = tmp_path / "run"
    metrics = train_in_process([*FAST, "data.train_size=256", "trainer.max_steps=3"], run_dir)
    record = run_dir / "status.json"
    summary.record_stopped(run_dir, signal.SIGTERM, None)  # a second signal's hard end
    Stopped(signal.SIGINT, None, said=False).record(run_dir)  # Ctrl-C in the controller
    assert json.loads(record.read_text()) == {"status": "completed", "step": 3}
    assert read_metrics(run_dir) == json.loads(json.dumps(metrics))
    record.unlink()  # as a continued start of the run does first (cli._claimed)
    summary.record_stopped(run_dir, signal.SIGTERM, 5)
    assert json.loads(record.read_text()) == {"status": "stopped", "signal": "SIGTERM",
                                              "step": 5}


# sitecustomize: the run signalled as its quantized model is scored, which takes a while
SIGNALLED_IN_THE_QUANTIZED_EVALUATION = """
import os, signal, time
import parallab.observe.meter as meter

quantized = meter.Meter.quantized

def slow(self, *args, **kwargs):
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(6)  # past the watchdog's patience with a process between steps (3 s)
    return quantized(self, *args, **kwargs)

meter.Meter.quantized = slow
"""


def test_a_signal_while_the_quantized_model_is_scored_waits_for_it(tmp_path):
    """trainer.quantize's scoring after the last evaluation is long work, not a stuck
    step: the watchdog had ended the run there, unsaved, 3 s after a signal. Its figures
    complete, the run ends finished, as one signalled in its last save."""
    env = sitecustomize(tmp_path, SIGNALLED_IN_THE_QUANTIZED_EVALUATION)
    run_dir = tmp_path / "run"
    ended = run_entry("train.py", [*RUN, "trainer.quantize=dynamic_int8"], run_dir,
                      timeout=120, env=env)
    assert ended.returncode == 0, output(ended)[-3000:]
    assert "quantized_eval_loss" in read_metrics(run_dir), read_metrics(run_dir)


def test_only_rank_0_of_a_sweep_run_in_place_keeps_a_jobs_record(tmp_path, monkeypatch):
    """Under torchrun, mpirun or srun every rank runs each job of a sweep: each had deleted
    and rewritten status.json, one merging the run's record read before rank 0 wrote it,
    which dropped "completed". Rank 1 writes none; rank 0's record is written whole."""
    from parallab import sweep_job
    from parallab.observe import summary

    summary.record_completed(tmp_path, 3)
    torchrun = {"RANK": "1", "LOCAL_RANK": "1", "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2",
                "GROUP_RANK": "0", "TORCHELASTIC_RUN_ID": "x", "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": "29500"}
    for name, value in torchrun.items():
        monkeypatch.setenv(name, value)
    sweep_job.failed(tmp_path, "rank 1's line")
    assert summary.read_status(tmp_path) == {"status": "completed", "step": 3}
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("LOCAL_RANK", "0")
    sweep_job.failed(tmp_path, "rank 0's line")
    assert summary.read_status(tmp_path) == {"status": "failed", "error": "rank 0's line"}
    assert [p.name for p in tmp_path.iterdir()] == ["status.json"]  # no file left beside it
