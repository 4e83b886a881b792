"""parallab on SLURM: in place under srun across nodes, sweeps through the submitit launcher
with each job's own allocation, requeued and time-limited jobs that continue their run.

The cluster tests run against a real SLURM started once per test run (slurm_cluster.py: munged,
slurmctld and two slurmd of 2 CPUs each on this machine); where its daemons cannot be had,
they skip with one line saying why. The rest check the pieces with SLURM's variables as
SLURM sets them.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import checked, free_port, losses, output, read_metrics, typed

from parallab.config.errors import ConfigError
from parallab.launching import allocation, distributed, in_place, launch, slurm
from parallab.launching.in_place import InPlace
from parallab.parallel import PLANS

PARALLAB = str(Path(sys.executable).parent / "parallab")
# two ranks of the MNIST recipe's CNN, long enough to be signalled mid-run (~50 ms a step)
RUN = ["parallel=ddp", "data=synthetic", "data.train_size=6400", "data.eval_size=256",
       "data.batch_size=32", "trainer.epochs=1", "trainer.log_every_n_steps=5",
       "trainer.checkpoint_every_n_steps=null", "device=cpu",
       "parallel.threads_per_worker=1"]
SLURM_VARS = [name for name in os.environ if name.startswith(("SLURM_", "SUBMITIT_"))]


@pytest.fixture
def no_slurm(monkeypatch):
    for name in [*SLURM_VARS, "RANK", "WORLD_SIZE", "LOCAL_RANK", "CUDA_VISIBLE_DEVICES"]:
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


def test_a_world_size_the_tasks_contradict_is_refused():
    from parallab.checks import validate

    cfg = typed("parallel=ddp", "parallel.world_size=4", "device=cpu")
    with pytest.raises(ConfigError, match=r"parallel.world_size=4, but slurm started 2 tasks"):
        validate.prepare(cfg, InPlace("slurm", 0, 0, 2, 1, 2))


@pytest.mark.parametrize("name,accepted", [
    ("USR1", True), ("SIGUSR2", True), ("12", True), ("null", True),
    ("KILL", False), ("STOP", False), ("TERM", False), ("SIGWHATEVER", False)])
def test_the_requeue_signal_is_one_slurm_can_send_and_the_run_can_catch(name, accepted):
    if accepted:
        checked(f"trainer.requeue_signal={name}", "device=cpu")
        return
    with pytest.raises(ConfigError, match=rf"trainer.requeue_signal={name}"):
        checked(f"trainer.requeue_signal={name}", "device=cpu")


def test_outside_slurm_the_requeue_signal_keeps_its_meaning(no_slurm):
    assert slurm.requeue_signals("USR1") == ()
    no_slurm.setenv("SLURM_JOB_ID", "77")  # an interactive allocation's shell: no task
    assert slurm.requeue_signals("USR1") == ()
    no_slurm.setenv("SLURM_TASK_PID", str(os.getpid()))  # a task SLURM started
    assert slurm.requeue_signals("USR1") == (10,)
    assert slurm.requeue_signals(None) == ()
    no_slurm.setenv("SUBMITIT_EXECUTOR", "slurm")  # a job the submitit launcher submitted
    assert slurm.requeue_signals("USR1") == (10, 12)


@pytest.mark.parametrize("visible,local_rank,ranks_here,device", [
    ("0,1,2,3", 2, 4, 2),  # --gpus-per-node=4 --ntasks-per-node=4: every task sees the four
    ("2", 2, 4, 0),  # --gpus-per-task=1: each task sees its own, as device 0
    ("4,5", 1, 2, 1),  # the node's other GPUs belong to another job
    ("0,1", 3, 4, None),  # two GPUs for four ranks: refused
])
def test_each_rank_takes_the_gpu_slurm_gives_it(no_slurm, visible, local_rank, ranks_here,
                                                device):
    no_slurm.setenv("CUDA_VISIBLE_DEVICES", visible)
    count = len(os.environ["CUDA_VISIBLE_DEVICES"].split(","))
    if device is None:
        with pytest.raises(ConfigError, match="see 2 GPUs"):
            distributed.gpu_index(local_rank, ranks_here, count)
    else:
        assert distributed.gpu_index(local_rank, ranks_here, count) == device


@pytest.mark.parametrize("env,name", [
    ({"SLURM_JOB_ID": "77"}, "slurm/77"),  # as SLURM starts it: SLURM_TASK_PID, this process
    ({"SLURM_JOB_ID": "77", "SLURM_STEP_ID": "0"}, "slurm/77"),
    ({"SLURM_JOB_ID": "77", "SLURM_STEP_ID": "3"}, "slurm/77.3"),
    ({"SLURM_JOB_ID": "81", "SLURM_ARRAY_JOB_ID": "77", "SLURM_ARRAY_TASK_ID": "4"},
     "slurm/77_4"),
])
def test_under_slurm_the_run_dir_is_named_by_the_job(no_slurm, env, name):
    no_slurm.setenv("SLURM_TASK_PID", str(os.getpid()))
    for key, value in env.items():
        no_slurm.setenv(key, value)
    assert launch._run_name() == name
    no_slurm.setenv("SLURM_RESTART_COUNT", "1")  # a requeue: the same name, and it resumes
    assert launch._run_name() == name and in_place.restarted()


GPU_NODES = allocation.Partition("gpu", cpus=64, gpus=8, nodes=4)
CPU_NODES = allocation.Partition("debug", cpus=2, gpus=0, nodes=2)


@pytest.mark.parametrize("overrides,partition,keys,expected", [
    (["parallel=ddp", "parallel.world_size=1"], CPU_NODES, {}, (1, 1, None)),
    (["parallel=ddp", "parallel.world_size=2"], CPU_NODES, {}, (1, 2, None)),
    (["parallel=ddp", "parallel.world_size=4"], CPU_NODES, {}, (2, 2, None)),
    (["parallel=fsdp", "parallel.world_size=16"], GPU_NODES, {}, (2, 8, 8)),
    (["parallel=ddp", "parallel.world_size=6"], GPU_NODES, {}, (1, 6, 6)),
    (["parallel=ddp", "parallel.world_size=12"], GPU_NODES, {}, (2, 6, 6)),
    (["parallel=ddp", "parallel.world_size=8"], GPU_NODES, {"tasks_per_node": 4}, (2, 4, 4)),
    (["parallel=ddp", "parallel.world_size=8"], GPU_NODES, {"nodes": 4}, (4, 2, 2)),
    (["parallel=dp", "parallel.world_size=4"], GPU_NODES, {}, (1, 1, 4)),  # one process
    (["parallel=ddp", "parallel.world_size=8", "device=cpu"], GPU_NODES, {}, (1, 8, None)),
    # parallel.world_size null: the checks' default (a node's GPUs for a process each; 2
    # ranks or parts on a CPU; a one-process layout its 1 or 2)
    (["parallel=ddp"], GPU_NODES, {}, (1, 8, 8)),
    (["parallel=pipeline"], CPU_NODES, {}, (1, 2, None)),
    (["parallel=dp"], GPU_NODES, {}, (1, 1, 1)),
    (["parallel=model"], GPU_NODES, {}, (1, 1, 2)),
])
def test_each_job_gets_the_allocation_its_layout_needs(overrides, partition, keys, expected):
    from parallab.cli import compose

    cfg = compose(overrides)
    needed = allocation.allocation(cfg, keys, partition, "job #0", PLANS[cfg.parallel.name])
    assert (needed.nodes, needed.tasks_per_node, needed.gpus_per_node) == expected


@pytest.mark.parametrize("overrides,partition,keys,refusal", [
    (["parallel=ddp", "parallel.world_size=8"], CPU_NODES, {}, "needs 4 node"),
    (["parallel=ddp", "parallel.world_size=40"], GPU_NODES, {}, "needs 5 node"),
    (["parallel=dp", "parallel.world_size=16"], GPU_NODES, {}, "16 GPUs each"),
    (["parallel=ddp", "parallel.world_size=8"], GPU_NODES, {"nodes": 2, "tasks_per_node": 2},
     "start 4 tasks"),
    (["parallel=ddp", "parallel.world_size=5"], GPU_NODES, {"tasks_per_node": 4},
     "does not split evenly"),
    (["parallel=ddp", "parallel.world_size=4"], CPU_NODES, {"tasks_per_node": 4},
     "tasks_per_node=4 is more ranks"),
])
def test_a_job_no_partition_holds_is_refused_in_one_line(overrides, partition, keys, refusal):
    from parallab.cli import compose

    cfg = compose(overrides)
    with pytest.raises(ConfigError, match=refusal):
        allocation.allocation(cfg, keys, partition, "job #0", PLANS[cfg.parallel.name])


def _as_slurm_task(rank: int, world: int, nodelist: str, timeout_s: float,
                   cwd: Path) -> subprocess.Popen:
    """One rank started with the variables srun gives a task, and nothing else of SLURM
    (SLURM_TASK_PID the task's own pid, as slurmstepd sets it: the shell's, which exec
    hands on)."""
    env = {k: v for k, v in os.environ.items() if k not in SLURM_VARS}
    env.update(SLURM_JOB_ID="4242", SLURM_STEP_ID="0", SLURM_NTASKS=str(world),
               SLURM_PROCID=str(rank), SLURM_LOCALID=str(rank), SLURM_NODEID="0",
               SLURM_STEP_TASKS_PER_NODE=str(world), SLURM_JOB_NODELIST=nodelist,
               SLURM_STEP_NODELIST=nodelist, MASTER_PORT=str(free_port()))
    command = [PARALLAB, "train", *RUN, f"parallel.rendezvous_timeout={timeout_s}"]
    return subprocess.Popen(["sh", "-c", 'SLURM_TASK_PID=$$ exec "$@"', "task", *command],
                            cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)


@pytest.mark.slow
def test_a_master_that_does_not_resolve_or_answer_ends_the_rank_in_one_line(tmp_path):
    started = time.monotonic()
    tasks = {"unresolved": _as_slurm_task(1, 2, "nowhere-[1-2]", 30, tmp_path),
             "alone": _as_slurm_task(0, 2, "localhost", 3, tmp_path),  # rank 1 never comes
             "unanswered": _as_slurm_task(1, 2, "localhost", 3, tmp_path)}  # nor rank 0
    said = {name: task.communicate(timeout=120)[0] for name, task in tasks.items()}
    assert time.monotonic() - started < 60
    for name, task in tasks.items():
        assert task.returncode != 0 and "Traceback" not in said[name], said[name]
    assert tasks["unresolved"].returncode == 2
    assert re.search(r"rank 1: the master nowhere-1 \(the first host of SLURM_STEP_NODELIST="
                     r"nowhere-\[1-2\]\) does not resolve .*set MASTER_ADDR", said["unresolved"])
    assert re.search(r"rank 0: the master localhost .*not every rank reached it .*within "
                     r"parallel.rendezvous_timeout=3 s", said["alone"])
    assert re.search(r"rank 1: the master localhost .*it could not be reached within "
                     r"parallel.rendezvous_timeout=3 s", said["unanswered"])


# -- against a real SLURM ------------------------------------------------------------------

def sbatch(cluster, workdir: Path, script: str, *options: str) -> str:
    path = workdir / "job.sh"
    path.write_text("#!/bin/bash\n" + script + "\n")
    return cluster.run("sbatch", "--parsable", f"--chdir={workdir}",
                       f"--output={workdir}/slurm-%j.out", "--open-mode=append",
                       *options, str(path)).stdout.strip()


def job_report(cluster, workdir: Path, job: str) -> str:
    """A job's state and the end of its output, for a test's failure message."""
    record = cluster.job(job)
    out = workdir / f"slurm-{job}.out"
    tail = out.read_text().splitlines()[-15:] if out.exists() else ["no output"]
    return (f"JobState={record.get('JobState')} Reason={record.get('Reason')} "
            f"ExitCode={record.get('ExitCode')} Restarts={record.get('Restarts')}\n" +
            "\n".join(tail))


def logged_step(run_dir: Path, at_least: int) -> bool:
    log = run_dir / "train.log"
    steps = re.findall(r"step (\d+)/", log.read_text()) if log.exists() else []
    return bool(steps) and int(steps[-1]) >= at_least


def stopped_at(run_dir: Path, signal_name: str) -> int:
    return int(re.search(rf"stopped by {signal_name}\b.* at step (\d+)",
                         (run_dir / "train.log").read_text())[1])


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.xdist_group("slurm")
def test_a_job_across_two_nodes_goes_on_through_the_time_limit_warning_and_a_requeue(
        cluster, tmp_path):
    """sbatch, then srun over two nodes, a task a rank, in place. The first start gets the
    time-limit warning (USR1, which SLURM delivers to every task, as `sbatch
    --signal=USR1@90` has it do): it saves and requeues itself. The second is requeued from
    outside (`scontrol requeue`: SIGTERM, as preemption): it saves. The third ends the run,
    with the losses of the built-in launcher's uninterrupted run, step by step. Beside it, a
    job that SLURM will not requeue keeps its checkpoint and says how to continue."""
    reference = tmp_path / "reference"  # the built-in launcher's, while the jobs run
    built_in = subprocess.Popen([PARALLAB, "train", *RUN, "parallel.world_size=2",
                                 f"hydra.run.dir={reference}"], cwd=tmp_path,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    (tmp_path / "kept").mkdir()
    job = sbatch(cluster, tmp_path, f"srun --kill-on-bad-exit=1 {PARALLAB} train {' '.join(RUN)}",
                 "--nodes=2", "--ntasks-per-node=1")
    # ten times as long: one task starts sooner than two nodes' ranks meet, and it must
    # still be training when it is signalled after the first job's step 10
    longer = [a.replace("data.train_size=6400", "data.train_size=64000") for a in RUN]
    kept = sbatch(cluster, tmp_path / "kept", f"srun {PARALLAB} train {' '.join(longer)} "
                  "parallel=none", "--ntasks=1", "--no-requeue")
    run_dir, kept_dir = (tmp_path / "outputs" / "slurm" / job,
                         tmp_path / "kept" / "outputs" / "slurm" / kept)
    for directory, name in ((run_dir, job), (kept_dir, kept)):
        cluster.wait_for(lambda: logged_step(directory, 10), 60, f"job {name}'s step 10")
        cluster.run("scancel", "--signal=USR1", name)
    cluster.release_requeued(job, restarts=1)
    cluster.wait_for(lambda: "restart 1" in (run_dir / "train.log").read_text(), 60,
                     "the second start")
    first_stop = stopped_at(run_dir, "SIGUSR1")
    cluster.wait_for(lambda: logged_step(run_dir, first_stop + 10), 60, "the second start's steps")
    cluster.run("scontrol", "requeue", job)
    cluster.release_requeued(job, restarts=2)
    cluster.wait_for(lambda: cluster.job(job).get("JobState") == "COMPLETED", 90,
                     "the job to complete")
    log = (run_dir / "train.log").read_text()
    assert f"asking SLURM to requeue job {job}" in log and "launching" not in log  # tasks are ranks
    assert "rank 1/2" in (run_dir / "train_rank1.log").read_text()
    second_stop = stopped_at(run_dir, "SIGTERM")
    assert f"at step {first_stop} (SLURM job {job}, restart 1)" in log
    assert f"at step {second_stop} (SLURM job {job}, restart 2)" in log
    assert 0 < first_stop < second_stop < 100
    assert built_in.wait(timeout=120) == 0, built_in.stdout.read()[-3000:]
    assert read_metrics(run_dir)["eval_loss"] == pytest.approx(
        read_metrics(reference)["eval_loss"], rel=1e-5)
    assert losses(run_dir) == pytest.approx(losses(reference), rel=1e-5)

    assert cluster.job(kept)["JobState"] == "FAILED"
    said = (tmp_path / "kept" / f"slurm-{kept}.out").read_text()
    line = re.search(rf"SLURM did not requeue job {kept} \(.*\); its checkpoint is kept: "
                     r"continue the run with: (.*)", said)
    assert line and f"hydra.run.dir={kept_dir} trainer.resume=auto" in line[1], said[-2000:]
    assert "Traceback" not in said and list((kept_dir / "checkpoints").glob("step_*.pt"))


# one process, a few steps: what a user types to try something
SHORT = [*RUN, "parallel=none", "trainer.max_steps=3"]


@pytest.mark.slow
@pytest.mark.xdist_group("slurm")
def test_runs_typed_in_an_interactive_allocation_each_keep_their_own_dir(cluster, tmp_path):
    """An salloc shell holds the job's id, but no task of it runs there: two experiments
    typed in it are two runs, each in its own dir, where the second was refused because
    the job's one dir held the first."""
    command = f"{PARALLAB} train {' '.join(SHORT)}"
    done = cluster.run("salloc", "-N1", "bash", "-c", f"{command} && {command} optim.lr=0.02",
                       cwd=tmp_path, timeout=180, check=False)
    assert done.returncode == 0, output(done)[-3000:]
    runs = sorted(p.parent for p in tmp_path.glob("outputs/**/metrics.json"))
    assert len(runs) == 2 and not (tmp_path / "outputs" / "slurm").exists(), runs


