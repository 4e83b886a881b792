"""Nothing lost: periodic checkpoints, exact resume after SIGTERM or SIGKILL, elastic
restarts, NaN policy, a full disk."""

from __future__ import annotations

import json
import logging
import math
import re
import signal
import sys

import pytest
import torch
from conftest import FAST, assert_ok, inject, output, read_metrics, run_entry, scalars

from parallab.cli import JobFailed, train_in_process
from parallab.config.errors import ConfigError

pytestmark = pytest.mark.slow
# a cosine schedule: every resume must also land on the uninterrupted run's learning rates
RUN = [*FAST, "trainer.epochs=3", "trainer.max_steps=40", "trainer.log_every_n_steps=1",
       "trainer.checkpoint_every_n_steps=10", "scheduler=cosine"]


def losses(run_dir) -> dict[int, tuple[float, float]]:
    """Step -> (train loss, learning rate); a resumed run's later values win."""
    rates = dict(scalars(run_dir, "train/lr"))
    return {step: (loss, rates[step]) for step, loss in scalars(run_dir, "train/loss")}


def resumed_at(text: str) -> list[int]:
    """The steps a log says its runs resumed at (a stopped run's "stopped by ... at step N"
    is not one)."""
    return [int(step) for step in re.findall(r"resumed from \S+ at step (\d+)", text)]


NONE = ["parallel=none"]
DDP = ["parallel=ddp", "parallel.world_size=2"]
# a module fixture runs once per xdist worker: the tests sharing a reference share a worker
ON_NONE_REFERENCE = pytest.mark.xdist_group("none_reference")
ON_DDP_REFERENCE = pytest.mark.xdist_group("ddp_reference")


@pytest.fixture(scope="module")
def references(tmp_path_factory):
    """Uninterrupted runs, made on first use: {layout name: run dir}."""
    made = {}

    def reference(parallel: list[str]):
        name = parallel[0].split("=")[1]
        if name not in made:  # its controller in this process: the start-up is not the point
            made[name] = tmp_path_factory.mktemp("reference") / name
            train_in_process([*RUN, *parallel], made[name])
        return made[name]

    return reference


# ddp's stop and resume: test_a_signalled_ddp_job_stops_together_saves_once_and_exits_0
@pytest.mark.parametrize("parallel", [
    pytest.param(NONE, id="none", marks=ON_NONE_REFERENCE),
    pytest.param(["parallel=fsdp", "parallel.world_size=2"], id="fsdp"),
    pytest.param(["parallel=pipeline", "parallel.world_size=2"], id="pipeline")])
def test_sigterm_saves_and_resume_continues_bit_for_bit(tmp_path, references, parallel,
                                                         caplog):
    reference = references(parallel)
    run_dir = tmp_path / "run"
    stopped = run_entry("train.py", [*RUN, *parallel], run_dir,
                        env=inject(tmp_path, 23, "os.kill(os.getpid(), signal.SIGTERM)"))
    assert stopped.returncode == 128 + signal.SIGTERM, output(stopped)[-3000:]
    assert "resume with: python train.py" in output(stopped)
    assert not (run_dir / "metrics.json").exists()
    with caplog.at_level(logging.INFO):
        train_in_process([*RUN, *parallel, "trainer.resume=auto"], run_dir)
    said = caplog.text + ((run_dir / "train.log").read_text()  # rank 0's, where launched
                          if (run_dir / "train.log").exists() else "")
    assert resumed_at(said) == [24]  # the stop's own checkpoint, not the periodic one
    assert losses(run_dir) == losses(reference)
    got, expected = read_metrics(run_dir), read_metrics(reference)
    for key in ("eval_accuracy", "state_memory_mb"):  # the resumed run measures it too
        assert got[key] == expected[key], key


@ON_NONE_REFERENCE
def test_sigkill_then_resume_from_the_last_periodic_checkpoint(tmp_path, references, caplog):
    reference = references(NONE)
    run_dir = tmp_path / "run"
    killed = run_entry("train.py", RUN, run_dir,
                       env=inject(tmp_path, 25, "os.kill(os.getpid(), signal.SIGKILL)"))
    assert killed.returncode != 0
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == [
        "step_00000010.pt", "step_00000020.pt"]  # whole files only: no temporary left
    with caplog.at_level(logging.INFO):
        train_in_process([*RUN, "trainer.resume=auto"], run_dir)
    assert resumed_at(caplog.text) == [20]
    assert losses(run_dir) == losses(reference)


