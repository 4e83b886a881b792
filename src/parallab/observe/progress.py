"""Progress: a tqdm bar on an interactive terminal, periodic log lines everywhere else.

The periodic lines always reach the run's log file; on a terminal they skip the console,
where the bar already shows them.
"""

from __future__ import annotations

import contextlib
import logging
import sys

from tqdm import tqdm
from tqdm.contrib.logging import logging_redirect_tqdm


class Progress(contextlib.ExitStack):
    def __init__(self, total_steps: int, active: bool, bar: bool | None):
        super().__init__()
        self.lines = logging.getLogger("parallab.observe.progress")
        self.bar = None
        show_bar = active and (sys.stderr.isatty() if bar is None else bar)
        self.lines.propagate = not show_bar
        self.lines.handlers = []
        if show_bar:
            root = logging.getLogger()
            self.lines.handlers = [h for h in root.handlers if isinstance(h, logging.FileHandler)]
            self.lines.setLevel(logging.INFO)
            self.bar = tqdm(total=total_steps, unit="step", dynamic_ncols=True)
            self.enter_context(self.bar)
            self.enter_context(logging_redirect_tqdm())
        self.active = active

    def update(self) -> None:
        if self.bar is not None:
            self.bar.update()

    def line(self, message: str, **postfix: str) -> None:
        if self.active:
            self.lines.info(message)
        if self.bar is not None:
            self.bar.set_postfix(postfix, refresh=False)
