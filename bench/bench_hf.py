"""A transformers model's step in parallab, against a hand-written loop and transformers'
own Trainer, on the same model and data.

    python bench/bench_hf.py [--steps 200] [--rounds 3]

The model is examples/hf_llama's tiny GPT-2 (2 blocks of width 64, built from its config),
the data its padded verses (dict samples: input_ids, attention_mask, labels with -100 on
padding), batch 16, AdamW lr 3e-3, one process on the CPU. All three run in this process,
taking turns of --steps steps over --rounds rounds (the order rotating), so that the
machine's drift hits each alike; each step is timed from the end of the one before, data
loading included, and the medians are compared:
  (h) hand:         DataLoader(shuffle=True), model(**batch).loss.backward(), AdamW step
                    (foreach kernels, as parallab's optim.implementation=auto takes on CPU)
  (p) parallab:     its Trainer built as `parallab train --config-dir conf experiment=llama
                    model=my_gpt2` builds it, running its own epoch loop
  (t) transformers: Trainer(TrainingArguments(per_device_train_batch_size=16, ...)), its
                    defaults otherwise (AdamW with torch's default kernels on CPU), timed
                    by a callback at each step's end
Prints ms/step and the ratios p/h (goal <= 1.03) and p/t (goal <= 1.0).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

from parallab.testing import REPO, scratch_dir

EXAMPLE = REPO / "examples" / "hf_llama"
BATCH, LR = 16, 3e-3


def datasets():
    from hf_llama.data import Verses

    return Verses(seq_len=64, size=8192), Verses(seq_len=64, size=256, offset=30000)


def gpt2():
    import torch

    from parallab import models
    from parallab.cli import compose
    from parallab.config.hydra_app import typed_config

    torch.manual_seed(42)
    overrides = ["experiment=llama", "model=my_gpt2"]
    cfg = typed_config(compose(overrides, EXAMPLE / "conf"), overrides)
    return models.build_model(models.check(cfg.model, cfg.data))  # the data's vocabulary


def hand(steps: int):
    """A generator: each next() trains `steps` more steps and yields their times."""
    import torch
    from torch.utils.data import DataLoader

    model = gpt2().train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, foreach=True)
    loader = DataLoader(datasets()[0], batch_size=BATCH, shuffle=True)
    batches = iter(())
    while True:
        times, tick = [], time.perf_counter()
        for _ in range(steps):
            batch = next(batches, None)
            if batch is None:
                batches = iter(loader)
                batch = next(batches)
            optimizer.zero_grad()
            model(**batch).loss.backward()
            optimizer.step()
            now = time.perf_counter()
            times.append(now - tick)
            tick = now
        yield times


def parallab(steps: int):
    from parallab.checks import validate
    from parallab.cli import compose
    from parallab.config.hydra_app import typed_config
    from parallab.launching import distributed
    from parallab.launching.preemption import Preemption
    from parallab.observe import loggers
    from parallab.observe.progress import Progress
    from parallab.training.build import build_trainer

    overrides = ["experiment=llama", "model=my_gpt2", "device=cpu", "trainer.epochs=1000",
                 "data.train.size=8192", f"data.batch_size={BATCH}", f"optim.lr={LR}"]
    cfg, layout = validate.prepare(typed_config(compose(overrides, EXAMPLE / "conf"), overrides),
                                   None)
    dist = distributed.setup("cpu", None, 60.0, None)
    logger = loggers.started(cfg, scratch_dir("bench-hf-"), True)
    trainer, _ = build_trainer(cfg, layout, dist, logger, None, Preemption())
    with Progress(10**9, True, False) as progress:
        while True:
            trainer.total_steps = trainer.step + steps
            done = len(trainer.meter.step_times)
            if trainer.train_epoch(progress):  # an epoch ended: fit() goes on to the next
                trainer.epoch, trainer.epoch_step = trainer.epoch + 1, 0
            yield trainer.meter.step_times[done:]


def transformers_trainer(steps: int):
    """transformers' Trainer, `steps` more steps per next() (its train() resumed from the
    state it left: max_steps raised, its loop and optimizer kept in this one call)."""
    import threading

    from transformers import Trainer, TrainerCallback, TrainingArguments

    times: list[float] = []
    turn = threading.Semaphore(0)
    done = threading.Semaphore(0)

    class Turns(TrainerCallback):  # pauses the Trainer's own loop between turns
        def __init__(self):
            self.tick = None

        def on_step_begin(self, args, state, control, **kwargs):
            if state.global_step % steps == 0:
                done.release()
                turn.acquire()
                self.tick = time.perf_counter()  # the pause is not the step's

        def on_step_end(self, args, state, control, **kwargs):
            now = time.perf_counter()
            times.append(now - self.tick)
            self.tick = now

    out = scratch_dir("bench-hf-trainer-")
    args = TrainingArguments(output_dir=str(out), per_device_train_batch_size=BATCH,
                             learning_rate=LR, max_steps=10**6, report_to=[],
                             save_strategy="no", logging_steps=50, use_cpu=True,
                             disable_tqdm=True, seed=42, dataloader_drop_last=True)
    trainer = Trainer(model=gpt2(), args=args, train_dataset=datasets()[0],
                      callbacks=[Turns()])
    threading.Thread(target=trainer.train, daemon=True).start()
    done.acquire()
    while True:
        times.clear()
        turn.release()
        done.acquire()
        yield list(times)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=3)
    options = parser.parse_args()
    sys.path.insert(0, str(EXAMPLE))
    import torch

    torch.set_num_threads(2)
    variants = {"hand": hand(options.steps), "parallab": parallab(options.steps),
                "transformers": transformers_trainer(options.steps)}
    for variant in variants.values():  # warm-up turn, not counted
        next(variant)
    times: dict[str, list[float]] = {name: [] for name in variants}
    for round_ in range(options.rounds):
        names = list(variants)
        for name in names[round_ % 3:] + names[:round_ % 3]:
            times[name] += next(variants[name])
        print(f"round {round_ + 1}: " + ", ".join(
            f"{n} {1e3 * statistics.median(t):.2f} ms" for n, t in times.items()), flush=True)
    step = {name: 1e3 * statistics.median(t) for name, t in times.items()}
    print("\n| variant | ms/step (median) | steps timed |\n|---|---|---|")
    for name, label in (("hand", "(h) hand-written loop"), ("parallab", "(p) parallab"),
                        ("transformers", "(t) transformers' Trainer")):
        print(f"| {label} | {step[name]:.2f} | {len(times[name])} |")
    print(f"\np/h = {step['parallab'] / step['hand']:.3f} (goal <= 1.03), "
          f"p/t = {step['parallab'] / step['transformers']:.3f} (goal <= 1.0)")


if __name__ == "__main__":
    main()
