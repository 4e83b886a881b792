"""Several ranks agree on a stop request (a signal, SLURM's time-limit warning) within
about AGREE_S of steps, whatever trainer.log_every_n_steps.

Each rank hears its own signal at its own moment, and ranks must stop at the same step (a
checkpoint is a collective), so they vote in an all-reduce: at each log step, riding the
loss's, and between log steps every `every` steps, the steps of about AGREE_S as rank 0 last
timed them, at most MOST_STEPS. Every rank reads rank 0's figure (the others add 0), so
every rank counts the same steps to the next vote. Voting only at log steps let a large
log_every_n_steps hold a stop past the launcher's grace period (the watchdog's GRACE_S,
SLURM's --signal lead), which then ended the ranks unsaved; voting every step costs a
host sync each step.
"""

from __future__ import annotations

import signal
import time

import torch

from parallab.launching.distributed import Dist
from parallab.launching.preemption import Preemption

AGREE_S = 5.0  # a stop is agreed within about this long of steps (GRACE_S is 120 s)
# at most this many steps between votes: steps that slow down many times over after a vote
# (a slower phase, a stalled input) had held the next one past GRACE_S; one small
# all-reduce in 100 steps costs no step anything seen
MOST_STEPS = 100
HEARD = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)  # the stop signals a vote names
SHARED = 3 + len(HEARD)  # the figures a vote adds to an all-reduce


class StopVote:
    def __init__(self, preemption: Preemption, dist: Dist) -> None:
        self.preemption, self.dist = preemption, dist
        self.agreed = False  # every rank has seen the stop request
        self.every = 1  # steps between votes: the first vote times the first step
        self.since = 0  # steps since the last vote
        self.started = time.monotonic()  # when the last vote was

    def due(self) -> bool:
        """Count a step; True where the ranks vote after it (every rank alike)."""
        self.since += 1
        return self.dist.world_size > 1 and self.since >= self.every

    def shared(self) -> torch.Tensor:
        """This rank's part of a vote: whether it was asked to stop, whether to requeue,
        (rank 0 alone) the seconds a step took since the last vote, and which signal it
        heard (a flag each of HEARD)."""
        asked = self.preemption.requested
        pace = (time.monotonic() - self.started) / max(self.since, 1) \
            if self.dist.is_main else 0.0
        heard = [float(asked and self.preemption.signum == s) for s in HEARD]
        return torch.tensor([float(asked), float(asked and self.preemption.requeue_asked),
                             pace, *heard], device=self.dist.device)

    def take(self, summed: list[float]) -> None:
        """The vote's sums (`shared`'s over all ranks): the stop agreed where any rank asked
        it, and the steps to the next vote."""
        stops, requeues, pace, *heard = summed
        self.agreed = self.agreed or stops > 0
        if requeues > 0:  # every rank stops to requeue, whichever received the warning
            self.preemption.requeue_agreed()
        elif stops > 0:  # and says the signal a rank heard
            self.preemption.stop_agreed(next((s for s, n in zip(HEARD, heard) if n > 0),
                                             signal.SIGTERM))
        self.every = min(MOST_STEPS, max(1, int(AGREE_S / pace))) if pace > 0 else 1
        self.since, self.started = 0, time.monotonic()

    def vote(self) -> None:
        """A vote of its own, between log steps (one small all-reduce)."""
        self.take(self.dist.all_reduce_sum(self.shared()).tolist())
