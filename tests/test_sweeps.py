"""Multirun sweeps: job dirs named by overrides, the summary, failures, skipping, presets."""

from __future__ import annotations

import csv
import re
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import REPO, output, run_entry

pytestmark = pytest.mark.slow
PARALLAB = str(Path(sys.executable).parent / "parallab")
QUICK = ["data=synthetic", "data.train_size=512", "data.eval_size=128", "trainer.max_steps=4",
         "device=cpu"]


def sweep(sweep_dir: Path, *args: str) -> subprocess.CompletedProcess:
    return run_entry("train.py", ["-m", *QUICK, *args, f"hydra.sweep.dir={sweep_dir}"])


def summary_rows(sweep_dir: Path) -> list[dict]:
    with open(sweep_dir / "summary.csv") as f:
        return list(csv.DictReader(f))


def test_a_job_whose_overrides_outgrow_a_file_name_gets_a_readable_stable_dir(tmp_path):
    """20 overrides: the job's dir name is cut to 255 bytes and ends with a hash of them all;
    its .hydra/ keeps every one, and the summary reads it."""
    many = ["trainer.timing_skip_steps=5", "trainer.keep_last_k=3", "trainer.on_nan=stop",
            "trainer.activation_checkpointing=none", "trainer.monitor=eval_loss",
            "trainer.save_best=true", "trainer.init_strict=true", "trainer.overwrite=false",
            "trainer.channels_last=false", "trainer.compile=false", "trainer.profile=false",
            "trainer.auto_batch_size=false", "trainer.accumulate_grad_batches=1",
            "trainer.eval_every_n_epochs=1", "trainer.log_every_n_steps=50",
            "parallel.max_restarts=0", "parallel.rendezvous_timeout=60", "precision.tf32=false",
            "optim.scale_lr=none", "data.eval_batch_size=1000"]
    result = sweep(tmp_path / "sweep", *many)
    assert result.returncode == 0, output(result)[-3000:]
    [job] = [p for p in (tmp_path / "sweep").iterdir() if (p / ".hydra").is_dir()]
    assert len(job.name.encode()) <= 255 and job.name.startswith("0_data.eval_batch_size=1000,")
    assert re.fullmatch(r".*_[0-9a-f]{10}", job.name)
    assert len((job / ".hydra" / "overrides.yaml").read_text().splitlines()) == 20 + len(QUICK)
    assert [row["status"] for row in summary_rows(tmp_path / "sweep")] == ["completed"]


def test_where_a_job_logs_stays_out_of_its_dir_name():
    """Any logger key, a project's own logger added with `+` too: Hydra's exclude_keys had
    named only some of them, so the rest (and a `_target_`'s dotted path) named the dir,
    and counted as what the job trains for sweep.skip_completed."""
    from parallab.config import naming

    assert naming.job_dir(0, "+logger.mine._target_=pkg.Mine,data.batch_size=16,"
                             "data.shape=[1,8,8],logger.mlflow.send_every_s=0") == \
        "0_data.batch_size=16,data.shape=[1,8,8]"
    assert naming.where_it_logs("+logger.mine._target_") and not naming.where_it_logs("loss")
    # a path's slashes had nested the job's dir a level each (another job's dir its parent)
    assert naming.job_dir(1, "data.files=/data/a.bin,optim.lr=0.1") == \
        "1_data.files=%2Fdata%2Fa.bin,optim.lr=0.1"


