"""metrics.csv in the run dir: a row per logged step, a column per figure (as Lightning's
CSVLogger), readable by pandas or a spreadsheet while the run goes on."""

from __future__ import annotations

import csv
from pathlib import Path
from typing import Any

from parallab.observe.loggers.base import Logger, RunInfo


class CSVLogger(Logger):
    def __init__(self, filename: str = "metrics.csv") -> None:
        self.filename = filename
        self.path: Path | None = None
        self.columns: list[str] = ["step"]
        self.rows: list[dict[str, Any]] = []  # every row so far: a new column rewrites them
        self.written = 0  # rows in the file
        self.resumed = False
        self.file = None
        self.writer: csv.DictWriter | None = None

    @classmethod
    def writes(cls, filename: str = "metrics.csv", **config: Any) -> list[str]:
        return [filename]

    def start(self, run: RunInfo) -> None:
        self.path = run.run_dir / self.filename
        self.path.parent.mkdir(parents=True, exist_ok=True)  # a subfolder of the run dir
        if self.path.exists():  # a resumed run's: its rows are kept, up to where it goes on
            with open(self.path, newline="") as file:
                reader = csv.DictReader(file)
                self.rows = [{k: v for k, v in row.items() if v != ""} for row in reader]
                self.columns = list(reader.fieldnames or self.columns)
            for row in self.rows:
                row["step"] = int(row["step"])
            self.resumed = True

    def scalars(self, values: dict[str, float], step: int) -> None:
        if self.resumed:  # rows the stopped run wrote after its checkpoint: this run's now
            self.rows = [row for row in self.rows if row["step"] < step]
            self.resumed = False
        # figures logged at the same step (train, then eval) share its row
        if self.rows and self.rows[-1]["step"] == step:
            self.rows[-1].update(values)
        else:
            self.write(pending=False)
            self.rows.append({"step": step, **values})

    def finish(self, final: dict[str, float], hparams: dict[str, Any], step: int) -> None:
        self.scalars(final, step)
        self.write(pending=True)

    def close(self, status: str) -> None:
        if self.path is not None:
            self.write(pending=True)
        if self.file is not None:
            self.file.close()

    def write(self, pending: bool) -> None:
        """Append the finished rows (and the open one, if `pending`); the whole file again
        when one brings a new column, so the header names every column."""
        end = len(self.rows) if pending else len(self.rows) - 1
        if self.written >= end:
            return
        new = [k for row in self.rows[self.written:end] for k in row if k not in self.columns]
        if new or self.writer is None:
            self.columns.extend(dict.fromkeys(new))
            if self.file is not None:
                self.file.close()
            self.file = open(self.path, "w", newline="")  # kept open: a row is one write
            self.writer = csv.DictWriter(self.file, self.columns)
            self.writer.writeheader()
            self.written = 0
        self.writer.writerows(self.rows[self.written:end])
        self.file.flush()  # readable while the run goes on
        self.written = end
