"""`parallab advise` against the exhaustive sweep it replaces, run as a user runs both.

    python bench/bench_advise.py [--sweep-steps 100] [--only gpt|own_model]

For a small gpt (data=bytes) and for examples/own_model (a user's ResMLP with its stages),
at world size 2 on this CPU: `parallab advise` once (timed), then every candidate it
measured trained again by `python train.py` for --sweep-steps steps (a -m sweep's jobs, one
process each). Targets: the recommendation's samples/s within 5% of the sweep's best among
candidates whose losses match the reference; advise's wall time <= 25% of the sweep's;
every memory prediction within 15% of the measurement. The sweep replays the candidates
advise measured, not those it pruned (the memory savers it found not needed).
"""

from __future__ import annotations

import argparse
import csv
import shlex
import time
from pathlib import Path

from parallab.testing import REPO, read_metrics, run_entry, scratch_dir

CASES = {
    "gpt": (REPO, ["model=gpt", "data=bytes", "optim=adamw", "model.layers=4", "model.width=128",
                   "model.context=64", "data.global_batch_size=16"]),
    "own_model": (REPO / "examples" / "own_model",
                  ["--config-dir", "conf", "experiment=waves", "data.global_batch_size=64"]),
}
COMMON = ["parallel.world_size=2", "device=cpu"]


def advise(cwd: Path, overrides: list[str], run_dir: Path) -> tuple[float, list[dict], str]:
    start = time.perf_counter()
    result = run_entry("parallab", ["advise", *overrides, *COMMON], run_dir, timeout=1800,
                       cwd=cwd)
    wall = time.perf_counter() - start
    if result.returncode != 0:
        raise SystemExit(result.stdout[-3000:] + result.stderr[-3000:])
    rows = list(csv.DictReader(open(run_dir / "advise.csv")))
    command = next(line for line in result.stdout.splitlines()
                   if line.startswith("parallab train"))
    return wall, rows, command


def sweep(cwd: Path, command: str, advise_dir: Path, steps: int,
          scratch: Path) -> tuple[float, dict[str, float]]:
    """Each measured candidate (its overrides.yaml in advise's run dir) trained
    --sweep-steps steps in its own process."""
    import yaml

    from parallab.advise.candidates import user_overrides

    # the command after `parallab train`, less the candidate's own settings
    user = user_overrides(shlex.split(command)[2:])
    speeds, wall = {}, 0.0
    for index, path in enumerate(sorted((advise_dir / "candidates").glob("*/overrides.yaml"))):
        record = yaml.safe_load(path.read_text())
        args = user + record["overrides"] + [
            f"trainer.max_steps={steps + 5}", "trainer.epochs=1000",
            "trainer.checkpoint_every_n_steps=null", "trainer.progress_bar=false"]
        start = time.perf_counter()
        run_dir = scratch / f"sweep_{index}"
        result = run_entry("parallab", ["train", *args], run_dir, timeout=1800, cwd=cwd)
        wall += time.perf_counter() - start
        if result.returncode == 0:
            speeds[record["layout"]] = read_metrics(run_dir)["samples_per_sec"]
    return wall, speeds


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--sweep-steps", type=int, default=100)
    parser.add_argument("--only", choices=list(CASES))
    args = parser.parse_args()
    for name, (cwd, overrides) in CASES.items():
        if args.only and name != args.only:
            continue
        scratch = scratch_dir(f"bench_advise_{name}_")
        wall, rows, command = advise(cwd, overrides, scratch / "advise")
        sweep_wall, speeds = sweep(cwd, command, scratch / "advise", args.sweep_steps, scratch)
        good = {r["layout"] for r in rows if r["verdict"] in ("reference", "matches")}
        best = max((s, layout) for layout, s in speeds.items() if layout in good)
        pick = next(r["layout"] for r in rows if r["ratio_to_best"] and
                    float(r["ratio_to_best"]) == 1.0)
        errors = [abs(float(r["memory_error"])) for r in rows if r["memory_error"]]
        measured = sum(1 for r in rows if r["samples_per_sec"])
        print(f"\n## {name}: {measured} of {len(rows)} candidates measured by advise; "
              f"{len(speeds)} of them ran in the sweep ({measured - len(speeds)} failed)")
        print(f"advise wall {wall:.1f} s, sweep wall ({args.sweep_steps} steps each) "
              f"{sweep_wall:.1f} s: ratio {wall / sweep_wall:.2f} (target <= 0.25)")
        print(f"recommended {pick}: {speeds.get(pick, float('nan')):.1f} samples/s in the sweep; "
              f"sweep's best matching {best[1]}: {best[0]:.1f}: ratio "
              f"{speeds.get(pick, float('nan')) / best[0]:.3f} (target >= 0.95)")
        within = sum(e <= 0.15 for e in errors)
        print(f"memory predictions: {within} of {len(errors)} within 15%, worst error "
              f"{max(errors):.1%} (target: all)")
        print("| layout | advise samples/s | sweep samples/s | verdict | memory error |")
        print("|---|---|---|---|---|")
        for r in rows:
            if r["samples_per_sec"]:
                print(f"| {r['layout']} | {float(r['samples_per_sec']):.1f} | "
                      f"{speeds.get(r['layout'], float('nan')):.1f} | {r['verdict']} | "
                      f"{float(r['memory_error'] or 0):+.1%} |")


if __name__ == "__main__":
    main()
