"""The workers' start: a rank's processes started as a fresh one would be, the fork server
launches share while the environment stays (its imports, a socket path too long for it),
and every rank, the server and its children ending with a controller killed alone."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from conftest import FAST, REPO, assert_ok, read_metrics, run_entry
from test_launch import TWO

from parallab.launching import forking, launch


def seen_by_a_rank(name: str) -> str | None:
    return os.environ.get(name)


def start_method(spec, store) -> tuple[str, float]:
    import multiprocessing

    import numpy as np

    return multiprocessing.get_start_method(), float(np.random.rand())


def a_rank(controller: int, run_dir: str) -> str:
    """A rank's life as launch.elastic starts one (worker.main), training `start_method`."""
    from types import SimpleNamespace

    from parallab.launching import worker

    spec = SimpleNamespace(controller=controller, run_dir=run_dir, failures=None,
                           cfg=SimpleNamespace(backend=SimpleNamespace(timeout_s=30),
                                               trainer=SimpleNamespace(requeue_signal=None)))
    return worker.main(start_method, spec)


@pytest.mark.distributed
def test_a_rank_starts_processes_as_a_freshly_started_one_would(tmp_path, monkeypatch):
    """Forked from the fork server, a rank still starts its own processes (a DataLoader's
    workers) by the platform's default method, not through the server: each DataLoader
    worker would be sent the pickled data set and import the main module (20 MNIST steps
    with data.num_workers=2 took 7.2 s there, 1.2 s forked). And numpy's global random
    numbers are its own, not the server's: two launches from one server drew the same ones."""
    import multiprocessing

    from conftest import typed

    monkeypatch.delenv("MASTER_PORT", raising=False)
    env = launch.worker_env(typed("parallel=ddp", "parallel.world_size=2"), TWO)
    (method, drawn), (_, again) = (launch.elastic(a_rank, (os.getpid(), str(tmp_path)), 2, 0,
                                                  env) for _ in range(2))
    assert method == multiprocessing.get_all_start_methods()[0]  # fork on Linux before 3.14
    assert drawn != again


@pytest.mark.distributed
def test_launches_share_a_fork_server_while_the_environment_stays(tmp_path, monkeypatch):
    """The ranks are forked from a server that imported torch and parallab once: kept from
    one launch to the next (pytest's name of the running test and inductor's in-process
    pointer aside), started anew when a variable changes, which the ranks then see, or when a
    job needs imports it did not make (then kept for a job needing fewer, and the imports
    kept through a restart for a changed variable). And no launch leaves a dir behind:
    torch's agent makes one a launch for its workers' error files, by default a
    torchelastic_* in the temporary dir that nothing removes (hundreds after a day of
    sweeps); the launch's own goes with it."""
    import tempfile
    from multiprocessing import forkserver

    from conftest import typed

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    monkeypatch.delenv("MASTER_PORT", raising=False)
    monkeypatch.delenv("PARALLAB_LAUNCH_MARK", raising=False)
    env = launch.worker_env(typed("parallel=ddp", "parallel.world_size=2"), TWO)

    def launched(imports: str = "") -> tuple[str | None, int]:
        seen = launch.elastic(seen_by_a_rank, ("PARALLAB_LAUNCH_MARK",), 2, 0,
                              {**env, forking.PRELOAD_VAR: imports})
        return seen, forkserver._forkserver._forkserver_pid

    seen, server = launched("json")
    assert seen is None
    monkeypatch.setenv("PYTEST_CURRENT_TEST", "another test (call)")
    assert launched("json") == (None, server)
    monkeypatch.setenv("_TORCHINDUCTOR_PYOBJECT_TENSOR_DATA_PTR", "140001")  # a compile here
    assert launched("json") == (None, server)
    monkeypatch.setenv("PARALLAB_LAUNCH_MARK", "1")
    seen, restarted = launched()
    assert seen == "1" and restarted != server
    assert launched("json") == ("1", restarted)  # its imports outlived the restart
    _, importing = launched("csv")
    assert importing != restarted and launched("json") == ("1", importing)
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(("torchelastic_",
                                                                      "parallab-"))] == []


@pytest.mark.parametrize("device, imports", [
    # installed ones: not the project's own modules (hf_llama), which may change between
    # two launches sharing a server
    ("cpu", ["peft", "transformers.LlamaConfig", "transformers.LlamaForCausalLM"]),
    # a module may initialize CUDA at import (bitsandbytes, under peft): not in the server
    ("auto", []), ("cuda", [])])
