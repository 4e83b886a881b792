"""Imported by the fork server alone (forking.PRELOAD), never by a controller or a worker.

It imports what the job's workers would each import to build its parts (forking.job_imports,
handed over in PARALLAB_PRELOAD): transformers' model classes, peft. A name that does not
import is left to the workers, whose own import then says why.

When its controller ends, the fork server leaves at once instead of tearing down the
torch it imported (2 s of CPU here). Until then it holds the controller's stdout and stderr,
which it hands to every worker, so a caller reading the job's output to its end (a test, a
pipe, a CI log) waited for that teardown. Its workers never run this: a forked worker
leaves by os._exit in multiprocessing's forkserver, skipping atexit; and nothing of the
server's own is left to flush or close."""

import atexit
import logging
import os
import pkgutil


def _import_the_jobs_parts() -> None:
    # peft imports torchao, whose enums' registration this torch warns of at import: nothing
    # a user can act on (models/adapters.py quiets it alike)
    pytree = logging.getLogger("torch.utils._pytree")
    level = pytree.level
    pytree.setLevel(logging.ERROR)
    try:
        for name in os.environ.get("PARALLAB_PRELOAD", "").split():
            try:
                pkgutil.resolve_name(name)
            except Exception:  # noqa: BLE001, S112 - the workers' own import reports it
                continue
    finally:
        pytree.setLevel(level)


_import_the_jobs_parts()
atexit.register(os._exit, 0)
