"""The DDP recipe on in-memory MNIST, as a user writes it by hand (for bench_ddp.py).

    torchrun --standalone --nproc-per-node=W bench/hand_ddp.py OUT.json
"""

import json
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DistributedSampler

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
from bench_loop import recipe_net  # noqa: E402

from parallab.data import mnist  # noqa: E402 (the IDX reader only)

WARMUP = 5


def main() -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    train = mnist.load(mnist.SHIPPED, "train")  # the copy parallab ships
    images, labels = (train.inputs.float() / 255 - 0.1307) / 0.3081, train.targets
    model = DDP(recipe_net())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.5)
    sampler = DistributedSampler(range(len(labels)), world, rank, shuffle=True, seed=42)
    sampler.set_epoch(0)
    order = torch.tensor(list(sampler))
    samples, start = 0, None
    for step, batch in enumerate(order.split(64)):
        if step == WARMUP:
            start = time.perf_counter()
        optimizer.zero_grad()
        loss = F.cross_entropy(model(images[batch]), labels[batch])
        loss.backward()
        optimizer.step()
        if step >= WARMUP:
            samples += len(batch) * world
    elapsed = time.perf_counter() - start
    if rank == 0:
        Path(sys.argv[1]).write_text(json.dumps({"samples_per_sec": samples / elapsed}))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
