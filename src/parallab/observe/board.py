"""The real TensorBoard server over a run or sweep dir, for tests and the docs screenshot."""

from __future__ import annotations

import contextlib
import json
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any, Iterator


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Board:
    def __init__(self, url: str):
        self.url = url

    def get(self, path: str) -> Any:
        with urllib.request.urlopen(self.url + path, timeout=10) as response:
            return json.loads(response.read())

    def post(self, path: str, body: dict) -> Any:
        request = urllib.request.Request(self.url + path, data=json.dumps(body).encode(),
                                         headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=10) as response:
            return json.loads(response.read())


@contextlib.contextmanager
def serve(logdir: Path, runs: int, timeout_s: float = 90) -> Iterator[Board]:
    """`tensorboard --logdir logdir` on a free loopback port, once it lists `runs` runs."""
    port = _free_port()
    command = [str(Path(sys.executable).with_name("tensorboard")), "--logdir", str(logdir),
               "--host", "127.0.0.1", "--port", str(port), "--reload_interval", "1"]
    server = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    board = Board(f"http://127.0.0.1:{port}")
    try:
        deadline = time.monotonic() + timeout_s
        while True:
            if server.poll() is not None:
                raise RuntimeError(f"tensorboard exited: {server.stderr.read().decode()[-2000:]}")
            with contextlib.suppress(OSError, ValueError):
                if len(board.get("/data/runs")) >= runs:
                    break
            if time.monotonic() > deadline:
                raise TimeoutError(f"tensorboard did not list {runs} runs in {timeout_s:.0f} s")
            time.sleep(0.5)
        yield board
    finally:
        server.terminate()
        server.wait(timeout=30)
