"""What a command costs from start to exit: a short launched fsdp run, and commands refused
before any worker starts (by parallab's checks, by Hydra's), each timed as a whole process.

    python bench/bench_start.py [--repeats 5]

The commands take turns, `repeats` rounds; each figure is the median wall time of its runs.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))
from parallab.testing import scratch_dir  # noqa: E402

# name: (the exit status it must end with, its overrides)
COMMANDS = {
    "fsdp, 4 ranks, 8 steps": (0, [
        "parallel=fsdp", "parallel.world_size=4", "data=synthetic", "data.train_size=2048",
        "data.eval_size=512", "trainer.max_steps=8", "device=cpu"]),
    # the ranks build a gpt with LoRA adapters: peft imported by each, or by their fork server
    "LoRA gpt, ddp, 4 ranks, 4 steps": (0, [
        "parallel=ddp", "parallel.world_size=4", "model=gpt", "data=bytes", "model.layers=2",
        "model.width=64", "model.context=64", "adapter=lora", "trainer.max_steps=4",
        "device=cpu"]),
    "refused by parallab's checks (data.batch_size=0)": (2, ["data.batch_size=0"]),
    "refused by Hydra (data.batch_sze=3)": (2, ["data.batch_sze=3"]),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    scratch = scratch_dir("bench-start-")
    times: dict[str, list[float]] = {name: [] for name in COMMANDS}
    for round_ in range(args.repeats):
        for i, (name, (status, overrides)) in enumerate(COMMANDS.items()):
            run_dir = scratch / f"{round_}_{i}"
            start = time.perf_counter()
            done = subprocess.run([sys.executable, str(REPO / "train.py"), *overrides,
                                   f"hydra.run.dir={run_dir}"], cwd=scratch,
                                  capture_output=True, text=True)
            times[name].append(time.perf_counter() - start)
            if done.returncode != status:  # a time is only a figure for what it timed
                sys.exit(f"{name}: exit status {done.returncode}, not {status}:\n"
                         f"{(done.stdout + done.stderr)[-2000:]}")
    print(f"| command | median wall s (of {args.repeats}) | min | max |\n|---|---|---|---|")
    for name, values in times.items():
        print(f"| {name} | {statistics.median(values):.2f} | {min(values):.2f} | "
              f"{max(values):.2f} |")


if __name__ == "__main__":
    main()
