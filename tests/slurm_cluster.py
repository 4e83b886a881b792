"""A real SLURM on this machine for the tests: munged, slurmctld and two slurmd (nodes plnode1
and plnode2 of 2 CPUs each, on their own ports), from Debian's slurm-wlm and munge.

The node names resolve to loopback inside the nodes only: each slurmd runs in a mount
namespace of its own where /etc/hosts is bound to a copy that names them (`unshare -m`), and
the jobs' tasks inherit it. Nothing outside the cluster's dir is changed. `stop()` cancels
every job, ends the daemons, and kills whatever is left that the cluster started (every
process carrying its marker in its environment).
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import secrets
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

NODES = ("plnode1", "plnode2")
CPUS = 2
DAEMONS = ("munged", "slurmctld", "slurmd", "unshare", "scontrol")
MARKER = "PARALLAB_TEST_SLURM"


def missing() -> str | None:
    """Why this machine cannot run the cluster, or None."""
    lacking = [d for d in DAEMONS if shutil.which(d) is None and not Path(f"/usr/sbin/{d}").exists()]
    if lacking:
        return f"{', '.join(lacking)} not installed (apt-get install slurm-wlm munge)"
    if os.geteuid() != 0:
        return "the test cluster runs its daemons as root"
    if subprocess.run(["unshare", "-m", "true"], capture_output=True).returncode != 0:
        return "unshare -m is not permitted here (the nodes' names resolve in a namespace)"
    return None


def _free_ports(count: int) -> list[int]:
    sockets = [socket.socket() for _ in range(count)]
    try:
        for sock in sockets:
            sock.bind(("127.0.0.1", 0))
        return [sock.getsockname()[1] for sock in sockets]
    finally:
        for sock in sockets:
            sock.close()


def _daemon(name: str) -> str:
    return shutil.which(name) or f"/usr/sbin/{name}"


class Cluster:
    def __init__(self, root: Path):
        self.root = root
        self.conf = root / "slurm.conf"
        self.env = {**os.environ, "SLURM_CONF": str(self.conf), MARKER: str(root)}
        self.daemons: list[subprocess.Popen] = []

    def start(self, timeout_s: float = 30) -> None:
        self.root.chmod(0o755)
        key = self.root / "munge.key"
        key.write_bytes(secrets.token_bytes(1024))
        key.chmod(0o600)
        socket_path = self.root / "munge.socket"
        self._spawn([_daemon("munged"), "--foreground", "--force", f"--socket={socket_path}",
                     f"--key-file={key}", f"--pid-file={self.root / 'munged.pid'}",
                     f"--log-file={self.root / 'munged.log'}",
                     f"--seed-file={self.root / 'munged.seed'}"])
        self._wait(lambda: socket_path.exists(), timeout_s, "munged")
        self._write_conf(socket_path)
        self._spawn([_daemon("slurmctld"), "-D", "-i", "-f", str(self.conf)])
        hosts = self.root / "hosts"
        hosts.write_text(Path("/etc/hosts").read_text() + f"\n127.0.0.1 {' '.join(NODES)}\n")
        for node in NODES:
            (self.root / "spool" / node).mkdir(parents=True, exist_ok=True)
            self._spawn(["unshare", "-m", "sh", "-c", f"mount --bind {hosts} /etc/hosts && "
                         f"exec {_daemon('slurmd')} -D -f {self.conf} -N {node}"])
        self._wait(self._idle, timeout_s, "two idle nodes")

    def _write_conf(self, munge_socket: Path) -> None:
        ctld, *node_ports = _free_ports(1 + len(NODES))
        host = socket.gethostname()
        root = self.root
        lines = [
            "ClusterName=parallabtest", f"SlurmctldHost={host}(127.0.0.1)",
            f"SlurmctldPort={ctld}", "SlurmUser=root", "SlurmdUser=root",
            "AuthType=auth/munge", "CredType=cred/munge", f"AuthInfo=socket={munge_socket}",
            f"StateSaveLocation={root}", f"SlurmdSpoolDir={root}/spool/%n",
            f"SlurmctldPidFile={root}/slurmctld.pid", f"SlurmdPidFile={root}/slurmd-%n.pid",
            f"SlurmctldLogFile={root}/slurmctld.log", f"SlurmdLogFile={root}/slurmd-%n.log",
            "ProctrackType=proctrack/pgid", "TaskPlugin=task/none",
            "SelectType=select/cons_tres", "SelectTypeParameters=CR_CPU",
            "SlurmdParameters=config_overrides", "MpiDefault=none", "JobCompType=jobcomp/none",
            "AccountingStorageType=accounting_storage/none",
            "JobAcctGatherType=jobacct_gather/none", "SwitchType=switch/none",
            "ReturnToService=2", "MailProg=/bin/true", "InactiveLimit=0", "MinJobAge=300",
            "KillWait=10",
            # the main scheduling loop every 2 s (SLURM's default is 60): a requeued job
            # released to start now starts within the loop, not a minute later
            "SchedulerParameters=sched_interval=2",
            *[f"NodeName={node} NodeHostname={host} NodeAddr=127.0.0.1 Port={port} "
              f"CPUs={CPUS} RealMemory=4000 State=UNKNOWN"
              for node, port in zip(NODES, node_ports)],
            f"PartitionName=debug Nodes={','.join(NODES)} Default=YES MaxTime=INFINITE State=UP",
        ]
        self.conf.write_text("\n".join(lines) + "\n")

    def _spawn(self, command: list[str]) -> None:
        log = open(self.root / f"{Path(command[0]).name}-{len(self.daemons)}.out", "wb")
        self.daemons.append(subprocess.Popen(command, env=self.env, stdout=log,
                                             stderr=subprocess.STDOUT, start_new_session=True,
                                             preexec_fn=_ended_with_the_tests))

    def _wait(self, ready, timeout_s: float, what: str) -> None:
        deadline = time.monotonic() + timeout_s
        while not ready():
            if time.monotonic() > deadline or any(d.poll() is not None for d in self.daemons):
                raise RuntimeError(f"the test SLURM cluster did not start ({what}); see "
                                   f"{self.root}/*.log and *.out")
            time.sleep(0.2)

    def _idle(self) -> bool:
        done = self.run("sinfo", "-h", "-o", "%T %D", check=False)
        return done.returncode == 0 and done.stdout.split() == ["idle", str(len(NODES))]

    def run(self, *command: str, check: bool = True, timeout: float = 60,
            **kwargs) -> subprocess.CompletedProcess:
        """A SLURM command (sbatch, srun, scontrol, ...) against this cluster."""
        env = {**self.env, **kwargs.pop("env", {})}
        return subprocess.run(list(command), env=env, capture_output=True, text=True,
                              check=check, timeout=timeout, **kwargs)

    def job(self, job_id: str) -> dict[str, str]:
        """`scontrol show job` as key=value pairs (JobState, Restarts, ...)."""
        text = self.run("scontrol", "-o", "show", "job", job_id).stdout
        return dict(item.split("=", 1) for item in text.split() if "=" in item)

    def wait_for(self, ready, timeout_s: float, what: str, state=None):
        """`ready()`'s first true value within `timeout_s`; else a failure naming `what`
        and, where given, `state()` (what the cluster says of the job then)."""
        deadline = time.monotonic() + timeout_s
        while True:
            found = ready()
            if found:
                return found
            if time.monotonic() > deadline:
                raise AssertionError(f"timed out waiting for {what}" +
                                     (f": {state()}" if state else ""))
            time.sleep(0.1)

    def release_requeued(self, job_id: str, restarts: int) -> None:
        """SLURM holds a requeued job for two minutes before it may start again (its begin
        time): once it is pending after its `restarts`-th requeue, let it start now, as an
        administrator can, so that a test need not wait."""
        self.wait_for(lambda: self.job(job_id).get("JobState") == "PENDING" and
                      int(self.job(job_id).get("Restarts", 0)) >= restarts,
                      30, f"job {job_id} to be requeued")
        # slurmd refuses a job whose credential is no newer, to the second, than the
        # revocation of its previous run's ("Killing non-startable batch job: Job credential
        # revoked", the job FAILED): started again within the second of its requeue, it
        # fails, which is what SLURM's two minutes guard against
        time.sleep(2)
        # said again while it stays pending (a job pending on a busy node is not harmed)
        deadline = time.monotonic() + 60
        while (job := self.job(job_id)).get("JobState") == "PENDING":
            if time.monotonic() > deadline:
                raise AssertionError(f"job {job_id} stayed pending after its requeue "
                                     f"(Reason={job.get('Reason')})")
            self.run("scontrol", "update", f"JobId={job_id}", "StartTime=now")
            time.sleep(3)

    def stop(self) -> None:
        self.run("scancel", "--user", "root", check=False)
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline and self.run("squeue", "-h", check=False).stdout.strip():
            time.sleep(0.2)
        for daemon in reversed(self.daemons):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(daemon.pid, signal.SIGTERM)
        for daemon in self.daemons:
            try:
                daemon.wait(timeout=10)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(daemon.pid, signal.SIGKILL)
        for pid in _marked(str(self.root)):  # slurmstepd and the tasks, if any are left
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)


def _marked(value: str) -> list[int]:
    """Processes whose environment carries the cluster's marker."""
    needle = f"{MARKER}={value}".encode() + b"\0"
    found = []
    for environ in Path("/proc").glob("[0-9]*/environ"):
        try:
            if needle in environ.read_bytes() + b"\0":
                found.append(int(environ.parent.name))
        except OSError:
            continue
    return [pid for pid in found if pid != os.getpid()]


def _ended_with_the_tests() -> None:
    """In a daemon before it execs: SIGTERM when the test process that started it ends, so
    a killed test run (its fixtures' stop() never run) leaves no cluster behind (Linux's
    PR_SET_PDEATHSIG, kept across exec)."""
    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # 1: PR_SET_PDEATHSIG