@pytest.mark.slow
@pytest.mark.xdist_group("slurm")
def test_a_requeued_job_whose_run_had_finished_leaves_it_as_it_was(cluster, tmp_path):
    """`scontrol requeue` of a job that had completed: it resumed at its last step, did
    nothing, and wrote its metrics.json again with null figures."""
    job = sbatch(cluster, tmp_path, f"{PARALLAB} train {' '.join(SHORT)}", "--ntasks=1")
    cluster.wait_for(lambda: cluster.job(job).get("JobState") == "COMPLETED", 90, "the job")
    run_dir = tmp_path / "outputs" / "slurm" / job
    record = (run_dir / "metrics.json").read_bytes()
    cluster.run("scontrol", "requeue", job)
    cluster.release_requeued(job, restarts=1)
    cluster.wait_for(lambda: cluster.job(job).get("JobState") == "COMPLETED", 150,
                     "the requeued job to complete", lambda: job_report(cluster, tmp_path, job))
    assert (run_dir / "metrics.json").read_bytes() == record
    assert "had finished (its metrics.json is complete)" in (run_dir / "train.log").read_text()


@pytest.mark.slow
@pytest.mark.xdist_group("slurm")
def test_a_run_dir_that_cannot_be_made_ends_every_rank_in_one_line(cluster, tmp_path):
    (tmp_path / "outputs").write_text("a file where the runs' dirs go\n")
    job = sbatch(cluster, tmp_path, f"srun {PARALLAB} train {' '.join(RUN)}", "--nodes=2",
                 "--ntasks-per-node=1")
    cluster.wait_for(lambda: cluster.job(job).get("JobState") not in ("PENDING", "RUNNING"),
                     90, "the job to end")
    said = (tmp_path / f"slurm-{job}.out").read_text()
    assert cluster.job(job)["JobState"] == "FAILED" and "Traceback" not in said, said[-3000:]
    lines = [line for line in said.splitlines() if "cannot be made" in line]
    assert lines == [f"hydra.run.dir={tmp_path}/outputs/slurm/{job} cannot be made: "
                     f"{tmp_path}/outputs is a file: give another hydra.run.dir, or move "
                     f"{tmp_path}/outputs aside"] * 2, said[-3000:]


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.xdist_group("slurm")
def test_a_sweep_over_world_size_gets_each_job_its_own_allocation(cluster, tmp_path):
    sweep_dir = tmp_path / "sweep"
    # a rank per node, as the key set says: the second job spans both nodes, beside the first
    command = [PARALLAB, "train", "-m", "hydra/launcher=submitit_slurm", *RUN,
               "data.train_size=512", "parallel.world_size=1,2",
               "hydra.launcher.tasks_per_node=1", f"hydra.sweep.dir={sweep_dir}"]
    done = cluster.run(*command, cwd=tmp_path, timeout=150, check=False)
    assert done.returncode == 0, output(done)[-3000:]
    said = output(done)
    assert re.search(r"submitting jobs #0 on 1 node\(s\) x 1 task\(s\) each", said)
    assert re.search(r"submitting jobs #1 on 2 node\(s\) x 1 task\(s\) each", said)
    jobs = sorted(p for p in sweep_dir.iterdir() if (p / ".hydra").is_dir())
    assert [read_metrics(job)["world_size"] for job in jobs] == [1, 2]
    assert (jobs[1] / "train_rank1.log").exists()  # two tasks, the ranks, in place
    assert "launching" not in (jobs[1] / "train.log").read_text()
    assert all(list(job.glob("events.out.tfevents.*")) for job in jobs)
    summary = (sweep_dir / "summary.md").read_text()
    assert summary.count("| completed |") == 2
    # the same sweep again, skipping what is done: nothing is submitted
    again = cluster.run(*command, "sweep.skip_completed=true", cwd=tmp_path, timeout=120,
                        check=False)
    assert again.returncode == 0, output(again)[-3000:]
    assert "submitting" not in output(again)
    assert (sweep_dir / "summary.md").read_text().count("| skipped |") == 2


