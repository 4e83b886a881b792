"""The fork server the built-in launcher's workers are forked from: started early, kept
from one launch to the next while the environment stays the same, importing once what
every worker would import (torch, parallab's worker code, the job's own parts)."""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.util
import os
import signal
import threading
from pathlib import Path
from typing import Any, Iterator

from omegaconf import OmegaConf

from parallab.config.errors import environment_set

AGENT_SIGNALS = "SIGQUIT"  # the signals torch's agent handles itself
PRELOAD_VAR = "PARALLAB_PRELOAD"  # the job's own imports, which fork_server.py makes


def server_env(cfg: Any = None) -> dict[str, str]:
    """What a launch (of `cfg`: with the job's imports) adds to the environment its fork
    server starts with."""
    env = {"TORCHELASTIC_SIGNALS_TO_HANDLE": AGENT_SIGNALS}  # older torch
    if "GLOO_SOCKET_IFNAME" not in os.environ:
        env["GLOO_SOCKET_IFNAME"] = "lo"  # gloo picks its interface from the hostname otherwise
    if cfg is not None:
        env[PRELOAD_VAR] = " ".join(job_imports(cfg))
    return env


def ready() -> bool:
    """Workers forked from a server that imported torch and parallab once, instead of each
    spawned worker importing them (seconds of CPU each): needs the server's stop (CPython 3.8+),
    the main thread, where kept_running() can start it with SIGTERM ignored, and a socket
    path that fits the temporary dir; else spawn."""
    from multiprocessing import forkserver

    return (hasattr(forkserver._forkserver, "_stop")
            and threading.current_thread() is threading.main_thread()
            and _socket_fits())


# the server listens on a socket in a dir of its own in TMPDIR, both named by tempfile
# (multiprocessing's prefixes, then 8 random characters each), and a Unix socket's path
# takes at most 107 bytes: under a longer temporary dir the server cannot start, and the
# launch ended in its traceback
SOCKET_PATH_MAX = 107
SOCKET_IN_TMPDIR = len("/pymp-") + 8 + len("/listener-") + 8


def _socket_fits() -> bool:
    import tempfile

    return len(os.fsencode(tempfile.gettempdir())) + SOCKET_IN_TMPDIR <= SOCKET_PATH_MAX


_server_environment: dict[str, str] | None = None  # what the running fork server started with
_server_imports: set[str] = set()  # and the job imports it made (PRELOAD_VAR)
# imported once by the fork server, not by each worker: parallab's worker code, and what
# DDP, FSDP2, tensor parallelism, DCP and rank 0's TensorBoard writer import lazily
# (torch._dynamo and the writer the costliest); first, the server's watch on its
# controller, its quick exit and the job's own imports (fork_server.py)
PRELOAD = ["parallab.launching.fork_server", "parallab.training.run", "torch._dynamo",
           "torch.distributed.fsdp", "torch.distributed.tensor.parallel",
           "torch.distributed.checkpoint", "torch.utils.tensorboard"]


@contextlib.contextmanager
def kept_running() -> Iterator[None]:
    """The fork server the workers are forked from: kept between launches (importing torch
    and parallab in a new one took half of a small job's launch) while the environment
    stays the same, since the workers inherit the server's environment, not the
    controller's; started anew when it differs. It ignores SIGTERM and SIGINT from its start
    (the dispositions survive exec): `timeout`, a `kill` of the process group or Ctrl-C
    would else end it, and the agent would read every worker's exit status as 255 and fail
    a job that is saving; workers take them over (preemption.hold). It ends with this
    process."""
    if ready():
        start_fork_server()
    yield


def warm_up(cfg: Any, starts_workers: bool) -> None:
    """A job of `cfg` (as composed) that will start workers: its fork server now, not once
    the config is checked."""
    if starts_workers and ready():
        with environment_set(server_env(cfg)):
            start_fork_server()


