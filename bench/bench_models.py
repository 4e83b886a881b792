"""Throughput and accuracy of each model on its data, short CPU runs, one table.

    python bench/bench_models.py [--repeats 1] [-- extra overrides, e.g. device=cuda]

Each row is `python train.py model=M data=D ...` in a fresh process (parallel=none);
samples/s leaves out the warm-up steps. resnet18 trains on real MNIST (one channel, so a new
first conv) for a few hundred steps: CIFAR-10 is not shipped and this machine is offline.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from parallab.testing import scratch_dir, train_metrics

RUNS = {  # name -> overrides
    "mnist_cnn": ["model=mnist_cnn", "data=mnist", "trainer.epochs=1"],
    "mlp": ["model=mlp", "data=mnist", "trainer.epochs=1"],
    "lstm": ["model=lstm", "data=text", "optim=adam", "trainer.epochs=3"],
    "resnet18": ["model=resnet18", "data=mnist", "trainer.epochs=1", "trainer.max_steps=300"],
}


def run(run_dir: Path, overrides: list[str]) -> dict:
    return train_metrics(["trainer.checkpoint_every_n_steps=null", *overrides], run_dir,
                         timeout=None)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--models", nargs="+", default=list(RUNS))
    parser.add_argument("extra", nargs="*", help="more overrides for every run")
    args = parser.parse_args()
    # `--models mlp trainer.max_steps=100`: --models swallows the overrides after it
    args.extra += [m for m in args.models if "=" in m]
    args.models = [m for m in args.models if "=" not in m]
    unknown = [m for m in args.models if m not in RUNS]
    if unknown:
        parser.error(f"--models {' '.join(unknown)}: not one of {', '.join(RUNS)}")
    work = scratch_dir("parallab-bench-models-")
    best: dict[str, dict] = {}
    for repeat in range(args.repeats):
        for name in args.models:
            metrics = run(work / f"{name}-{repeat}", [*RUNS[name], *args.extra])
            print(f"{name}: {metrics['samples_per_sec']:,.0f} samples/s, eval accuracy "
                  f"{100 * metrics['eval_accuracy']:.2f}%", flush=True)
            if metrics["samples_per_sec"] > best.get(name, {}).get("samples_per_sec", 0):
                best[name] = metrics
    print("\n| model | data | steps | batch | samples/s | step ms (median) | eval accuracy |")
    print("|---|---|---|---|---|---|---|")
    for name, m in best.items():
        data = next(o.split("=")[1] for o in RUNS[name] if o.startswith("data="))
        print(f"| {name} | {data} | {m['steps']} | {m['global_batch_size']} | "
              f"{m['samples_per_sec']:,.0f} | {m['step_time_ms']:.1f} | "
              f"{100 * m['eval_accuracy']:.2f}% |")


if __name__ == "__main__":
    main()
