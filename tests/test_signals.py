"""A run stopped as it starts or hangs: Ctrl-C while a job starts, while the command
imports and in a sweep (one line, exit status 130, no process left), and a hang after a
signal ended by the watchdog where an evaluation is not."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import textwrap
import time

import pytest
from conftest import inject, output, run_entry
from test_resume import DDP, RUN

pytestmark = pytest.mark.slow


WAIT_AFTER_SIGTERM = """
import os, signal, sys, time
from parallab.launching.preemption import MIN_STUCK_S, Preemption

with Preemption() as preemption:
    preemption.step_done(1, [], False)
    with preemption.busy():  # an evaluation longer than the patience is not a hang
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(MIN_STUCK_S + 1)
    print("survived the evaluation", flush=True)
    time.sleep(60)  # a hang: no step ends
print("not stopped")
"""


def test_after_a_signal_a_hang_ends_the_process_but_an_evaluation_does_not():
    start = time.monotonic()
    result = subprocess.run([sys.executable, "-c", WAIT_AFTER_SIGTERM], capture_output=True,
                            text=True, timeout=60)
    assert result.stdout == "survived the evaluation\n", result.stderr
    assert result.returncode == 128 + signal.SIGTERM
    assert time.monotonic() - start < 45  # the watchdog, not the end of the 60 s hang


# sitecustomize for a command's processes: Ctrl-C (SIGINT to the whole process group, as a
# terminal sends it) at one moment of its start
AT_START = """
import os, signal
import {module} as where

called = where.{function}


def interrupted(*args, **kwargs):
    if {condition}:
        os.killpg(os.getpgid(0), signal.SIGINT)
    return called(*args, **kwargs)

where.{function} = interrupted
"""


def left_running(marker: str) -> list[int]:
    """The processes whose environment holds `marker` (this test's own)."""
    found = []
    for proc in os.listdir("/proc"):
        try:
            if proc.isdigit() and marker.encode() in open(f"/proc/{proc}/environ", "rb").read():
                found.append(int(proc))
        except OSError:
            continue
    return found


@pytest.mark.distributed
@pytest.mark.parametrize("module,function,condition,recorded", [
    # the fork server importing torch for the workers, the controller importing its checks
    ("parallab.launching.forking", "start_fork_server", "True", False),
    ("parallab.checks.validate", "check_data", "True", False),  # the controller's checks
    # a rank building its model, the other perhaps already waiting in its first collective
    ("parallab.training.build", "build_trainer", "os.environ.get('RANK') == '1'", True),
], ids=["imports", "checks", "a rank building"])
def test_ctrl_c_while_a_job_starts_ends_it_in_one_line_with_exit_status_130(
        tmp_path, module, function, condition, recorded):
    """Where a traceback of whatever it interrupted (an import, the fork server's EOFError)
    ended the command with exit status 1 or 130: one line, no process left, 130; the run's
    record says it was stopped once its dir is claimed (else the dir holds no record)."""
    folder = tmp_path / "inject"
    folder.mkdir()
    (folder / "sitecustomize.py").write_text(textwrap.dedent(AT_START).format(
        module=module, function=function, condition=condition))
    marker = f"PARALLAB_TEST_RUN={tmp_path}"
    run_dir = tmp_path / "run"
    stopped = run_entry("train.py", [*RUN, *DDP], run_dir, prefix=["setsid", sys.executable],
                        env={"PYTHONPATH": str(folder), "PARALLAB_TEST_RUN": str(tmp_path)})
    said = output(stopped)
    assert stopped.returncode == 130, said[-3000:]
    for noise in ("Traceback", "KeyboardInterrupt", "EOFError"):
        assert noise not in said, said[-3000:]
    assert len(re.findall(r"stopped by SIGINT", said)) == 1, said[-3000:]
    deadline = time.monotonic() + 10
    while left_running(marker) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not left_running(marker)
    assert not list(run_dir.glob("checkpoints/*")) and not (run_dir / "metrics.json").exists()
    record = run_dir / "status.json"
    assert (json.loads(record.read_text()) if recorded else record.exists()) == (
        {"status": "stopped", "signal": "SIGINT", "step": 0} if recorded else False)


@pytest.mark.distributed
def test_ctrl_c_in_a_sweep_stops_it_at_that_job_with_exit_status_130(tmp_path):
    sweep_dir = tmp_path / "sweep"
    stopped = run_entry("train.py", ["-m", *RUN, *DDP, "optim.lr=0.01,0.02",
                                     f"hydra.sweep.dir={sweep_dir}"],
                        prefix=["setsid", sys.executable], env=inject(
                            tmp_path, 12, "os.killpg(os.getpgid(0), signal.SIGINT)",
                            "os.environ['RANK'] == '0' and 'lr=0.01' in str(self.logger.run_dir)"))
    assert stopped.returncode == 130, output(stopped)[-3000:]
    assert "Traceback" not in output(stopped)
    first, second = sorted(p for p in sweep_dir.iterdir() if (p / ".hydra").is_dir())
    assert json.loads((first / "status.json").read_text())["signal"] == "SIGINT"
    assert not (first / "metrics.json").exists() and not (second / "metrics.json").exists()
    assert not list(second.glob("events.out.tfevents.*"))  # never started
    rows = (sweep_dir / "summary.md").read_text()
    assert rows.count("| stopped |") == 2 and "sweep.skip_completed=true" in output(stopped)


# sitecustomize for the `parallab` command: Ctrl-C while it imports the CLI
AT_IMPORT = """
import os, signal, sys


class Interrupting:
    def find_spec(self, name, path=None, target=None):
        if name == "parallab.cli":
            os.kill(os.getpid(), signal.SIGINT)
        return None

sys.meta_path.insert(0, Interrupting())
"""


def test_ctrl_c_while_the_command_imports_is_one_line(tmp_path):
    """`parallab train` interrupted while it imports its modules: one line, 130, not the
    traceback of the import it cut short."""
    folder = tmp_path / "inject"
    folder.mkdir()
    (folder / "sitecustomize.py").write_text(textwrap.dedent(AT_IMPORT))
    stopped = run_entry("parallab", ["train", *RUN], tmp_path / "run",
                        prefix=None, env={"PYTHONPATH": str(folder)})
    said = output(stopped)
    assert stopped.returncode == 130, said[-3000:]
    assert "Traceback" not in said and "KeyboardInterrupt" not in said, said[-3000:]
    assert len(re.findall(r"stopped by SIGINT", said)) == 1, said[-3000:]
