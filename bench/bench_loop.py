"""Per-step cost of the framework: the MNIST recipe vs a hand-written loop vs train.py.

    python bench/bench_loop.py [--repeats 3] [--only recipe|own|gpt]

One MNIST epoch each, same model (the MNIST recipe's CNN), batch 64, SGD lr 0.01 momentum 0.5, seed 42,
each variant in a fresh process, interleaved so machine noise hits all alike:
  (a) recipe:    the MNIST recipe as written: torchvision MNIST, ToTensor+Normalize per
                 sample, DataLoader(batch_size=64, shuffle=True)
  (b) hand:      a minimal loop over the split held in memory as one normalised tensor
  (c) parallab:  python train.py trainer.epochs=1 (its own epoch timer, metrics.json)
Prints seconds per epoch, eval accuracy, and the ratios c/b and a/c. This machine is shared
and noisy (the same epoch varies by 10% from run to run), so c/b is also given as the median
over back-to-back (b, c) pairs, run in alternating order, which cancels slow drifts.

Those three run in separate processes, whose speed on this shared machine differs by more
than the framework's cost. So the per-step figure that decides is measured in one process:
  (b') hand and (c') parallab's Trainer (built as train.py builds it, running its own epoch
       loop with every per-step check, counter and log) take turns on the same in-memory
       split: after each of the Trainer's log windows (50 steps), 50 steps of the hand loop;
       3 epochs, the median of the turns' ratios is c'/b'. The same turns on parallab's gpt in
       nanoGPT's CPU shape against a minimal loop (`--only gpt`: 1,000 steps).

Then the same for a user's model given by _target_ (examples/own_model: ResMLP on its Waves
Dataset, Adam, MSE, batch 32, 1,024 steps):
  (d) hand:      the loop its user would write: DataLoader(Waves, shuffle=True), Adam, MSE
  (e) parallab:  parallab train --config-dir conf experiment=waves, from the example's dir
  (f) parallab with optim.implementation=for_loop: torch's per-parameter optimizer loop, the one (d)
                 gets by default on CPU, so that f/d is the trainer's own per-step cost
and the ratios e/d and f/d.
"""

from __future__ import annotations

import argparse
import gzip
import json
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

from parallab.testing import read_metrics, run_entry, scratch_dir, train_metrics

REPO = Path(__file__).resolve().parents[1]
SHIPPED = REPO / "src" / "parallab" / "data" / "files"  # parallab.data.mnist.SHIPPED: MNIST/raw/


def recipe_net():
    import torch
    import torch.nn.functional as F
    from torch import nn

    class Net(nn.Module):  # the MNIST recipe's CNN, dropout p=0.5 as the recipe meant
        def __init__(self):
            super().__init__()
            self.conv1 = nn.Conv2d(1, 10, kernel_size=5)
            self.conv2 = nn.Conv2d(10, 20, kernel_size=5)
            self.conv2_drop = nn.Dropout2d()
            self.fc1 = nn.Linear(320, 50)
            self.fc2 = nn.Linear(50, 10)

        def forward(self, x):
            x = torch.relu(torch.max_pool2d(self.conv1(x), 2))
            x = torch.relu(torch.max_pool2d(self.conv2_drop(self.conv2(x)), 2))
            x = torch.relu(self.fc1(x.view(-1, 320)))
            x = F.dropout(x, 0.5, training=self.training)
            return torch.log_softmax(self.fc2(x), dim=1)

    torch.manual_seed(42)
    return Net()


def accuracy(model, images, labels) -> float:
    import torch

    model.eval()
    with torch.no_grad():
        correct = sum((model(x).argmax(1) == y).sum().item()
                      for x, y in zip(images.split(1000), labels.split(1000)))
    return correct / len(labels)


def run_recipe(root: str, device: str = "cpu") -> dict:
    """The recipe as written; on a GPU its model.cuda() and inputs.cuda() per batch."""
    import torch
    from torch.utils.data import DataLoader
    from torchvision import datasets, transforms

    transform = transforms.Compose([transforms.ToTensor(), transforms.Normalize((0.1307,), (0.3081,))])
    trainset = datasets.MNIST(root, train=True, download=False, transform=transform)
    testset = datasets.MNIST(root, train=False, download=False, transform=transform)
    model = recipe_net().to(device)
    loader = DataLoader(trainset, batch_size=64, shuffle=True)
    criterion = torch.nn.CrossEntropyLoss()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.5)
    start = time.perf_counter()
    for inputs, labels in loader:
        inputs, labels = inputs.to(device), labels.to(device)
        optimizer.zero_grad()
        loss = criterion(model(inputs), labels)
        loss.backward()
        optimizer.step()
    if device != "cpu":
        torch.cuda.synchronize()
    epoch = time.perf_counter() - start
    images, labels = next(iter(DataLoader(testset, batch_size=len(testset))))
    return {"epoch_s": epoch, "accuracy": accuracy(model, images.to(device), labels.to(device))}


