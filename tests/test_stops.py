"""How one process a signal stops ends: its exit status and its record (status.json), when
the stop is ended hard and when the signal comes after the last step."""

from __future__ import annotations

import json
import signal

import pytest
from conftest import FAST, inject, output, run_entry

pytestmark = pytest.mark.slow
RUN = [*FAST, "trainer.max_steps=12", "trainer.checkpoint_every_n_steps=5"]


@pytest.mark.parametrize("action", [
    # a second request after the first (SAME_REQUEST_S to 0: the next one is a second)
    "preemption.SAME_REQUEST_S = 0.0; os.kill(os.getpid(), signal.SIGTERM); "
    "os.kill(os.getpid(), signal.SIGTERM); time.sleep(30)",
    # a stop that never reaches a step boundary: the watchdog ends it (MIN_STUCK_S after)
    "os.kill(os.getpid(), signal.SIGTERM); time.sleep(30)",
], ids=["second signal", "watchdog"])
def test_one_process_ended_hard_records_that_it_was_stopped(tmp_path, action):
    """Its record was left unwritten (os._exit runs nothing after it), where a launched
    job's controller, or a stop at a step, writes it: a script or a sweep's summary took
    the run for one still going, or one that never started."""
    run_dir = tmp_path / "run"
    action = "import time; import parallab.launching.preemption as preemption; " + action
    ended = run_entry("train.py", RUN, run_dir, timeout=120, env=inject(tmp_path, 7, action))
    assert ended.returncode == 128 + signal.SIGTERM, output(ended)[-3000:]
    assert "ended without saving" in output(ended) or "ended at once" in output(ended)
    assert json.loads((run_dir / "status.json").read_text()) == {
        "status": "stopped", "signal": "SIGTERM", "step": None}
