"""Imported by the fork server alone (launch.PRELOAD), never by a controller or a worker.

When its controller ends, the fork server leaves at once instead of tearing down the
torch it imported (2 s of CPU here). Until then it holds the controller's stdout and stderr,
which it hands to every worker, so a caller reading the job's output to its end (a test, a
pipe, a CI log) waited for that teardown. Its workers never run this: a forked worker
leaves by os._exit in multiprocessing's forkserver, skipping atexit; and nothing of the
server's own is left to flush or close."""

import atexit
import os

atexit.register(os._exit, 0)
