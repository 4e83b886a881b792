"""Where the wall time of a 2 x 2 sweep goes: composition, worker start-up, training, exit.

    python bench/bench_sweep.py

Runs `python train.py -m parallel=ddp parallel.world_size=1,2 data.batch_size=32,64` on
the synthetic set (one epoch each) and splits its wall time by the timestamps of the log
lines every job writes: Hydra's `#k : overrides` (the job's config is composed after it),
`launching N workers` (validated, about to start them), the workers' `rank 0/N on cpu`
(imported torch, joined the process group), `metrics:` (trained and evaluated), and the
next job's line (workers and agent gone).
"""

from __future__ import annotations

import re
import subprocess
import sys
import time
from datetime import datetime
from pathlib import Path

from parallab.testing import scratch_dir

REPO = Path(__file__).resolve().parents[1]
SWEEP = ["-m", "parallel=ddp", "parallel.world_size=1,2", "data.batch_size=32,64",
         "data=synthetic", "trainer.epochs=1", "device=cpu", "trainer.progress_bar=false"]
MARKS = {"job": r"\[HYDRA\] \t#\d+ :", "launch": r"launching \d+ workers",
         "worker": r"rank 0/\d+ on", "done": r"metrics: ", "end": r"\[HYDRA\] summary of"}
PHASES = [("composition + checks", "job", "launch"), ("worker start-up", "launch", "worker"),
          ("training + eval", "worker", "done"), ("exit", "done", "next")]


def stamp(line: str) -> float:
    return datetime.strptime(line[1:24], "%Y-%m-%d %H:%M:%S,%f").timestamp()


def main() -> None:
    sweep_dir = scratch_dir("parallab-bench-sweep-") / "sweep"
    start = time.time()
    result = subprocess.run([sys.executable, str(REPO / "train.py"), *SWEEP,
                             f"hydra.sweep.dir={sweep_dir}"], capture_output=True, text=True,
                            check=True)
    wall = time.time() - start
    jobs: list[dict[str, float]] = []
    end = None
    for line in result.stdout.splitlines():
        for mark, pattern in MARKS.items():
            if re.search(pattern, line):
                if mark == "job":
                    jobs.append({})
                if mark == "end":
                    end = stamp(line)
                elif jobs:
                    jobs[-1].setdefault(mark, stamp(line))
    for job, following in zip(jobs, jobs[1:] + [{"job": end}]):
        job["next"] = following["job"]
    print(f"2 x 2 sweep: {wall:.1f} s wall; until the first job: {jobs[0]['job'] - start:.1f} s "
          "(imports, the sweep's own composition)\n")
    print("| job | " + " | ".join(name for name, _, _ in PHASES) + " | total |")
    print("|---" * (len(PHASES) + 2) + "|")
    for index, job in enumerate(jobs):
        spans = [job[b] - job[a] for _, a, b in PHASES]
        print(f"| {index} | " + " | ".join(f"{s:.2f}" for s in spans) + f" | {sum(spans):.2f} |")
    means = [sum(job[b] - job[a] for job in jobs) / len(jobs) for _, a, b in PHASES]
    print("| mean | " + " | ".join(f"{m:.2f}" for m in means) + f" | {sum(means):.2f} |")


if __name__ == "__main__":
    main()
