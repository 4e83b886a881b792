"""What a checkpoint costs: seconds per save, and its share of an epoch at the default interval.

    python bench/bench_checkpoint.py [--saves 20]

Saves the seed CNN's full training state (model, SGD momentum, scaler, position, RNG) the
way a run does (temporary file, fsync, rename) into a fresh dir, and relates the median
save time to one epoch of `python train.py` measured in the same sitting.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))
from parallab.checkpoint import Checkpointer  # noqa: E402
from parallab.config import MnistCnnConfig, TrainerConfig  # noqa: E402
from parallab.distributed import Dist  # noqa: E402
from parallab.models.mnist_cnn import MnistCNN  # noqa: E402


def save_seconds(saves: int, directory: Path) -> tuple[float, int]:
    model = MnistCNN(MnistCnnConfig())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.5)
    model(torch.randn(8, 1, 28, 28)).sum().backward()
    optimizer.step()  # momentum buffers exist, as mid-run
    state = {"model": model.state_dict(), "optimizer": optimizer.state_dict(),
             "grad_scaler": {}, "step": 500, "epoch": 0, "epoch_step": 500}
    dist = Dist(0, 0, 1, 1, torch.device("cpu"), None)
    checkpointer = Checkpointer(directory, dist, {"model": {"name": "mnist_cnn"}}, keep_last_k=3)
    times = []
    for i in range(saves):
        start = time.perf_counter()
        path = checkpointer.save(state, f"step_{i:08d}")
        times.append(time.perf_counter() - start)
    return statistics.median(times), path.stat().st_size


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--saves", type=int, default=20)
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="parallab-bench-ckpt-"))
    per_save, size = save_seconds(args.saves, work / "checkpoints")
    subprocess.run([sys.executable, str(REPO / "train.py"), "trainer.epochs=1", "device=cpu",
                    "trainer.checkpoint_every_n_steps=null", f"hydra.run.dir={work / 'run'}"],
                   check=True, capture_output=True)
    metrics = json.loads((work / "run" / "metrics.json").read_text())
    interval = TrainerConfig().checkpoint_every_n_steps
    saves_per_epoch = math.floor((metrics["steps"] - 1) / interval) + 1  # + the epoch-end one
    share = saves_per_epoch * per_save / metrics["epoch_time_s"]
    print("| model | checkpoint size | seconds per save (median) | epoch s | saves per epoch "
          f"(every {interval} steps + epoch end) | share of the epoch |")
    print("|---|---|---|---|---|---|")
    print(f"| mnist_cnn | {size / 1024:.0f} KiB | {per_save:.4f} | "
          f"{metrics['epoch_time_s']:.2f} | {saves_per_epoch} | {100 * share:.2f}% |")


if __name__ == "__main__":
    main()
