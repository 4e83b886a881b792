"""Starting the workers: PyTorch's elastic launcher (its signals passed on to them), and the
resolvers that name a run's dir and log files, shared by the ranks an external launcher
started in place (launching/in_place.py: which launcher, the ranks' meeting).
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import tempfile
import threading
import uuid
from datetime import datetime
from pathlib import Path
from typing import Any, Callable, Iterator

from omegaconf import OmegaConf

from parallab.config import naming
from parallab.config.errors import environment_set
from parallab.launching import slurm
from parallab.launching.forking import (AGENT_SIGNALS, kept_running, ready,
                                        server_env)
from parallab.launching.in_place import RUN_TIME_ENV, current

log = logging.getLogger(__name__)


def _run_time(pattern: str) -> str:
    stamp = os.environ.get(RUN_TIME_ENV)
    moment = datetime.fromisoformat(stamp) if stamp else datetime.now()
    return moment.strftime(pattern)


def _rank() -> int:
    """This process's rank, from whichever launcher started it: Hydra configures the log
    files before the app exports RANK (submitit calls the app in a fresh process)."""
    ctx = current()
    return ctx.rank if ctx is not None else 0


def _rank_suffix() -> str:
    return naming.rank_suffix(_rank())


def _rank_zero(value: Any, otherwise: Any = None) -> Any:
    return value if _rank() == 0 else otherwise


def _run_name() -> str:
    """The default run dir's name: by the SLURM job (stable across a requeue) inside one,
    else by the date and time the run started."""
    return slurm.run_name() if slurm.in_job() else _run_time("%Y-%m-%d/%H-%M-%S")


def register_resolvers() -> None:
    """Resolvers conf/config.yaml uses so that every rank shares one run dir and log names
    (cached: the submitit launcher's jobs reuse the sweep dir their submitter resolved)."""
    OmegaConf.register_new_resolver("run_time", _run_time, use_cache=True, replace=True)
    OmegaConf.register_new_resolver("run_name", _run_name, use_cache=True, replace=True)
    OmegaConf.register_new_resolver("job_dir", naming.job_dir, replace=True)
    OmegaConf.register_new_resolver("rank_suffix", _rank_suffix, replace=True)
    OmegaConf.register_new_resolver("rank_zero", _rank_zero, replace=True)


def worker_env(cfg, layout) -> dict[str, str]:
    """The environment of the workers a job of `cfg` starts with the resolved `layout`
    (parallel.layout.Layout): their threads, gloo on loopback (the built-in launcher starts
    one node), and what their fork server imports."""
    from parallab.launching.distributed import threads_for

    threads = threads_for(layout.per_node, cfg.parallel.threads_per_worker)
    return {"OMP_NUM_THREADS": str(threads), **server_env(cfg)}


def hidden_module_problem() -> str | None:
    """A module in the dir parallab runs in named as parallab or as one of Python's own that
    this process has imported (queue, tokenize: torch's): that dir leads the workers' import
    path (the parallab command puts it first, as `python -m` does), where it hides the real
    one, and every worker failed importing, in a traceback far from the cause."""
    import sys

    here = Path.cwd().resolve()
    if not any(Path(p or ".").resolve() == here for p in sys.path):
        return None
    names = ["parallab", *sorted(set(sys.stdlib_module_names) & set(sys.modules))]
    for name in names:
        spec = getattr(sys.modules.get(name), "__spec__", None)
        if getattr(spec, "origin", None) in ("built-in", "frozen"):  # found before any path
            continue
        loaded = getattr(sys.modules.get(name), "__file__", None)
        for found in (here / f"{name}.py", here / name / "__init__.py"):
            if found.is_file() and (loaded is None or Path(loaded).resolve() != found):
                return (f"{found.relative_to(here)}, in the dir parallab runs in, hides "
                        f"{'parallab' if name == 'parallab' else f'Python module {name}'} "
                        "from the workers, whose imports look here first: rename it, or run "
                        "from another dir")
    return None


def master_port_problem() -> str | None:
    """MASTER_PORT, where the user set it for parallab's own launcher (its agent's store
    listens there): not a port number, or one in use on this machine, which ended the
    launch in a traceback once its workers had been announced."""
    import socket

    from parallab.launching import rendezvous

    value = os.environ.get("MASTER_PORT")
    if not value:
        return None
    unset = "unset it (each job then gets a free port)"
    if not value.isdigit() or not 0 < int(value) < 65536:
        return f"MASTER_PORT={value} is not a port number: {unset} or set one of 1-65535"
    with socket.socket() as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the store binds
        try:
            probe.bind((rendezvous.HOST, int(value)))
        except OSError:
            return f"MASTER_PORT={value} is in use on this machine: {unset} or set a free one"
    return None


def launch_config(config_class, world_size: int, max_restarts: int, logs: str | None = None):
    """torch's LaunchConfig for world_size workers on this machine, its agent's per-attempt
    dirs (the workers' error files) under `logs` (None: torch's default, a new
    /tmp/torchelastic_* dir a launch, which nothing removes). Fields newer torch releases
    added (the shutdown's grace, the signals the agent handles) are set where
    `config_class` has them: torch 2.11's takes neither."""
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs

    from parallab.launching import rendezvous

    port = os.environ.get("MASTER_PORT") or 0  # 0: a free port per job
    newer = {
        "shutdown_timeout": 30,  # a stopping worker's time to save before SIGKILL
        # not SIGINT/SIGTERM/SIGHUP: torch's agent would turn them into an exception that
        # stops the workers before they save (tracebacks, nothing saved);
        # _forwarding_stop_signals passes them on instead
        "signals_to_handle": AGENT_SIGNALS,
    }
    fields = config_class.__dataclass_fields__
    return config_class(
        min_nodes=1,
        max_nodes=1,
        nproc_per_node=world_size,
        run_id=f"parallab-{uuid.uuid4().hex[:12]}",
        rdzv_backend=rendezvous.register(),
        rdzv_endpoint=f"{rendezvous.HOST}:{port}",
        local_addr=rendezvous.HOST,
        max_restarts=max_restarts,
        monitor_interval=0.1,
        start_method="forkserver" if ready() else "spawn",
        logs_specs=DefaultLogsSpecs(log_dir=logs),
        **{key: value for key, value in newer.items() if key in fields},
    )


def elastic(entrypoint: Callable, args: tuple, world_size: int, max_restarts: int,
            worker_env: dict[str, str], requeue: tuple[int, ...] = (),
            stop_file: Path | None = None) -> Any:
    """Run `entrypoint(*args)` in world_size workers on this machine; rank 0's result.
    `requeue`: the signals that stop them to requeue a SLURM job; `stop_file`: where a stop
    signal is noted for the workers (worker.stop_file).

    The rendezvous listens on loopback only (more nodes go through torchrun/SLURM/mpirun).
    """
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    # the controlling process reports a failure once, with the root cause's traceback
    logging.getLogger("torch.distributed.elastic").setLevel(logging.CRITICAL)
    # the agent hands its own environment to the workers; its dirs go with the launch (a
    # failure's error file is read into the exception it raises)
    with tempfile.TemporaryDirectory(prefix="parallab-launch-") as logs, \
            environment_set(worker_env), _forwarding_stop_signals(requeue, stop_file), \
            kept_running():
        config = launch_config(LaunchConfig, world_size, max_restarts, logs)
        results = elastic_launch(config, entrypoint)(*args)
    return results[0]


def _workers() -> list[int]:
    """This process's children and their children (Linux /proc; none found elsewhere): the
    workers, forked by the fork server or spawned by the agent."""
    parents: dict[int, int] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()  # after "(comm)": state ppid
        except (OSError, IndexError):
            continue
        parents[int(stat.parent.name)] = int(fields[1])
    children = {pid for pid, parent in parents.items() if parent == os.getpid()}
    return sorted(children | {pid for pid, parent in parents.items() if parent in children})


_stopped_by: list[int] = []  # the stop signals this process passed on to its workers


def stopped_by() -> int | None:
    """The signal that asked this process's launched job to stop, if one did."""
    return _stopped_by[0] if _stopped_by else None


@contextlib.contextmanager
def _forwarding_stop_signals(requeue: tuple[int, ...] = (),
                             stop_file: Path | None = None) -> Iterator[None]:
    """While the workers run, a SIGINT, SIGTERM or SIGHUP (a closed terminal) to this process
    is passed on to them: they
    save at the next step the ranks agree on and end normally, and the job ends with them.
    Ctrl-C signals the whole group, so the workers see it twice, at once, and count it once
    (preemption.SAME_REQUEST_S); a scheduler that signals this process alone reaches them
    too. A later signal reaches them again and stops them at once. It is noted in
    `stop_file` first, for a worker not yet listening (preemption.hold). `requeue`: SLURM's
    time-limit warning, passed on alike and noted, so that this process requeues the job
    once the workers have saved."""
    _stopped_by.clear()  # this launch's own
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def forward(signum: int, frame: object) -> None:
        if signum in requeue:
            slurm.note(signum)
        _stopped_by.append(signum)
        if stop_file is not None and not stop_file.exists():
            stop_file.write_text(str(signum))
        for pid in _workers():  # the fork server and the resource tracker ignore both
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signum)

    # torch's agent installs its own SIGQUIT handler and leaves it: put ours back
    previous = {signal.SIGQUIT: signal.getsignal(signal.SIGQUIT)}
    previous.update({signum: signal.signal(signum, forward) for signum in (
        signal.SIGINT, signal.SIGTERM, signal.SIGHUP, *requeue)})
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
