"""What a rank holds when a sharded run starts from weights: laid out on meta, each rank
reading its part (trainer.init_from, the default where every tensor is saved), against
building and loading the whole model on every rank first (what trainer.init_strict=false
does, as every start from weights did before).

    python bench/bench_init.py [--width 1536] [--layers 8] [--repeats 2]

A gpt of `width` x `layers` is saved as one .pt and one .safetensors file; each is the
trainer.init_from of a 2-rank fsdp run of one step, both ways, alternating. The figure is
rank 0's start_memory_mb: its peak resident set once model, optimizer and data are built.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))
from parallab.models.gpt import GPT  # noqa: E402
from parallab.testing import scratch_dir, train_metrics  # noqa: E402
from parallab.training import checkpoint  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--width", type=int, default=1536)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    import safetensors.torch

    scratch = scratch_dir("parallab-bench-init-")
    model = GPT(width=args.width, layers=args.layers, heads=8, context=64)
    params = sum(p.numel() for p in model.parameters())
    files = {"pt": scratch / "w.pt", "safetensors": scratch / "w.safetensors"}
    checkpoint.save(files["pt"], {"model": model.state_dict()})
    safetensors.torch.save_model(model, str(files["safetensors"]))
    del model
    run = ["model=gpt", "data=bytes", "data.eval_fraction=0.002", f"model.width={args.width}",
           f"model.layers={args.layers}", "model.heads=8", "model.context=64",
           "parallel=fsdp", "parallel.world_size=2", "data.batch_size=2",
           "trainer.max_steps=1", "trainer.checkpoint_every_n_steps=null",
           "trainer.save_best=false", "device=cpu"]
    print(f"gpt {args.width} x {args.layers}: {params / 1e6:.0f} M parameters, "
          f"{params * 4 / 2**20:,.0f} MiB in float32; fsdp on 2 ranks\n")
    print("| file | whole model on each rank (MB) | each rank its part (MB) | ratio |")
    print("|---|---|---|---|")
    for kind, path in files.items():
        figures: dict[str, list[float]] = {"whole": [], "part": []}
        for repeat in range(args.repeats):
            for way, extra in (("whole", ["trainer.init_strict=false"]), ("part", [])):
                metrics = train_metrics([*run, f"trainer.init_from={path}", *extra],
                                        scratch / f"{kind}-{way}-{repeat}")
                figures[way].append(metrics["start_memory_mb"])
        whole, part = (statistics.median(figures[w]) for w in ("whole", "part"))
        print(f"| .{kind} | {whole:,.0f} | {part:,.0f} | {part / whole:.2f} |")


if __name__ == "__main__":
    torch.set_num_threads(1)
    main()
