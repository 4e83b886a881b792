"""LoRA against full fine-tuning on a transformers Llama of a few hundred million
parameters, built from its config (nothing downloaded): the training state a rank holds and
the step time.

    python bench/bench_lora.py [--steps 6] [--layers 24] [--width 1024]

Both runs are `parallab train --config-dir examples/hf_llama/conf experiment=llama` with the
model widened (hidden_size --width, --layers decoder layers, 16 heads, 4 key-value heads,
MLP 2.75 x width), batch 4 of 64 tokens, AdamW, one process on the CPU, --steps steps each
(the first two not timed), taking turns: full, lora, full, lora. Each run's figures come
from its metrics.json: state_memory_mb (parameters, gradients and optimizer state),
peak_memory_mb (the process's peak RSS) and step_time_ms. Goal: LoRA's state <= 0.3 x full
fine-tuning's (the base's parameters alone, about 1/4 of parameters + gradients + AdamW's
two moments).
"""

from __future__ import annotations

import argparse
import statistics

from parallab.testing import REPO, read_metrics, run_entry, scratch_dir

EXAMPLE = REPO / "examples" / "hf_llama"


def run(name: str, args, lora: bool, round_: int) -> dict:
    width = args.width
    overrides = [
        "experiment=llama", "device=cpu", f"trainer.max_steps={args.steps}",
        "trainer.timing_skip_steps=2", "trainer.log_every_n_steps=1", "data.batch_size=4",
        "data.train.size=256", "data.eval.size=8", "data.eval_batch_size=8",
        f"model.config.hidden_size={width}", f"model.config.intermediate_size={width * 11 // 4}",
        f"model.config.num_hidden_layers={args.layers}", "model.config.num_attention_heads=16",
        "model.config.num_key_value_heads=4", "trainer.checkpoint_every_n_steps=null",
        *(["adapter=lora", "adapter.r=16", "adapter.alpha=32"] if lora else [])]
    run_dir = scratch_dir("bench_lora") / f"{name}{round_}"
    done = run_entry("parallab", ["train", "--config-dir", "conf", *overrides], run_dir,
                     timeout=3600, cwd=EXAMPLE)
    if done.returncode:
        raise SystemExit(done.stdout[-3000:] + done.stderr[-3000:])
    return read_metrics(run_dir)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    figures: dict[str, list[dict]] = {"full": [], "lora": []}
    for round_ in range(args.rounds):
        for name in figures:
            figures[name].append(run(name, args, name == "lora", round_))
            got = figures[name][-1]
            print(f"{name} round {round_}: state {got['state_memory_mb']:.0f} MB, peak "
                  f"{got['peak_memory_mb']:.0f} MB, step {got['step_time_ms']:.0f} ms",
                  flush=True)
    med = {name: {key: statistics.median(r[key] for r in runs) for key in
                  ("state_memory_mb", "peak_memory_mb", "step_time_ms")}
           for name, runs in figures.items()}
    print(f"model: Llama, {args.layers} layers of width {args.width}, built from its config")
    for key in ("state_memory_mb", "peak_memory_mb", "step_time_ms"):
        print(f"{key}: full {med['full'][key]:.0f}, lora {med['lora'][key]:.0f}, "
              f"lora/full {med['lora'][key] / med['full'][key]:.3f}")


if __name__ == "__main__":
    main()
