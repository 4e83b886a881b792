"""Inside a SLURM job: its hosts, its stable name, and requeueing it.

SLURM tells each task its place (SLURM_PROCID, SLURM_LOCALID, SLURM_STEP_TASKS_PER_NODE) and
the job's hosts in its bracket syntax (`gpu[01-03,07],cpu5`). A requeued job (preemption,
`scontrol requeue`, a node failure, or parallab's own answer to the time-limit warning) runs
again under the same job id with SLURM_RESTART_COUNT >= 1, so a run dir named by the job id
is found again and the run continues from its last checkpoint.
"""

from __future__ import annotations

import itertools
import logging
import os
import re
import shutil
import signal
import subprocess

from parallab.config.errors import ConfigError

log = logging.getLogger(__name__)

# signals no process can catch: asking SLURM for one as the warning kills the job instead
UNCATCHABLE = {signal.SIGKILL, signal.SIGSTOP}
# a stop without a requeue already: Ctrl-C, a closed terminal, and SIGTERM (scancel,
# preemption, the time limit itself), after which the job ends or SLURM itself requeues it
STOPPING = {signal.SIGINT, signal.SIGTERM, signal.SIGHUP}


def in_job() -> bool:
    """This process runs inside a SLURM job's batch script or one of its srun steps: SLURM
    started it or an ancestor of it (SLURM_TASK_PID). SLURM's variables alone do not say
    so: an interactive allocation's shell (salloc) holds the job's id but is no task of it,
    and a plain shell may hold variables copied from a job; a run there is a plain run."""
    task = os.environ.get("SLURM_TASK_PID", "")
    return bool(os.environ.get("SLURM_JOB_ID")) and task.isdigit() and int(task) in _lineage()


