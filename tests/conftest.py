"""Shared helpers: run the real entrypoints in subprocesses, each in its own output dir."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
# small, quick settings for end-to-end runs on a 2-core CPU
FAST = ["data=synthetic", "data.train_size=2048", "data.eval_size=512", "trainer.epochs=1",
        "trainer.log_every_n_steps=5", "device=cpu"]


def run_entry(script: str, args: list[str], run_dir: Path | None = None, timeout: float = 300,
              env: dict[str, str] | None = None, cwd: Path = REPO,
              prefix: list[str] | None = None) -> subprocess.CompletedProcess:
    """Run train.py/evaluate.py as a user would; output dir pinned to `run_dir` if given."""
    command = (prefix or [sys.executable]) + [str(REPO / script), *args]
    if run_dir is not None:
        command.append(f"hydra.run.dir={run_dir}")
    full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
    return subprocess.run(command, cwd=cwd, env=full_env, capture_output=True, text=True,
                          timeout=timeout)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def only_run_dir(root: Path) -> Path:
    """The one run dir under outputs/ (asserting the ranks did not split it)."""
    dirs = [p.parent for p in root.glob("outputs/*/*/.hydra")]
    assert len(dirs) == 1, dirs
    return dirs[0]


def output(result: subprocess.CompletedProcess) -> str:
    return result.stdout + result.stderr


def assert_ok(result: subprocess.CompletedProcess) -> None:
    assert result.returncode == 0, output(result)[-4000:]


def read_metrics(run_dir: Path) -> dict:
    return json.loads((run_dir / "metrics.json").read_text())


def scalars(run_dir: Path, tag: str) -> list[tuple[int, float]]:
    """(step, value) of one TensorBoard scalar, read back with tensorboard's own reader."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(run_dir), size_guidance={"scalars": 0})
    events.Reload()
    return [(e.step, e.value) for e in events.Scalars(tag)]


def typed(*overrides: str):
    """The real conf/ composed with `overrides`, as the typed Config train.py checks."""
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    from parallab import launch
    from parallab.cli import CONF_DIR
    from parallab.config import register_configs

    launch.register_resolvers()
    register_configs()
    with initialize_config_dir(config_dir=CONF_DIR, version_base=None):
        return OmegaConf.to_object(compose("config", overrides=list(overrides)))


@pytest.fixture
def train(tmp_path):
    """train(args...) -> (result, run_dir): the real train.py in a fresh output dir."""

    def _train(*args: str, timeout: float = 300, env: dict[str, str] | None = None,
               name: str = "run"):
        run_dir = tmp_path / name
        return run_entry("train.py", list(args), run_dir, timeout, env), run_dir

    return _train
