"""SIGTERM / SIGINT / SIGHUP (a cluster pre-empting the job, Ctrl-C, a closed terminal or
a dropped ssh connection): save, then stop cleanly.

Under SLURM the time-limit warning (trainer.requeue_signal, USR1; the submitit launcher's
USR2) stops the run the same way, and is noted so that the job requeues itself once every
rank has saved (launching/slurm.py).

The first signal only sets a flag; the training loop sees it at a step boundary, saves a
checkpoint and stops (before its first step: at once, with nothing to save). A process
whose main thread is stuck in C++ (a collective whose peer died) cannot run Python signal
handlers, so the signal is also read in a helper thread from Python's wakeup fd, written by
the C-level handler at once; a watchdog there ends the process when, after the signal, no
step completes for STUCK_STEPS times the slowest step seen (at least MIN_STUCK_S; start-up
and the first step, evaluation and checkpoints do not count), or the stop takes over
GRACE_S. A second signal ends the process at once; one within SAME_REQUEST_S of the first
is the same request arriving twice (Ctrl-C signals the whole process group, and the
launcher passes its own copy on to the workers too).

Before a run's Preemption takes over, a launched rank holds a stop signal for it (hold), so
that a Ctrl-C while the ranks start still stops them together; a command's own process
ends at once on Ctrl-C, in one line (ended_by_interrupt).
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import sys
import threading
import time
from pathlib import Path
from types import FrameType
from typing import Callable, Iterator

from parallab.launching import slurm
from parallab.observe.observer import StepObserver

SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
STUCK_STEPS = 5  # no step finished for this many slowest steps after a signal: stuck
MIN_STUCK_S = 3.0
GRACE_S = 120.0  # the longest a stop, checkpoint included, may take
SAME_REQUEST_S = 2.0  # a repeat this soon after the first signal is the same request


class Preemption(StepObserver):
    """The run's stop request, and its watchdog, which times the loop's steps as one of its
    observers (step_done)."""

    def __init__(self, requeue: tuple[int, ...] = (),
                 ended_hard: Callable[[int], str] | None = None) -> None:
        self.signals = (*SIGNALS, *requeue)
        # records a stop ended at once (the signal's number) and says how to go on (the end
        # of its line): os._exit runs nothing after it, so a process no controller outlives
        # would leave no record
        self.ended_hard = ended_hard
        self.requeue = requeue  # signals that also ask the job to requeue itself
        self.signum: int | None = None
        self._busy = 0  # evaluating or saving: long, but not stuck
        self._last_step: float | None = None  # when the last step ended
        self._slowest_step = 0.0
        self._closed = threading.Event()
        self._previous: dict[int, object] = {}
        self._previous_fd = -1
        self._sockets: tuple[socket.socket, socket.socket] | None = None
        self._since = 0.0  # when the first signal came
        self._agreed = False  # signum is another rank's, agreed in a vote
        self._lock = threading.Lock()

    @property
    def requested(self) -> bool:
        if self.signum is None and self._sockets is not None:
            # a signal the listener has not read yet (its thread waits for a core on a busy
            # machine): the C handler wrote it before kill() returned, so read it here
            try:
                self._read(self._sockets[0].recv(64, socket.MSG_DONTWAIT))
            except OSError:  # nothing waiting (BlockingIOError), or closed
                pass
        return self.signum is not None

    @property
    def requeue_asked(self) -> bool:
        return self.signum is not None and self.signum in self.requeue

    def requeue_agreed(self) -> None:
        """Another rank received SLURM's warning first (SLURM reaches the nodes at their
        own pace): this one stops for it too, and its own copy, which may come once the
        run has ended, ends nothing (__exit__)."""
        with self._lock:
            if self.requeue and not self.requeue_asked:
                self.signum = self.requeue[0]
                slurm.note(self.signum)

    def stop_agreed(self, signum: int) -> None:
        """Another rank was signalled (`signum`), this one not: its stop says that signal
        (it had said SIGTERM, whatever another rank heard)."""
        with self._lock:
            if self.signum is None:
                self.signum, self._agreed = signum, True

    def step_done(self, step: int, batches: list, last: bool) -> None:
        now = time.monotonic()
        if self._last_step is not None:  # the first step's time holds start-up and compiling
            self._slowest_step = max(self._slowest_step, now - self._last_step)
        self._last_step = now

    @contextlib.contextmanager
    def busy(self):
        """Work between steps that may take long (evaluation, a checkpoint)."""
        self._busy += 1
        try:
            yield
        finally:
            self._busy -= 1
            if self._last_step is not None:  # the next step's time leaves this out
                self._last_step = time.monotonic()

    def _python_handler(self, signum: int, frame: FrameType | None) -> None:
        """Installed so the signal does not kill the process; the listener does the work."""

    def _on_signal(self, signum: int) -> None:
        with self._lock:  # the listener and the main thread (requested) both read signals
            self._count(signum)

    def _count(self, signum: int) -> None:
        if self._agreed:  # its own copy of the stop the ranks agreed on: the same request
            self._agreed = False
            return
        if self.signum is not None:
            # the same request arriving twice, or SLURM's warning again (or late, once
            # another rank's agreed it): not a second request
            if time.monotonic() - self._since < SAME_REQUEST_S or signum in self.requeue:
                return
            self._end(signum, "again: ended at once, without saving")
        self.signum, self._since = signum, time.monotonic()
        if signum in self.requeue:
            slurm.note(signum)
        threading.Thread(target=self._watch, args=(time.monotonic(),), daemon=True).start()

    def _watch(self, since: float) -> None:
        while not self._closed.wait(0.2):
            now = time.monotonic()
            patience = max(MIN_STUCK_S, STUCK_STEPS * self._slowest_step)
            # before a step has ended the run is starting (building, its first step): not stuck
            waiting = 0.0 if self._last_step is None else now - max(self._last_step, since)
            stuck = not self._busy and waiting > patience
            if stuck or now - since > GRACE_S:
                self._end(self.signum or signal.SIGTERM, "and no step ended after it: "
                          "ended without saving" if stuck else f"and the stop took "
                          f"over {GRACE_S:.0f} s: ended without saving")

    def _end(self, signum: int, how: str) -> None:
        # anything it raises ends the process as well: raised in the listener or the watchdog,
        # it would end that thread, and leave the stuck process running
        with contextlib.suppress(Exception):
            how += self.ended_hard(signum) if self.ended_hard is not None else ""
        _said_and_ended(signum, how)

    def _listen(self, reader: socket.socket) -> None:
        while True:
            try:
                data = reader.recv(64)
            except OSError:
                return
            if not data:
                return
            self._read(data)

    def _read(self, data: bytes) -> None:
        for signum in data:
            if signum in self.signals and not self._closed.is_set():
                self._on_signal(signum)

    def __enter__(self) -> Preemption:
        if threading.current_thread() is not threading.main_thread():
            return self
        reader, writer = socket.socketpair()
        writer.setblocking(False)
        self._sockets = (reader, writer)
        self._previous_fd = signal.set_wakeup_fd(writer.fileno(), warn_on_full_buffer=False)
        for signum in self.signals:
            self._previous[signum] = signal.signal(signum, self._python_handler)
        threading.Thread(target=self._listen, args=(reader,), daemon=True).start()
        if _held:  # asked while the rank was starting
            self._on_signal(_held[0])
            _held.clear()
        return self

    def __exit__(self, *exc: object) -> None:
        self._closed.set()
        if self._sockets is None:
            return
        signal.set_wakeup_fd(self._previous_fd)
        for signum, handler in self._previous.items():
            late = self.requeue_asked and signum in self.requeue  # the run saved for it
            signal.signal(signum, signal.SIG_IGN if late else handler)
        for sock in self._sockets:
            sock.close()


def _said_and_ended(signum: int, how: str) -> None:
    """The process ends at once with 128 + the signal, in one line (from any thread)."""
    os.write(2, f"stopped by {signal.Signals(signum).name} {how}\n".encode())
    os._exit(128 + signum)


_held: list[int] = []  # stop signals a starting rank received, for its Preemption


def hold(requeue: tuple[int, ...], stop_file: Path | None) -> None:
    """A launched rank, from its start until its run's Preemption takes over: SIGINT,
    SIGHUP and the requeue signals are held for the Preemption (the rank stops with the others once
    they all run, at once if none has stepped yet), where they would else end it in a
    traceback, or not at all (the fork server it is forked from ignores SIGINT and SIGTERM).
    SIGTERM is held too where the controller was asked to stop (`stop_file`, written before
    it passes a signal on); without that it is torch's agent ending its workers after a
    failure, and ends the rank at once, as it ends one torchrun starts."""
    def held(signum: int, frame: FrameType | None) -> None:
        if signum == signal.SIGTERM and not (stop_file is not None and stop_file.exists()):
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
            return
        _held.append(signum)

    for signum in (*SIGNALS, *requeue):
        signal.signal(signum, held)
    if stop_file is not None and stop_file.exists():  # asked before this rank could hear it
        _held.append(int(stop_file.read_text()))


@contextlib.contextmanager
def ended_by_interrupt(what: str = "before training began: nothing was saved"
                       ) -> Iterator[None]:
    """A command's own process: Ctrl-C inside, anywhere a run's Preemption does not take
    it (an import, composing, the checks), ends the command in one line, exit status 130,
    where Python would print the traceback of whatever it interrupted."""
    try:
        yield
    except KeyboardInterrupt:
        print(f"stopped by SIGINT {what}", file=sys.stderr, flush=True)
        raise SystemExit(128 + signal.SIGINT) from None
