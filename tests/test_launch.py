"""How the entrypoint recognises an external launcher and shares one run dir with its ranks
(the workers' start and the fork server: test_fork_server.py)."""

from __future__ import annotations

import os
import socket

import pytest
from conftest import FAST, checked, read_metrics, run_entry

from parallab.cli import JobFailed
from parallab.config.errors import ConfigError
from parallab.launching import in_place, launch, slurm
from parallab.parallel.layout import Layout

LAUNCHER_VARS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK",
                 "TORCHELASTIC_RUN_ID", "MASTER_ADDR", "MASTER_PORT", "SUBMITIT_LOCAL_NTASKS",
                 "SUBMITIT_LOCAL_GLOBALID", "SUBMITIT_LOCAL_LOCALID", "SUBMITIT_LOCAL_JOB_ID",
                 "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_LOCAL_RANK",
                 "OMPI_COMM_WORLD_LOCAL_SIZE", "PMI_SIZE", "PMI_RANK", "MPI_LOCALRANKID",
                 "MPI_LOCALNRANKS", "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_USE_AGENT_STORE",
                 "SLURM_NTASKS", "SLURM_PROCID", "SLURM_LOCALID", "SLURM_NNODES",
                 "SLURM_NTASKS_PER_NODE", "SLURM_JOB_ID", "SLURM_STEP_ID", "SLURM_STEPID",
                 "SLURM_NODEID", "SLURM_STEP_TASKS_PER_NODE", "SLURM_TASKS_PER_NODE",
                 "SLURM_STEP_NUM_NODES", "SLURM_JOB_NODELIST", "SLURM_STEP_NODELIST",
                 "SLURM_RESTART_COUNT", "SLURM_ARRAY_JOB_ID", "SLURM_ARRAY_TASK_ID",
                 "SLURM_TASK_PID", in_place.RUN_TIME_ENV)
# what torchrun's agent sets for a worker (and parallab's own launcher for its workers)
TORCHRUN_WORKER = {"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2",
                   "GROUP_RANK": "1", "TORCHELASTIC_RUN_ID": "none",
                   "TORCHELASTIC_RESTART_COUNT": "0", "MASTER_ADDR": "127.0.0.1",
                   "MASTER_PORT": "29500"}
SLURM_TASK = {"SLURM_JOB_ID": "7", "SLURM_STEP_ID": "0", "SLURM_TASK_PID": str(os.getpid())}
TWO = Layout(2, ("dp_replicate", "dp_shard", "tp"), True, dp_replicate=2)  # parallel=ddp's


@pytest.fixture
def clean_env(monkeypatch):
    for name in LAUNCHER_VARS:
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


@pytest.mark.parametrize("env,expected", [
    ({}, None),
    (TORCHRUN_WORKER, ("torchrun", 3, 1, 4, 2)),
    ({**SLURM_TASK, "SLURM_NTASKS": "8", "SLURM_PROCID": "5", "SLURM_LOCALID": "1",
      "SLURM_NODEID": "1", "SLURM_STEP_TASKS_PER_NODE": "4(x2)"}, ("slurm", 5, 1, 8, 4)),
    ({**SLURM_TASK, "SLURM_NTASKS": "4", "SLURM_PROCID": "3", "SLURM_LOCALID": "0",
      "SLURM_NODEID": "1", "SLURM_STEP_TASKS_PER_NODE": "3,1"},
     ("slurm", 3, 0, 4, 1)),  # nodes holding unequal counts
    ({**SLURM_TASK, "SLURM_NTASKS": "1", "SLURM_PROCID": "0"}, None),  # one task
    # the batch script itself: SLURM_NTASKS is the job's, but this is one process
    ({"SLURM_JOB_ID": "7", "SLURM_TASK_PID": str(os.getpid()), "SLURM_NTASKS": "4",
      "SLURM_PROCID": "0", "SLURM_LOCALID": "0"}, None),
    # a step's variables copied into a shell no SLURM task started: a plain run
    ({**SLURM_TASK, "SLURM_TASK_PID": "1", "SLURM_NTASKS": "8", "SLURM_PROCID": "5",
      "SLURM_STEP_TASKS_PER_NODE": "4(x2)"}, None),
    ({"OMPI_COMM_WORLD_SIZE": "2", "OMPI_COMM_WORLD_RANK": "1",
      "OMPI_COMM_WORLD_LOCAL_RANK": "1", "OMPI_COMM_WORLD_LOCAL_SIZE": "2"},
     ("mpirun", 1, 1, 2, 2)),
    ({"PMI_SIZE": "4", "PMI_RANK": "2", "MPI_LOCALRANKID": "0", "MPI_LOCALNRANKS": "2"},
     ("mpirun", 2, 0, 4, 2)),
])
def test_detects_the_launcher_from_its_variables(clean_env, env, expected):
    for name, value in env.items():
        clean_env.setenv(name, value)
    found = in_place.detect()
    assert (found and (found.launcher, found.rank, found.local_rank, found.world_size,
                       found.local_world_size)) == expected


