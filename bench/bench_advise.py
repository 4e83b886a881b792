"""`parallab advise` against the exhaustive sweep it replaces, run as a user runs both.

    python bench/bench_advise.py [--sweep-steps 100] [--only gpt|own_model|cnn] [--exhaustive]
                                 [advise overrides, e.g. 'advise.layouts=[none,ddp]']
    python bench/bench_advise.py --step-time [--only gpt|cnn]

For a small gpt (data=bytes) and for examples/own_model (a user's ResMLP with its stages),
at world size 2 on this CPU: `parallab advise` once (timed), then a sweep: candidates of
advise's grid trained by `parallab train` for --sweep-steps steps, one process each (a -m
sweep's jobs). Without --exhaustive the sweep replays the candidates advise measured, not
those it pruned (the memory savers it found not needed); with it, every candidate of
advise's full grid (advise.full_grid, composed in this process as advise composes it),
those train.py refuses (exit 2) and those that fail counted apart.

The sweep judges every candidate it trained as advise judges (advise.report.judge: its
losses over advise's measured steps against its precision's reference, within
advise.rtol), so it needs no verdict of advise's; its runs log the loss each step, as
advise's own do. Targets: the recommendation's samples/s within 5% of the sweep's best
matching candidate; advise's wall time <= 25% of the sweep's; every memory prediction
within 15% of the measurement.
"""

from __future__ import annotations

import argparse
import csv
import shlex
import statistics
import time
from pathlib import Path

from parallab.testing import REPO, losses, read_metrics, run_entry, scratch_dir

# name: (working dir, its --config-dir or None, overrides)
CASES = {
    "gpt": (REPO, None, ["model=gpt", "data=bytes", "optim=adamw", "model.layers=4",
                         "model.width=128", "model.context=64", "data.global_batch_size=16"]),
    "own_model": (REPO / "examples" / "own_model", "conf",
                  ["experiment=waves", "data.global_batch_size=64"]),
    "cnn": (REPO, None, ["model=mnist_cnn", "data=mnist", "data.global_batch_size=64"]),
}
# --step-time: each layout's step at world sizes 2 and 4 against its prediction from the
# parts its job measured; one precision, no memory savers, so that the grid is the layouts
STEP_TIME = ["advise.precisions=[fp32]", "advise.activation_checkpointing=[none]",
             "advise.max_accumulation=1", "advise.only_needed=false"]
COMMON = ["parallel.world_size=2", "device=cpu"]
NAN = float("nan")  # a figure a candidate has not


def advise(cwd: Path, args: list[str], run_dir: Path) -> tuple[float, list[dict], str]:
    """`parallab advise ARGS`, timed: its wall time, advise.csv's rows, its command."""
    start = time.perf_counter()
    result = run_entry("parallab", ["advise", *args], run_dir, timeout=1800, cwd=cwd)
    wall = time.perf_counter() - start
    if result.returncode != 0:
        raise SystemExit(result.stdout[-3000:] + result.stderr[-3000:])
    rows = list(csv.DictReader(open(run_dir / "advise.csv")))
    command = next(line for line in result.stdout.splitlines()
                   if line.startswith("parallab train"))
    return wall, rows, command


def grid(cwd: Path, config_dir: str | None, overrides: list[str]):
    """advise's full grid for `overrides` (fresh candidates, nothing measured), the
    composed advise options, and what its runs add to measure (dropout off), as `parallab
    advise OVERRIDES` composes them."""
    from parallab.advise import dropout_off, full_grid
    from parallab.cli import compose
    from parallab.config.hydra_app import typed_config

    args = ["advise.run=true", *overrides]
    cfg = typed_config(compose(args, cwd / config_dir if config_dir else None), args)
    return full_grid(cfg, args)[0], cfg.advise, dropout_off(cfg.model)


def advised(advise_dir: Path) -> set[str]:
    """The labels of the candidates advise ran (each wrote its overrides.yaml)."""
    import yaml

    return {yaml.safe_load(path.read_text())["layout"]
            for path in (advise_dir / "candidates").glob("*/overrides.yaml")}