@pytest.mark.distributed
@ON_DDP_REFERENCE
def test_elastic_restart_after_a_killed_worker_ends_as_if_uninterrupted(tmp_path, references):
    reference = references(DDP)
    run_dir = tmp_path / "run"
    result = run_entry("train.py", [*RUN, *DDP, "parallel.max_restarts=1"], run_dir,
                       env=inject(tmp_path, 25, "os.kill(os.getpid(), signal.SIGKILL)",
                                  'os.environ.get("RANK") == "1" and '
                                  'os.environ.get("TORCHELASTIC_RESTART_COUNT") == "0"'))
    assert_ok(result)
    assert "resumed from" in (run_dir / "train.log").read_text()
    got, expected = read_metrics(run_dir), read_metrics(reference)
    for key in ("train_loss", "eval_loss", "eval_accuracy", "steps"):
        assert got[key] == expected[key], key


def test_periodic_checkpoints_are_pruned_to_keep_last_k(train_here):
    _, run_dir = train_here(*RUN, "trainer.checkpoint_every_n_steps=5", "trainer.keep_last_k=2")
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == [
        "best.pt", "last.pt", "step_00000032.pt", "step_00000035.pt"]  # 32: epoch 1's end
    state = torch.load(run_dir / "checkpoints" / "last.pt", weights_only=True)
    assert {"model", "optimizer", "grad_scaler", "rng", "config", "epoch_step"} <= set(state)
    # a user's own files named like them: neither resumed from (step_notes.pt was a
    # ValueError traceback; step_99.pt, the newest by its number, was resumed from) nor
    # pruned (the backup copy and step_4.pt were deleted)
    folder = run_dir / "checkpoints"
    (folder / "step_notes.pt").write_text("notes")
    for copy in ("step_00000032.backup.pt", "step_4.pt", "step_99.pt"):
        (folder / copy).write_bytes((folder / "step_00000032.pt").read_bytes())
    train_here(*RUN, "trainer.checkpoint_every_n_steps=5", "trainer.keep_last_k=2",
               "trainer.max_steps=52", "trainer.resume=auto")
    assert sorted(p.name for p in folder.iterdir()) == [
        "best.pt", "last.pt", "step_00000032.backup.pt", "step_00000045.pt", "step_00000050.pt",
        "step_4.pt", "step_99.pt", "step_notes.pt"]


def test_a_resume_at_another_global_batch_trains_the_epochs_left_at_it(train_here):
    """A resume at another global batch than saved counts the epochs left in its steps: it
    ended at once, an epoch untrained, its steps counted as the saved size's. Mid-epoch in
    map-style data, whose place is the batches its steps took, it would go on from other
    samples: refused; the same global batch split otherwise goes on."""
    small = [*FAST, "model=mlp", "data.train_size=64", "data.batch_size=16",
             "trainer.checkpoint_every_n_steps=1", "trainer.log_every_n_steps=1",
             "scheduler=cosine"]
    train_here(*small, "trainer.max_steps=2")  # saved 2 steps into the epoch
    resume = [*small, "trainer.epochs=2", "trainer.resume=auto"]
    for other in ("data.batch_size=32", "trainer.accumulate_grad_batches=2"):
        with pytest.raises(ConfigError, match=r"was saved 2 steps into an epoch, at 16 "
                           r"samples a step over all ranks, and this run takes 32"):
            train_here(*resume, other)
    metrics, _ = train_here(*[o for o in resume if o != "data.batch_size=16"],
                            "data.global_batch_size=16", "trainer.accumulate_grad_batches=2")
    assert (metrics["steps"], metrics["global_batch_size"]) == (8, 16)
    train_here(*small, name="ended")  # 4 steps, the epoch's end
    metrics, run_dir = train_here(*resume, "data.batch_size=32", name="ended")
    assert (metrics["steps"], metrics["global_batch_size"]) == (6, 32)  # 4 + 2 of 32
    rates = [lr for _, lr in scalars(run_dir, "train/lr")]
    assert len(rates) == 6 and rates[-1] < rates[-2]  # the cosine over the new 6 steps