def test_skip_completed_skips_a_job_only_where_its_dir_trained_the_same(tmp_path):
    """Two sweeps of other experiments given one hydra.sweep.dir name their jobs alike (the
    dir's name leaves `experiment` out): the second's sweep.skip_completed=true took the
    first's finished jobs for its own. Such a sweep is refused before any job runs, naming
    both, the first's record as it was (its jobs had run, been refused, and written their
    record over it); the same sweep skips, given trainer.resume=auto too (which named other
    dirs). Without skip_completed it is refused alike, and so are two jobs of one dir."""
    own = tmp_path / "conf" / "experiment"
    own.mkdir(parents=True)
    for name, lr in (("slow", 0.001), ("quick", 0.1)):
        (own / f"{name}.yaml").write_text(f"# @package _global_\noptim:\n  lr: {lr}\n")
    sweep_dir = tmp_path / "sweep"

    def sweep_of(*args: str) -> subprocess.CompletedProcess:
        return run_entry("train.py", [f"--config-dir={tmp_path / 'conf'}", "-m", *QUICK,
                                      "data.batch_size=16,32", *args,
                                      f"hydra.sweep.dir={sweep_dir}"])

    first = sweep_of("experiment=slow")
    assert first.returncode == 0, output(first)
    before = summary_rows(sweep_dir)
    other = sweep_of("experiment=quick", "sweep.skip_completed=true")
    said = output(other).strip().splitlines()
    assert other.returncode == 2 and len(said) == 1, said
    assert said[0].startswith("job #0 (") and "holds a finished job of other overrides (" \
        in said[0] and "experiment=slow" in said[0] and "here " in said[0]
    assert summary_rows(sweep_dir) == before and [r["status"] for r in before] == [
        "completed", "completed"]
    assert "experiment=slow" in next(sweep_dir.glob("0_*/.hydra")).joinpath(
        "overrides.yaml").read_text()
    rerun = sweep_of("experiment=slow")
    assert rerun.returncode == 2 and "already holds a run (metrics.json, checkpoints/): " \
        "continue the sweep with sweep.skip_completed=true" in output(rerun)
    same = sweep_of("experiment=slow", "hydra.sweep.subdir=same")
    assert same.returncode == 2 and "would both write" in output(same)
    # trainer.resume is no part of a job's dir name: the rerun finds its jobs
    again = sweep_of("experiment=slow", "sweep.skip_completed=true", "trainer.resume=auto")
    assert again.returncode == 0, output(again)
    assert [r["status"] for r in summary_rows(sweep_dir)] == ["skipped", "skipped"]
    # the same overrides composed from a YAML changed since (or a project's own option of
    # a built-in's name): their finished jobs had been taken for these
    (own / "slow.yaml").write_text("# @package _global_\noptim:\n  lr: 0.002\n")
    changed = sweep_of("experiment=slow", "sweep.skip_completed=true")
    assert changed.returncode == 2 and "holds a finished job of these overrides composed " \
        "from other configs" in output(changed)


def test_the_summary_holds_this_sweeps_jobs_alone(tmp_path):
    """A second sweep into the same hydra.sweep.dir: its summary was of every job dir there,
    the first sweep's too (4 jobs for 2); it is of its own. Rerun with a value more and
    sweep.skip_completed=true, the finished jobs under their new numbers were trained again."""
    sweep_dir = tmp_path / "sweep"
    assert sweep(sweep_dir, "optim.lr=0.01,0.02").returncode == 0
    second = sweep(sweep_dir, "optim.lr=0.005,0.03")
    assert second.returncode == 0, output(second)
    rows = summary_rows(sweep_dir)
    assert [r["job"].split("optim.lr=")[1].split(",")[0] for r in rows] == ["0.005", "0.03"]
    earlier = [r["eval_loss"] for r in rows]
    # given one more value, its jobs numbered anew (0_..lr=0.03 is now 2_..lr=0.03): those
    # finished are skipped as their earlier dirs, their figures read from there
    more = sweep(sweep_dir, "optim.lr=0.001,0.005,0.03", "sweep.skip_completed=true")
    assert more.returncode == 0, output(more)
    rows = summary_rows(sweep_dir)
    assert [r["status"] for r in rows] == ["completed", "skipped", "skipped"]
    assert [r["eval_loss"] for r in rows[1:]] == earlier and all(earlier)
    # rebuilt from the dirs alone (`parallab summary`): a skipped job stands for the dir it
    # was skipped as, which is not listed again (each run had been listed twice)
    from parallab.observe import summary

    lrs = [r["job"].split("optim.lr=")[1].split(",")[0] for r in summary.collect(sweep_dir)]
    assert sorted(lrs) == ["0.001", "0.005", "0.01", "0.02", "0.03"]


def test_a_failing_job_is_reported_and_the_others_still_run(tmp_path):
    sweep_dir = tmp_path / "sweep"
    result = sweep(sweep_dir, "data.batch_size=0,32")
    assert result.returncode != 0, output(result)
    rows = summary_rows(sweep_dir)
    assert [r["status"] for r in rows] == ["failed", "completed"]
    assert "data.batch_size=0" in rows[0]["error"] and float(rows[1]["eval_accuracy"]) > 0
    assert rows[1]["job"] == "1_data.batch_size=32,data.eval_size=128,data.train_size=512," \
                             "data=synthetic,trainer.max_steps=4"
    assert (sweep_dir / "summary.md").read_text().count("\n") == 4
    assert (sweep_dir / "summary.png").stat().st_size > 10_000
    assert "| failed |" in result.stdout  # the table is printed too
    # `parallab summary` writes the same from the job dirs alone
    for name in ("summary.csv", "summary.md", "summary.png"):
        (sweep_dir / name).unlink()
    rebuilt = subprocess.run([PARALLAB, "summary", str(sweep_dir)], capture_output=True,
                             text=True)
    assert rebuilt.returncode == 0, rebuilt.stderr
    assert "| failed |" in rebuilt.stdout and "| completed |" in rebuilt.stdout
    assert summary_rows(sweep_dir) == rows and (sweep_dir / "summary.png").exists()
    nothing = subprocess.run([PARALLAB, "summary", str(tmp_path)], capture_output=True,
                             text=True)
    assert nothing.returncode != 0 and "no multirun jobs" in nothing.stderr