def run_hand(root: str) -> dict:
    import torch
    import torch.nn.functional as F
    sys.path.insert(0, str(REPO / "src"))
    from parallab.data import mnist

    def normalised(split):
        return (split.inputs.float() / 255 - 0.1307) / 0.3081, split.targets

    images, labels = normalised(mnist.load(root, "train"))
    test_images, test_labels = normalised(mnist.load(root, "test"))
    model = recipe_net()
    torch.manual_seed(42)  # dropout masks drawn as train.py draws them, for equal accuracy
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.5)
    start = tick = time.perf_counter()
    step_times = []
    order = torch.randperm(len(labels), generator=torch.Generator().manual_seed(42))
    for batch in order.split(64):
        optimizer.zero_grad()
        loss = F.cross_entropy(model(images[batch]), labels[batch])
        loss.backward()
        optimizer.step()
        step_times.append(time.perf_counter() - tick)
        tick = time.perf_counter()
    epoch = time.perf_counter() - start
    return {"epoch_s": epoch, "step_ms": 1e3 * statistics.median(step_times[5:]),
            "accuracy": accuracy(model, test_images, test_labels)}


def run_parallab(out: Path) -> dict:
    metrics = train_metrics(["trainer.epochs=1", "device=cpu"], out, timeout=None)
    return {"epoch_s": metrics["epoch_time_s"], "step_ms": metrics["step_time_ms"],
            "accuracy": metrics["eval_accuracy"]}


EXAMPLE = REPO / "examples" / "own_model"
OWN_SIZE = 32768  # training samples: 1,024 steps of 32
OWN = ["train", "--config-dir", "conf", "experiment=waves", "trainer.epochs=1", "device=cpu",
       f"data.train.size={OWN_SIZE}", "trainer.checkpoint_every_n_steps=null"]


def run_own_hand(size: str) -> dict:
    import torch
    import torch.nn.functional as F
    from torch.utils.data import DataLoader
    sys.path.insert(0, str(EXAMPLE))
    from own_model.data import Waves
    from own_model.model import ResMLP

    torch.manual_seed(42)
    model = ResMLP(8, 1, width=64, depth=4, expansion=2)  # conf/model/resmlp.yaml
    optimizer = torch.optim.Adam(model.parameters(), lr=0.003)
    loader = DataLoader(Waves(int(size), seed=0), batch_size=32, shuffle=True,
                        generator=torch.Generator().manual_seed(42))
    start = tick = time.perf_counter()
    step_times = []
    for inputs, targets in loader:
        optimizer.zero_grad()
        F.mse_loss(model(inputs), targets).backward()
        optimizer.step()
        step_times.append(time.perf_counter() - tick)
        tick = time.perf_counter()
    epoch = time.perf_counter() - start
    test = Waves(1024, seed=1)
    model.eval()
    with torch.no_grad():
        loss = F.mse_loss(model(test.x), test.y).item()
    return {"epoch_s": epoch, "step_ms": 1e3 * statistics.median(step_times[5:]),
            "eval_loss": loss}


def run_own_parallab(out: Path, *extra: str) -> dict:
    run_entry("parallab", [*OWN, *extra], out, cwd=EXAMPLE, check=True, timeout=None)
    metrics = read_metrics(out)
    return {"epoch_s": metrics["epoch_time_s"], "step_ms": metrics["step_time_ms"],
            "eval_loss": metrics["eval_loss"]}


def own_model(repeats: int, work: Path) -> None:
    """(d) vs (e): the framework's cost on a user's model and Dataset."""
    results: dict[str, list[dict]] = {"hand": [], "parallab": [], "loop": []}
    for repeat in range(repeats):
        trio = [lambda: results["hand"].append(in_subprocess("own_hand", str(OWN_SIZE))),
                lambda: results["parallab"].append(run_own_parallab(work / f"own{repeat}")),
                lambda: results["loop"].append(run_own_parallab(
                    work / f"loop{repeat}", "optim.implementation=for_loop"))]
        for run in trio if repeat % 2 == 0 else reversed(trio):
            run()
        print(f"own model, repeat {repeat + 1}: " + ", ".join(
            f"{k} {v[-1]['epoch_s']:.2f}s" for k, v in results.items()), flush=True)
    best = {k: min(r["epoch_s"] for r in v) for k, v in results.items()}
    step = {k: statistics.median(r["step_ms"] for r in v) for k, v in results.items()}
    loss = {k: statistics.median(r["eval_loss"] for r in v) for k, v in results.items()}
    print("\n| variant | s/epoch (best) | ms/step (median) | eval loss |\n|---|---|---|---|")
    for name, label in (("hand", "(d) hand-written loop, DataLoader over Waves"),
                        ("parallab", "(e) parallab train experiment=waves"),
                        ("loop", "(f) the same, optim.implementation=for_loop")):
        print(f"| {label} | {best[name]:.2f} | {step[name]:.3f} | {loss[name]:.4f} |")
    for name, ratio in (("parallab", "e/d"), ("loop", "f/d")):
        paired = statistics.median(p["epoch_s"] / h["epoch_s"]
                                   for p, h in zip(results[name], results["hand"]))
        print(f"{ratio} = {best[name] / best['hand']:.3f} per epoch (best of each), "
              f"{paired:.3f} (median of back-to-back runs), "
              f"{step[name] / step['hand']:.3f} per step (median) (target <= 1.02)")


