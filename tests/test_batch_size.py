"""The batch-size finder: budget and out-of-memory stops, agreement across ranks, no side effects."""

from __future__ import annotations

import logging
import textwrap
import time

import pytest
import torch
from conftest import FAST, read_metrics

from parallab.data.loaders import MemoryLoader
from parallab.data.synthetic import Synthetic
from parallab.launching.distributed import Dist
from parallab.models.mnist_cnn import MnistCNN
from parallab.training.batch_size import find_batch_size

CPU_RANK = Dist(0, 0, 1, 1, torch.device("cpu"), None)


def test_trials_leave_model_and_optimizer_as_they_were():
    torch.manual_seed(0)
    model = MnistCNN()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    train = Synthetic(train_size=1024, eval_size=8).make(seed=0)[0]
    loader = MemoryLoader(train, CPU_RANK, 16, shuffle=True, seed=0)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    def step(batch):
        inputs, targets = batch
        torch.nn.functional.nll_loss(model(inputs), targets).backward()

    size, trials = find_batch_size(model, optimizer, step, loader, CPU_RANK, max_memory_mb=None)
    assert [t.batch_size for t in trials][:2] == [16, 32]
    # doubling while it pays; 256 is the last size whose 4 steps fit in the 1024 samples
    assert [t.batch_size for t in trials] == [16 * 2 ** i for i in range(len(trials))]
    assert size == [t.batch_size for t in trials if t.verdict == "fits"][-1] <= 256
    assert trials[-1].verdict in ("less than 5% faster", "shard too small")
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert optimizer.state_dict()["state"] == {}


def test_compiled_each_trial_and_the_run_get_a_graph_for_their_own_size():
    """Not the dynamic-shape graph torch.compile makes once it sees a second batch size."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(784, 10))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    loader = MemoryLoader(Synthetic(train_size=512, eval_size=8).make(seed=0)[0], CPU_RANK,
                          16, shuffle=True, seed=0)
    batches: list[object] = []  # the batch dimension of each graph compiled

    def recording(graph, inputs):
        batches.append(next(i.shape[0] for i in inputs  # a SymInt where dynamic
                            if isinstance(i, torch.Tensor) and i.dim() == 4))
        return graph.forward

    model.compile(backend=recording)

    def step(batch):
        inputs, targets = batch
        torch.nn.functional.cross_entropy(model(inputs), targets).backward()
        time.sleep(0.01)  # a step's fixed cost: each doubling is faster, whatever the noise

    size, trials = find_batch_size(model, optimizer, step, loader, CPU_RANK, None,
                                   compiled=True)
    step(next(iter(loader.resized(size))))
    assert len(trials) >= 4  # 16 to 128 fit, 256 is more than the shard holds
    assert batches == [t.batch_size for t in trials if t.verdict != "shard too small"] + [size]
    torch._dynamo.reset()


@pytest.mark.slow
def test_a_memory_budget_stops_the_search_and_the_run_goes_on(train_here, caplog):
    caplog.set_level(logging.INFO, logger="parallab")
    _, run_dir = train_here(*FAST, "trainer.auto_batch_size=true", "trainer.max_memory_mb=1",
                            "trainer.max_steps=5")
    # the finder's table, as train.py logs it to the console and train.log
    assert "over trainer.max_memory_mb=1" in caplog.text
    assert read_metrics(run_dir)["global_batch_size"] == 64  # kept data.batch_size


OOM_ON_RANK_1 = """
import os
import torch
import parallab.models.mnist_cnn as mnist_cnn

forward = mnist_cnn.MnistCNN.forward

def forward_with_a_small_gpu(self, x):
    if os.environ.get("RANK") == "1" and self.training and x.shape[0] >= 128:
        raise torch.OutOfMemoryError("injected: CUDA out of memory on rank 1")
    return forward(self, x)

mnist_cnn.MnistCNN.forward = forward_with_a_small_gpu
"""


@pytest.mark.slow
@pytest.mark.distributed
def test_ranks_agree_when_only_one_runs_out_of_memory(train_here, tmp_path, monkeypatch):
    (tmp_path / "inject").mkdir()
    (tmp_path / "inject" / "sitecustomize.py").write_text(textwrap.dedent(OOM_ON_RANK_1))
    monkeypatch.setenv("PYTHONPATH", str(tmp_path / "inject"))  # the workers start with it
    _, run_dir = train_here(*FAST, "data.train_size=4096", "parallel=ddp",
                            "parallel.world_size=2", "trainer.auto_batch_size=true",
                            "trainer.max_steps=5")
    log = (run_dir / "train.log").read_text()  # rank 0's log: workers write it in-process too
    assert "| 128 |" in log and "does not fit on another rank" in log
    assert read_metrics(run_dir)["global_batch_size"] == 2 * 64  # both ranks chose 64
    assert "finder chose 64" in log


@pytest.mark.slow
@pytest.mark.distributed
def test_the_finder_searches_on_the_sharded_model_under_fsdp(train_here):
    _, run_dir = train_here(*FAST, "data.train_size=4096", "data.batch_size=16",
                            "parallel=fsdp", "parallel.world_size=2",
                            "trainer.auto_batch_size=true", "trainer.max_steps=5")
    log = (run_dir / "train.log").read_text()  # rank 0's log: workers write it in-process too
    rows = [line for line in log.splitlines()
            if line.startswith("| 16 |") or line.startswith("| 32 |")]
    assert len(rows) == 2  # a second trial ran, at twice the batch
    chosen = int(log.split("finder chose ")[1].split()[0])
    assert chosen in {16, 32, 64, 128, 256, 512}
    metrics = read_metrics(run_dir)
    assert metrics["global_batch_size"] == 2 * chosen
    assert metrics["steps"] == min(5, 2048 // chosen)  # one epoch of each rank's half


def test_a_resume_keeps_the_batch_the_finder_chose(train_here, monkeypatch):
    """Resumed, the finder is not run again: timed afresh it may choose another batch, which
    a checkpoint saved inside its epoch does not take (the resume was refused)."""
    from parallab.training import batch_size

    chosen = iter([32, 128])  # what the finder would choose at the start, and again
    monkeypatch.setattr(batch_size, "find_batch_size", lambda *a, **k: (next(chosen), []))
    run = [*FAST, "trainer.auto_batch_size=true", "trainer.checkpoint_every_n_steps=3"]
    train_here(*run, "trainer.max_steps=3")
    _, run_dir = train_here(*run, "trainer.max_steps=5", "trainer.resume=auto")
    metrics = read_metrics(run_dir)
    assert (metrics["steps"], metrics["global_batch_size"]) == (5, 32)