def job_imports(cfg: Any) -> list[str]:
    """What each worker of a job of `cfg` (composed or typed) would import to build its
    parts, for the fork server to import once instead: what its model, data and loss name
    by `_target_` (transformers' model classes) and what its adapter declares (peft: seconds
    of CPU a rank); installed ones only, not a project's own
    files, which may change between two launches that share the server. Not data's own
    `_target_`: typing sets it where the composed config has none, and both must give the
    same list. Only for a job on the CPU (device=cpu): a module may initialize CUDA at
    import (bitsandbytes does, which peft imports where it is installed), and a rank forked
    after that could not use the GPU."""
    device = _get(cfg, "device")
    if getattr(device, "value", device) != "cpu":
        return []
    targets = [*_targets(_get(cfg, "model")), *_targets(_get(cfg, "loss")),
               *_targets(_get(cfg, "data"), own=False)]
    adapter = _get(cfg, "adapter")
    kind = OmegaConf.get_type(adapter) if OmegaConf.is_config(adapter) else type(adapter)
    return sorted(name for name in set(targets) | set(getattr(kind, "imports", ()))
                  if _installed(name))


def _installed(name: str) -> bool:
    """Whether `name` (a dotted path) comes from an installed distribution."""
    try:
        spec = importlib.util.find_spec(name.partition(".")[0])
    except (ImportError, ValueError):
        return False
    origin = getattr(spec, "origin", None) or ""
    return bool({"site-packages", "dist-packages"} & set(Path(origin).parts))


def _get(cfg: Any, key: str) -> Any:
    return cfg.get(key) if OmegaConf.is_config(cfg) else getattr(cfg, key, None)


def _targets(node: Any, own: bool = True) -> Iterator[str]:
    """The `_target_` paths in a config part, at any depth (interpolations left out; with
    own=False, not the part's own)."""
    if OmegaConf.is_config(node):
        node = OmegaConf.to_container(node, resolve=False)
    elif dataclasses.is_dataclass(node) and not isinstance(node, type):
        node = {f.name: getattr(node, f.name) for f in dataclasses.fields(node)}
    if isinstance(node, dict):
        target = node.get("_target_")
        if own and isinstance(target, str) and "${" not in target:
            yield target
        for value in node.values():
            yield from _targets(value)
    elif isinstance(node, (list, tuple)):
        for value in node:
            yield from _targets(value)


# left out when the fork server's environment is compared: the workers' threads (set by
# the agent and distributed.setup), pytest's name of the running test, which differs for
# every test of a suite that runs parallab in its process (each launch would start a new
# server, its imports paid again), the job's imports (compared as a set), and the
# address of an object in this process that inductor hands its C++ loader through the
# environment once a run here has compiled (meaningless in any other process)
PER_CALL = ("OMP_NUM_THREADS", "PYTEST_CURRENT_TEST", PRELOAD_VAR,
            "_TORCHINDUCTOR_PYOBJECT_TENSOR_DATA_PTR")


def _environment() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k not in PER_CALL}


def start_fork_server() -> None:
    """The fork server, started (or kept) for this environment: called early, while the
    controller checks the config, its imports run beside those checks on another core. A
    job needing imports the running server did not make, or launched in a changed
    environment, gets a new one that makes them and the earlier ones, so that jobs taking
    turns do not restart it each time."""
    global _server_environment, _server_imports
    from multiprocessing import forkserver

    server = forkserver._forkserver
    # the earlier imports too, whatever changed: installed modules, which jobs taking
    # turns would otherwise import anew at each restart
    needed = set(os.environ.get(PRELOAD_VAR, "").split()) | _server_imports
    with environment_set(server_env()):
        environment = _environment()
        if server._forkserver_pid is not None and (environment != _server_environment
                                                   or needed != _server_imports):
            server._stop()
        forkserver.set_forkserver_preload(PRELOAD)
        # ignored from its start (a Ctrl-C during its imports printed their traceback, then
        # the controller's EOFError): multiprocessing ignores SIGINT only after them; a
        # closed terminal's SIGHUP is the run's to take, as its workers save
        previous = {signum: signal.signal(signum, signal.SIG_IGN)
                    for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)}
        try:
            with environment_set({PRELOAD_VAR: " ".join(sorted(needed))}):
                forkserver.ensure_running()
        finally:
            for signum, handler in previous.items():
                signal.signal(signum, handler)
        _server_environment, _server_imports = environment, needed
