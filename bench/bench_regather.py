"""Sequence parallelism's gathered inputs kept to backward, or gathered again there
(parallel.regather_in_backward): activations kept and step time, side by side.

    python bench/bench_regather.py [--repeats 3] [--steps 30] [-- extra overrides]

Kept bytes: one forward and loss of the default gpt on one batch, split over a real
2-rank gloo tp group with the sequence cut, counted on rank 0 with saved_tensors_hooks
(activations.saved_for_backward: what a rank keeps, whatever the device). Step time:
`python train.py model=gpt data=bytes parallel=tp parallel.world_size=2
parallel.sequence_parallel=true parallel.regather_in_backward=M` in a fresh process each,
the two interleaved over the repeats; the best run's median step time each.
"""

from __future__ import annotations

import argparse
import os
import statistics

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from parallab.cli import compose
from parallab.testing import free_port, interleaved_runs, scratch_dir

RUN = ["model=gpt", "data=bytes", "device=cpu", "trainer.log_every_n_steps=10",
       "trainer.checkpoint_every_n_steps=null", "data.eval_fraction=0.01", "parallel=tp",
       "parallel.world_size=2", "parallel.sequence_parallel=true"]
MODES = ("false", "true")


def _kept(rank: int, extra: list[str], port: int, out) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    from parallab.loss import build_loss, resolve
    from parallab.models import build_model
    from parallab.parallel import activations, tp_plans

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    mesh = init_device_mesh("cpu", (2,))
    cfg = compose([*RUN, *extra])
    found = {}
    for mode in MODES:
        torch.manual_seed(0)
        model = build_model(cfg.model)
        loss = build_loss(resolve(dict(cfg.loss), None, None))
        sharded = tp_plans.split(model, mesh, None, True, loss, regather=mode == "true")
        tokens = torch.randint(0, cfg.model.vocab_size, (cfg.data.batch_size, cfg.model.context))
        with tp_plans.loss_context(sharded), activations.saved_for_backward(model) as saved:
            value = loss.bind(model).step_loss(model, (tokens, tokens), tokens.numel())[1]
            found[mode] = saved()
        with tp_plans.loss_context(sharded):
            value.backward()
    if rank == 0:
        out.put(found)
    dist.destroy_process_group()


def kept_bytes(extra: list[str]) -> dict[str, int]:
    context = mp.get_context("spawn")
    out = context.Queue()
    port = free_port()
    mp.start_processes(_kept, args=(extra, port, out), nprocs=2, start_method="spawn")
    return out.get()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("extra", nargs="*", help="more overrides")
    args = parser.parse_args()
    kept = kept_bytes(args.extra)
    work = scratch_dir("parallab-bench-regather-")
    runs = interleaved_runs(MODES, lambda mode: [
        *RUN, f"trainer.max_steps={args.steps}", f"parallel.regather_in_backward={mode}",
        *args.extra], args.repeats, work)
    best = {mode: min(r["step_time_ms"] for r in results) for mode, results in runs.items()}
    print(f"\ngpt defaults, tp 2 with sequence parallelism, data=bytes {' '.join(args.extra)}\n")
    print("| regather_in_backward | kept for backward, a rank (MB) | vs false | step (ms, best "
          f"of {args.repeats}) | vs false | median of runs (ms) | all-gathers a step (MB) |")
    print("|---|---|---|---|---|---|---|")
    for mode in MODES:
        median = statistics.median(r["step_time_ms"] for r in runs[mode])
        print(f"| {mode} | {kept[mode] / 2**20:.1f} | {kept[mode] / kept['false']:.2f} | "
              f"{best[mode]:.1f} | {best[mode] / best['false']:.2f} | {median:.1f} | "
              f"{runs[mode][0]['comm_all_gather_mb']:.2f} |")


if __name__ == "__main__":
    main()