def test_a_diverging_run_stops_with_a_clear_message(train_here):
    with pytest.raises(JobFailed, match=r"train loss is (nan|inf)") as failed:
        train_here(*RUN, "optim.lr=1e6")
    assert failed.value.status == 1 and "trainer.on_nan=skip" in str(failed.value)


def test_on_nan_skip_drops_the_bad_steps_and_finishes(train_here, monkeypatch):
    """One poisoned batch (its gradients NaN) is dropped and the run goes on to a finite
    end; a run that drops most steps stops instead (test_faults)."""
    from parallab.training.trainer import Trainer

    step = Trainer.train_step

    def poisoned(self, batches):
        if self.step == 5:
            batches = [(inputs * float("nan"), targets) for inputs, targets in batches]
        return step(self, batches)

    monkeypatch.setattr(Trainer, "train_step", poisoned)
    _, run_dir = train_here(*RUN, "trainer.on_nan=skip")
    assert scalars(run_dir, "train/skipped_steps")[-1][1] == 1
    metrics = read_metrics(run_dir)
    assert metrics["steps"] == 40 and math.isfinite(metrics["eval_loss"])


def test_a_sharded_writes_failure_names_a_ranks_own_error(tmp_path):
    """torch's CheckpointException holds each rank's error under a line of ranks: the
    first rank's own error is named, and the disk is blamed only where it is why."""
    import errno

    from torch.distributed.checkpoint.api import CheckpointException

    from parallab.training.formats.base import write_failure

    planned = CheckpointException("ranks", {1: (ValueError("overlapping chunks\nmore"), None),
                                            0: (RuntimeError("chunks overlap"), None)})
    said = str(write_failure(tmp_path / "best.dcp", planned))
    assert "(rank 0: RuntimeError: chunks overlap)" in said and "free space" not in said
    full = CheckpointException("ranks", {0: (OSError(errno.ENOSPC, "No space left"), None)})
    said = str(write_failure(tmp_path / "best.dcp", full))
    assert "(No space left)" in said and "free space" in said


def test_a_full_disk_is_a_clear_error_and_the_previous_checkpoint_survives(
        train_here, tmp_path, monkeypatch):
    import errno

    save, calls = torch.save, []

    def save_on_a_small_disk(obj, f, *args, **kwargs):
        calls.append(f)
        if len(calls) == 2:
            raise OSError(errno.ENOSPC, "No space left on device")
        return save(obj, f, *args, **kwargs)

    monkeypatch.setattr(torch, "save", save_on_a_small_disk)
    with pytest.raises(JobFailed) as failed:
        train_here(*RUN, name="run")
    assert "could not write checkpoint" in str(failed.value)
    assert "No space left on device" in str(failed.value)
    run_dir = tmp_path / "run"
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == ["step_00000010.pt"]
    assert torch.load(run_dir / "checkpoints" / "step_00000010.pt", weights_only=True)["step"] == 10


@ON_DDP_REFERENCE
@pytest.mark.distributed
@pytest.mark.parametrize("who,signum", [
    # Ctrl-C: the terminal signals the whole process group, controller and workers alike
    ("the group", signal.SIGINT),
    # a closed terminal or a dropped ssh connection: the whole group too
    ("the group", signal.SIGHUP),
    # a scheduler that signals the controller alone (setsid made it the group's leader); it
    # passes the request on
    ("the controller", signal.SIGTERM)], ids=["ctrl-c", "hang-up", "scheduler"])
