"""Activation checkpointing: activations kept for backward and step time, each mode
(none / full / selective / selective_alternate), side by side.

    python bench/bench_activations.py [--repeats 3] [--steps 40] [-- extra overrides]

Kept bytes: one forward and loss of the default gpt on one batch of data=bytes, counted
with saved_tensors_hooks (activations.saved_bytes: a figure that does not depend on the
device). Step time: `python train.py model=gpt data=bytes trainer.max_steps=STEPS
trainer.activation_checkpointing=M` in a fresh process each, the modes interleaved over the
repeats; the median step time (warm-up steps left out) of each run, the best run per mode.
peak_memory_mb is the run's own (CPU: resident set; CUDA: peak allocated).
"""

from __future__ import annotations

import argparse
import statistics

import torch
import torch.nn.functional as F

from parallab.cli import compose
from parallab.models import build_model
from parallab.parallel import activations
from parallab.testing import interleaved_runs, scratch_dir

RUN = ["model=gpt", "data=bytes", "device=cpu", "trainer.log_every_n_steps=10",
       "trainer.checkpoint_every_n_steps=null", "data.eval_fraction=0.01"]


def kept_bytes(mode: str, extra: list[str]) -> int:
    cfg = compose([*RUN, *extra])
    torch.manual_seed(0)
    model = activations.apply(build_model(cfg.model), mode)
    tokens = torch.randint(0, cfg.model.vocab_size, (cfg.data.batch_size, cfg.model.context))

    def forward() -> torch.Tensor:
        return F.cross_entropy(model(tokens).flatten(0, 1), tokens.flatten())

    return activations.saved_bytes(model, forward)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("extra", nargs="*", help="more overrides, e.g. device=cuda")
    args = parser.parse_args()
    work = scratch_dir("parallab-bench-activations-")
    kept = {mode: kept_bytes(mode, args.extra) for mode in activations.MODES}
    runs = interleaved_runs(activations.MODES, lambda mode: [
        *RUN, f"trainer.max_steps={args.steps}", f"trainer.activation_checkpointing={mode}",
        *args.extra], args.repeats, work)
    best = {mode: min(r["step_time_ms"] for r in results) for mode, results in runs.items()}
    print(f"\ngpt defaults, data=bytes {' '.join(args.extra)}\n")
    print("| activation_checkpointing | kept for backward (MB) | vs none | step (ms, best of "
          f"{args.repeats}) | vs none | median of runs (ms) | peak_memory_mb |")
    print("|---|---|---|---|---|---|---|")
    for mode in activations.MODES:
        median = statistics.median(r["step_time_ms"] for r in runs[mode])
        peak = max(r["peak_memory_mb"] for r in runs[mode])
        print(f"| {mode} | {kept[mode] / 2**20:.1f} | {kept[mode] / kept['none']:.2f} | "
              f"{best[mode]:.1f} | {best[mode] / best['none']:.2f} | {median:.1f} | "
              f"{peak:,.0f} |")


if __name__ == "__main__":
    main()
