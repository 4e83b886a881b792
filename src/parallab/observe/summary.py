"""A multirun's summary: one row per job (overrides, status, metrics), as CSV, Markdown, plot.

Written by SummaryCallback when a multirun ends, and by `parallab summary DIR` for any
finished sweep dir, including one made by an older run.
"""

from __future__ import annotations

import csv
import json
import logging
import os
import signal
from pathlib import Path
from typing import Any

import yaml
from hydra.experimental.callback import Callback

log = logging.getLogger(__name__)
# a run's outcome (completed, stopped), and a sweep job's (failed, skipped) and what it trained
STATUS_FILE = "status.json"
METRIC_COLUMNS = ["eval_accuracy", "eval_loss", "train_loss", "samples_per_sec",
                  "step_time_ms", "epoch_time_s", "wall_time_s", "world_size",
                  "global_batch_size", "precision_dtype", "backend", "parallel",
                  "peak_memory_mb", "state_memory_mb", "steps", "tokens_per_sec", "mfu",
                  "comm_mb_per_step"]
# summary.md: the figures to compare at a glance (summary.csv has them all)
MARKDOWN_METRICS = [*METRIC_COLUMNS[:8], "peak_memory_mb", "state_memory_mb",
                    "comm_mb_per_step"]


def _json_object(path: Path) -> dict[str, Any] | None:
    """A JSON file holding an object; None if it is missing, corrupt or holds anything else."""
    try:
        value = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return value if isinstance(value, dict) else None


def read_metrics(run_dir: Path) -> dict[str, Any] | None:
    """A run's metrics.json if it is complete (an object with a numeric eval_loss), else None."""
    metrics = _json_object(run_dir / "metrics.json")
    complete = metrics is not None and isinstance(metrics.get("eval_loss"), (int, float))
    return metrics if complete else None


def advised(run_dir: Path) -> bool:
    """Whether the dir holds advise's answer: advise.md, written last (after advise.csv)."""
    return (run_dir / "advise.md").exists()


def finished(run_dir: Path) -> bool:
    """Whether a sweep's job dir holds a finished job: a run's complete metrics, or
    advise's answer (an advise job writes no metrics.json)."""
    return read_metrics(run_dir) is not None or advised(run_dir)


def read_status(run_dir: Path) -> dict[str, Any]:
    """A job's status.json ({} where it holds none)."""
    return _json_object(run_dir / STATUS_FILE) or {}


def write_status(run_dir: str | Path, **fields: Any) -> None:
    """A run's or a job's record, status.json, holding `fields`: written whole under another
    name and moved into place, so a reader (a summary, the record merged into a sweep job's)
    never sees half of it."""
    path = Path(run_dir) / STATUS_FILE
    written = path.with_name(f".{STATUS_FILE}.{os.getpid()}.tmp")
    written.write_text(json.dumps(fields) + "\n")
    os.replace(written, path)


def record_completed(run_dir: str | Path, step: int) -> None:
    """A run's record that it finished (`step`: its last), written beside its complete
    metrics.json: final for this start of the run (record_stopped)."""
    write_status(run_dir, status="completed", step=step)


def record_stopped(run_dir: str | Path, signum: int, step: int | None) -> None:
    """A run's record that a signal stopped it (`step`: where it saved; None where it ended
    unsaved). A run that finished stays completed: a signal that came just after its
    record was written (a second one ending it at once, Ctrl-C in the controller as the
    workers end) stopped nothing of it, and "stopped" beside its complete metrics had told
    a script or a sweep's summary to resume a run with nothing left. A new start of the
    run deletes the record first (cli._claimed), so a continued run's stop is recorded."""
    if read_status(Path(run_dir)).get("status") == "completed":
        return
    write_status(run_dir, status="stopped", signal=signal.Signals(signum).name, step=step)


def job_row(job_dir: Path) -> dict[str, Any]:
    try:
        overrides = yaml.safe_load((job_dir / ".hydra" / "overrides.yaml").read_text()) or []
    except (OSError, yaml.YAMLError):
        overrides = ["(unreadable overrides.yaml)"]
    status = read_status(job_dir)
    # a job skipped as another dir's: its figures, or its answer, are that dir's
    done_dir = job_dir.parent / status["as"] if status.get("as") else job_dir
    metrics = read_metrics(job_dir) or (read_metrics(done_dir) if status.get("as") else None)
    if status.get("status") == "failed":  # this start failed, whatever an earlier one left
        metrics, state = None, "failed"
    elif metrics:
        state = status.get("status") or "completed"
    elif (job_dir / "metrics.json").exists():  # written, but not as a run writes it
        state = "unreadable"
    elif (done_dir / "advise.csv").exists():  # experiment=advise: its answer is its table
        state = "advised (advise.md)"
    elif (answer := _simulated(job_dir)) is not None:  # parallab simulate's, predicted
        metrics, fits = answer
        state = "simulated (simulate.md)" if fits else "simulated, does not fit (simulate.md)"
    else:
        state = status.get("status") or "incomplete"
    row = {"job": job_dir.name, "overrides": " ".join(map(str, overrides)), "status": state,
           "error": str(status.get("error", ""))}
    row.update({key: (metrics or {}).get(key) for key in METRIC_COLUMNS})
    return row