@pytest.mark.parametrize("env,unset", [
    ({"RANK": "0", "WORLD_SIZE": "2"}, "RANK WORLD_SIZE"),
    ({"WORLD_SIZE": "4"}, "WORLD_SIZE"),
    ({"RANK": "1", "WORLD_SIZE": "2"}, "RANK WORLD_SIZE"),
    # torch's env:// variables set by hand, without the agent that marks a torchrun worker
    ({"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "MASTER_ADDR": "nohost.invalid",
      "MASTER_PORT": "29555"}, "RANK LOCAL_RANK WORLD_SIZE"),
    ({"OMPI_COMM_WORLD_SIZE": "2"}, "OMPI_COMM_WORLD_SIZE"),
    ({"PMI_RANK": "1"}, "PMI_RANK"),
])
def test_a_launchers_variables_left_partly_set_end_the_command_in_one_line(clean_env, env,
                                                                           unset, caplog):
    """Left in a shell after an `export`, they made a one-process run read a rank and a
    world size no launcher started (half of every epoch, the loss divided by ranks that
    never ran, no metrics.json from rank 1): now one line naming them, before Hydra."""
    from parallab import cli

    for name, value in env.items():
        clean_env.setenv(name, value)
    with pytest.raises(SystemExit) as ended:
        cli.train(["train.py", "device=cpu"])
    [line] = [r.getMessage() for r in caplog.records if r.levelname == "ERROR"]
    assert ended.value.code == 2 and f": unset {unset}, or start the run with " in line, line


def test_a_one_process_layout_reads_no_rank_or_world_size(clean_env):
    from parallab.launching import distributed

    clean_env.setenv("RANK", "1")
    clean_env.setenv("WORLD_SIZE", "2")
    clean_env.setenv("LOCAL_WORLD_SIZE", "2")
    place = distributed.setup("cpu", None, 60, None)
    assert (place.rank, place.world_size, place.local_world_size) == (0, 1, 1)


def test_a_rank_gives_up_on_an_unreached_master_after_the_timeout_not_twice_it(clean_env):
    """torch's client store retried for twice parallel.rendezvous_timeout before it gave up,
    and the line then said "within" the timeout."""
    import time

    from conftest import free_port

    from parallab.config.errors import OneLineError

    clean_env.setenv("MASTER_ADDR", "127.0.0.1")
    clean_env.setenv("MASTER_PORT", str(free_port()))
    started = time.monotonic()
    with pytest.raises(OneLineError, match="could not be reached within parallel."
                                           "rendezvous_timeout=2 s"):
        in_place.meet(in_place.InPlace("torchrun", 1, 1, 2, 2), 2.0, "MASTER_ADDR")
    assert time.monotonic() - started < 3.5  # it took 4.5


def test_a_one_process_layout_under_a_launchers_full_set_is_refused_without_a_wait(tmp_path):
    """Open MPI's whole set (copied into a shell, or mpirun -np 2) under parallel=none: rank
    0 hosted a rendezvous and waited the whole timeout for a rank 1 that a one-process
    layout never has; now the layout's refusal at once."""
    ompi = {"OMPI_COMM_WORLD_SIZE": "2", "OMPI_COMM_WORLD_RANK": "0",
            "OMPI_COMM_WORLD_LOCAL_RANK": "0", "OMPI_COMM_WORLD_LOCAL_SIZE": "2"}
    result = run_entry("train.py", [*FAST, "parallel.rendezvous_timeout=300"], tmp_path,
                       env=ompi, timeout=60)
    assert result.returncode == 2, result.stdout[-2000:] + result.stderr[-2000:]
    assert "parallel=none runs one process, but mpirun started 2" in result.stdout


