"""One way to run parallab as a user runs it, for tests and bench/ alike: the real entrypoint
(`python train.py`, `python evaluate.py`, or the installed `parallab` command) in a fresh
process, its output dir pinned, its metrics.json read back."""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any, Callable, Iterator

REPO = Path(__file__).resolve().parents[2]  # the checkout, where this runs from one


def run_entry(script: str, args: list[str], run_dir: Path | None = None, timeout: float = 300,
              env: dict[str, str] | None = None, cwd: Path | None = None,
              prefix: list[str] | None = None, check: bool = False
              ) -> subprocess.CompletedProcess:
    """Run `script` (train.py, evaluate.py: the checkout's; or `parallab` for the installed
    command beside this Python) with `args`, its output dir pinned to `run_dir` if given."""
    if script == "parallab":
        command = [str(Path(sys.executable).parent / "parallab"), *args]
    else:
        command = (prefix or [sys.executable]) + [str(REPO / script), *args]
    if run_dir is not None:
        command.append(f"hydra.run.dir={run_dir}")
    full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
    result = subprocess.run(command, cwd=cwd or REPO, env=full_env, capture_output=True,
                            text=True, timeout=timeout)
    if check and result.returncode != 0:
        said = (result.stdout + result.stderr)[-4000:]
        raise RuntimeError(f"{' '.join(command)} failed:\n{said}")
    return result


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def read_metrics(run_dir: Path) -> dict[str, Any]:
    return json.loads((Path(run_dir) / "metrics.json").read_text())


def scalars(run_dir: Path, tag: str) -> list[tuple[int, float]]:
    """(step, value) of one TensorBoard scalar in step order, read back with tensorboard's
    own reader file by file, a resumed run's file after the one it continues: a directory
    read sorts files by name, and a writer's per-process counter in the name (…9 before
    …10) can put a later file of the same second first."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    runs = []
    for path in Path(run_dir).glob("events.out.tfevents.*"):
        events = EventAccumulator(str(path), size_guidance={"scalars": 0})
        events.Reload()
        if tag in events.Tags()["scalars"]:
            runs.append((events.FirstEventTimestamp(), events.Scalars(tag)))
    points = {e.step: e.value for _, run in sorted(runs, key=lambda r: r[0]) for e in run}
    return sorted(points.items())


def as_logged(value: float) -> float:
    """A figure as TensorBoard stores it (float32): metrics.json keeps float64, so a figure
    read back from the event file equals this, not the figure itself."""
    import numpy as np

    return float(np.float32(value))


def losses(run_dir: Path) -> list[float]:
    """The logged train/loss values of a run, in step order."""
    return [value for _, value in scalars(run_dir, "train/loss")]


def train_metrics(args: list[str], run_dir: Path, **kwargs: Any) -> dict[str, Any]:
    """`python train.py ARGS` in a fresh process; its metrics.json (RuntimeError if it fails)."""
    run_entry("train.py", args, run_dir, check=True, **kwargs)
    return read_metrics(run_dir)


def interleaved_runs(modes: tuple[str, ...] | list[str], args_of: Callable[[str], list[str]],
                     repeats: int, work: Path) -> dict[str, list[dict[str, Any]]]:
    """Each mode's `python train.py args_of(mode)` metrics, `repeats` runs each in fresh
    processes, the modes interleaved so that a shared machine's drift falls on all of them
    alike; each run's step time printed as it ends."""
    runs: dict[str, list[dict[str, Any]]] = {mode: [] for mode in modes}
    for repeat in range(repeats):
        for mode in modes:
            metrics = train_metrics(args_of(mode), work / f"{mode}-{repeat}", timeout=None)
            runs[mode].append(metrics)
            print(f"{mode} #{repeat}: {metrics['step_time_ms']:.1f} ms/step", flush=True)
    return runs


def scratch_dir(prefix: str) -> Path:
    """A temporary dir for a benchmark's runs, removed when the process exits (their
    checkpoints and event files are hundreds of MB)."""
    path = Path(tempfile.mkdtemp(prefix=prefix))
    atexit.register(shutil.rmtree, path, True)
    return path