def test_an_optuna_sweep_whose_every_trial_fails_ends_with_its_summary_and_one_line(tmp_path):
    """Optuna's sweeper asked its study for the best of no completed trial: the sweep
    ended in its traceback, no summary written."""
    sweep_dir = tmp_path / "sweep"
    result = sweep(sweep_dir, "hydra/sweeper=optuna", "hydra.sweeper.n_trials=2",
                   "optim.lr=interval(0.01,0.1)", "data.batch_size=0")
    said = output(result)
    assert result.returncode == 1, said[-3000:]
    assert "Traceback" not in said and "No trials are completed" not in said
    rows = summary_rows(sweep_dir)
    assert [r["status"] for r in rows] == ["failed", "failed"]
    assert all("data.batch_size=0" in r["error"] for r in rows)
    assert "| failed |" in result.stdout
    assert result.stdout.strip().splitlines()[-1].endswith(  # (Optuna's own log: stderr)
        "every trial of the Optuna sweep failed, so it has no best parameters: each trial's "
        f"error is in {sweep_dir / 'summary.md'} (its log, with any traceback, in its job "
        "dir's train.log there); mend it and run the sweep again")


# sitecustomize for the sweep's process: SIGTERM to itself at the first job's 2nd step
STOP_FIRST_JOB = """
import os, signal
import parallab.training.trainer as trainer

step = trainer.Trainer.train_step

def train_step(self, batches):
    if self.step == 2 and not os.environ.get("STOPPED"):
        os.environ["STOPPED"] = "1"
        os.kill(os.getpid(), signal.SIGTERM)
    return step(self, batches)

trainer.Trainer.train_step = train_step
"""


def test_a_stopped_sweep_stops_and_its_printed_command_finishes_it(tmp_path):
    """SIGTERM in job 0 (the node is reclaimed): job 0 saves, job 1 is not started, the
    sweep exits with 128 + SIGTERM (not 0: a scheduler took it for finished) printing the
    command that continues it; that command resumes job 0 and runs job 1, leaving nothing
    finished run twice."""
    import shlex

    sweep_dir = tmp_path / "sweep"
    (tmp_path / "inject").mkdir()
    (tmp_path / "inject" / "sitecustomize.py").write_text(STOP_FIRST_JOB)
    stopped = run_entry("train.py", ["-m", *QUICK, "trainer.checkpoint_every_n_steps=null",
                                     "data.batch_size=16,32", f"hydra.sweep.dir={sweep_dir}"],
                        env={"PYTHONPATH": str(tmp_path / "inject")})
    assert stopped.returncode == 128 + 15, output(stopped)
    assert [r["status"] for r in summary_rows(sweep_dir)] == ["stopped", "stopped"]
    line = next(x for x in output(stopped).splitlines() if "the sweep stops here" in x)
    command = shlex.split(line.split("continue it with: ", 1)[1])
    assert command[:2] == ["python", "train.py"] and "sweep.skip_completed=true" in command
    result = run_entry("train.py", command[2:])
    assert result.returncode == 0, output(result)
    rows = summary_rows(sweep_dir)
    assert [r["status"] for r in rows] == ["completed", "completed"]
    assert "resumed from" in (sweep_dir / rows[0]["job"] / "train.log").read_text()


def test_every_experiment_preset_runs(tmp_path):
    """On the quick synthetic set: all but strategies, which is gpt on text (below), and
    advise, which trains nothing itself (tests/test_advise.py)."""
    presets = sorted(p.stem for p in (REPO / "experiments").glob("*.yaml")
                     if p.stem not in ("strategies", "advise"))
    assert {"scaling", "precision"} <= set(presets)
    result = sweep(tmp_path / "sweep", "experiment=glob(*,exclude=[strategies,advise])")
    assert result.returncode == 0, output(result)
    rows = summary_rows(tmp_path / "sweep")
    assert len(rows) == len(presets) and {r["status"] for r in rows} == {"completed"}
    assert {r["parallel"] for r in rows} >= {"ddp", "none"}  # scaling runs ddp