def test_a_restart_count_left_in_a_shell_resumes_nothing(clean_env, train_here):
    """TORCHELASTIC_RESTART_COUNT (or SLURM_RESTART_COUNT, with SLURM_JOB_ID) counts only
    under the launcher that set it: left in a shell, a new run in a dir holding a finished
    one was made to continue it silently; it is refused, as without the variable."""
    short = [*FAST, "trainer.max_steps=2"]
    _, run_dir = train_here(*short)
    clean_env.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    clean_env.setenv("SLURM_JOB_ID", "4242")
    clean_env.setenv("SLURM_RESTART_COUNT", "1")
    assert not in_place.restarted() and not slurm.in_job()
    assert launch._run_name() != "slurm/4242"
    with pytest.raises(JobFailed, match="already holds a run"):
        train_here(*FAST, "trainer.max_steps=4")
    assert read_metrics(run_dir)["steps"] == 2


@pytest.mark.parametrize("env,bad", [
    ({**TORCHRUN_WORKER, "WORLD_SIZE": "abc"}, "WORLD_SIZE='abc'"),
    ({**SLURM_TASK, "SLURM_NTASKS": "2 tasks"}, "SLURM_NTASKS='2 tasks'"),
])
def test_a_launchers_variable_that_is_no_number_ends_the_command_in_one_line(clean_env, env,
                                                                             bad, caplog):
    """Before Hydra composes anything: exit status 2 and the variable named."""
    from parallab import cli

    for name, value in env.items():
        clean_env.setenv(name, value)
    with pytest.raises(SystemExit) as ended:
        cli.train(["train.py", "device=cpu"])
    [line] = [r.getMessage() for r in caplog.records if r.levelname == "ERROR"]
    assert ended.value.code == 2 and line.startswith(f"{bad} is not a whole number")


@pytest.mark.parametrize("nodelist,hosts", [
    ("gpu[01-03,07],cpu5", ["gpu01", "gpu02", "gpu03", "gpu07", "cpu5"]),
    ("node7", ["node7"]), ("a[1,4]", ["a1", "a4"]), ("n[10-11]", ["n10", "n11"]),
    ("gpu[003-005,010],cpu1", ["gpu003", "gpu004", "gpu005", "gpu010", "cpu1"]),
    ("rack[1-2]-n[08-09]", ["rack1-n08", "rack1-n09", "rack2-n08", "rack2-n09"]),
    ("a-b,c[9-10]", ["a-b", "c9", "c10"]),
])
def test_slurm_host_lists_expand_as_scontrol_show_hostnames_does(nodelist, hosts):
    assert slurm.hostnames(nodelist) == hosts


def listening_addresses() -> list[str]:
    """In a worker: the addresses that this job's processes listen on, once gloo is up."""
    import psutil
    import torch.distributed as dist

    def listening(process: psutil.Process) -> set[str]:
        return {c.laddr.ip for c in process.net_connections("inet")
                if c.status == psutil.CONN_LISTEN}

    dist.init_process_group("gloo")
    mine = listening(psutil.Process())
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    dist.destroy_process_group()
    agent = psutil.Process(os.getppid())  # the elastic agent: it hosts the stores
    return sorted(listening(agent).union(*everyone))


@pytest.mark.distributed
def test_the_launcher_listens_on_loopback_only(monkeypatch):
    from conftest import typed

    monkeypatch.delenv("MASTER_PORT", raising=False)
    cfg = typed("parallel=ddp", "parallel.world_size=2")
    addresses = launch.elastic(listening_addresses, (), 2, 0, launch.worker_env(cfg, TWO))
    assert addresses == ["127.0.0.1"]


def test_a_master_port_taken_or_no_port_is_refused_before_launch(monkeypatch):
    """The built-in launcher's agent listens at a MASTER_PORT the user set: one taken here,
    or no port number, is one line before any worker starts (launched, a traceback once the
    workers were announced). A one-process run, which launches nothing, is not held to it."""
    ddp = ("parallel=ddp", "parallel.world_size=2", "device=cpu")
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        monkeypatch.setenv("MASTER_PORT", str(port))
        with pytest.raises(ConfigError, match=f"^MASTER_PORT={port} is in use on this machine"):
            checked(*ddp)
        checked("device=cpu")
    checked(*ddp)  # free again
    monkeypatch.setenv("MASTER_PORT", "abc")
    with pytest.raises(ConfigError, match="^MASTER_PORT=abc is not a port number"):
        checked(*ddp)


