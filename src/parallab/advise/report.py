"""The verdict on each measured candidate and the answer: advise.csv, advise.md, advise.png
and the one command that trains with the recommended layout."""

from __future__ import annotations

import csv
import shlex
from pathlib import Path
from typing import Any

from parallab.advise.candidates import cost
from parallab.parallel.grid import Candidate, kept_for

# the measured step time beside its prediction from its measured parts (the model's check)
COLUMNS = ["layout", "world_size", "predicted_memory_mb", "measured_memory_mb",
           "memory_error", "samples_per_sec", "ratio_to_best", "step_time_ms",
           "predicted_step_ms_here", "simulated_step_ms_here", "comm_mb_per_step", "verdict",
           "predicted_step_ms", "reason"]


def reference_of(candidates: list[Candidate], precision: str) -> Candidate | None:
    """The single-device (or smallest) measured layout in `precision`, fewest savers."""
    ran = [c for c in candidates if c.measured and c.precision == precision]
    return min(ran, key=lambda c: (c.world_size, c.layout.preset != "none", cost(c)),
               default=None)


def judge(candidates: list[Candidate], rtol: float) -> None:
    """Each measured candidate's losses against its precision's reference; those of a model
    with BatchNorm (its run's `batchnorm` figure) that normalise fewer rows at a time (per
    rank, micro-batch or accumulated batch) say so, a difference by design."""
    for candidate in (c for c in candidates if c.measured):
        reference = reference_of(candidates, candidate.precision)
        if reference is candidate:
            candidate.verdict = "reference"
            continue
        mine, theirs = candidate.figures["losses"], reference.figures["losses"]
        if len(mine) != len(theirs):
            candidate.verdict = f"differs: {len(mine)} losses against {len(theirs)}"
            continue
        worst = max(range(len(mine)), key=lambda i: _relative(mine[i], theirs[i]))
        error = _relative(mine[worst], theirs[worst])
        candidate.verdict = "matches" if error <= rtol else (
            f"differs: step {worst + 1} loss {mine[worst]:.6g} vs {theirs[worst]:.6g} "
            f"({error:.1e} relative)")
        if error > rtol and candidate.figures.get("batchnorm") and \
                _splits_rows(candidate, reference):
            candidate.verdict += "; BatchNorm normalises each rank's or micro-batch's rows"


def _splits_rows(candidate: Candidate, reference: Candidate) -> bool:
    """The candidate's forward sees fewer rows at once than its reference's."""
    def split(c: Candidate) -> int:  # a pipeline's micro-batches, each accumulated
        return c.layout.dp * c.layout.passes
    return split(candidate) > split(reference)


def _relative(a: float, b: float) -> float:
    return abs(a - b) / max(abs(b), 1e-12)


def correct(candidate: Candidate) -> bool:
    return candidate.verdict in ("reference", "matches")


def best(candidates: list[Candidate]) -> Candidate | None:
    """The fastest candidate whose losses match its reference."""
    good = [c for c in candidates if c.measured and correct(c) and c.figures.get(
        "samples_per_sec")]
    return max(good, key=lambda c: c.figures["samples_per_sec"], default=None)


def rows(candidates: list[Candidate]) -> list[dict[str, Any]]:
    top = best(candidates)
    top_speed = top.figures["samples_per_sec"] if top else None
    table = []
    for c in sorted(candidates, key=lambda c: (not c.measured,
                                               -(c.figures.get("samples_per_sec") or 0))):
        f = c.figures
        speed = f.get("samples_per_sec")
        measured = f.get("measured_memory_mb")
        table.append({
            "layout": c.label, "world_size": c.world_size,
            "predicted_memory_mb": c.predicted_mb, "measured_memory_mb": measured,
            "memory_error": (c.predicted_mb / measured - 1) if c.predicted_mb and measured
            else None,
            "samples_per_sec": speed,
            "ratio_to_best": speed / top_speed if speed and top_speed else None,
            "step_time_ms": f.get("step_time_ms"), "comm_mb_per_step": f.get("comm_mb_per_step"),
            "verdict": c.verdict, "predicted_step_ms": f.get("predicted_step_ms"),
            "predicted_step_ms_here": f.get("predicted_step_ms_here"),
            "simulated_step_ms_here": f.get("simulated_step_ms_here"),
            "reason": c.reason or f.get("error"),
        })
    return table


def _cell(value: Any) -> str:
    if value is None:
        return ""
    if isinstance(value, float):
        return f"{value:.3g}" if abs(value) < 10 else f"{value:,.1f}"
    return str(value)


def write(candidates: list[Candidate], run_dir: Path, command: str | None,
          notes: list[str]) -> list[dict[str, Any]]:
    table = rows(candidates)
    with open(run_dir / "advise.csv", "w", newline="") as out:
        writer = csv.DictWriter(out, fieldnames=COLUMNS)
        writer.writeheader()
        writer.writerows(table)
    shown = [k for k in COLUMNS if any(r[k] is not None for r in table)]
    lines = ["# parallab advise", ""]
    lines += [f"Recommended: `{command}`" if command else "No candidate ran and matched "
              "its reference.", "", *notes, "",
              "| " + " | ".join(shown) + " |", "|" + "---|" * len(shown)]
    lines += ["| " + " | ".join(_cell(r[k]).replace("|", "/") for k in shown) + " |"
              for r in table]
    (run_dir / "advise.md").write_text("\n".join(lines) + "\n")
    _plot(candidates, run_dir / "advise.png")
    return table


def _plot(candidates: list[Candidate], path: Path) -> None:
    """samples/s against memory per rank, the Pareto front (nothing both faster and
    smaller) marked; layouts whose losses differ drawn apart."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ran = [c for c in candidates if c.measured and c.figures.get("samples_per_sec")]
    points = [(c.figures["measured_memory_mb"], c.figures["samples_per_sec"], c) for c in ran]
    front = [p for p in points if correct(p[2]) and not any(
        q[0] <= p[0] and q[1] >= p[1] and q != p and correct(q[2]) for q in points)]
    figure, axes = plt.subplots(figsize=(8, 5))
    for memory, speed, c in points:
        axes.scatter(memory, speed, marker="o" if correct(c) else "x",
                     color="tab:blue" if correct(c) else "tab:red")
        axes.annotate(c.label, (memory, speed), fontsize=6, alpha=0.8)
    front.sort()
    axes.plot([p[0] for p in front], [p[1] for p in front], color="tab:green",
              label="Pareto front")
    axes.set_xlabel("memory per rank: state + activations (MB)")
    axes.set_ylabel("samples/s")
    axes.set_title("parallab advise (x: losses differ from the reference)")
    axes.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


def command(entry: list[str], user: list[str], candidate: Candidate, global_batch: int) -> str:
    """The command line (`entry`: python train.py, any --config-dir) that trains with
    `candidate`."""
    extra = [] if any(o.startswith("data.global_batch_size=") for o in user) else [
        f"data.global_batch_size={global_batch}"]
    user = kept_for(user, candidate.layout)
    return " ".join([entry[0], *(shlex.quote(o) for o in [*entry[1:], *user, *extra,
                                                          *candidate.overrides])])
