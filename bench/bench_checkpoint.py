"""What a checkpoint costs: seconds per save, and its share of an epoch at the default interval.

    python bench/bench_checkpoint.py [--saves 20]

For the MNIST recipe's CNN (SGD) and the default gpt (AdamW), saves the full training state (model,
optimizer, scaler, position, RNG) the way a run does (temporary file, fsync, rename) into a
fresh dir, and relates the median save to the step time of `python train.py` measured in
the same sitting: an epoch holds a save every trainer.checkpoint_every_n_steps plus one at
its end.
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))
from parallab.config.schema import TrainerConfig  # noqa: E402
from parallab.data.bytetext import Bytes  # noqa: E402
from parallab.launching.distributed import Dist  # noqa: E402
from parallab.models.gpt import GPT  # noqa: E402
from parallab.models.mnist_cnn import MnistCNN  # noqa: E402
from parallab.testing import scratch_dir, train_metrics
from parallab.training.checkpoint import Checkpointer  # noqa: E402


def mnist_cnn() -> tuple[torch.nn.Module, torch.optim.Optimizer, torch.Tensor, int]:
    model = MnistCNN()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.5)
    return model, optimizer, torch.randn(8, 1, 28, 28), math.ceil(60_000 / 64)


def gpt() -> tuple[torch.nn.Module, torch.optim.Optimizer, torch.Tensor, int]:
    model = GPT()  # conf/model/gpt.yaml's sizes are GPT's defaults
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    train, _ = Bytes().make(seed=0)
    return model, optimizer, torch.randint(256, (2, 256)), math.ceil(len(train) / 32)


MODELS = {"mnist_cnn": (mnist_cnn, []),
          "gpt": (gpt, ["model=gpt", "data=bytes", "optim=adamw", "data.eval_fraction=0.002"])}


def save_seconds(build, saves: int, directory: Path) -> tuple[float, int, int]:
    model, optimizer, inputs, steps_per_epoch = build()
    model(inputs).float().sum().backward()
    optimizer.step()  # optimizer state exists, as mid-run
    state = {"model": model.state_dict(), "optimizer": optimizer.state_dict(),
             "grad_scaler": {}, "step": 500, "epoch": 0, "epoch_step": 500}
    dist = Dist(0, 0, 1, 1, torch.device("cpu"), None)
    checkpointer = Checkpointer(directory, dist, {"model": {}}, keep_last_k=3)
    times = []
    for i in range(saves):
        start = time.perf_counter()
        path = checkpointer.save(state, f"step_{i:08d}")
        times.append(time.perf_counter() - start)
    return statistics.median(times), path.stat().st_size, steps_per_epoch


def step_seconds(overrides: list[str], run_dir: Path) -> float:
    return train_metrics(["trainer.max_steps=30", "device=cpu",
                          "trainer.checkpoint_every_n_steps=null", *overrides], run_dir,
                         timeout=None)["step_time_ms"] / 1e3


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--saves", type=int, default=20)
    args = parser.parse_args()
    work = scratch_dir("parallab-bench-ckpt-")
    interval = TrainerConfig().checkpoint_every_n_steps
    print("| model | checkpoint size | seconds per save (median) | step s | steps per epoch | "
          f"saves per epoch (every {interval} steps + epoch end) | share of the epoch |")
    print("|---|---|---|---|---|---|---|")
    for name, (build, overrides) in MODELS.items():
        per_save, size, steps = save_seconds(build, args.saves, work / name / "checkpoints")
        step = step_seconds(overrides, work / name / "run")
        saves = math.floor((steps - 1) / interval) + 1
        share = saves * per_save / (steps * step)
        print(f"| {name} | {size / 2**20:.2f} MiB | {per_save:.4f} | {step:.4f} | {steps} | "
              f"{saves} | {100 * share:.3f}% |", flush=True)


if __name__ == "__main__":
    main()
