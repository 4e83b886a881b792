"""Imported by the fork server alone (forking.PRELOAD), never by a controller or a worker.

It imports what the job's workers would each import to build its parts (forking.job_imports,
handed over in PARALLAB_PRELOAD): transformers' model classes, peft. A name that does not
import is left to the workers, whose own import then says why.

When its controller ends, the fork server leaves at once instead of tearing down the
torch it imported (seconds of CPU). Until then it holds the controller's stdout and stderr,
which it hands to every worker, so a caller reading the job's output to its end (a test, a
pipe, a CI log) waited for that teardown. Its workers never run this: a forked worker
leaves by os._exit in multiprocessing's forkserver, skipping atexit; and nothing of the
server's own is left to flush or close."""

import atexit
import os
import pkgutil

from parallab.config.targets import import_warnings_quieted
from parallab.launching.forking import PRELOAD_VAR


def _import_the_jobs_parts() -> None:
    with import_warnings_quieted():  # here instead of in each rank
        for name in os.environ.get(PRELOAD_VAR, "").split():
            try:
                pkgutil.resolve_name(name)
            except Exception:  # noqa: BLE001, S112 - the workers' own import reports it
                continue


_import_the_jobs_parts()
atexit.register(os._exit, 0)
