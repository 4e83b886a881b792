"""What watches a training loop's steps. The loop holds its observers in one list (the
preemption's watchdog, the Meter, a profiler, the memory snapshot, advise's activation
counter) and tells each when a step starts and when it is done, and lets each wrap the one
step it counts (a process's second: the first may set things up). Each call is a no-op
here: an observer defines those it needs."""

from __future__ import annotations

import contextlib
from typing import Any, ContextManager


class StepObserver:
    def step_started(self) -> None:
        """An optimizer step begins."""

    def step_done(self, step: int, batches: list, last: bool) -> None:
        """Step `step` over `batches` (this rank's micro-batches) ended (`last`: the run's)."""

    def counting(self, trainer: Any, batches: list) -> ContextManager[None]:
        """Around the counted step, which `trainer` is about to run over `batches`."""
        return contextlib.nullcontext()


class Stepped(StepObserver):
    """A recorder that is stepped once a step (torch.profiler's profile, the memory
    snapshot)."""

    def __init__(self, recorder: Any):
        self.recorder = recorder

    def step_done(self, step: int, batches: list, last: bool) -> None:
        self.recorder.step()