def sweep(cwd: Path, command: str, candidates: list, steps: int, window: int,
          scratch: Path, measuring: list[str]) -> tuple[float, dict[str, int]]:
    """Each candidate trained `steps` steps in its own `parallab train` process with the
    user's settings of the recommended command; a run's samples/s and first `window`
    losses go into its figures, a refusal (exit 2) into its reason, a failure into its
    figures' error; each with `measuring` too (dropout off, as advise measures). The
    sweep's wall time and how many ran, were refused, failed."""
    from parallab.advise.candidates import user_overrides

    # the command after `parallab train`, less the recommended candidate's own settings
    user = user_overrides(shlex.split(command)[2:])
    counts = {"ran": 0, "refused": 0, "failed": 0}
    wall = 0.0
    for index, candidate in enumerate(candidates):
        args = user + candidate.overrides + measuring + [
            f"trainer.max_steps={steps + 5}", "trainer.epochs=1000",
            "trainer.checkpoint_every_n_steps=null", "trainer.progress_bar=false",
            "trainer.log_every_n_steps=1"]  # every loss, to judge the run
        run_dir = scratch / f"sweep_{index}"
        start = time.perf_counter()
        result = run_entry("parallab", ["train", *args], run_dir, timeout=1800, cwd=cwd)
        wall += time.perf_counter() - start
        said = (result.stdout + result.stderr).splitlines()
        last = next((line for line in reversed(said) if line.strip()), "no output")
        if result.returncode == 0:
            candidate.figures = {"samples_per_sec": read_metrics(run_dir)["samples_per_sec"],
                                 "losses": losses(run_dir)[:window]}
            counts["ran"] += 1
        elif result.returncode == 2:  # train.py's one-line refusal of the settings
            candidate.reason = last
            counts["refused"] += 1
        else:
            candidate.figures = {"error": f"exit {result.returncode}: {last}"}
            counts["failed"] += 1
        print(f"  {candidate.label}: {_outcome(candidate)}", flush=True)
    return wall, counts


def _outcome(candidate) -> str:
    if candidate.reason:
        return f"refused ({candidate.reason})"
    if "error" in candidate.figures:
        return f"failed ({candidate.figures['error']})"
    return f"{candidate.figures['samples_per_sec']:.1f} samples/s"


def compare(name: str, rows: list[dict], candidates: list, swept: list, counts: dict,
            wall: float, sweep_wall: float, steps: int, exhaustive: bool) -> None:
    """advise's answer against the sweep's: speed of the pick, wall time, memory errors."""
    from parallab.advise import report

    by_label = {r["layout"]: r for r in rows}
    measured = sum(1 for r in rows if r["samples_per_sec"])
    pick = next(r["layout"] for r in rows if r["ratio_to_best"] and
                float(r["ratio_to_best"]) == 1.0)
    speed = {c.label: c.figures["samples_per_sec"] for c in swept if c.measured}
    best = report.best(swept)
    kind = "every candidate of the grid" if exhaustive else "the candidates advise measured"
    print(f"\n## {name}: grid of {len(candidates)} candidates, {measured} measured by advise; "
          f"the sweep trained {kind}: {counts['ran']} ran, {counts['refused']} refused, "
          f"{counts['failed']} failed")
    print(f"advise wall {wall:.1f} s, sweep wall ({steps} steps each) {sweep_wall:.1f} s: "
          f"ratio {wall / sweep_wall:.2f} (target <= 0.25)")
    if best is None:
        print("the sweep has no candidate matching its reference")
    else:
        print(f"recommended {pick}: {speed.get(pick, NAN):.1f} samples/s in the sweep; "
              f"sweep's best matching {best.label}: {speed[best.label]:.1f}: ratio "
              f"{speed.get(pick, NAN) / speed[best.label]:.3f} (target >= 0.95)")
    disagree = [c.label for c in swept if c.verdict and c.label in by_label and
                by_label[c.label]["verdict"] and report.correct(c) != (
                    by_label[c.label]["verdict"] in ("reference", "matches"))]
    print(f"verdicts: the sweep and advise disagree on {len(disagree)}: {disagree}")
    errors = [abs(float(r["memory_error"])) for r in rows if r["memory_error"]]
    if errors:
        print(f"memory predictions: {sum(e <= 0.15 for e in errors)} of {len(errors)} within "
              f"15%, worst error {max(errors):.1%} (target: all)")
    # the step-time model's check here: each step predicted from its measured parts
    here = [(float(r["predicted_step_ms_here"]), float(r["step_time_ms"])) for r in rows
            if r.get("predicted_step_ms_here")]
    if here:
        ratios = sorted(measured / predicted for predicted, measured in here)
        print(f"step time here from its parts: median error "
              f"{statistics.median(abs(r - 1) for r in ratios):.0%} over {len(here)} layouts, "
              f"measured / predicted {ratios[0]:.2f} to {ratios[-1]:.2f}")
    print("| layout | advise samples/s | sweep samples/s | sweep verdict | memory error | "
          "advise step ms | predicted here ms |")
    print("|---|---|---|---|---|---|---|")
    for c in sorted(swept, key=lambda c: -speed.get(c.label, -1.0)):
        row = by_label.get(c.label, {})
        advise_speed, error = row.get("samples_per_sec"), row.get("memory_error")
        print(f"| {c.label} | {f'{float(advise_speed):.1f}' if advise_speed else '-'} | "
              f"{speed.get(c.label, NAN):.1f} | {c.verdict or _outcome(c)} | "
              f"{f'{float(error):+.1%}' if error else '-'} | "
              f"{_ms(row.get('step_time_ms'))} | {_ms(row.get('predicted_step_ms_here'))} |")