TURN = 50  # steps per turn: one log window of the default trainer.log_every_n_steps
# nanoGPT's CPU shape (its README's "baby GPT" on a laptop): 4 layers, 4 heads, width 128,
# context 64, batch 12, AdamW, gradient clipping at 1.0, fp32
GPT = ["model=gpt", "data=bytes", "optim=adamw", "model.layers=4", "model.heads=4",
       "model.width=128", "model.context=64", "data.batch_size=12", "trainer.clip_grad_norm=1.0",
       "trainer.max_steps=1000", f"trainer.log_every_n_steps={TURN}"]


def interleaved(epochs: int = 3, probe: bool = False, gpt: bool = False) -> None:
    """(b') vs (c') in this process: the Trainer's own epochs, and after each of its log
    windows (TURN steps) TURN steps of the hand loop, each turn timed. `probe`: both on a
    model with next to no compute (one Linear layer), so that the difference per step is
    the trainer's own cost in microseconds. `gpt`: both on parallab's gpt in nanoGPT's CPU
    shape, the hand loop the minimal one (AdamW with torch's defaults, clipping, the loss
    over every position)."""
    import torch
    import torch.nn.functional as F

    from parallab.checks import validate
    from parallab.cli import compose
    from parallab.config.hydra_app import typed_config
    from parallab.launching import distributed
    from parallab.launching.preemption import Preemption
    from parallab.models import build_model
    from parallab.observe import loggers
    from parallab.observe.progress import Progress
    from parallab.training.build import build_trainer

    overrides = ["device=cpu", f"trainer.epochs={epochs}",
                 *(["model=mlp", "model.hidden=[]"] if probe else []), *(GPT if gpt else [])]
    cfg, layout = validate.prepare(typed_config(compose(overrides), overrides), None)
    dist = distributed.setup("cpu", None, 60.0, None)
    logger = loggers.started(cfg, scratch_dir("parallab-bench-in-"), True)
    trainer, _ = build_trainer(cfg, layout, dist, logger, None, Preemption())
    loader = trainer.data.train
    inputs, targets = loader.source.prepare(loader.inputs), loader.targets  # prepared once
    torch.manual_seed(42)
    model = build_model(cfg.model) if probe or gpt else recipe_net()
    optimizer = (torch.optim.AdamW(model.parameters(), lr=cfg.optim.lr) if gpt else
                 torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.5))
    order = torch.randperm(len(targets), generator=torch.Generator().manual_seed(42)).split(
        cfg.data.batch_size)
    turns: list[tuple[float, float]] = []  # (parallab, hand) ms/step
    mark = {"time": time.perf_counter(), "step": 0, "turn": 0}
    log_window = trainer.log_window

    def hand_step(batch: torch.Tensor) -> None:
        optimizer.zero_grad()
        output = model(inputs[batch])
        F.cross_entropy(output.flatten(0, -2), targets[batch].flatten()).backward()
        if gpt:
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()

    def hand_after(progress) -> None:  # the trainer's log step, then a turn of the hand loop
        log_window(progress)
        start = time.perf_counter()
        parallab = (start - mark["time"]) / (trainer.step - mark["step"]) * 1e3
        for batch in order[mark["turn"] * TURN % (len(order) - TURN):][:TURN]:
            hand_step(batch)
        mark.update(time=time.perf_counter(), step=trainer.step, turn=mark["turn"] + 1)
        turns.append((parallab, (mark["time"] - start) / TURN * 1e3))

    trainer.log_window = hand_after
    with Progress(trainer.total_steps, True, False) as progress:
        for trainer.epoch in range(epochs):  # fit()'s epochs, without its evaluations
            trainer.epoch_step = 0
            mark.update(time=time.perf_counter(), step=trainer.step)
            trainer.train_epoch(progress)
            if trainer.step >= trainer.total_steps:
                break
    turns = turns[2:]  # warm-up
    hand, parallab = (statistics.median(t[i] for t in turns) for i in (1, 0))
    if probe:
        extra = statistics.median(p - h for p, h in turns) * 1e3
        print(f"probe (one Linear layer), {len(turns)} turns: hand {hand * 1e3:.0f} us/step, "
              f"parallab {parallab * 1e3:.0f} us/step (medians): the trainer's own cost "
              f"{extra:.0f} us/step (median of the turns' differences)")
        return
    ratio = statistics.median(p / h for p, h in turns)
    print(f"\n{'gpt (nanoGPT CPU shape)' if gpt else 'the CNN'}, in one process, {len(turns)} "
          f"turns: hand {hand:.3f} ms/step, parallab {parallab:.3f} ms/step (medians); "
          f"c'/b' = {ratio:.3f} (median of the turns' ratios) (target <= 1.02)")