def test_the_launch_config_sets_only_the_fields_this_torch_has():
    """torch 2.11's LaunchConfig has no shutdown_timeout nor signals_to_handle: a launch
    there gives them to the agent where the class takes them, and leaves them out else."""
    import dataclasses

    from torch.distributed.launcher.api import LaunchConfig

    newer = ("shutdown_timeout", "signals_to_handle")
    older = dataclasses.make_dataclass("LaunchConfig", [
        (f.name, f.type, dataclasses.field(default=None))
        for f in dataclasses.fields(LaunchConfig) if f.name not in newer])
    config = launch.launch_config(older, 2, 0)
    assert config.nproc_per_node == 2 and not any(hasattr(config, name) for name in newer)
    current = launch.launch_config(LaunchConfig, 2, 0)
    if "shutdown_timeout" in LaunchConfig.__dataclass_fields__:
        assert current.shutdown_timeout == 30


def test_the_resume_command_is_the_one_the_user_ran():
    """After a stop, the command printed to continue: the entry the user ran, its config
    dir, the overrides less the run dir and resume, then those two."""
    from parallab.config.hydra_app import entry_command
    from parallab.training.run import RunSpec

    argv = ["/venv/bin/parallab", "--config-dir", "conf", "experiment=waves", "x=1"]
    assert entry_command(argv) == ["parallab", "train", "--config-dir", "conf"]
    assert entry_command(["train.py", "-cd=conf", "a=1"]) == ["python", "train.py", "-cd=conf"]
    spec = RunSpec(None, None, "outputs/my run", ["experiment=waves", "trainer.resume=null",
                                                  "hydra.run.dir=elsewhere"],
                   command=entry_command(argv))
    assert spec.resume_command() == ("parallab train --config-dir conf experiment=waves "
                                     "'hydra.run.dir=outputs/my run' trainer.resume=auto")
    # a sweep job's dir holds what Hydra's grammar parses: quoted, it reads back as it is
    import shlex

    from hydra.core.override_parser.overrides_parser import OverridesParser

    job = "sweep/0_data.shape=[1,8,8],optim.lr=0.01"
    line = RunSpec(None, None, job, ["optim.lr=0.01", "trainer.init_from=w.pt"]).resume_command()
    args = shlex.split(line)[2:]
    assert args[0] == "optim.lr=0.01" and len(args) == 3  # the weights are in its checkpoint
    assert OverridesParser.create().parse_override(args[1]).value() == job


def test_a_module_of_the_run_dir_hiding_one_the_workers_import_is_refused(tmp_path,
                                                                         monkeypatch):
    """The parallab command puts the dir it runs in first on the workers' import path: a
    queue.py there (torch imports queue) or a parallab.py ended every worker importing, in
    a forkserver's EOFError. A standard module nothing here imports (test) is the user's."""
    hidden_module_problem = launch.hidden_module_problem
    monkeypatch.chdir(tmp_path)
    (tmp_path / "queue.py").write_text("raise SystemExit('mine')\n")
    assert hidden_module_problem() is None  # the dir not on the path: nothing hidden
    monkeypatch.syspath_prepend(str(tmp_path))
    assert hidden_module_problem().startswith("queue.py, in the dir parallab runs in, hides "
                                              "Python module queue from the workers")
    (tmp_path / "queue.py").rename(tmp_path / "test.py")
    assert hidden_module_problem() is None
    for name in ("time", "os"):  # built in, or frozen: found before any dir, so hidden never
        (tmp_path / f"{name}.py").write_text("")
    assert hidden_module_problem() is None
    (tmp_path / "parallab.py").write_text("")
    assert hidden_module_problem().startswith("parallab.py, in the dir parallab runs in, "
                                              "hides parallab from")