@pytest.mark.distributed
def test_strategies_preset_trains_every_layout_at_one_global_batch(tmp_path):
    from omegaconf import OmegaConf

    from parallab.parallel import PLANS

    preset = OmegaConf.load(REPO / "experiments" / "strategies.yaml")
    swept = preset.hydra.sweeper.params.parallel.split(",")
    # dp needs GPUs to differ; auto is every layout, which parallab simulate ranks
    assert sorted(swept) == sorted(set(PLANS) - {"dp", "auto"})
    sweep_dir = tmp_path / "sweep"
    # the preset's mechanics on three of them; each one's equivalence is test_strategies'
    result = run_entry("train.py", ["-m", "experiment=strategies", "trainer.max_steps=3",
                                    "parallel=none,ddp,fsdp_tp",
                                    "model.layers=2", "model.width=32", "model.context=32",
                                    "data.eval_fraction=0.001", f"hydra.sweep.dir={sweep_dir}"])
    assert result.returncode == 0, output(result)
    rows = summary_rows(sweep_dir)
    assert sorted(r["parallel"] for r in rows) == ["ddp", "fsdp_tp", "none"]
    assert {r["global_batch_size"] for r in rows} == {"64"}
    losses = [float(r["eval_loss"]) for r in rows]
    assert max(losses) - min(losses) < 1e-4  # the same training, however it is split


@pytest.mark.distributed
def test_every_rank_of_an_optuna_ddp_trial_trains_with_that_trials_parameters(tmp_path):
    import re

    result = sweep(tmp_path / "sweep", "experiment=lr_search", "hydra.sweeper.n_trials=2",
                   "parallel=ddp", "parallel.world_size=2")
    assert result.returncode == 0, output(result)
    assert "Best parameters" in output(result)
    jobs = sorted(p for p in (tmp_path / "sweep").iterdir() if p.is_dir())
    assert len(jobs) == 2
    for job in jobs:
        chosen = dict(o.split("=", 1) for o in (job / ".hydra" / "overrides.yaml").read_text()
                      .replace("- ", "").split() if o.startswith(("optim.lr", "data.batch")))
        for log_name in ("train.log", "train_rank1.log"):
            line = re.search(r"optim\.lr=(\S+), data\.batch_size=(\d+)",
                             (job / log_name).read_text())
            assert float(line[1]) == pytest.approx(float(chosen["optim.lr"]), rel=1e-5)
            assert line[2] == chosen["data.batch_size"]


@pytest.mark.distributed
def test_submitit_local_runs_each_job_as_ranks_in_place(tmp_path):
    result = sweep(tmp_path / "sweep", "hydra/launcher=submitit_local",
                   "hydra.launcher.tasks_per_node=2", "parallel=ddp", "data.batch_size=16,32")
    assert result.returncode == 0, output(result)
    rows = summary_rows(tmp_path / "sweep")
    assert [(r["status"], r["world_size"]) for r in rows] == [("completed", "2")] * 2
    for job in filter(Path.is_dir, (tmp_path / "sweep").iterdir()):
        if (job / ".hydra").is_dir():  # rank 1 logs to its own file, as under torchrun
            assert "rank 0/2" in (job / "train.log").read_text()
            assert "rank 1/2" not in (job / "train.log").read_text()
            assert (job / "train_rank1.log").is_file()


@pytest.mark.parametrize("launcher", ["basic", "submitit_local"])
def test_a_sweep_with_a_job_the_checks_refuse_runs_none_of_its_jobs(tmp_path, launcher):
    """Every job is checked before the first starts or is submitted: a world size of 0 or
    -3 ends the sweep in one line naming the job, where the other jobs ran (or were
    submitted) and that one failed alone, or the sweep ended in an IndexError."""
    sweep_dir = tmp_path / "sweep"
    result = sweep(sweep_dir, f"hydra/launcher={launcher}", "parallel=ddp",
                   "parallel.world_size=2,0,-3")
    assert result.returncode == 2, output(result)[-3000:]
    assert "Traceback" not in output(result)
    [line] = result.stderr.strip().splitlines()
    assert re.fullmatch(r"job #1 \(.*parallel.world_size=0\): parallel.world_size=0 is out of "
                        r"range: it must be >= 1", line), line
    assert not [p for p in sweep_dir.iterdir() if p.is_dir()]  # no job's dir, no .submitit


@pytest.mark.parametrize("entry", [[PARALLAB, "advise", "-m"],
                                   ["train.py", "-m", "advise.run=true"]])
