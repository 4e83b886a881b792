"""One way to run parallab as a user runs it, for tests and bench/ alike: the real entrypoint
(`python train.py`, `python evaluate.py`, or the installed `parallab` command) in a fresh
process, its output dir pinned, its metrics.json read back."""

from __future__ import annotations

import atexit
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

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
        raise RuntimeError(f"{' '.join(command)} failed:\n{(result.stdout + result.stderr)[-4000:]}")
    return result


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


def losses(run_dir: Path) -> list[float]:
    """The logged train/loss values of a run, in step order."""
    return [value for _, value in scalars(run_dir, "train/loss")]


def train_metrics(args: list[str], run_dir: Path, **kwargs: Any) -> dict[str, Any]:
    """`python train.py ARGS` in a fresh process; its metrics.json (RuntimeError if it fails)."""
    run_entry("train.py", args, run_dir, check=True, **kwargs)
    return read_metrics(run_dir)


def scratch_dir(prefix: str) -> Path:
    """A temporary dir for a benchmark's runs, removed when the process exits (their
    checkpoints and event files are hundreds of MB)."""
    path = Path(tempfile.mkdtemp(prefix=prefix))
    atexit.register(shutil.rmtree, path, True)
    return path
