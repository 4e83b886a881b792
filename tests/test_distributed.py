"""Real multi-process runs on CPU with gloo: the launcher, DDP, in-place launchers, failures."""

from __future__ import annotations

import json
import math
import os
import re
import shlex
import shutil
import socket
import subprocess
import sys
import tempfile
import textwrap
import time
import uuid
from pathlib import Path

import pytest
from conftest import (
    FAST,
    REPO,
    assert_ok,
    free_port,
    inject,
    only_run_dir,
    output,
    read_metrics,
    run_entry,
    scalars,
    sitecustomize,
)

pytestmark = [pytest.mark.slow, pytest.mark.distributed]
BIN = Path(sys.executable).parent


def assert_ddp_run(run_dir, world_size: int, batch_size: int) -> None:
    """What a ddp run leaves: its world, rank logs, thread split and one event file."""
    metrics = read_metrics(run_dir)
    assert (metrics["world_size"], metrics["backend"], metrics["parallel"]) == (
        world_size, "gloo", "ddp")
    assert metrics["global_batch_size"] == batch_size * world_size
    rank_logs = sorted(p.name for p in run_dir.glob("train_rank*.log"))
    assert rank_logs == [f"train_rank{r}.log" for r in range(1, world_size)]
    threads = max(1, len(os.sched_getaffinity(0)) // world_size)
    assert f"rank 0/{world_size} on cpu, {threads} threads," in (run_dir / "train.log").read_text()
    assert len(list(run_dir.glob("events.out.tfevents*"))) == 1  # rank 0 alone writes


def test_ddp_trains_a_whole_epoch_in_equal_steps_per_rank(train_here):
    _, run_dir = train_here(*FAST, "parallel=ddp", "parallel.world_size=3")
    assert_ddp_run(run_dir, 3, 64)
    assert read_metrics(run_dir)["steps"] == math.ceil(math.ceil(2048 / 3) / 64)


def test_ddp_matches_one_process_with_the_global_batch(train_here):
    """The reference: ddp with one worker at the global batch (4 data-parallel ranks against
    one device: test_mesh's hsdp 2x2, whose ranks shard the data the same way)."""
    common = [*FAST, "model.dropout=0", "trainer.max_steps=20", "trainer.log_every_n_steps=1"]
    _, single_dir = train_here(*common, "parallel=ddp", "parallel.world_size=1",
                               "data.batch_size=32", name="single")
    _, ddp_dir = train_here(*common, "data.batch_size=16", "parallel=ddp",
                            "parallel.world_size=2", name="ddp")
    assert_ddp_run(ddp_dir, 2, 16)
    assert_ddp_run(single_dir, 1, 32)
    expected, got = scalars(single_dir, "train/loss"), scalars(ddp_dir, "train/loss")
    assert [s for s, _ in got] == list(range(1, 21))
    for (_, a), (_, b) in zip(expected, got, strict=True):
        assert b == pytest.approx(a, rel=1e-4, abs=1e-5)


def test_eval_counts_every_sample_once_over_uneven_shards(train_here):
    # one step too small to move a float32 weight: both score the same (initial) model
    common = [*FAST, "trainer.max_steps=1", "optim.lr=1e-12", "data.eval_size=1001",
              "data.eval_batch_size=64"]
    one, _ = train_here(*common, name="single")
    three, _ = train_here(*common, "parallel=ddp", "parallel.world_size=3", name="ddp")
    assert three["eval_accuracy"] == one["eval_accuracy"]  # same correct count out of 1001
    assert three["eval_loss"] == pytest.approx(one["eval_loss"], rel=1e-6)


def test_torchrun_runs_the_entrypoint_in_place(tmp_path):
    result = run_entry("train.py", [*FAST, "parallel=ddp"], cwd=tmp_path, prefix=[
        str(BIN / "torchrun"), "--standalone", "--nproc-per-node=2",
        f"--log-dir={tmp_path / 'torchrun'}"])  # torch's own dir here, not left in /tmp
    assert_ok(result)
    run_dir = only_run_dir(tmp_path)
    assert read_metrics(run_dir)["world_size"] == 2
    assert (run_dir / "train_rank1.log").exists()


def test_a_sweep_under_torchrun_runs_each_job_in_its_own_process_group(tmp_path):
    """torchrun's agent hosts the store every job meets at: each job in a key space of its
    own, where the second job read the first's gloo addresses and waited till the timeout."""
    result = run_entry("train.py", ["-m", *FAST, "parallel=ddp", "trainer.max_steps=2",
                                    "optim.lr=0.1,0.2", "backend.timeout_s=60",
                                    f"hydra.sweep.dir={tmp_path / 'sweep'}"],
                       cwd=tmp_path, timeout=240, prefix=[
                           str(BIN / "torchrun"), "--standalone", "--nproc-per-node=2",
                           f"--log-dir={tmp_path / 'torchrun'}"])
    assert_ok(result)
    summary = (tmp_path / "sweep" / "summary.csv").read_text()
    assert summary.count(",completed,") == 2, summary


# sitecustomize for torchrun's workers: every rank signalled at its step 5, as a scheduler
# signals every task; rank 0 slow to say where it stopped once all of them have saved
SIGNALLED_AND_SLOW = """
import os, signal, time
import parallab.training.run as run
import parallab.training.trainer as trainer

step, stopped = trainer.Trainer.train_step, run._stopped

def train_step(self, batches):
    if self.step == 5:
        os.kill(os.getpid(), signal.SIGTERM)
    return step(self, batches)

def slow(trainer, preemption, spec, main):
    time.sleep(3 if main else 0)
    return stopped(trainer, preemption, spec, main)

trainer.Trainer.train_step, run._stopped = train_step, slow
"""


def test_a_stopped_run_in_place_ends_after_rank_0_has_said_where(tmp_path):
    """The other ranks end once saved; with 128 + the signal, torchrun (as srun
    --kill-on-bad-exit and mpirun do) would end rank 0 before its line and its record."""
    result = run_entry("train.py", [*FAST, "parallel=ddp", "trainer.log_every_n_steps=1"],
                       cwd=tmp_path, env=sitecustomize(tmp_path, SIGNALLED_AND_SLOW), prefix=[
                           str(BIN / "torchrun"), "--standalone", "--nproc-per-node=2",
                           f"--log-dir={tmp_path / 'torchrun'}"])
    assert "exitcode  : 143" in output(result), output(result)[-3000:]  # rank 0's, as run
    run_dir = only_run_dir(tmp_path)
    said = (run_dir / "train.log").read_text()
    assert "stopped by SIGTERM at step 6, checkpoint saved" in said
    assert json.loads((run_dir / "status.json").read_text()) == {
        "status": "stopped", "signal": "SIGTERM", "step": 6}
    # under torchrun as it was started, where a bare `python train.py` resumed on one process
    command = resume_command(said)
    assert Path(command[0]).name == "torchrun", command
    assert command[1:5] == ["--standalone", "--nproc-per-node=2",
                            f"--log-dir={tmp_path / 'torchrun'}", str(REPO / "train.py")]
    assert command[-2:] == [f"hydra.run.dir={run_dir}", "trainer.resume=auto"]


def resume_command(said: str) -> list[str]:
    """The command a stopped run's log says resumes it."""
    found = re.findall(r"resume with: (.+)", said)
    assert len(found) == 1, said[-3000:]
    return shlex.split(found[0])


# sitecustomize for parallab's own workers: rank 1 alone hung up on at its step 3, and the
# ranks' vote on a stop due every 0.2 s of steps rather than 5 s, so a short run shows it
SIGNALLED_ONE_RANK = """
import os, signal
import parallab.training.stop_vote as stop_vote
import parallab.training.trainer as trainer

stop_vote.AGREE_S = 0.2
step = trainer.Trainer.train_step

def train_step(self, batches):
    if self.step == 3 and self.dist.rank == 1:
        os.kill(os.getpid(), signal.SIGHUP)
    return step(self, batches)

trainer.Trainer.train_step = train_step
"""


def test_ranks_agree_on_a_stop_long_before_the_next_log_step(tmp_path):
    """One rank's signal stops every rank within the vote's time, not at the next log step
    (150 steps away here), which a cluster's grace period may not reach: the ranks save the
    same step and the run says so, naming the signal that rank heard (rank 0 had said
    SIGTERM, heard by none)."""
    (tmp_path / "inject").mkdir()
    (tmp_path / "inject" / "sitecustomize.py").write_text(SIGNALLED_ONE_RANK)
    result = run_entry("train.py", [*FAST, "data.train_size=20480", "parallel=ddp",
                                    "trainer.max_steps=150", "trainer.log_every_n_steps=1000"],
                       cwd=tmp_path, env={"PYTHONPATH": str(tmp_path / "inject")})
    run_dir = only_run_dir(tmp_path)
    status = json.loads((run_dir / "status.json").read_text())
    assert status["status"] == "stopped", output(result)[-3000:]
    assert status["signal"] == "SIGHUP" and result.returncode == 129, output(result)[-3000:]
    assert 4 <= status["step"] <= 75, status  # a log step's agreement: 150, the last
    assert [p.name for p in (run_dir / "checkpoints").iterdir()] == [
        f"step_{status['step']:08d}.pt"]  # every rank saved that step


# sitecustomize for the workers: steps of 0.3 s, so that a stop is not agreed within 2.5 s
SLOW_STEPS = """
import time
import parallab.training.trainer as trainer

step = trainer.Trainer.train_step

def train_step(self, batches):
    time.sleep(0.3)
    return step(self, batches)

trainer.Trainer.train_step = train_step
"""


def test_a_second_signal_after_training_says_where_to_resume(tmp_path):
    """Two SIGTERMs to the controller, the second before the ranks agreed on the first:
    ended at once, unsaved, after checkpoints were written, the command had said "before
    training began: nothing was saved"."""
    import signal

    (tmp_path / "inject").mkdir()
    (tmp_path / "inject" / "sitecustomize.py").write_text(SLOW_STEPS)
    run_dir = tmp_path / "run"
    command = [sys.executable, str(REPO / "train.py"), *FAST, "parallel=ddp",
               "trainer.log_every_n_steps=1000", "trainer.checkpoint_every_n_steps=2",
               f"hydra.run.dir={run_dir}"]
    job = subprocess.Popen(command, env={**os.environ, "PYTHONPATH": str(tmp_path / "inject")},
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + 120
    while not list((run_dir / "checkpoints").glob("step_*.pt")) and time.monotonic() < deadline:
        time.sleep(0.2)
    job.send_signal(signal.SIGTERM)
    time.sleep(2.5)
    job.send_signal(signal.SIGTERM)
    said = job.communicate(timeout=120)[0]
    assert job.returncode == 143, said[-3000:]
    assert "the ranks ended without saving this step" in said and \
        "resume from the last checkpoint with: python train.py" in said, said[-3000:]


def test_two_nodes_over_loopback(tmp_path):
    """One rank a node: the second node's rank is global rank 1 at local rank 0, so a rank-0
    duty taken by the local rank would show (its log named train.log, not train_rank1.log)."""
    port = free_port()
    command = [str(BIN / "torchrun"), "--nnodes=2", "--nproc-per-node=1", "--rdzv-backend=c10d",
               f"--rdzv-endpoint=127.0.0.1:{port}", f"--rdzv-id={uuid.uuid4().hex}",
               f"--log-dir={tmp_path / 'torchrun'}", str(REPO / "train.py"), *FAST,
               "parallel=ddp"]
    env = {**os.environ, "GLOO_SOCKET_IFNAME": "lo"}

    def start_node() -> subprocess.Popen:
        return subprocess.Popen(command, cwd=tmp_path, env=env, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True)

    # Both agents see 127.0.0.1 as their own host; started together, both may try to host the
    # rendezvous store. On two machines one is simply started first: do the same here.
    nodes = [start_node()]
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        with socket.socket() as probe:
            if probe.connect_ex(("127.0.0.1", port)) == 0:
                break
        time.sleep(0.2)
    nodes.append(start_node())
    outputs = [node.communicate(timeout=300)[0] for node in nodes]
    assert [node.returncode for node in nodes] == [0, 0], outputs
    run_dir = only_run_dir(tmp_path)
    assert read_metrics(run_dir)["world_size"] == 2
    assert sorted(p.name for p in run_dir.glob("train*.log")) == ["train.log",
                                                                   "train_rank1.log"]


@pytest.mark.skipif(shutil.which("mpirun") is None, reason="needs mpirun (openmpi-bin)")
def test_mpirun_runs_the_entrypoint_in_place_and_resumes_under_it(tmp_path):
    """Stopped by a scheduler's SIGTERM to every rank, the run says to resume under mpirun
    as it was started (a bare `python train.py` resumed it on one process); that command
    finishes it on both ranks."""
    stop = inject(tmp_path, 5, "os.kill(os.getpid(), signal.SIGTERM)")
    run = [*FAST, "parallel=ddp", "backend=gloo", "trainer.log_every_n_steps=1"]
    mpirun = ["mpirun", "--allow-run-as-root", "--oversubscribe", "-np", "2", sys.executable]
    port = {"MASTER_PORT": str(free_port())}
    stopped = run_entry("train.py", run, cwd=tmp_path, env={**port, **stop}, prefix=mpirun)
    run_dir = only_run_dir(tmp_path)
    said = (run_dir / "train.log").read_text()
    assert "stopped by SIGTERM at step 6, checkpoint saved" in said, output(stopped)[-3000:]
    command = resume_command(said)
    assert command[:7] == [*mpirun, str(REPO / "train.py")], command
    result = subprocess.run(command, cwd=tmp_path, env={**os.environ, **port},
                            capture_output=True, text=True, timeout=300)
    assert_ok(result)
    assert read_metrics(run_dir)["world_size"] == 2
    assert "resumed from" in (run_dir / "train.log").read_text()
    assert (run_dir / "train_rank1.log").exists()


@pytest.mark.skipif(shutil.which("mpirun") is None, reason="needs mpirun (openmpi-bin)")
@pytest.mark.parametrize("host,status,says", [
    ("nohost.invalid", 2, "the master nohost.invalid does not resolve on this node"),
    # an address nothing answers at (TEST-NET-1): the ranks give up after the timeout
    ("192.0.2.1", 1, "within parallel.rendezvous_timeout=3 s"),
])
def test_under_mpirun_a_master_not_reached_ends_the_job_in_one_line(tmp_path, host, status,
                                                                     says):
    """parallel.rendezvous_timeout held under SLURM only: elsewhere a master that did not
    resolve, or did not answer, printed c10d's warnings every 30-40 s for minutes."""
    started = time.monotonic()
    result = run_entry("train.py", [*FAST, "parallel=ddp", "backend=gloo",
                                    "parallel.rendezvous_timeout=3"], cwd=tmp_path, timeout=90,
                       env={"MASTER_ADDR": host, "MASTER_PORT": str(free_port())}, prefix=[
                           "mpirun", "--allow-run-as-root", "--oversubscribe", "-np", "2",
                           sys.executable])
    assert time.monotonic() - started < 60
    said = [line for line in output(result).splitlines() if line.startswith("rank ")]
    assert result.returncode == status and said, output(result)[-3000:]
    assert all(says in line for line in said) and "Traceback" not in output(result), said
    assert not list(tmp_path.glob("outputs/*/*/.hydra"))  # before Hydra made a run dir


# Loaded by every Python process of the test's job; the agent sets RANK in a worker only
# after the interpreter starts, so the rank is checked when the step runs.
INJECT = """
import os
import parallab.training.trainer as trainer

step = trainer.Trainer.train_step

def failing_step(self, batches):
    if self.step == 3 and os.environ.get("RANK") == "1":
        {action}
    return step(self, batches)

trainer.Trainer.train_step = failing_step
"""


def processes_with(marker: str) -> list[int]:
    found = []
    for proc in Path("/proc").iterdir():
        try:
            if proc.name.isdigit() and marker.encode() in (proc / "environ").read_bytes():
                found.append(int(proc.name))
        except OSError:
            continue
    return found


@pytest.fixture
def short_tmp():
    """A temporary dir short enough for the fork server's socket (pytest's may not be)."""
    path = Path(tempfile.mkdtemp(prefix="pl-"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.mark.parametrize("action,shown,extra", [
    ("raise RuntimeError('injected failure on rank 1')", "RuntimeError: injected failure", []),
    ("os.kill(os.getpid(), 9)", "SIGKILL", []),
    # a hung rank: the others' next collective gives up after backend.timeout_s
    ("import time; time.sleep(300)", "Timed out waiting 5000ms", ["backend.timeout_s=5"]),
])
def test_a_failing_rank_ends_the_whole_job_promptly(tmp_path, short_tmp, action, shown,
                                                     extra):
    (tmp_path / "inject").mkdir()
    (tmp_path / "inject" / "sitecustomize.py").write_text(
        textwrap.dedent(INJECT).format(action=action))
    marker = f"parallab-test-{uuid.uuid4().hex}"
    start = time.monotonic()
    result = run_entry("train.py", [*FAST, "parallel=ddp", "parallel.world_size=2",
                                    "trainer.epochs=5", *extra], tmp_path / "run",
                       env={"PYTHONPATH": str(tmp_path / "inject"), "PARALLAB_MARK": marker,
                            "TMPDIR": str(short_tmp)})
    elapsed = time.monotonic() - start
    assert result.returncode != 0
    assert shown in output(result)
    assert elapsed < 60, f"took {elapsed:.0f}s to notice"
    deadline = time.monotonic() + 15  # the agent's children may take a moment to be reaped
    while processes_with(marker) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert processes_with(marker) == []
    left = [p.name for p in short_tmp.iterdir()  # the job's own temporary dir
            if not p.name.startswith("torchinductor_")]  # torch's cache, kept by design
    assert left == []  # no rank's error file, no launch dir
