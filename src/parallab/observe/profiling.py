"""trainer.profile: torch.profiler over steps 3-5 (after one to wait, one to warm up), one
Chrome trace per rank in <run dir>/profiler/, which TensorBoard's profiler plugin and
chrome://tracing open."""

from __future__ import annotations

import contextlib
import logging
import os
from pathlib import Path
from typing import Any, Iterator

import torch

from parallab.config.errors import environment_set

log = logging.getLogger(__name__)


@contextlib.contextmanager
def profiled(enabled: bool, device: torch.device, run_dir: Path, rank: int,
             is_main: bool) -> Iterator[Any]:
    """The profiler to step once per training step, or None when not enabled."""
    if not enabled:
        yield None
        return
    from torch.profiler import (
        ProfilerActivity,
        profile,
        schedule,
        tensorboard_trace_handler,
    )

    activities, quiet = [ProfilerActivity.CPU], {}
    if device.type == "cuda":
        activities.append(ProfilerActivity.CUDA)
    elif "KINETO_LOG_LEVEL" not in os.environ:  # a user's own kept
        # torch's CUDA build where no GPU is: kineto logs "ERROR ... gpuGetDeviceCount
        # failed" as the profiler starts, though the CPU trace is whole, and a line as each
        # window starts and stops; its level is read then (6: none). Set for the profile
        # alone: a process that goes on (a test's, a notebook's) keeps its environment
        quiet = {"KINETO_LOG_LEVEL": "6"}
    trace_dir = run_dir / "profiler"
    with environment_set(quiet), profile(
            activities=activities, schedule=schedule(wait=1, warmup=1, active=3, repeat=1),
            on_trace_ready=tensorboard_trace_handler(str(trace_dir),
                                                     worker_name=f"rank{rank}")) as profiler:
        yield profiler
    if is_main:
        log.info("profiler trace written to %s", trace_dir)
