"""Imported by the fork server alone (forking.PRELOAD), never by a controller or a worker.

It imports what the job's workers would each import to build its parts (forking.job_imports,
handed over in PARALLAB_PRELOAD): transformers' model classes, peft. A name that does not
import is left to the workers, whose own import then says why.

When its controller ends, the fork server leaves at once instead of tearing down the
torch it imported (seconds of CPU). Until then it holds the controller's stdout and stderr,
which it hands to every worker, so a caller reading the job's output to its end (a test, a
pipe, a CI log) waited for that teardown. Its workers never run this: a forked worker
leaves by os._exit in multiprocessing's forkserver, skipping atexit; and nothing of the
server's own is left to flush or close.

However its controller ends (killed with SIGKILL, a `timeout` of a whole test suite), the
server ends with it, and so do the workers it forked that have not ended within a grace:
the server ignores SIGTERM and SIGINT, and a forked child not yet a rank inherits that, so
both were left behind, reparented to init, for good. A thread waits on the controller from
the server's first import (forking.PRELOAD names this module first), so a server still
importing torch leaves at once too."""

import atexit
import contextlib
import os
import pkgutil
import select
import signal
import threading
import time

from parallab.config.targets import import_warnings_quieted
from parallab.launching.forking import PRELOAD_VAR


def _import_the_jobs_parts() -> None:
    with import_warnings_quieted():  # here instead of in each rank
        for name in os.environ.get(PRELOAD_VAR, "").split():
            try:
                pkgutil.resolve_name(name)
            except Exception:  # noqa: BLE001, S112 - the workers' own import reports it
                continue


GRACE_S = 3.0  # for a worker to end by itself once its controller has (worker.end_with)


def _children() -> list[int]:
    """This server's children that have not ended (a zombie has, awaiting its reaping)."""
    me = os.getpid()
    try:
        pids = [int(p) for p in open(f"/proc/{me}/task/{me}/children").read().split()]
    except OSError:
        return []
    return [pid for pid in pids if _running(pid)]


def _running(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rpartition(")")[2].split()[0] != "Z"
    except OSError:
        return False


def _leave_with(controller: int) -> None:
    """Once `controller` has ended: the workers given GRACE_S to end, the rest killed, and
    this server gone (a pidfd; polling where there is none)."""
    if controller != 1:  # else the controller had ended already: reparented to init
        try:
            with contextlib.closing(os.pidfd_open(controller)) as fd:  # Linux 5.3
                select.select([fd], [], [])
        except (AttributeError, OSError):
            while os.getppid() == controller:
                time.sleep(1)
    deadline = time.monotonic() + GRACE_S
    while _children() and time.monotonic() < deadline:
        time.sleep(0.1)
    for pid in _children():
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGKILL)
    os._exit(0)


threading.Thread(target=_leave_with, args=(os.getppid(),), name="parallab-controller-watch",
                 daemon=True).start()
_import_the_jobs_parts()
atexit.register(os._exit, 0)