def test_the_fork_server_imports_a_cpu_jobs_parts_as_composed_and_as_typed(device, imports):
    from conftest import typed

    from parallab.cli import compose
    from parallab.launching import forking

    overrides = ["experiment=llama_lora", f"device={device}"]
    project = REPO / "examples" / "hf_llama" / "conf"
    assert forking.job_imports(compose(overrides, project)) == imports
    assert forking.job_imports(typed(*overrides, config_dir=project)) == imports


def descendants(pid: int) -> list[int]:
    """The processes under `pid` (Linux /proc): its fork server and the ranks it forked."""
    parents = {}
    for stat in os.listdir("/proc"):
        if stat.isdigit():
            try:
                with open(f"/proc/{stat}/stat") as f:
                    parents[int(stat)] = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError):
                continue
    found, frontier = [], [pid]
    while frontier:
        children = [p for p, parent in parents.items() if parent in frontier]
        found += children
        frontier = children
    return found


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"  # a zombie has ended
    except OSError:
        return False


@pytest.mark.distributed
def test_a_temporary_dir_too_long_for_the_fork_servers_socket_spawns_the_workers(tmp_path):
    """The fork server listens on a Unix socket in the temporary dir, whose path may not
    pass 107 bytes: under a longer TMPDIR the workers are spawned instead."""
    temporary = tmp_path / ("t" * max(1, 100 - len(str(tmp_path))))  # 100 bytes or more
    temporary.mkdir()
    result = run_entry("train.py", [*FAST, "parallel=ddp", "parallel.world_size=2",
                                    "trainer.max_steps=2"], tmp_path / "run",
                       env={"TMPDIR": str(temporary)})
    assert_ok(result)
    assert read_metrics(tmp_path / "run")["world_size"] == 2


@pytest.mark.slow
@pytest.mark.distributed
def test_ranks_end_with_a_controller_killed_alone(tmp_path):
    """SIGKILL to the controller alone (it cannot pass that on): its ranks end with it, and
    write nothing more into the run dir."""
    import signal
    import time

    run_dir = tmp_path / "run"
    under: list[int] = []
    controller = subprocess.Popen(
        [sys.executable, str(REPO / "train.py"), *FAST, "parallel=tp", "model=mlp",
         "data.shape=[1,8,8]", "parallel.world_size=2", "trainer.epochs=1000",
         "trainer.log_every_n_steps=1", f"hydra.run.dir={run_dir}"], cwd=REPO,
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        while "step 5/" not in ((run_dir / "train.log").read_text()
                                if (run_dir / "train.log").exists() else ""):
            assert time.monotonic() < deadline and controller.poll() is None
            time.sleep(0.2)
        under += descendants(controller.pid)
        assert len(under) >= 3  # the fork server and two ranks (and its helpers)
        controller.kill()
        controller.wait()
        deadline = time.monotonic() + 10
        while any(map(alive, under)) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not [p for p in under if alive(p)]
        written = (run_dir / "train.log").stat().st_mtime
        time.sleep(1)
        assert (run_dir / "train.log").stat().st_mtime == written
        assert not (run_dir / "metrics.json").exists()
    finally:  # nothing left behind, whatever happened
        for pid in [controller.pid, *under, *descendants(controller.pid)]:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


CONTROLLER = """
import multiprocessing, time
from parallab.launching import forking
forking.PRELOAD = ["parallab.launching.fork_server"]  # its watch, without torch's imports
forking.start_fork_server()
child = multiprocessing.get_context("forkserver").Process(target=time.sleep, args=(3600,))
child.start()
print(child.pid, flush=True)
time.sleep(3600)
"""


def test_the_fork_server_and_a_child_it_forked_end_with_a_controller_killed_alone():
    """A controller killed from outside (a test suite's `timeout`): its fork server, which
    ignores SIGTERM, and a child forked from it that has not become a rank (and so ignores
    it too) were left alive, reparented to init, for over an hour."""
    import signal
    import time

    controller = subprocess.Popen([sys.executable, "-c", CONTROLLER], cwd=REPO,
                                  stdout=subprocess.PIPE, text=True, start_new_session=True)
    child = server = None
    try:
        child = int(controller.stdout.readline())
        with open(f"/proc/{child}/stat") as f:
            server = int(f.read().rsplit(")", 1)[1].split()[1])
        assert server != controller.pid and alive(server)
        controller.kill()
        controller.wait()
        deadline = time.monotonic() + 15
        while (alive(server) or alive(child)) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not alive(server) and not alive(child)
    finally:  # nothing left behind, whatever happened
        for pid in (controller.pid, server, child):
            if pid is not None:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