def step_time(names: list[str], extra: list[str]) -> None:
    """advise's step-time model against its own measurements: each candidate's step at
    world sizes 2 and 4 predicted from the parts its launched job measured (its compute
    share over a one-rank group, what its collectives add to a replay of its step, a
    pipeline's parts through its schedule: docs/parallel.md, advise)."""
    ratios, twice, simulated = [], {}, []
    print("| model | world size | layout | measured ms | predicted ms | measured / predicted | "
          "simulated ms | measured / simulated |")
    print("|---|---|---|---|---|---|---|---|")
    for name in names:
        cwd, config_dir, overrides = CASES[name]
        flags = ["--config-dir", config_dir] if config_dir else []
        for n in (2, 4):
            scratch = scratch_dir(f"bench_advise_{name}_{n}_")
            args = [*flags, *overrides, f"parallel.world_size={n}", "device=cpu", *STEP_TIME,
                    *extra]
            _, rows, _ = advise(cwd, args, scratch / "advise")
            for row in rows:
                if row.get("predicted_step_ms_here") and row.get("step_time_ms"):
                    measured, predicted = (float(row[k]) for k in ("step_time_ms",
                                                                   "predicted_step_ms_here"))
                    ratios.append(measured / predicted)
                    twice.setdefault((name, row["layout"]), []).append(measured)
                    sim = float(row.get("simulated_step_ms_here") or NAN)
                    if sim == sim:
                        simulated.append(measured / sim)
                    print(f"| {name} | {n} | {row['layout']} | {measured:.1f} | "
                          f"{predicted:.1f} | {ratios[-1]:.2f} | {sim:.1f} | "
                          f"{measured / sim:.2f} |", flush=True)
    errors = [abs(r - 1) for r in ratios]
    print(f"\nmedian |error| {statistics.median(errors):.1%} over {len(ratios)} candidates; "
          f"measured / predicted {min(ratios):.2f} to {max(ratios):.2f} (goal: median <= 10%, "
          "every one within 1.3x)")
    if simulated:  # cluster=this's simulation, from the traced step alone: no part measured
        print(f"simulated here (cluster=this): median |error| "
              f"{statistics.median(abs(r - 1) for r in simulated):.1%} over {len(simulated)} "
              f"candidates; measured / simulated {min(simulated):.2f} to {max(simulated):.2f} "
              "(goal on the gpt: median <= 25%)")
    # a layout advise measured in both jobs (at world size 2 and among world size 4's
    # candidates): how far apart two measurements of one step are here, in one sitting
    apart = [max(ms) / min(ms) for ms in twice.values() if len(ms) > 1]
    if apart:
        print(f"the same candidate measured in both jobs: {min(apart):.2f} to "
              f"{max(apart):.2f} x apart (median {statistics.median(apart):.2f}) over "
              f"{len(apart)} candidates")


def _ms(value: str | None) -> str:
    return f"{float(value):.1f}" if value else "-"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--sweep-steps", type=int, default=100)
    parser.add_argument("--only", choices=list(CASES))
    parser.add_argument("--exhaustive", action="store_true",
                        help="sweep every candidate of advise's grid, not only those it measured")
    parser.add_argument("extra", nargs="*", help="more overrides for advise and its grid, "
                        "e.g. 'advise.layouts=[none,ddp]' 'advise.precisions=[fp32]'")
    parser.add_argument("--step-time", action="store_true",
                        help="the step-time model alone, at world sizes 2 and 4 (gpt, cnn)")
    args = parser.parse_args()
    if args.step_time:
        step_time([args.only] if args.only else ["gpt", "cnn"], args.extra)
        return
    from parallab.advise import report

    for name, (cwd, config_dir, overrides) in CASES.items():
        if args.only and name != args.only:
            continue
        scratch = scratch_dir(f"bench_advise_{name}_")
        chosen = [*overrides, *COMMON, *args.extra]
        flags = ["--config-dir", config_dir] if config_dir else []
        wall, rows, command = advise(cwd, flags + chosen, scratch / "advise")
        candidates, options, measuring = grid(cwd, config_dir, chosen)
        ran = advised(scratch / "advise")
        missing = ran - {c.label for c in candidates}
        if missing:  # the grid here is not advise's: the comparison would mean nothing
            raise SystemExit(f"advise ran candidates not in the grid composed here: {missing}")
        swept = candidates if args.exhaustive else [c for c in candidates if c.label in ran]
        print(f"{name}: sweeping {len(swept)} of {len(candidates)} candidates", flush=True)
        sweep_wall, counts = sweep(cwd, command, swept, args.sweep_steps,
                                   options.warmup_steps + options.steps, scratch, measuring)
        report.judge(swept, options.rtol)
        compare(name, rows, candidates, swept, counts, wall, sweep_wall, args.sweep_steps,
                args.exhaustive)


if __name__ == "__main__":
    main()
