"""DDP throughput against a hand-written DDP loop, and what launching costs.

    python bench/bench_ddp.py [--world-sizes 1 2 4] [--repeats 2]

One MNIST epoch at each world size, one thread per rank, interleaved in one sitting:
  hand:     bench/hand_ddp.py (the DDP recipe's loop on in-memory data) under torchrun
  parallab: python train.py parallel=ddp (its elastic launch, metrics.json samples_per_sec)
Then the seconds from `python train.py parallel=ddp parallel.world_size=2
trainer.max_steps=1` to exit, against two concurrent `python -c "import torch, torchvision"`.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

from parallab.testing import scratch_dir, train_metrics

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent


def hand(world: int, out: Path) -> float:
    subprocess.run([str(BIN / "torchrun"), "--standalone", f"--nproc-per-node={world}",
                    str(REPO / "bench" / "hand_ddp.py"), str(out)],
                   check=True, capture_output=True, env={"OMP_NUM_THREADS": "1",
                                                         "GLOO_SOCKET_IFNAME": "lo",
                                                         "PATH": str(BIN)})
    return json.loads(out.read_text())["samples_per_sec"]


def parallab(world: int, run_dir: Path, *extra: str) -> float:
    return train_metrics(["parallel=ddp", f"parallel.world_size={world}",
                          "parallel.threads_per_worker=1", "trainer.epochs=1", "device=cpu",
                          *extra], run_dir, timeout=None)["samples_per_sec"]


def timed(commands: list[list[str]]) -> float:
    start = time.perf_counter()
    for process in [subprocess.Popen(c, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
                    for c in commands]:
        assert process.wait() == 0
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--world-sizes", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    work = scratch_dir("parallab-bench-ddp-")
    rows = []
    for world in args.world_sizes:
        runs = {"hand": [], "parallab": []}
        for repeat in range(args.repeats):
            runs["hand"].append(hand(world, work / f"hand{world}-{repeat}.json"))
            runs["parallab"].append(parallab(world, work / f"run{world}-{repeat}"))
        best = {k: max(v) for k, v in runs.items()}  # least disturbed by the shared machine
        rows.append((world, best["hand"], best["parallab"]))
        print(f"world_size {world}: hand {best['hand']:,.0f}, parallab {best['parallab']:,.0f} "
              f"samples/s", flush=True)

    base_hand, base_ours = rows[0][1], rows[0][2]
    print("\n| world size | hand-written DDP samples/s | parallab samples/s | parallab / hand "
          "| scaling efficiency (hand) | scaling efficiency (parallab) |")
    print("|---|---|---|---|---|---|")
    for world, h, p in rows:
        print(f"| {world} | {h:,.0f} | {p:,.0f} | {p / h:.3f} | "
              f"{h / (base_hand * world / rows[0][0]):.2f} | {p / (base_ours * world / rows[0][0]):.2f} |")

    imports = [[sys.executable, "-c", "import torch, torchvision"]] * 2
    launches = [[[sys.executable, str(REPO / "train.py"), "parallel=ddp",
                  "parallel.world_size=2", "trainer.max_steps=1", "device=cpu",
                  f"hydra.run.dir={work / f'launch{n}'}"]] for n in range(3)]  # a dir each
    import_s = statistics.median(timed(imports) for _ in range(3))
    launch_s = statistics.median(timed(launch) for launch in launches)
    print(f"\nlaunch: train.py parallel=ddp world_size=2 max_steps=1 exits in {launch_s:.1f}s; "
          f"two concurrent `import torch, torchvision` take {import_s:.1f}s")


if __name__ == "__main__":
    main()