def _lineage() -> list[int]:
    """This process and its ancestors (Linux's /proc; where there is none, SLURM's word is
    taken: SLURM_TASK_PID itself)."""
    if not os.path.exists("/proc/self/stat"):
        return [int(os.environ["SLURM_TASK_PID"])]
    found, pid = [], os.getpid()
    while pid > 1 and pid not in found:
        found.append(pid)
        try:
            with open(f"/proc/{pid}/stat") as stat:  # after "(comm)": state ppid
                pid = int(stat.read().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            break
    return found


def in_step() -> bool:
    """A task that srun started (the batch script itself has no step id: a process it runs
    directly is one process, whatever the job's task count)."""
    return in_job() and bool(os.environ.get("SLURM_STEP_ID") or os.environ.get("SLURM_STEPID"))


def job_name() -> str:
    """The job as `scontrol` names it: `ARRAYID_TASK` for an array task, else the job id."""
    env = os.environ
    if env.get("SLURM_ARRAY_JOB_ID") and env.get("SLURM_ARRAY_TASK_ID"):
        return f"{env['SLURM_ARRAY_JOB_ID']}_{env['SLURM_ARRAY_TASK_ID']}"
    return env["SLURM_JOB_ID"]


def run_name() -> str:
    """The run dir's name under SLURM: stable across a requeue, which runs the same job (and
    its steps, numbered from 0 again) anew; a later srun step of one job gets its own."""
    step = os.environ.get("SLURM_STEP_ID") or os.environ.get("SLURM_STEPID") or "0"
    return f"slurm/{job_name()}" + ("" if step in ("0", "batch") else f".{step}")


def restart_count() -> int:
    """How many times SLURM has requeued this job (0 at its first start; 0 outside one)."""
    return int(os.environ.get("SLURM_RESTART_COUNT") or 0) if in_job() else 0


def hostnames(nodelist: str) -> list[str]:
    """SLURM's host list expanded, as `scontrol show hostnames` does:
    'gpu[01-03,07],cpu5' -> gpu01 gpu02 gpu03 gpu07 cpu5; 'r[1-2]n[1-2]' -> r1n1 r1n2 r2n1 r2n2."""
    hosts: list[str] = []
    for expression in re.findall(r"(?:[^,\[]|\[[^\]]*\])+", nodelist):
        parts = [p for p in re.split(r"(\[[^\]]*\])", expression) if p]
        choices = [_ranges(p[1:-1]) if p.startswith("[") else [p] for p in parts]
        hosts += ["".join(names) for names in itertools.product(*choices)]
    return hosts


def _ranges(spec: str) -> list[str]:
    """'01-03,07' -> 01 02 03 07 (zero-padded to the width of each range's start)."""
    names: list[str] = []
    for item in spec.split(","):
        low, _, high = item.partition("-")
        if not high:
            names.append(low)
            continue
        names += [str(n).zfill(len(low)) for n in range(int(low), int(high) + 1)]
    return names


def tasks_per_node(spec: str) -> list[int]:
    """SLURM_STEP_TASKS_PER_NODE as a count per node: '2(x3),1' -> [2, 2, 2, 1]."""
    counts: list[int] = []
    for item in filter(None, spec.split(",")):
        match = re.fullmatch(r"(\d+)(?:\(x(\d+)\))?", item.strip())
        if match is None:
            raise ValueError(f"not a SLURM tasks-per-node list: {spec!r}")
        counts += [int(match[1])] * int(match[2] or 1)
    return counts


def master_host() -> tuple[str, str]:
    """The host rank 0 runs on (the first of the step's nodes, else the job's), and the
    variable it came from."""
    for name in ("SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST", "SLURM_NODELIST"):
        if os.environ.get(name):
            return hostnames(os.environ[name])[0], name
    return "127.0.0.1", "MASTER_ADDR"


def parse_signal(name: str | int | None, key: str = "trainer.requeue_signal") -> int | None:
    """`USR1`, `SIGUSR1` or a number as a signal SLURM can send and this process can catch;
    ConfigError naming `key` otherwise."""
    if name is None:
        return None
    text = str(name).strip().upper()
    try:
        signum = signal.Signals(int(text)) if text.isdigit() else signal.Signals[
            text if text.startswith("SIG") else "SIG" + text]
    except (KeyError, ValueError):
        raise ConfigError(f"{key}={name} names no signal: use a name such as USR1 (what "
                          "sbatch --signal=USR1@90 sends), USR2, or null to turn it off") from None
    if signum in UNCATCHABLE:
        raise ConfigError(f"{key}={name}: {signum.name} cannot be caught, so the job could not "
                          "save before it ends: use USR1 (sbatch --signal=USR1@90) or USR2")
    if signum in STOPPING:
        raise ConfigError(f"{key}={name}: {signum.name} already stops the run and saves (scancel "
                          "and preemption send it); the requeue signal must be another: use USR1")
    return int(signum)


def requeue_signals(configured: str | None) -> tuple[int, ...]:
    """The signals that ask this run to save and requeue its job: `trainer.requeue_signal`,
    and the submitit launcher's own (USR2, or SUBMITIT_PREEMPT_SIGNAL) in a job it submitted;
    none outside SLURM, where a signal keeps its default meaning."""
    if not in_job():
        return ()
    found = {parse_signal(configured)}
    if os.environ.get("SUBMITIT_EXECUTOR") == "slurm":
        found.add(parse_signal(os.environ.get("SUBMITIT_PREEMPT_SIGNAL") or "USR2",
                               "SUBMITIT_PREEMPT_SIGNAL"))
    return tuple(sorted(s for s in found if s is not None))


_asked: list[int] = []  # requeue signals this process received during its run


def note(signum: int) -> None:
    """A requeue signal arrived (the run saves and stops; requeue_if_asked ends the job)."""
    _asked.append(signum)


def asked() -> int | None:
    return _asked[0] if _asked else None


def requeue() -> str | None:
    """`scontrol requeue` of this job (an array task by its own name); None once SLURM took
    it, else why not."""
    scontrol = shutil.which("scontrol")
    if scontrol is None:
        return "scontrol is not on PATH"
    try:
        result = subprocess.run([scontrol, "requeue", job_name()], capture_output=True,
                                text=True, timeout=60)
    except subprocess.TimeoutExpired:
        return "scontrol requeue did not answer within 60 s"
    said = (result.stderr or result.stdout).strip().splitlines()
    return None if result.returncode == 0 else (said[-1] if said else f"exit {result.returncode}")
