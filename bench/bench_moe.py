"""Mixture of experts, measured here: expert parallelism against FSDP, grouped matmul
against the loop over experts, and the all-to-all's share of a step.

    python bench/bench_moe.py [--steps 30] [--repeats 3]

Part 1: tokens/s of a gpt whose experts hold most of its weights (4 blocks, each 8 experts
of width 1024, 2 a token, over a width of 256: 25.2M of its 26.4M weights), as a user runs
it, at 2 and 4 ranks: fsdp (every rank gathers every expert) against fsdp with parallel.ep
= the ranks (each rank holds its experts, the tokens go to them), the same global batch,
side by side, each pair `--repeats` times interleaved; their ratio. Goal: ep at least as
fast as fsdp.
Part 2: one MoE layer's experts, forward and backward, grouped_mm against the loop over
experts, float32 and bfloat16 (where grouped_mm takes them), in this process.
Part 3: the all-to-all's share of an ep step: each rank's exchanges of one step (per MoE
layer: counts and expert ids once, tokens out and back, forward and backward), replayed
alone over gloo at the step's sizes, against the step's measured time.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch

from parallab.testing import scratch_dir, train_metrics

WIDTH, HIDDEN, EXPERTS, TOP_K, LAYERS, SEQ, GLOBAL = 256, 1024, 8, 2, 4, 128, 32
GPT = ["model=gpt", "data=bytes", "optim=adamw", "device=cpu", "trainer.epochs=1",
       "trainer.checkpoint_every_n_steps=null", "trainer.progress_bar=false",
       "trainer.save_best=false", "data.eval_fraction=0.002", f"model.layers={LAYERS}",
       f"model.width={WIDTH}", "model.heads=4", f"model.context={SEQ}",
       f"model.moe.experts={EXPERTS}", f"model.moe.top_k={TOP_K}", f"model.moe.width={HIDDEN}"]


def layouts(world: int) -> dict[str, list[str]]:
    base = ["parallel=fsdp", f"parallel.world_size={world}", f"data.batch_size={GLOBAL // world}"]
    return {f"fsdp {world}": base, f"fsdp {world} + ep {world}": [*base, f"parallel.ep={world}"]}


def part1(steps: int, repeats: int, work: Path) -> dict[str, float]:
    print("| layout | tokens/s (median) | runs | step ms | ep / fsdp |\n|---|---|---|---|---|")
    steps_ms = {}
    for world in (2, 4):
        found: dict[str, list[dict]] = {name: [] for name in layouts(world)}
        for r in range(repeats):
            for name, overrides in layouts(world).items():
                found[name].append(train_metrics(
                    [*GPT, *overrides, f"trainer.max_steps={steps}"],
                    work / f"{name.replace(' ', '_')}_{r}", timeout=None))
        fsdp = statistics.median(m["tokens_per_sec"] for m in found[f"fsdp {world}"])
        for name, runs in found.items():
            tokens = statistics.median(m["tokens_per_sec"] for m in runs)
            step = statistics.median(m["step_time_ms"] for m in runs)
            steps_ms[name] = step
            ratio = f"{tokens / fsdp:.2f}" if "ep" in name else ""
            each = ", ".join(f"{m['tokens_per_sec']:,.0f}" for m in runs)
            print(f"| {name} | {tokens:,.0f} | {each} | {step:.0f} | {ratio} |", flush=True)
    return steps_ms


def part2() -> None:
    from parallab.models.experts import Experts

    print("\n| dtype | grouped_mm ms | loop ms | loop / grouped |\n|---|---|---|---|")
    tokens = GLOBAL // 2 * SEQ  # a rank's tokens at 2 ranks
    for dtype in (torch.float32, torch.bfloat16):
        layer = Experts(EXPERTS, WIDTH, HIDDEN, TOP_K).to(dtype)
        x = torch.randn(tokens, WIDTH, dtype=dtype, requires_grad=True)
        ids = torch.stack([torch.randperm(EXPERTS)[:TOP_K] for _ in range(tokens)])
        weights = torch.rand(tokens, TOP_K)
        seconds = {}
        for grouped in (True, False):
            layer.grouped = grouped
            times = []
            for _ in range(12):
                start = time.perf_counter()
                layer(x, ids, weights).sum().backward()
                times.append(time.perf_counter() - start)
            seconds[grouped] = statistics.median(times[2:])
        print(f"| {str(dtype).removeprefix('torch.')} | {seconds[True] * 1e3:.1f} | "
              f"{seconds[False] * 1e3:.1f} | {seconds[False] / seconds[True]:.2f} |", flush=True)


def _exchanges(rank: int, world: int, store: str, out: str) -> None:
    """A step's all-to-alls of an ep rank, per MoE layer as the dispatch sends them: the
    counts and the tokens' expert ids once, the tokens (with their router weights) out and
    their outputs back, forward and backward; each token once to each rank holding any of
    its experts (random routing's average of them), at even splits."""
    import torch.distributed as dist

    from parallab.simulate.experts import ranks_a_token

    torch.set_num_threads(max(1, (os.cpu_count() or 2) // world))
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    units = int(GLOBAL // world * SEQ * ranks_a_token(EXPERTS, TOP_K, world, "random"))
    units -= units % world
    rows, ids = torch.randn(units, WIDTH + TOP_K), torch.zeros(units, TOP_K, dtype=torch.long)
    counts = torch.full((world,), units // world)
    times = []
    for _ in range(5):
        dist.barrier()
        start = time.perf_counter()
        for _ in range(LAYERS):
            dist.all_to_all_single(torch.empty_like(counts), counts)
            dist.all_to_all_single(torch.empty_like(ids), ids)
            for _ in range(4):
                dist.all_to_all_single(torch.empty_like(rows), rows)
        dist.barrier()
        times.append(time.perf_counter() - start)
    if rank == 0:
        Path(out).write_text(str(statistics.median(times)))
    dist.destroy_process_group()


def part3(steps_ms: dict[str, float]) -> None:
    import torch.multiprocessing as mp

    print("\n| layout | all-to-all ms a step | step ms | share |\n|---|---|---|---|")
    for world in (2, 4):
        with tempfile.TemporaryDirectory() as tmp:
            out = f"{tmp}/seconds"
            mp.spawn(_exchanges, args=(world, f"{tmp}/store", out), nprocs=world)
            exchange = float(Path(out).read_text()) * 1e3
        step = steps_ms[f"fsdp {world} + ep {world}"]
        print(f"| fsdp {world} + ep {world} | {exchange:.1f} | {step:.0f} | "
              f"{exchange / step:.0%} |", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    steps_ms = part1(args.steps, args.repeats, scratch_dir("parallab-bench-moe-"))
    part2()
    part3(steps_ms)


if __name__ == "__main__":
    main()
