"""Throughput and accuracy per precision mode, eager and compiled, side by side.

    python bench/bench_precision.py [--repeats 2] [--model mnist_cnn] [-- extra overrides]

Each configuration is `python train.py trainer.epochs=1 precision=P trainer.compile=C` in a
fresh process, interleaved over the repeats; best samples/s (warm-up steps, and so compile
time, left out) and median eval accuracy per configuration.
"""

from __future__ import annotations

import argparse
import itertools
import statistics
from pathlib import Path

from parallab.testing import scratch_dir, train_metrics


def run(run_dir: Path, overrides: list[str]) -> dict:
    return train_metrics(["trainer.epochs=1", *overrides], run_dir, timeout=None)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--precisions", nargs="+", default=["fp32", "amp", "bf16"])
    parser.add_argument("extra", nargs="*", help="more overrides, e.g. model=... device=cuda")
    args = parser.parse_args()
    work = scratch_dir("parallab-bench-precision-")
    configs = list(itertools.product(args.precisions, ["false", "true"]))
    results: dict[tuple[str, str], list[dict]] = {c: [] for c in configs}
    for repeat in range(args.repeats):
        for precision, compiled in configs:
            name = f"{precision}-compile_{compiled}-{repeat}"
            results[(precision, compiled)].append(run(work / name, [
                f"precision={precision}", f"trainer.compile={compiled}", *args.extra]))
            print(f"{name}: {results[(precision, compiled)][-1]['samples_per_sec']:,.0f} "
                  "samples/s", flush=True)
    base = max(r["samples_per_sec"] for r in results[(args.precisions[0], "false")])
    print(f"\n{' '.join(args.extra) or 'defaults'}\n")
    print("| precision | dtype | compile | samples/s (best) | vs fp32 eager | eval accuracy |")
    print("|---|---|---|---|---|---|")
    for (precision, compiled), runs in results.items():
        best = max(r["samples_per_sec"] for r in runs)
        accuracy = statistics.median(r["eval_accuracy"] for r in runs)
        print(f"| {precision} | {runs[0]['precision_dtype']} | {compiled} | {best:,.0f} | "
              f"{best / base:.2f} | {100 * accuracy:.2f}% |")


if __name__ == "__main__":
    main()
