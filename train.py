"""Train: `python train.py [group=option ...] [key=value ...]` (see README.md)."""

import sys
from pathlib import Path

# this file's dir leads sys.path, where its name would shadow a user's own module named
# train (model._target_=train.Net); parallab is installed (src/), not imported from here
if sys.path and Path(sys.path[0] or ".").resolve() == Path(__file__).resolve().parent:
    del sys.path[0]

from parallab.launching.preemption import ended_by_interrupt

if __name__ == "__main__":
    with ended_by_interrupt():  # Ctrl-C while the package imports: one line, not a traceback
        from parallab.cli import train

        train()
