"""The resume command a run that srun started in place prints when a signal stops it, against
a real SLURM (slurm_cluster.py; skipped in one line where its daemons cannot be had): srun
leads it, with the counts and options it gave its tasks, and it continues the run."""

from __future__ import annotations

import os
import re
import shlex
import signal
import sys
from pathlib import Path

import pytest
from conftest import REPO, inject, output, read_metrics


RUN = ["parallel=ddp", "model=mlp", "data=synthetic", "data.train_size=512",
       "data.eval_size=64", "trainer.max_steps=12", "trainer.log_every_n_steps=2",
       "device=cpu", "parallel.threads_per_worker=1"]


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.xdist_group("slurm")
def test_a_run_srun_started_prints_a_resume_command_under_srun(cluster, tmp_path):
    """Stopped by SIGTERM at step 3 (rank 0 signalled: the ranks agree at their next vote),
    the run printed `python train.py ...`, which resumed a run of two tasks over two nodes
    in one process; srun's task has slurmstepd for its parent, so srun's own command line
    is rebuilt from the step's variables."""
    run_dir = tmp_path / "run"
    # `python` the printed command names is this one, in the tasks srun starts
    path = {"PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    stopping = {**inject(tmp_path, 3, "os.kill(os.getpid(), signal.SIGTERM)",
                         "os.environ.get('SLURM_PROCID') == '0'"), **path}
    stopped = cluster.run("srun", "--ntasks=2", "--nodes=2", "--cpus-per-task=1", "python",
                          "train.py", *RUN, f"hydra.run.dir={run_dir}", check=False,
                          timeout=120, env=stopping, cwd=REPO)
    assert stopped.returncode == 128 + signal.SIGTERM, output(stopped)[-3000:]
    said = re.search(r"resume with: (.*)", output(stopped))
    assert said, output(stopped)[-3000:]
    command = said[1].strip()
    assert command == shlex.join(["srun", "--ntasks=2", "--nodes=2", "--cpus-per-task=1",
                                  "python", "train.py", *RUN, f"hydra.run.dir={run_dir}",
                                  "trainer.resume=auto"]), command
    resumed = cluster.run(*shlex.split(command), check=False, timeout=120, env=path, cwd=REPO)
    assert resumed.returncode == 0, output(resumed)[-3000:]
    assert re.search(r"resumed from .* at step \d", (run_dir / "train.log").read_text())
    assert read_metrics(run_dir)["world_size"] == 2
