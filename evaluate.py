"""Evaluate a checkpoint: `python evaluate.py ckpt=PATH [group=option ...]`."""

import sys
from pathlib import Path

# this file's dir leads sys.path, where its name would shadow a user's own module named
# evaluate (model._target_=evaluate.Net); parallab is installed (src/), not imported from here
if sys.path and Path(sys.path[0] or ".").resolve() == Path(__file__).resolve().parent:
    del sys.path[0]

from parallab.commands import evaluate

if __name__ == "__main__":
    evaluate()