def test_a_signalled_ddp_job_stops_together_saves_once_and_says_it_was_stopped(
        tmp_path, references, who, signum):
    """Its exit status is 128 + the signal (130 for Ctrl-C, 129 for a closed terminal), and
    its record (status.json) says it was stopped: a script or a scheduler took an exit
    status 0 for a finished run."""
    reference = references(DDP)
    run_dir = tmp_path / "run"
    action = f"os.kill{'pg' if who == 'the group' else ''}(os.getpgid(0), {int(signum)})"
    stopped = run_entry("train.py", [*RUN, *DDP], run_dir, prefix=["setsid", sys.executable],
                        env=inject(tmp_path, 23, action, condition="os.environ['RANK'] == '0'"))
    assert stopped.returncode == 128 + signum, output(stopped)[-3000:]
    assert "Traceback" not in output(stopped) and "SignalException" not in output(stopped)
    assert output(stopped).count("resume with: python train.py") == 1  # rank 0, once
    assert not (run_dir / "metrics.json").exists()
    record = json.loads((run_dir / "status.json").read_text())
    steps = sorted(int(p.name[5:13]) for p in (run_dir / "checkpoints").glob("step_*.pt"))
    assert record == {"status": "stopped", "signal": signum.name, "step": steps[-1]}
    # the group's ranks all hold the request at step 24's all-reduce; one forwarded by the
    # controller may reach the workers a step or a few later (a 3 ms step on a busy machine)
    assert (steps[-1] == 24) if who == "the group" else (24 <= steps[-1] < 30), steps
    if signum == signal.SIGINT:  # the others save the same way; one resume suffices
        train_in_process([*RUN, *DDP, "trainer.resume=auto"], run_dir)
        # at the next log step, all ranks together (rank 0's log, the resumed run's lines)
        assert resumed_at((run_dir / "train.log").read_text()) == [24]
        assert losses(run_dir) == losses(reference)
        got, expected = read_metrics(run_dir), read_metrics(reference)
        for key in ("eval_accuracy", "state_memory_mb"):  # the resumed run measures it too
            assert got[key] == expected[key], key


def test_a_finished_run_resumed_or_requeued_keeps_its_record(train_here, caplog):
    """Nothing left to train: where it resumed at its last step and wrote metrics.json again
    with the figures of no step (train_loss and epoch_time_s null), the record stays as the
    run left it, and the log says the run had finished."""
    short = [*FAST, "trainer.max_steps=3"]
    _, run_dir = train_here(*short)
    record = (run_dir / "metrics.json").read_bytes()
    with caplog.at_level(logging.INFO):
        again, _ = train_here(*short, "trainer.resume=auto")
    assert (run_dir / "metrics.json").read_bytes() == record
    assert again == json.loads(record)
    assert f"the run in {run_dir} had finished at step 3" in caplog.text


def test_a_run_stopped_at_its_last_step_resumes_to_its_train_loss(tmp_path, train_here):
    """Stopped in its last step, resumed: no epoch is left to train, and its train_loss had
    come out null; it is the restored epoch's, the uninterrupted run's."""
    short = [*FAST, "trainer.max_steps=3"]
    reference, _ = train_here(*short, name="reference")
    run_dir = tmp_path / "run"
    stopped = run_entry("train.py", short, run_dir,
                        env=inject(tmp_path, 2, "os.kill(os.getpid(), signal.SIGTERM)"))
    assert stopped.returncode == 128 + signal.SIGTERM, output(stopped)[-3000:]
    metrics = train_in_process([*short, "trainer.resume=auto"], run_dir)
    assert metrics["steps"] == 3
    assert metrics["train_loss"] == pytest.approx(reference["train_loss"], rel=1e-6)


# sitecustomize: the run signalled as it writes its last checkpoint, once it has trained
SIGNALLED_AT_THE_END = """
import os, signal
import parallab.training.checkpoint as checkpoint

save = checkpoint.Checkpointer.save


def signalled(self, state, name):
    if name == "last":
        os.kill(os.getpid(), signal.SIGTERM)
    return save(self, state, name)

checkpoint.Checkpointer.save = signalled
"""


def test_a_signal_as_a_finished_run_saves_its_end_leaves_it_finished(tmp_path):
    """The last save ran past the run's handling of signals: a SIGTERM there ended the
    process in it, silently, its record unwritten and a temporary left (under the launcher,
    a worker failure). The run ends as finished."""
    (tmp_path / "inject").mkdir()
    (tmp_path / "inject" / "sitecustomize.py").write_text(SIGNALLED_AT_THE_END)
    run_dir = tmp_path / "run"
    ended = run_entry("train.py", [*FAST, "trainer.max_steps=3"], run_dir,
                      env={"PYTHONPATH": str(tmp_path / "inject")})
    assert ended.returncode == 0, output(ended)[-3000:]
    assert read_metrics(run_dir)["steps"] == 3 and (run_dir / "checkpoints" / "last.pt").exists()
    assert not list((run_dir / "checkpoints").glob(".*.tmp"))


