"""data=token_files against the limit: a plain np.memmap slice loop, and its share of a step.

    python bench/bench_data.py [--tokens 100_000_000] [--seq-len 1024] [--batch 8]

One flat uint16 token file (nanoGPT's train.bin layout) of --tokens random ids, written
once to a scratch dir. Each reader takes the same number of batches of --batch windows of
seq_len + 1 tokens in a shuffled order and makes them int64 tensors x, y:
  plain:   the loop nanoGPT's get_batch runs, one memmap slice per window, np.stack
  loader:  data=token_files' training loader (one rank), read in the caller's thread
           (prefetch 0: its own cost) and ahead on its thread (prefetch 2)
with the page cache warm (the file read once before) and cold (its pages dropped with
posix_fadvise(DONTNEED) before each reader). Prints tokens/s per rank and each against the
plain loop's. Then the data's share of a small gpt's step (4 layers, width 128, a vocabulary
of 8,192, AdamW): the time each step waits for its batch over the step's, cold, prefetch 0
and 2.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from parallab.data.pretrain.blend import Source, Stream  # noqa: E402
from parallab.data.pretrain.files import open_tokens  # noqa: E402
from parallab.data.pretrain.loader import Samples, TokenLoader  # noqa: E402
from parallab.data.pretrain.windows import Windows  # noqa: E402
from parallab.launching.distributed import Dist  # noqa: E402
from parallab.testing import scratch_dir  # noqa: E402


def token_file(root: Path, tokens: int) -> Path:
    path = root / "train.bin"
    data = np.memmap(path, dtype=np.uint16, mode="w+", shape=(tokens,))
    rng = np.random.default_rng(0)
    for start in range(0, tokens, 1 << 24):
        chunk = data[start:start + (1 << 24)]
        chunk[:] = rng.integers(0, 50_257, len(chunk), dtype=np.uint16)
    data.flush()
    return path


def drop_cache(path: Path) -> None:
    """The file's pages out of the page cache (clean pages: no root needed)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def warm(path: Path) -> None:
    with open(path, "rb") as f:
        while f.read(1 << 24):
            pass


def plain(path: Path, seq_len: int, batch: int, batches: int) -> float:
    """nanoGPT's get_batch over a shuffled order of windows; seconds."""
    data = np.memmap(path, dtype=np.uint16, mode="r")
    order = np.random.default_rng(1).permutation((len(data) - 1) // seq_len)
    began = time.perf_counter()
    for b in range(batches):
        starts = order[b * batch:(b + 1) * batch] * seq_len
        window = np.stack([data[s:s + seq_len + 1] for s in starts]).astype(np.int64)
        x, y = torch.from_numpy(window[:, :-1]), torch.from_numpy(window[:, 1:])
    return time.perf_counter() - began


def loader(path: Path, seq_len: int, batch: int, prefetch: int) -> TokenLoader:
    windows = Windows([open_tokens(str(path), "uint16")], seq_len)
    dist = Dist(0, 0, 1, 1, torch.device("cpu"), None)
    return TokenLoader(Stream([Source("train", windows)], seed=1),
                       Samples("pair", False, False), dist, batch, prefetch, [], None)


def ours(path: Path, seq_len: int, batch: int, batches: int, prefetch: int) -> float:
    reader = loader(path, seq_len, batch, prefetch)
    reader.set_epoch(0)
    began = time.perf_counter()
    for i, (x, y) in enumerate(reader):
        if i + 1 == batches:
            break
    return time.perf_counter() - began


def rates(path: Path, args) -> None:
    tokens = args.batches * args.batch * args.seq_len
    for cache in ("warm", "cold"):
        figures = {}
        for name, read in (("plain", lambda: plain(path, args.seq_len, args.batch,
                                                   args.batches)),
                           ("loader, prefetch 0", lambda: ours(path, args.seq_len, args.batch,
                                                               args.batches, 0)),
                           ("loader, prefetch 2", lambda: ours(path, args.seq_len, args.batch,
                                                               args.batches, 2))):
            times = []
            for _ in range(args.repeats):
                drop_cache(path) if cache == "cold" else warm(path)
                times.append(read())
            figures[name] = tokens / statistics.median(times)
        for name, rate in figures.items():
            print(f"{cache:4}  {name:20} {rate / 1e6:8.1f} M tokens/s per rank   "
                  f"{rate / figures['plain']:.2f} of plain")


def step_share(path: Path, args) -> None:
    """The share of a small gpt's step spent waiting for the batch, the cache cold."""
    from parallab.models.gpt import GPT

    torch.manual_seed(0)
    model = GPT(vocab_size=8192, context=args.step_seq_len, layers=4, heads=4, width=128)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    for prefetch in (0, 2):
        drop_cache(path)
        reader = loader(path, args.step_seq_len, args.step_batch, prefetch)
        reader.set_epoch(0)
        batches, waited, total = iter(reader), [], []
        for step in range(args.steps):
            began = time.perf_counter()
            x, y = next(batches)
            x, y = x % 8192, y % 8192  # the file's ids are GPT-2's; the model's are fewer
            got = time.perf_counter()
            loss = torch.nn.functional.cross_entropy(model(x).flatten(0, 1), y.flatten())
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            if step >= 3:  # warm-up steps left out
                waited.append(got - began)
                total.append(time.perf_counter() - began)
        print(f"gpt step (4 x 128, vocab 8192, batch {args.step_batch} x {args.step_seq_len}), cold, "
              f"prefetch {prefetch}: {statistics.median(total) * 1e3:.1f} ms a step, data "
              f"{sum(waited) / sum(total):.2%} of it")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=100_000_000)
    parser.add_argument("--seq-len", type=int, default=1024)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--batches", type=int, default=500)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--step-batch", type=int, default=8)
    parser.add_argument("--step-seq-len", type=int, default=256)
    args = parser.parse_args()
    path = token_file(scratch_dir("bench_data_"), args.tokens)
    print(f"{args.tokens:,} uint16 tokens in {path}; batches of {args.batch} x "
          f"{args.seq_len + 1} tokens, {args.batches} a reader, median of {args.repeats}")
    rates(path, args)
    step_share(path, args)


if __name__ == "__main__":
    main()
