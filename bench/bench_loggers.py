"""What a tracker beside TensorBoard costs a step: the same run logged to TensorBoard alone,
and to TensorBoard plus MLflow (a real `mlflow server` on loopback), CSV or W&B (offline).

    python bench/bench_loggers.py [--steps 300] [--rounds 10] [--log-every 10]

Each round runs every logger set once, in turn, in this process (the MNIST CNN of the
default recipe, data.batch_size=64, trainer.log_every_n_steps as given: more often than the
default 50, so the loggers are called more), after one warm-up run; the order rotates
from round to round. The figure is each run's mean step time (its steps over their time,
trainer.timing_skip_steps left out: a median would hide the steps that log) over that of
TensorBoard alone in the same round (neighbours in time share the shared machine's
load), the median of those ratios over the rounds. Goal: <= 1.02.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))
from parallab.cli import train_in_process  # noqa: E402
from parallab.testing import free_port, mlflow_server, scratch_dir  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--log-every", type=int, default=10)
    args = parser.parse_args()
    os.environ.setdefault("WANDB_MODE", "offline")
    scratch = scratch_dir("parallab-bench-loggers-")
    with mlflow_server(scratch, free_port()) as uri:
        sets = {"tensorboard": ["logger=tensorboard"],
                "tensorboard + mlflow": ["logger=[tensorboard,mlflow]",
                                         f"logger.mlflow.tracking_uri={uri}"],
                "tensorboard + csv": ["logger=[tensorboard,csv]"],
                "tensorboard + wandb": ["logger=[tensorboard,wandb]"]}
        run = [f"trainer.max_steps={args.steps}", f"trainer.log_every_n_steps={args.log_every}",
               "trainer.checkpoint_every_n_steps=null", "trainer.save_best=false",
               "trainer.timing_skip_steps=20", "device=cpu"]
        train_in_process(run, scratch / "warm-up")
        times: dict[str, list[float]] = {name: [] for name in sets}
        names = list(sets)
        for round_ in range(args.rounds):
            for name in names[round_ % len(names):] + names[:round_ % len(names)]:
                metrics = train_in_process([*run, *sets[name]],
                                           scratch / f"{round_}-{name.replace(' ', '')}")
                times[name].append(1e3 * metrics["global_batch_size"]
                                   / metrics["samples_per_sec"])
    print(f"MNIST CNN, {args.steps} steps, logged every {args.log_every}; mean step time, "
          f"{args.rounds} rounds\n")
    print("| loggers | step time, ms: median (min-max) | ratio to TensorBoard alone: median "
          "of the rounds' (min-max) |")
    print("|---|---|---|")
    for name, values in times.items():
        ratios = [t / base for t, base in zip(values, times["tensorboard"])]
        print(f"| {name} | {statistics.median(values):.3f} ({min(values):.3f}-"
              f"{max(values):.3f}) | {statistics.median(ratios):.3f} ({min(ratios):.3f}-"
              f"{max(ratios):.3f}) |")


if __name__ == "__main__":
    main()