@pytest.mark.parametrize("launcher,world,local,entry,expected", [
    ("torchrun", 4, 4, ["python", "train.py"], "torchrun --standalone --nproc-per-node=4 "
     "train.py"),
    ("torchrun", 4, 2, ["parallab", "train", "--config-dir", "conf"], "torchrun --nnodes=2 "
     "--nproc-per-node=2 --no-python parallab train --config-dir conf"),
    ("mpirun", 2, 2, ["python", "train.py"], "mpirun -np 2 python train.py"),
    # srun's task is slurmstepd's child, srun's own command line nowhere to read
    ("slurm", 4, 2, ["parallab", "train"], "srun --ntasks=4 --nodes=2 parallab train"),
], ids=["torchrun", "torchrun nodes", "mpirun", "slurm"])
def test_a_resume_command_the_launcher_cannot_be_read_for_keeps_it_from_its_counts(
        monkeypatch, launcher, world, local, entry, expected):
    """Where this process's parent is not the launcher (a wrapper script, a remote node's
    daemon) or /proc is hidden, the launcher and its counts still lead the resume command,
    which would else resume the run on one process."""
    from parallab.launching import relaunch

    for name, _ in relaunch.SRUN_OPTIONS:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.delenv("SUBMITIT_EXECUTOR", raising=False)
    monkeypatch.setattr(relaunch, "_parent_argv", lambda: ["/bin/sh", "job.sh"])
    ctx = in_place.InPlace(launcher, 0, 0, world, local)
    assert " ".join(relaunch.launched(entry, ctx)) == expected


def test_an_srun_steps_resume_command_keeps_the_options_srun_gave_its_tasks(monkeypatch):
    """srun's options as the variables it gives each task carry them (SLURM_NTASKS_PER_NODE
    only where given), its counts from the step; a task of the submitit launcher's job keeps
    the bare command (submitit restarts its own)."""
    from parallab.launching import relaunch

    ctx = in_place.InPlace("slurm", 0, 0, 8, 4, 2)
    env = {"SLURM_NTASKS_PER_NODE": "4", "SLURM_CPUS_PER_TASK": "6", "SLURM_GPUS_PER_NODE":
           "4", "SLURM_GPUS_PER_TASK": "", "SLURM_JOB_ID": "7"}
    assert " ".join(relaunch.srun_command(["python", "train.py", "-cd", "conf"], ctx, env)) == (
        "srun --ntasks=8 --nodes=2 --ntasks-per-node=4 --cpus-per-task=6 --gpus-per-node=4 "
        "python train.py -cd conf")
    # a step srun placed unevenly (3 tasks over 2 nodes): no per-node count it was not given
    uneven = in_place.InPlace("slurm", 0, 0, 3, 2, 2)
    assert relaunch.srun_command(["parallab", "train"], uneven, {}) == [
        "srun", "--ntasks=3", "--nodes=2", "parallab", "train"]
    monkeypatch.setenv("SUBMITIT_EXECUTOR", "slurm")
    assert relaunch.launched(["python", "train.py"], ctx) == ["python", "train.py"]


def test_a_stopped_sweeps_command_in_place_keeps_its_launcher(monkeypatch, tmp_path):
    """The command that continues a sweep a signal stopped under mpirun (or torchrun) ran
    it on one process."""
    from parallab import sweep_job
    from parallab.invocation import Invocation
    from parallab.launching import relaunch

    monkeypatch.setattr(relaunch, "_parent_argv", lambda: [])  # /proc hidden
    monkeypatch.setattr(in_place, "current", lambda: in_place.InPlace("mpirun", 0, 0, 2, 2))
    call = Invocation(["train.py", "-m", "optim.lr=0.1,0.2", "hydra.sweep.dir=old"])
    assert sweep_job.continue_command(tmp_path, call) == (
        f"mpirun -np 2 python train.py -m optim.lr=0.1,0.2 hydra.sweep.dir={tmp_path} "
        "sweep.skip_completed=true")


@pytest.mark.parametrize("parent,expected", [
    (["/usr/bin/python3", "/venv/bin/torchrun", "--standalone", "--nproc-per-node=2",
      "train.py", "a=1"], "/venv/bin/torchrun --standalone --nproc-per-node=2 train.py a=1"),
    (["mpirun", "-np", "2", "/usr/bin/python3", "train.py", "a=1"],
     "mpirun -np 2 /usr/bin/python3 train.py a=1"),
    # a wrapper script between launcher and rank is not the launcher: its command dropped
    # mpirun, and the resume ran on one process
    (["/bin/bash", "./wrap.sh", "train.py", "a=1"], None),
], ids=["torchrun", "mpirun", "wrapper"])
def test_the_launchers_own_command_is_taken_only_from_a_launcher(parent, expected):
    from parallab.launching import relaunch

    found = relaunch._from_parent(["python", "train.py", "a=1"], parent, ["train.py", "a=1"])
    assert (found and " ".join(found)) == expected
