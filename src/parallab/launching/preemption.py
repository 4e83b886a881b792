"""SIGTERM / SIGINT (a cluster pre-empting the job, Ctrl-C): save, then stop cleanly.

Under SLURM the time-limit warning (trainer.requeue_signal, USR1; the submitit launcher's
USR2) stops the run the same way, and is noted so that the job requeues itself once every
rank has saved (launching/slurm.py).

The first signal only sets a flag; the training loop sees it at a step boundary, saves a
checkpoint and stops. A process whose main thread is stuck in C++ (a collective whose peer
died) cannot run Python signal handlers, so the signal is also read in a helper thread from
Python's wakeup fd, written by the C-level handler at once; a watchdog there ends the
process when, after the signal, no step completes for STUCK_STEPS times the slowest step
seen (at least MIN_STUCK_S; start-up and the first step, evaluation and checkpoints do not
count), or the stop takes over GRACE_S. A second signal ends the process at once; one
within SAME_REQUEST_S of the first is the same request arriving twice (Ctrl-C signals the
whole process group, and the launcher passes its own copy on to the workers too).
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import threading
import time
from types import FrameType

from parallab.launching import slurm

SIGNALS = (signal.SIGTERM, signal.SIGINT)
STUCK_STEPS = 5  # no step finished for this many slowest steps after a signal: stuck
MIN_STUCK_S = 3.0
GRACE_S = 120.0  # the longest a stop, checkpoint included, may take
SAME_REQUEST_S = 2.0  # a repeat this soon after the first signal is the same request


class Preemption:
    def __init__(self, requeue: tuple[int, ...] = ()) -> None:
        self.signals = (*SIGNALS, *requeue)
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

    def step_done(self) -> None:
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
        if self.signum is not None:
            if time.monotonic() - self._since < SAME_REQUEST_S:
                return
            os._exit(128 + signum)
        self.signum, self._since = signum, time.monotonic()
        if signum in self.requeue:
            slurm.note(signum)
        threading.Thread(target=self._watch, args=(time.monotonic(),), daemon=True).start()

    def _watch(self, since: float) -> None:
        while not self._closed.wait(0.2):
            now = time.monotonic()
            patience = max(MIN_STUCK_S, STUCK_STEPS * self._slowest_step)
            waiting = now - (since if self._last_step is None else max(self._last_step, since))
            stuck = not self._busy and waiting > patience
            if stuck or now - since > GRACE_S:
                os._exit(128 + (self.signum or signal.SIGTERM))

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
        return self

    def __exit__(self, *exc: object) -> None:
        self._closed.set()
        if self._sockets is None:
            return
        signal.set_wakeup_fd(self._previous_fd)
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        for sock in self._sockets:
            sock.close()
