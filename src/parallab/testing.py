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