def in_subprocess(variant: str, arg: str) -> dict:
    result = subprocess.run([sys.executable, __file__, "--variant", variant, "--arg", arg],
                            check=True, capture_output=True, text=True)
    return json.loads(result.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--variant")
    parser.add_argument("--arg")
    parser.add_argument("--only", choices=["recipe", "own", "gpt"],
                        help="one of the comparisons (gpt: its in-process turns alone)")
    args = parser.parse_args()
    if args.variant:  # a child process running one variant
        run = {"recipe": run_recipe, "hand": run_hand, "own_hand": run_own_hand}[args.variant]
        print(json.dumps(run(args.arg)))
        return
    if args.only == "gpt":
        interleaved(gpt=True)
        return
    if args.only != "own":
        recipe_cnn(args.repeats)
        interleaved()
        interleaved(probe=True)
        interleaved(gpt=True)
    if args.only != "recipe":
        own_model(args.repeats, scratch_dir("parallab-bench-own-"))


def extracted_mnist() -> Path:
    """A scratch dir holding MNIST/raw/ as torchvision's MNIST reads it (extracted)."""
    work = scratch_dir("parallab-bench-")
    raw = work / "MNIST" / "raw"
    raw.mkdir(parents=True)
    for gz in (SHIPPED / "MNIST" / "raw").glob("*.gz"):
        with gzip.open(gz) as src, open(raw / gz.stem, "wb") as dst:
            shutil.copyfileobj(src, dst)
    return work


def recipe_cnn(repeats: int) -> None:
    """(a), (b), (c): the MNIST recipe, a hand-written loop and train.py on the MNIST recipe's CNN."""
    work = extracted_mnist()
    results: dict[str, list[dict]] = {"recipe": [], "hand": [], "parallab": []}
    for repeat in range(repeats):
        pair = [lambda: results["hand"].append(in_subprocess("hand", str(SHIPPED))),
                lambda: results["parallab"].append(run_parallab(work / f"run{repeat}"))]
        for run in pair if repeat % 2 == 0 else reversed(pair):  # no side always goes first
            run()
        results["recipe"].append(in_subprocess("recipe", str(work)))
        print(f"repeat {repeat + 1}: " + ", ".join(
            f"{k} {v[-1]['epoch_s']:.2f}s" for k, v in results.items()), flush=True)

    # the machine is shared: the fastest of the repeats is the cost with the least noise in it
    best = {k: min(r["epoch_s"] for r in v) for k, v in results.items()}
    median = {k: statistics.median(r["epoch_s"] for r in v) for k, v in results.items()}
    step = {k: statistics.median(r["step_ms"] for r in v) for k, v in results.items() if k != "recipe"}
    acc = {k: statistics.median(r["accuracy"] for r in v) for k, v in results.items()}
    print("\n| variant | s/epoch (best) | s/epoch (median) | ms/step (median) | eval accuracy |")
    print("|---|---|---|---|---|")
    for name, label in (("recipe", "(a) the MNIST recipe, DataLoader + ToTensor"),
                        ("hand", "(b) hand-written loop, in-memory tensors"),
                        ("parallab", "(c) python train.py")):
        step_ms = f"{step[name]:.2f}" if name in step else "-"
        print(f"| {label} | {best[name]:.2f} | {median[name]:.2f} | {step_ms} | "
              f"{100 * acc[name]:.2f}% |")
    paired = statistics.median(p["epoch_s"] / h["epoch_s"]
                               for p, h in zip(results["parallab"], results["hand"]))
    print(f"\nc/b = {best['parallab'] / best['hand']:.3f} per epoch (best of each), "
          f"{paired:.3f} (median of back-to-back pairs), "
          f"{step['parallab'] / step['hand']:.3f} per step (median) (target <= 1.02)")
    print(f"a/c = {best['recipe'] / best['parallab']:.2f} (target >= 1.7)")
    print(f"accuracy c - b = {100 * (acc['parallab'] - acc['hand']):+.2f} points (target within 0.3)")


if __name__ == "__main__":
    main()