def textbook_volume(param_bytes: float, replicas: int = 1, shards: int = 1, tp: int = 1,
                    layers: int = 0, activation: float = 0.0,
                    sequence_parallel: bool = False, micro: int = 1) -> dict[str, float]:
    """Bytes one rank sends per step by collective kind, as ring algorithms send them
    (all-reduce 2(n-1)/n x the tensor, all-gather (n-1)/n x the whole, reduce-scatter
    (n-1)/n x the input), for the layouts whose volume a textbook gives: data parallel over
    `replicas` x `shards` (FSDP gathers the parameters twice and scatters the gradients
    once within a shard group, each of `micro` accumulated micro-batches; the replicas
    all-reduce one gradient shard, once a step), or tensor
    parallel alone over `tp` ranks on gpt (`layers` blocks of 4 all-reduces of an
    `activation` of (B, T, C) bytes, forward and backward of attention and MLP, 2 more for
    the embedding and the head's input gradient, nothing for the logits, which stay cut by
    vocabulary; with sequence parallelism each block all-reduce becomes an all-gather and a
    reduce-scatter, the head gathers its input and scatters its gradient, the embedding
    still all-reduces). Not counted, as comm.py cannot see them: the loss's all-reduces of
    three float32 a token (their largest logit, their exponentials' sum, the target's
    logit), which DTensor calls inside its own dispatch of the loss's ops."""
    ring = lambda n: (n - 1) / n  # noqa: E731 - the ring's share
    volume = {"all_reduce": 0.0, "all_gather": 0.0, "reduce_scatter": 0.0}
    if shards > 1:
        volume["all_gather"] += 2 * micro * ring(shards) * param_bytes
        volume["reduce_scatter"] += micro * ring(shards) * param_bytes
    if replicas > 1:
        volume["all_reduce"] += 2 * ring(replicas) * param_bytes / shards
    if tp > 1:
        split = (4 * layers + 2) * activation  # the tensors tp all-reduces without SP
        if sequence_parallel:
            volume["all_reduce"] += 2 * ring(tp) * activation
            volume["all_gather"] += ring(tp) * split
            volume["reduce_scatter"] += ring(tp) * (split - activation)
        else:
            volume["all_reduce"] += 2 * ring(tp) * split
    return volume


@contextlib.contextmanager
def mlflow_server(store: Path, port: int, ready_s: float = 90) -> Iterator[str]:
    """A real `mlflow server` on 127.0.0.1:`port` (sqlite store and artifacts in `store`),
    its URI once it answers; stopped at the end."""
    import time
    import urllib.request

    uri = f"http://127.0.0.1:{port}"
    server = subprocess.Popen(
        [str(Path(sys.executable).parent / "mlflow"), "server", "--host", "127.0.0.1",
         "--port", str(port), "--workers", "1",
         "--backend-store-uri", f"sqlite:///{store / 'mlflow.db'}",
         "--artifacts-destination", str(store / "artifacts")],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        # tracking only: no job runner, whose consumer processes import MLflow again each
        # (half a minute of CPU a server on two cores)
        env={**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"})
    try:
        deadline = time.monotonic() + ready_s
        while True:
            try:
                urllib.request.urlopen(f"{uri}/health", timeout=2)
                break
            except OSError:
                if server.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"mlflow server did not answer at {uri}") from None
                time.sleep(0.5)
        yield uri
    finally:
        server.terminate()
        server.wait(timeout=30)


@contextlib.contextmanager
def relay(target: str) -> Iterator[tuple[str, Callable[[], None]]]:
    """A TCP relay to `target` (http://HOST:PORT) on a port of its own: its URI, and a call
    that cuts it (the listener and every connection shut), which is how a tracker that goes
    away mid-run looks to its client, while the real one goes on serving other tests."""
    import socket
    import threading
    from urllib.parse import urlparse

    where = urlparse(target)
    listener = socket.create_server(("127.0.0.1", 0))
    relayed: list[socket.socket] = []

    def pump(source: socket.socket, sink: socket.socket) -> None:
        with contextlib.suppress(OSError):
            while data := source.recv(65536):
                sink.sendall(data)
        with contextlib.suppress(OSError):
            sink.shutdown(socket.SHUT_WR)

    def accept() -> None:
        with contextlib.suppress(OSError):
            while True:
                client = listener.accept()[0]
                server = socket.create_connection((where.hostname, where.port))
                relayed.extend((client, server))
                for ends in ((client, server), (server, client)):
                    threading.Thread(target=pump, args=ends, daemon=True).start()

    def cut() -> None:
        for sock in (listener, *relayed):
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)  # wakes the threads blocked on it
            sock.close()

    threading.Thread(target=accept, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{listener.getsockname()[1]}", cut
    finally:
        cut()
