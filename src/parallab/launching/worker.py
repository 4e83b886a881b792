"""A launched worker's life around its training: its log files, its end with the controller,
and the one-line error it leaves the controller. Started by the elastic agent in a fresh
process (launch.elastic), it runs the training function it is given on its run spec."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import select
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Callable, Iterator

from parallab.config import naming
from parallab.config.errors import OneLineError
from parallab.launching import distributed, preemption, slurm
from parallab.observe.logfile import RunLog

log = logging.getLogger(__name__)
LOG_FORMAT = "[%(asctime)s][%(name)s][%(levelname)s] - %(message)s"  # Hydra's


def main(train: Callable[..., dict[str, Any]], spec) -> dict[str, Any]:
    """Entry point of a worker: `train(spec, store=...)` on this rank (spec: the run's
    training.run.RunSpec); the agent records its traceback for the controlling process."""
    end_with(spec.controller)
    preemption.hold(slurm.requeue_signals(spec.cfg.trainer.requeue_signal),
                    stop_file(spec.failures))
    as_started_afresh()
    log_to_files(spec.run_dir)
    with recorded_once():
        try:
            with leaving_failure(spec.failures):
                return train(spec, store=distributed.attempt_store(spec.cfg.backend.timeout_s))
        except Exception as error:
            if distributed.lost_a_peer(error):
                # the agent names the first exit it sees as the root cause: leave that to
                # the rank that failed (or was killed) first, whose end broke this one's
                # connection
                time.sleep(distributed.PEER_FAILURE_GRACE_S)
            raise


@contextlib.contextmanager
def recorded_once() -> Iterator[None]:
    """An exception inside is written to this rank's error file, which the agent reads into
    the failure the controller reports, and ends the process with exit status 1, as torch's
    multiprocessing wrapper would end it. Raised on, it would reach that wrapper, which
    pickles the traceback a second time into a file of the temporary dir that the agent
    reads and nothing removes: a `pytorch-errorfile-*.pickle` left by each failed rank."""
    from torch.distributed.elastic.multiprocessing.errors import get_error_handler

    try:
        yield
    except Exception as error:
        get_error_handler().record_exception(error)
        raise SystemExit(1) from None


def stop_file(failures: str | None) -> Path | None:
    """Where the controller notes that it was asked to stop (a signal's number), before it
    passes the signal on to the ranks: one not yet listening reads it there."""
    return Path(failures, "stop") if failures else None


def as_started_afresh() -> None:
    """A rank forked from the fork server undoes what it inherited from it, to run as a rank
    a launcher starts afresh (torchrun's) does (its signals: preemption.hold):
    multiprocessing's start method, 'forkserver' in the server's
    children: a DataLoader's workers were started through it, each sent the pickled data
    set and importing the main module, not forked (a short ddp run with data.num_workers=2
    took seven times as long as with none); and numpy's global random state,
    which a fork keeps (Python's own `random` reseeds itself): every rank of every launch
    from one server drew the same numbers, in a user's data augmentation say."""
    import multiprocessing

    multiprocessing.set_start_method(None, force=True)  # the platform's default
    if "numpy" in sys.modules:  # torch imports it where it is installed
        sys.modules["numpy"].random.seed()  # from the OS's entropy, as a new process is


class LeftByWorker(OneLineError):
    """A worker's one-line error as it left it for its controller: its rank, line and
    exit status."""

    def __init__(self, rank: int, left: dict[str, Any]):
        super().__init__(f"rank {rank}: {left['message']}")
        self.status = left["status"]


@contextlib.contextmanager
def leaving_failure(failures: str | None) -> Iterator[None]:
    """A OneLineError raised inside leaves its line and status in `failures` (a dir the
    controller made; this rank's file), where one_line_failures finds it: the job ends with
    that line rather than the traceback torch's agent records."""
    failure = Path(failures, f"rank{distributed.rank_from_env()}.json") if failures else None
    if failure is not None:
        failure.unlink(missing_ok=True)  # an earlier attempt's, before an elastic restart
    try:
        yield
    except OneLineError as error:
        if failure is not None:  # told by its type: the controller ends with this line
            failure.write_text(json.dumps({"status": error.status, "message": str(error)}))
        raise


@contextlib.contextmanager
def one_line_failures() -> Iterator[str]:
    """A dir for a launch's ranks to leave their one-line errors in (leaving_failure): a
    launch inside that fails as its first failing rank said in one line raises that line
    (LeftByWorker), any other failure torch's ChildFailedError, its traceback."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    with tempfile.TemporaryDirectory(prefix="parallab-failures-") as failures:
        try:
            yield failures
        except ChildFailedError as error:
            rank, _ = error.get_first_failure()
            left = Path(failures, f"rank{rank}.json")
            if not left.is_file():
                raise
            raise LeftByWorker(rank, json.loads(left.read_text())) from None


def log_to_files(run_dir: str) -> None:
    """Rank 0 appends to the run's log (train.log); rank k writes train_rank{k}.log."""
    rank = distributed.rank_from_env()
    formatter = logging.Formatter(LOG_FORMAT)
    file_handler = RunLog(Path(run_dir) / naming.log_file(rank))
    console = logging.StreamHandler(sys.stdout)
    console.setLevel(logging.INFO if rank == 0 else logging.WARNING)
    root = logging.getLogger()
    root.setLevel(logging.INFO)
    for handler in (file_handler, console):
        handler.setFormatter(formatter)
        root.addHandler(handler)


def end_with(controller: int) -> None:
    """This worker ends when the controller (process `controller`) does: a controller killed
    alone (SIGKILL, which it cannot pass on) so takes its ranks with it, rather than leaving
    them training on, unsupervised, into a run dir it no longer locks. The workers' parent
    is the fork server, which lives while any worker does, so the parent's death says
    nothing: a thread waits on the controller itself (a pidfd; polling where there is none)."""
    def wait() -> None:
        try:
            with contextlib.closing(os.pidfd_open(controller)) as fd:  # Linux 5.3
                select.select([fd], [], [])  # readable once the process has ended
        except (AttributeError, OSError):
            while _alive(controller):
                time.sleep(1)
        log.error("the controller (pid %d) has ended: this rank stops", controller)
        logging.shutdown()
        os._exit(1)

    threading.Thread(target=wait, name="parallab-controller-watch", daemon=True).start()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process now holds the number: ours has ended
        return False
    return True