def test_an_advise_sweeps_jobs_are_checked_as_advise_checks_its_run(tmp_path, entry):
    """parallel.world_size is the largest world size advise measures (1 and each divisor),
    not a layout of parallel=none's: a sweep of it is not refused as train would refuse it
    (a job of world size 2 passes, the one of 0 is named), and advise's own keys are checked
    before any job runs. parallab advise is train's app with a flag the launcher did not
    see, so every job had been refused as one that trains."""
    sweep_dir = tmp_path / "sweep"
    script, *first = entry
    for varied, says in [
            (["parallel.world_size=2,0"], "parallel.world_size=0 is out of range: it must be "
                                          ">= 1"),
            (["parallel.world_size=2", "advise.steps=3,0"], "advise.steps=0 is out of range: "
                                                            "it must be >= 1")]:
        result = run_entry(script, [*first, "model=mlp", "data=synthetic", "device=cpu",
                                    *varied, f"hydra.sweep.dir={sweep_dir}"])
        assert result.returncode == 2, output(result)[-3000:]
        [line] = result.stderr.strip().splitlines()
        assert line.startswith("job #1 (") and line.endswith(f"): {says}"), line
        assert not sweep_dir.exists() or not [p for p in sweep_dir.iterdir() if p.is_dir()]


def test_an_advise_sweep_continued_skips_its_answered_jobs(tmp_path):
    """An advise job writes advise.md, no metrics.json: continued with
    sweep.skip_completed=true, its job is skipped as answered, where it had failed in its
    dir ('holds a run (advise.md)') and the summary, reading advise.csv first, said
    advised and exit 0. A job whose last start failed is summarised as failed."""
    import json

    from parallab.observe import summary

    sweep_dir = tmp_path / "sweep"
    command = ["advise", "-m", "model=mlp", "data=synthetic", "device=cpu",
               "parallel.world_size=1", "advise.precisions=[fp32,bf16]", "advise.steps=2",
               "advise.warmup_steps=1", "optim.lr=0.1", f"hydra.sweep.dir={sweep_dir}"]
    for extra in ([], ["sweep.skip_completed=true"]):
        result = run_entry(PARALLAB, [*command, *extra])
        assert result.returncode == 0, output(result)[-3000:]
    [job] = [p for p in sweep_dir.iterdir() if p.is_dir()]
    assert summary.read_status(job)["status"] == "skipped", output(result)[-3000:]
    assert [row["status"] for row in summary_rows(sweep_dir)] == ["advised (advise.md)"]
    (job / summary.STATUS_FILE).write_text(json.dumps({"status": "failed", "error": "x"}))
    assert summary.job_row(job)["status"] == "failed"


@pytest.mark.distributed
def test_a_failed_ddp_job_is_summarised_by_its_root_cause(tmp_path):
    (tmp_path / "inject").mkdir()
    (tmp_path / "inject" / "sitecustomize.py").write_text(
        "import os\n"
        "import parallab.training.trainer as trainer\n"
        "step = trainer.Trainer.train_step\n"
        "def failing(self, batches):\n"
        "    if self.step == 2 and os.environ.get('RANK') == '1':\n"
        "        raise RuntimeError('injected failure on rank 1')\n"
        "    return step(self, batches)\n"
        "trainer.Trainer.train_step = failing\n")
    sweep_dir = tmp_path / "sweep"
    result = run_entry("train.py", ["-m", *QUICK, "parallel=ddp", "parallel.world_size=2",
                                    f"hydra.sweep.dir={sweep_dir}"],
                       env={"PYTHONPATH": str(tmp_path / "inject")})
    assert result.returncode != 0
    [row] = summary_rows(sweep_dir)
    assert row["status"] == "failed"
    assert row["error"] == "rank 1: RuntimeError: injected failure on rank 1"


def test_a_simulate_sweep_summarizes_each_jobs_best_layout(tmp_path):
    """`parallab simulate -m` over world sizes: each job's row holds its best layout as
    predicted (marked so), in a run's columns, where train's summary found none."""
    done = run_entry("parallab", ["simulate", "-m", "model=gpt", "model.layers=2",
                                  "model.width=64", "model.heads=4", "model.context=64",
                                  "data.seq_len=64", "precision=bf16", "parallel=fsdp",
                                  "parallel.world_size=8,16", "cluster=h100",
                                  f"hydra.sweep.dir={tmp_path}"], timeout=300)
    assert done.returncode == 0, output(done)[-3000:]
    rows = summary_rows(tmp_path)
    assert [r["status"] for r in rows] == ["simulated (simulate.md)"] * 2
    assert [int(r["world_size"]) for r in rows] == [8, 16]
    assert all(r["parallel"].startswith("fsdp(F") and float(r["samples_per_sec"]) > 0 and
               float(r["peak_memory_mb"]) > 0 for r in rows)
