"""Every parallel strategy on the gpt model, run as a user runs it, side by side.

    python bench/bench_strategies.py [--steps 12] [--memory-only]

Part 1, memory: parameters + gradients + optimizer state (AdamW) held per rank
(metrics.json's state_memory_mb) of fsdp against ddp at world sizes 2 and 4, for the default
gpt. Targets: fsdp <= 0.6 x ddp at 2 ranks, <= 0.35 x at 4.
Part 2, throughput: samples/s and peak memory per rank of each strategy at the same global
batch on a smaller gpt, so the whole table runs in a few minutes on a 2-core CPU.
Part 3 (--layouts), the mesh layouts on the default gpt at a global batch of 8: training
state held per rank and the bytes each rank sends per step by collective kind (comm.py,
counted on the second step), next to the textbook volumes of ring algorithms. Targets:
ddp, fsdp and tp within 10% of the textbook; tp 2 holds <= 0.55 x ddp's state per rank;
hsdp 2x2 holds fsdp 2's state, its replicas all-reduce one half-size gradient shard;
accumulating, fsdp and hsdp reduce-scatter each micro-batch's gradients, hsdp's replicas
all-reduce once.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from parallab.testing import scratch_dir, textbook_volume, train_metrics

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
                           "data.batch_size=2", "trainer.max_steps=3",
                           "trainer.timing_skip_steps=0", "data.eval_fraction=0.002"],
                          work / f"{parallel}{world}")
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
        metrics = run([*SMALL, *overrides, f"trainer.max_steps={steps}",
                       "trainer.timing_skip_steps=2", "data.eval_fraction=0.005"],
                      work / name.replace(" ", "_"))
        speed = metrics["samples_per_sec"]
        base = base or speed
        print(f"| {name} | {speed:,.1f} | {speed / base:.2f} | {metrics['peak_memory_mb']:,.0f} | "
              f"{metrics['state_memory_mb']:.1f} | {metrics['eval_loss']:.3f} |", flush=True)


def textbook(layout: str, params: float, batch: int) -> dict[str, float]:
    """Bytes per rank and step by kind for the default gpt (4 layers, width 256, context
    256, vocabulary 256), parameters of `params` bytes, `batch` sequences per rank."""
    context, width = 256, 256
    tp = dict(tp=2, layers=4, activation=batch * context * width * 4)
    return {
        "ddp 4": lambda: textbook_volume(params, replicas=4),
        "fsdp 4": lambda: textbook_volume(params, shards=4),
        "fsdp 2": lambda: textbook_volume(params, shards=2),
        "fsdp 2 accumulating 2": lambda: textbook_volume(params, shards=2, micro=2),
        "hsdp 2x2 accumulating 2": lambda: textbook_volume(params, replicas=2, shards=2,
                                                             micro=2),
        "hsdp 2x2": lambda: textbook_volume(params, replicas=2, shards=2),
        "ddp 2 x fsdp 2": lambda: textbook_volume(params, replicas=2, shards=2),
        "tp 2": lambda: textbook_volume(params, **tp),
        "tp 2 sequence parallel": lambda: textbook_volume(params, **tp, sequence_parallel=True),
    }.get(layout, dict)()


LAYOUTS = {  # name -> (overrides, sequences per rank); a global batch of 8 each
    "ddp 4": (["parallel=ddp", "parallel.world_size=4"], 2),
    "fsdp 4": (["parallel=fsdp", "parallel.world_size=4"], 2),
    "fsdp 2": (["parallel=fsdp", "parallel.world_size=2"], 4),
    "hsdp 2x2": (["parallel=hsdp", "parallel.world_size=4"], 2),
    # each micro-batch's gradients reduce-scattered (the shards accumulate), the replicas'
    # all-reduce once a step
    "fsdp 2 accumulating 2": (["parallel=fsdp", "parallel.world_size=2",
                                 "trainer.accumulate_grad_batches=2"], 2),
    "hsdp 2x2 accumulating 2": (["parallel=hsdp", "parallel.world_size=4",
                                   "trainer.accumulate_grad_batches=2"], 1),
    "tp 2": (["parallel=tp", "parallel.world_size=2"], 8),
    "tp 2 sequence parallel": (["parallel=tp", "parallel.world_size=2",
                                "parallel.sequence_parallel=true"], 8),
    "fsdp_tp 2x2": (["parallel=fsdp_tp", "parallel.world_size=4"], 4),
    "pipeline 2": (["parallel=pipeline", "parallel.world_size=2"], 8),
    "pipeline 2 x dp 2": (["parallel=pipeline", "parallel.world_size=4", "parallel.pp=2"], 4),
    "pipeline 2 x tp 2": (["parallel=pipeline", "parallel.world_size=4", "parallel.pp=2",
                           "parallel.tp=2"], 8),
    "pipeline 2 x tp 2 sequence parallel": (["parallel=pipeline", "parallel.world_size=4",
                                             "parallel.pp=2", "parallel.tp=2",
                                             "parallel.sequence_parallel=true"], 8),
    "ddp 2 x fsdp 2": (["parallel=ddp", "parallel.world_size=4", "parallel.dp_shard=2"], 2),
    "pipeline 2 x fsdp 2": (["parallel=pipeline", "parallel.world_size=4", "parallel.pp=2",
                             "parallel.dp_shard=2", "parallel.dp_replicate=1"], 4),
}
KINDS = ("all_reduce", "all_gather", "reduce_scatter", "p2p")


def layouts(work: Path) -> None:
    from parallab.models.gpt import GPT

    params = 4 * sum(p.numel() for p in GPT().parameters())
    print(f"\n| layout (default gpt, global batch 8) | state MB/rank | vs ddp 4 | "
          f"{' | '.join(f'{k} MB' for k in KINDS)} | total MB/step | textbook MB | "
          "measured / textbook |")
    print("|---|---|---|" + "---|" * len(KINDS) + "---|---|---|")
    ddp = None
    for name, (overrides, batch) in LAYOUTS.items():
        m = run([*overrides, f"data.batch_size={batch}", "trainer.max_steps=2",
                 "trainer.timing_skip_steps=0", "trainer.log_every_n_steps=10",
                 "data.eval_fraction=0.002"], work / name.replace(" ", "_"))
        ddp = ddp or m["state_memory_mb"]
        expected = sum(textbook(name, params, batch).values()) / 2**20
        figures = " | ".join(f"{m.get(f'comm_{k}_mb', 0.0):.2f}" for k in KINDS)
        book, ratio = ((f"{expected:.2f}", f"{m['comm_mb_per_step'] / expected:.3f}")
                       if expected else ("-", "-"))
        print(f"| {name} | {m['state_memory_mb']:.2f} | {m['state_memory_mb'] / ddp:.2f} | "
              f"{figures} | {m['comm_mb_per_step']:.2f} | {book} | {ratio} |", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--memory-only", action="store_true")
    parser.add_argument("--layouts", action="store_true", help="part 3 alone")
    args = parser.parse_args()
    work = scratch_dir("parallab-bench-strategies-")
    if args.layouts:
        layouts(work)
        return
    memory(work)
    if not args.memory_only:
        throughput(work, args.steps)


if __name__ == "__main__":
    main()
