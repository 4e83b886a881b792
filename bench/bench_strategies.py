"""Every parallel strategy on the gpt model, run as a user runs it, side by side.

    python bench/bench_strategies.py [--steps 12] [--memory-only]

Part 1, memory: parameters + gradients + optimizer state (AdamW) held per rank
(metrics.json's state_memory_mb) of fsdp against ddp at world sizes 2 and 4, for the default
gpt. Targets: fsdp <= 0.6 x ddp at 2 ranks, <= 0.35 x at 4.
Part 2, throughput: samples/s and peak memory per rank of each strategy at the same global
batch on a smaller gpt, so the whole table runs in a few minutes on a 2-core CPU.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from parallab.testing import scratch_dir, train_metrics

GPT = ["model=gpt", "data=bytes", "optim=adamw", "device=cpu", "trainer.epochs=1",
       "trainer.checkpoint_every_n_steps=null", "trainer.progress_bar=false"]
SMALL = ["model.layers=4", "model.width=128", "model.heads=4", "model.context=128"]
GLOBAL_BATCH = 16
STRATEGIES = {  # name -> overrides at GLOBAL_BATCH samples per step
    "none": ["parallel=none", f"data.batch_size={GLOBAL_BATCH}"],
    "ddp 2": ["parallel=ddp", "parallel.world_size=2", f"data.batch_size={GLOBAL_BATCH // 2}"],
    "fsdp 2": ["parallel=fsdp", "parallel.world_size=2", f"data.batch_size={GLOBAL_BATCH // 2}"],
    "model 2": ["parallel=model", "parallel.world_size=2", f"data.batch_size={GLOBAL_BATCH}"],
    "pipeline 2 gpipe": ["parallel=pipeline", "parallel.world_size=2", "parallel.schedule=gpipe",
                         f"data.batch_size={GLOBAL_BATCH}"],
    "pipeline 2 1f1b": ["parallel=pipeline", "parallel.world_size=2", "parallel.schedule=1f1b",
                        f"data.batch_size={GLOBAL_BATCH}"],
}


def run(overrides: list[str], run_dir: Path) -> dict:
    return train_metrics([*GPT, *overrides], run_dir, timeout=None)


def memory(work: Path) -> None:
    print("| world size | ddp MB/rank | fsdp MB/rank | fsdp / ddp | target |")
    print("|---|---|---|---|---|")
    for world, target in ((2, 0.6), (4, 0.35)):
        held = {}
        for parallel in ("ddp", "fsdp"):
            metrics = run([f"parallel={parallel}", f"parallel.world_size={world}",
                           "data.batch_size=2", "trainer.max_steps=3", "trainer.warmup_steps=0",
                           "data.eval_fraction=0.002"], work / f"{parallel}{world}")
            held[parallel] = metrics["state_memory_mb"]
        ratio = held["fsdp"] / held["ddp"]
        print(f"| {world} | {held['ddp']:.1f} | {held['fsdp']:.1f} | {ratio:.3f} | "
              f"<= {target} {'met' if ratio <= target else 'MISSED'} |", flush=True)


def throughput(work: Path, steps: int) -> None:
    print(f"\n| strategy (gpt {' '.join(SMALL)}, global batch {GLOBAL_BATCH}) | samples/s | "
          "vs none | peak RSS MB/rank | state MB/rank | eval loss |")
    print("|---|---|---|---|---|---|")
    base = None
    for name, overrides in STRATEGIES.items():
        metrics = run([*SMALL, *overrides, f"trainer.max_steps={steps}", "trainer.warmup_steps=2",
                       "data.eval_fraction=0.005"], work / name.replace(" ", "_"))
        speed = metrics["samples_per_sec"]
        base = base or speed
        print(f"| {name} | {speed:,.1f} | {speed / base:.2f} | {metrics['peak_memory_mb']:,.0f} | "
              f"{metrics['state_memory_mb']:.1f} | {metrics['eval_loss']:.3f} |", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--memory-only", action="store_true")
    args = parser.parse_args()
    work = scratch_dir("parallab-bench-strategies-")
    memory(work)
    if not args.memory_only:
        throughput(work, args.steps)


if __name__ == "__main__":
    main()
