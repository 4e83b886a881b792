"""What parallab simulate leaves in its run dir: simulate.json (every layout, fastest
first), simulate.md (the table, the parts that make each step, the best command and its
sbatch lines), simulate.png (tokens/s per GPU against the GPU count for the best few)."""

from __future__ import annotations

import json
import os
import shlex
from pathlib import Path
from typing import Any

from parallab.config.errors import ConfigError, OneLineError
from parallab.parallel.grid import Candidate

ANSWER = ("simulate.json", "simulate.md", "simulate.png")

# the rest: exposed collectives by kind, and a pipeline schedule's own time (schedule_s,
# where a CPU pays it)
PARTS = ("compute_s", "bubble_s", "optimizer_s")


def entry(c: Candidate, fits: bool, command: str) -> dict[str, Any]:
    """One layout as simulate.json holds it."""
    p = c.prediction
    found: dict[str, Any] = {"layout": c.label, "command": command, "fits": fits,
                             "tokens_per_sec_per_gpu": None, "step_time_s": None, "mfu": None,
                             "memory_per_gpu_gb": c.memory_gb, "parts": {}}
    if p is not None:
        found.update({"tokens_per_sec_per_gpu": p.tokens_per_sec_per_gpu,
                      "step_time_s": p.step_time_s, "mfu": p.mfu, "parts": p.parts,
                      "memory_gb": p.memory})
    else:
        found["reason"] = c.reason or "its training state alone is over the GPU's memory"
    return found


def command_of(entry_words: list[str], user: list[str], c: Candidate) -> str:
    from parallab.parallel.grid import kept_for

    return shlex.join([*entry_words, *kept_for(user, c.layout), *c.overrides])


def sbatch(c: Candidate, gpus_per_node: int, command: str) -> list[str]:
    """The lines that give the layout its allocation: a task per GPU, spread over nodes as
    parallab's SLURM launcher spreads the same layout (launching.allocation.spread)."""
    from parallab.launching.allocation import spread

    try:
        held = spread(c.layout.world_size, None, None, gpus_per_node, "this layout")
    except ConfigError as error:  # no even spread: the launcher refuses it too
        return ["#!/bin/bash", f"# {error}"]
    return ["#!/bin/bash", f"#SBATCH --nodes={held.nodes}",
            f"#SBATCH --ntasks-per-node={held.tasks_per_node}",
            f"#SBATCH --gpus-per-node={held.tasks_per_node}", "#SBATCH --signal=USR1@90",
            "#SBATCH --requeue", f"srun --kill-on-bad-exit=1 {command}"]


def gib(size: float) -> str:
    """A size to tenths, small ones to two figures (not 0.0 beside 0.0)."""
    return f"{size:,.1f}" if size >= 1 else f"{size:.2g}"


def _part_names(entries: list[dict[str, Any]]) -> list[str]:
    kinds = sorted({k for e in entries for k in e.get("parts", {}) if k not in PARTS})
    return [*PARTS[:1], *kinds, *PARTS[1:]]


def markdown(head: dict[str, Any], entries: list[dict[str, Any]], rows: int,
             notes: list[str]) -> str:
    names = _part_names(entries)
    lines = [f"# parallab simulate: {head['model']} on {head['world_size']:,} x "
             f"{head['cluster']} ({head['gpu']})", "",
             f"Sequences of {head['seq_len']:,} tokens; {head['precision']}"
             f"{', compiled' if head['compile'] else ''}. A prediction, from one block traced "
             "on fake tensors (docs/parallel.md: planning for a cluster).", "",
             *_measured_when(head.get("measured")),
             "| layout | tokens/s/GPU | step s | MFU | memory GiB | fits | "
             + " | ".join(n.removesuffix("_s") for n in names) + " |",
             "|" + "---|" * (6 + len(names))]
    for e in entries[:rows]:
        tps = e["tokens_per_sec_per_gpu"]
        cells = [e["layout"], f"{tps:,.0f}" if tps else "-",
                 f"{e['step_time_s']:.3f}" if e["step_time_s"] else "-",
                 f"{e['mfu']:.1%}" if e["mfu"] else "-",
                 gib(e["memory_per_gpu_gb"]) if e["memory_per_gpu_gb"] else "-",
                 "yes" if e["fits"] else ("no" if e["memory_per_gpu_gb"] else
                                          e.get("reason") or "no")]
        cells += [f"{e['parts'][n]:.3f}" if n in e["parts"] else "" for n in names]
        lines.append("| " + " | ".join(cells) + " |")
    if len(entries) > rows:
        lines.append(f"\n{len(entries) - rows} more in simulate.json (simulate.rows="
                     f"{rows} here).")
    lines += ["", *notes]
    return "\n".join(lines) + "\n"


def _measured_when(measured: dict[str, Any] | None) -> list[str]:
    """cluster=this: when its rates were measured, and how busy the machine was then."""
    if measured is None:
        return []
    from parallab.simulate.this_machine import BUSY

    low = ": the rates may be low, the overheads high" if measured["busy"] > BUSY else ""
    return [f"This machine's rates were measured {measured['at']}, while other work took "
            f"{measured['busy']:.0%} of its cores{low} (cluster.remeasure=true measures them "
            "again).", ""]


def write(out: Path, head: dict[str, Any], entries: list[dict[str, Any]], rows: int,
          notes: list[str], curves: dict[str, list[tuple[int, float]]],
          measured: list[tuple[int, float, str]]) -> None:
    """The answer's three files, each written whole under a temporary name and all renamed
    at the end: a full disk leaves no half answer, and ends the command in one line."""
    made = {name: out / f".{name}.tmp" for name in ANSWER}
    try:
        made["simulate.json"].write_text(json.dumps({**head, "layouts": entries}, indent=2)
                                         + "\n")
        made["simulate.md"].write_text(markdown(head, entries, rows, notes))
        plot(made["simulate.png"], head, curves, measured)
        for name, temporary in made.items():
            os.replace(temporary, out / name)
    except OSError as error:
        for temporary in made.values():
            temporary.unlink(missing_ok=True)
        raise OneLineError(f"parallab simulate: the answer could not be written to {out} "
                           f"({error.strerror}): free space there, or give another "
                           "hydra.run.dir") from None


def plot(path: Path, head: dict[str, Any], curves: dict[str, list[tuple[int, float]]],
         measured: list[tuple[int, float, str]]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.8))
    for label, points in curves.items():
        if points:
            ax.plot([n for n, _ in points], [v for _, v in points], marker="o", label=label)
    for n, value, label in measured:
        ax.scatter([n], [value], marker="x", s=60, color="black")
        ax.annotate(label, (n, value), fontsize=7, xytext=(4, 4), textcoords="offset points")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("GPUs")
    ax.set_ylabel("tokens/s per GPU (predicted)")
    ax.set_title(f"{head['model']} on {head['cluster']}: seq {head['seq_len']:,}", fontsize=10)
    if ax.get_legend_handles_labels()[0]:  # matplotlib warns of an empty legend
        ax.legend(fontsize=7)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110, format="png")  # a temporary name: its suffix is not .png
    plt.close(fig)