def _simulated(job_dir: Path) -> tuple[dict[str, Any], bool] | None:
    """A `parallab simulate` job's best layout (simulate.json's first: the fastest that
    fits, or the layout given where it does not) in the columns a run reports, and whether
    it fits: predicted on its cluster, not measured."""
    answer = _json_object(job_dir / "simulate.json")
    layouts = (answer or {}).get("layouts") or [{}]
    best, world = layouts[0], (answer or {}).get("world_size")
    try:
        tokens = best["tokens_per_sec_per_gpu"] * world
        return {"parallel": best["layout"], "world_size": world, "tokens_per_sec": tokens,
                "samples_per_sec": tokens / answer["seq_len"], "mfu": best["mfu"],
                "step_time_ms": best["step_time_s"] * 1e3,
                "peak_memory_mb": best["memory_per_gpu_gb"] * 1024}, bool(best["fits"])
    except (KeyError, TypeError):  # not written as simulate writes it
        return None


def collect(sweep_dir: Path, jobs: list[Path] | None = None) -> list[dict[str, Any]]:
    """The rows of `jobs` (dirs), in their order; None: of every job dir in `sweep_dir` but
    those a later sweep's job stands for (its status says it was skipped as that dir: both
    rows had been listed, the run twice)."""
    def job_number(job: Path) -> tuple[int, str]:
        head = job.name.split("_")[0]
        return (int(head) if head.isdigit() else -1, job.name)

    if jobs is None:
        jobs = sorted((p.parent.parent for p in sweep_dir.glob("*/.hydra/overrides.yaml")),
                      key=job_number)
        stood_for = {read_status(job).get("as") for job in jobs}
        jobs = [job for job in jobs if job.name not in stood_for]
    return [job_row(job) for job in jobs]


def _cell(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:,.4f}" if abs(value) < 10 else f"{value:,.1f}"
    return "" if value is None else str(value)


def markdown(rows: list[dict[str, Any]]) -> str:
    columns = ["job", "overrides", "status", *MARKDOWN_METRICS, "error"]
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(_cell(row[c]) for c in columns) + " |" for row in rows]
    return "\n".join(lines)


def plot(rows: list[dict[str, Any]], path: Path) -> None:
    """samples/s and scaling efficiency against world size (a line per per-rank batch), and
    eval accuracy against global batch size."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    numeric = ("samples_per_sec", "global_batch_size", "world_size")
    finished = [r for r in rows if r["status"] in ("completed", "skipped")
                and all(isinstance(r[k], (int, float)) and r[k] for k in numeric)]
    fig, (speed, efficiency, accuracy) = plt.subplots(1, 3, figsize=(15, 4.2))
    by_batch: dict[int, list[tuple[int, float]]] = {}
    for r in finished:
        per_rank = r["global_batch_size"] // max(r["world_size"], 1)
        by_batch.setdefault(per_rank, []).append((r["world_size"], r["samples_per_sec"]))
    for per_rank, points in sorted(by_batch.items()):
        points.sort()
        worlds, speeds = zip(*points)
        speed.plot(worlds, speeds, marker="o", label=f"batch {per_rank}/rank")
        base = speeds[0] / worlds[0]
        efficiency.plot(worlds, [s / (base * w) for w, s in points], marker="o",
                        label=f"batch {per_rank}/rank")
    # accuracy where the runs report it, else the eval loss (a regression, say)
    quality = "eval_accuracy" if all(isinstance(r["eval_accuracy"], (int, float))
                                     for r in finished) else "eval_loss"
    accuracy.scatter([r["global_batch_size"] for r in finished], [r[quality] for r in finished])
    for axes, title, ylabel in ((speed, "throughput", "samples/s"),
                                (efficiency, "scaling efficiency", "efficiency"),
                                (accuracy, quality.replace("_", " ")[5:], quality.replace("_", " "))):
        axes.set_title(title)
        axes.set_ylabel(ylabel)
        axes.grid(alpha=0.3)
    worlds = sorted({w for points in by_batch.values() for w, _ in points})
    speed.set_xticks(worlds)
    efficiency.set_xticks(worlds)
    speed.set_xlabel("world size")
    efficiency.set_xlabel("world size")
    accuracy.set_xlabel("global batch size")
    if by_batch:
        speed.legend()
        efficiency.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def write(sweep_dir: Path, jobs: list[Path] | None = None) -> list[dict[str, Any]]:
    """summary.csv, summary.md and summary.png in `sweep_dir` of `jobs` (None: every job
    dir it holds); the rows."""
    rows = collect(sweep_dir, jobs)
    with open(sweep_dir / "summary.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]) if rows else ["job"])
        writer.writeheader()
        writer.writerows(rows)
    (sweep_dir / "summary.md").write_text(markdown(rows) + "\n")
    plot(rows, sweep_dir / "summary.png")
    return rows


class SummaryCallback(Callback):
    """At the end of a multirun: the summary, the table printed, exit 1 if a job failed.
    Its rows are this multirun's jobs where they ran in this process (Hydra's own launcher;
    an earlier sweep's jobs in the same hydra.sweep.dir are not this one's), else every
    job dir the sweep dir holds (a launcher's jobs elsewhere: SLURM's)."""

    def __init__(self) -> None:
        self.jobs: list[Path] = []

    def on_job_start(self, config, **kwargs: Any) -> None:
        self.jobs.append(Path(config.hydra.runtime.output_dir))

    def on_multirun_end(self, config, **kwargs: Any) -> None:
        sweep_dir = Path(config.hydra.sweep.dir)
        rows = write(sweep_dir, self.jobs or None)
        print(markdown(rows), flush=True)
        failed = [r["job"] for r in rows if r["status"] == "failed"]
        log.info("summary of %d jobs in %s", len(rows), sweep_dir)
        if failed:
            log.error("%d of %d jobs failed: %s", len(failed), len(rows), ", ".join(failed))
            raise SystemExit(1)