@pytest.mark.slow
@pytest.mark.xdist_group("slurm")
@pytest.mark.parametrize("sizes,refusal", [
    ("2,8", r"job #1 \(.*parallel.world_size=8.*\) needs 4 node\(s\) x 2 task\(s\), but a node "
            r"of partition debug holds 2 CPUs and 0 GPUs, and it has 2 node\(s\): lower "
            r"parallel.world_size, or choose hydra.launcher.partition"),
    # submitted, it failed in SLURM (0), or ended the sweep in an IndexError (-3)
    ("0,2", r"job #0 \(.*parallel.world_size=0\): parallel.world_size=0 is out of range: it "
            r"must be >= 1"),
    ("2,-3", r"job #1 \(.*parallel.world_size=-3\): parallel.world_size=-3 is out of range: "
             r"it must be >= 1"),
])
def test_a_sweep_job_refused_is_refused_before_anything_is_submitted(cluster, tmp_path, sizes,
                                                                       refusal):
    # an earlier test's job may still be ending on the shared cluster: only new ones count
    queued = set(cluster.run("squeue", "-h", "-o", "%i").stdout.split())
    done = cluster.run(PARALLAB, "train", "-m", "hydra/launcher=submitit_slurm", *RUN,
                       f"parallel.world_size={sizes}", f"hydra.sweep.dir={tmp_path / 'sweep'}",
                       cwd=tmp_path, check=False)
    assert done.returncode == 2, output(done)[-3000:]
    [line] = done.stderr.strip().splitlines()
    assert re.fullmatch(refusal, line), line
    assert not (tmp_path / "sweep" / ".submitit").exists()
    assert set(cluster.run("squeue", "-h", "-o", "%i").stdout.split()) <= queued