def test_a_save_cut_short_leaves_no_temporary_for_good(train_here):
    """A second Ctrl-C (or a kill) while a checkpoint is written leaves its temporary: the
    run's next start removes it, and resumes from the last complete checkpoint."""
    run = [*FAST, "trainer.max_steps=2", "trainer.checkpoint_every_n_steps=null"]
    _, run_dir = train_here(*run)
    left = run_dir / "checkpoints" / ".step_3.pt.tmp"
    left.write_bytes(b"\\0" * 1024)  # a write cut short
    metrics, _ = train_here(*run[:-2], "trainer.max_steps=3", "trainer.resume=auto")
    assert metrics["steps"] == 3 and not left.exists()


def test_a_resume_at_another_rank_count_says_so_once(caplog):
    """Each rank had said the RNG states did not match, in a line counting "1 ranks"."""
    from parallab.launching.distributed import Dist
    from parallab.training import checkpoint

    state = {"rng": [torch.get_rng_state()]}
    with caplog.at_level("WARNING"):
        for rank in range(2):
            checkpoint.restore_rng(state, Dist(rank, rank, 2, 2, torch.device("cpu"), None))
    said = [r.getMessage() for r in caplog.records]
    assert len(said) == 1 and "RNG states for 1 rank, this run has 2" in said[0]


def test_the_ranks_vote_on_a_stop_within_a_bounded_count_of_steps():
    """The steps to the next vote come from rank 0's pace, at most 100: steps 5 ms long
    had set 1,000, and a run whose steps then slowed 50-fold held a stop for 250 s, past the
    120 s after which a stopping rank ends unsaved."""
    from parallab.launching.distributed import Dist
    from parallab.launching.preemption import Preemption
    from parallab.training.stop_vote import StopVote

    vote = StopVote(Preemption(), Dist(0, 0, 2, 2, torch.device("cpu"), None))
    for pace, every in ((0.005, 100), (1.0, 5), (30.0, 1)):
        vote.take([0.0, 0.0, pace, 0.0, 0.0, 0.0])
        assert vote.every == every and not vote.agreed


def test_a_resume_on_other_samples_names_the_data_key_that_differs(train_here, tmp_path):
    """A map-style data set's samples are the run's as much as token files' are: another
    data set, another text, another share held out had gone on mid-epoch without a word
    (the loss jumped; windows once held out were trained on). How they are loaded may
    change."""
    from conftest import checked

    text = tmp_path / "text.txt"
    text.write_text("a run's own text, long enough to cut into windows of bytes. " * 200)
    run = [*FAST, "model=gpt", "model.layers=1", "model.width=32", "model.heads=2",
           "model.context=32", "data=bytes", "data.seq_len=32", f"data.path={text}",
           "data.batch_size=8", "trainer.max_steps=2", "trainer.checkpoint_every_n_steps=1"]
    run = [o for o in run if not o.startswith(("data=synthetic", "data.train_size",
                                               "data.eval_size"))]
    _, run_dir = train_here(*run)
    ckpt = run_dir / "checkpoints" / "last.pt"
    other = tmp_path / "other.txt"
    other.write_text(text.read_text().upper())
    for given, says in ((f"data.path={other}", f"data.path={other} differs from its {text}"),
                        ("data.eval_fraction=0.5", "data.eval_fraction=0.5 differs from its "
                                                   "0.1")):
        with pytest.raises(ConfigError, match=re.escape(says)):
            checked(*run, given, f"trainer.resume={ckpt}")
    checked(*run, "data.eval_batch_size=4", f"trainer.resume={ckpt}")
    # the value to give back is said as an override takes it: None had read as 'None'
    from parallab.checks.starts import _value

    assert [_value(v) for v in (None, True, "a,b", 0.1)] == ["null", "true", "'a,b'", "0.1"]
