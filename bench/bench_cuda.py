"""Throughput on one CUDA GPU, side by side: a GPT-2-small-shaped gpt per
precision, eager and compiled; a transformers GPT-2 of the same shape; the MNIST recipe as
written against `train.py` for one epoch.

    python bench/bench_cuda.py [--steps 200] [--batch N] [--json F]
        [--parts gpt mnist hf profile levers vocab hfsdpa wide]

gpt: 12 layers, 12 heads, width 768, context 1024 (byte tokens: vocab 256), AdamW (fused on
CUDA), data=bytes. The per-rank batch is the batch-size finder's pick in bf16 (one run with
trainer.auto_batch_size=true from 8 up) unless --batch is given. Each configuration is
`python train.py ... precision=P trainer.compile=C` in a fresh process; tokens/s and MFU
leave the first 10 steps out (compilation), eval loss is on the final weights. fp8 runs
only where the GPU has float8 tensor cores.

levers: the bf16 compiled gpt at each of --batches in each of torch.compile's --modes
(default, reduce-overhead: CUDA graphs, max-autotune-no-cudagraphs), and transformers'
GPT-2 beside it (unless --no-hf), each profiled (steps 3-5, inside the steps timing leaves
out) for the GPU's busy share and the attention backend. vocab: the gpt with GPT-2's own
head (--vocab-size 50304, tied). hfsdpa: how transformers' GPT-2 calls SDPA compiled and
eagerly, on its own and as a run builds it. wide: float8 where its matmuls are large, a
gpt of --wide-width (--wide-layers deep) in bf16 and in fp8 with each of --wide-recipes,
compiled, the same steps and batch.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

from parallab.testing import REPO, scratch_dir, train_metrics

# the data, optimizer and timing every model here runs with
RUN = ["data=bytes", "data.eval_fraction=0.01", "data.eval_batch_size=16", "optim=adamw",
       "optim.lr=6e-4", "device=cuda", "trainer.timing_skip_steps=10",
       "trainer.log_every_n_steps=50", "trainer.checkpoint_every_n_steps=null"]
GPT = ["model=gpt", "model.layers=12", "model.heads=12", "model.width=768",
       "model.context=1024", *RUN]
HF = ["--config-dir", str(REPO / "examples" / "hf_llama" / "conf"), "model=my_gpt2",
      "model.config.n_embd=768", "model.config.n_layer=12", "model.config.n_head=12",
      "model.config.n_positions=1024", "data.seq_len=1024", *RUN]
# precision:eager|compile[:steps]; fp32 is slow, a few steps time it (default: --steps)
CONFIGS = ["fp32:eager:20", "bf16:eager:60", "bf16:compile", "fp8:compile"]


def has_fp8() -> bool:
    from parallab.config.schema import PrecisionConfig
    from parallab.precision import device_problem

    return device_problem(PrecisionConfig(name="fp8"), "cuda") is None


DEADLINE = float("inf")  # --deadline: no run starts past it, none runs beyond it
KEEP: Path | None = None  # --keep: each run's log files are copied here


def keep_logs(run_dir: Path, name: str) -> None:
    for log in sorted(run_dir.glob("*.log")) if KEEP else []:
        shutil.copy(log, KEEP / f"{name}-{log.name}")


def run(work: Path, name: str, overrides: list[str]) -> dict:
    start = time.perf_counter()
    left = min(600.0, DEADLINE - time.monotonic())
    if left < 30:
        print(f"{name}: skipped, {left:.0f} s left of --deadline", flush=True)
        return {"name": name, "failed": True}
    try:
        metrics = train_metrics(overrides, work / name, timeout=left)
    except (RuntimeError, subprocess.TimeoutExpired) as error:  # a row, not the end
        print(f"{name}: FAILED\n{str(error)[-3000:]}", flush=True)
        keep_logs(work / name, name)
        return {"name": name, "failed": True}
    keep_logs(work / name, name)
    metrics = {"name": name, "wall_s": time.perf_counter() - start, **metrics}
    print(f"{name}: {metrics.get('tokens_per_sec', 0):,.0f} tokens/s, mfu "
          f"{metrics.get('mfu') or 0:.3f}, eval_loss {metrics['eval_loss']:.4f}, "
          f"wall {metrics['wall_s']:.0f} s", flush=True)
    return metrics


def trace_summary(run_dir: Path, top: int = 12) -> tuple[float, str]:
    """Where the profiled steps' time went (trainer.profile=true: steps 3-5): the GPU's busy
    share of the span its kernels cover, host-device synchronisations, the top kernels."""
    import gzip

    path = next((run_dir / "profiler").glob("*.json*"))
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt") as f:
        events = [e for e in json.load(f)["traceEvents"] if e.get("ph") == "X"]
    kernels = sorted((e for e in events if e.get("cat") == "kernel"), key=lambda e: e["ts"])
    if not kernels:  # a CPU run's trace
        return float("nan"), "profiled steps: no GPU kernels in the trace"
    busy, end = 0.0, 0.0
    for e in kernels:  # the union of kernel intervals: streams may overlap
        start, stop = max(e["ts"], end), e["ts"] + e["dur"]
        busy += max(0.0, stop - start)
        end = max(end, stop)
    span = end - kernels[0]["ts"]
    syncs = [e for e in events if e.get("cat") == "cuda_runtime" and
             ("Synchronize" in e["name"] or e["name"].startswith("cudaMemcpy"))]
    by_name: dict[str, float] = {}
    for e in kernels:
        by_name[e["name"][:70]] = by_name.get(e["name"][:70], 0.0) + e["dur"]
    lines = [f"profiled steps: GPU busy {busy / 1e3:.1f} of {span / 1e3:.1f} ms "
             f"({100 * busy / span:.1f}%), {len(kernels)} kernels, {len(syncs)} host-device "
             f"syncs or copies ({sum(e['dur'] for e in syncs) / 1e3:.2f} ms)"]
    lines += [f"  {100 * t / busy:5.1f}%  {name}" for name, t in
              sorted(by_name.items(), key=lambda kv: -kv[1])[:top]]
    attention: dict[str, list[float]] = {}  # which SDPA backend the host dispatched to
    for e in events:
        if e.get("cat") == "cpu_op" and "scaled_dot_product" in e["name"]:
            attention.setdefault(e["name"], []).append(e["dur"])
    lines += [f"  host op {name}: {len(d)} calls" for name, d in sorted(attention.items())]
    return busy / span, "\n".join(lines)


def run_profiled(work: Path, name: str, overrides: list[str]) -> dict:
    """`run` with trainer.profile=true (steps 3-5, which timing leaves out): the metrics
    and the GPU's busy share of the profiled steps, their summary printed."""
    metrics = run(work, name, [*overrides, "trainer.profile=true"])
    if not metrics.get("failed"):
        metrics["gpu_busy"], metrics["profile"] = trace_summary(work / name)
        print(metrics["profile"], flush=True)
    return metrics


def levers(work: Path, batches: list[int], steps: int, modes: list[str],
           hf: bool = True) -> list[dict]:
    """bf16 + compile per batch in each of torch.compile's `modes` (default, CUDA graphs
    through reduce-overhead, max-autotune-no-cudagraphs), and transformers' GPT-2 in the
    default mode, each profiled."""
    rows = []
    for batch in batches:
        for mode in modes:
            rows.append({"precision": "bf16", "compile": mode, **run_profiled(
                work, f"gpt-bf16-{mode}-b{batch}",
                [*GPT, "precision=bf16", "trainer.compile=true", f"trainer.compile_mode={mode}",
                 f"data.batch_size={batch}", f"trainer.max_steps={steps}"])})
        if hf:
            rows.append({"model": "transformers GPT-2", "precision": "bf16",
                         "compile": "default", **run_profiled(work, f"hf-gpt2-bf16-b{batch}", [
                             *HF, "precision=bf16", "trainer.compile=true",
                             f"data.batch_size={batch}", f"trainer.max_steps={steps}"])})
    return rows


def wide(work: Path, layers: int, batch: int, steps: int, width: int = 2048,
         recipes: tuple[str, ...] = ("tensorwise", "rowwise")) -> list[dict]:
    """float8 (each of `recipes`) against bf16 at a width where matmuls are large (heads of
    128), compiled, the same steps, batch and data."""
    shape = ["model=gpt", f"model.layers={layers}", f"model.heads={width // 128}",
             f"model.width={width}",
             "model.context=1024", *RUN, f"data.batch_size={batch}",
             f"trainer.max_steps={steps}", "trainer.compile=true"]
    rows = []
    for precision, recipe in (("bf16", None), *(("fp8", r) for r in recipes)):
        if precision == "fp8" and not has_fp8():
            continue
        extra = [f"precision.fp8_recipe={recipe}"] if recipe else []
        rows.append({"model": f"gpt width {width} x {layers}", "compile": True,
                     "precision": f"{precision} {recipe or ''}".strip(), **run(
                         work, f"wide{width}-{precision}-{recipe or ''}".rstrip("-"),
                         [*shape, f"precision={precision}", *extra])})
    return rows


def profiled(work: Path, batch: int) -> str:
    """bf16 + compile with trainer.profile=true, and its trace summarised."""
    metrics = run_profiled(work, "gpt-bf16-compile-profiled", [
        *GPT, "precision=bf16", "trainer.compile=true", f"data.batch_size={batch}",
        "trainer.max_steps=8"])
    return metrics.get("profile", "failed")


def vocab(work: Path, batch: int, steps: int, size: int, modes: list[str]) -> list[dict]:
    """GPT-2 small with GPT-2's own head: a `size`-token vocabulary (50,304: 50,257 padded
    to a multiple of 64) tied to the embedding, 124 M parameters; the byte data's 256 ids
    are a part of it. The head's matmul is then a quarter of the step's FLOPs, as in GPT-2,
    and the cross-entropy runs over 50,304 logits a token."""
    return [{"model": f"gpt, vocab {size} tied", "precision": "bf16", "compile": mode,
             **run_profiled(work, f"gpt-vocab{size}-{mode}", [
                 *GPT, f"model.vocab_size={size}", "model.tie_embeddings=true",
                 "precision=bf16", "trainer.compile=true", f"trainer.compile_mode={mode}",
                 f"data.batch_size={batch}", f"trainer.max_steps={steps}"])}
            for mode in modes]


def hf_sdpa(device: str = "cuda") -> None:
    """How transformers' GPT-2 (the bench's shape) calls scaled_dot_product_attention under
    torch.compile and eagerly on this GPU, on its own and as a run builds it: a mask,
    strides, scale (given the full mask, its attention kernels took 2.6x the gpt's)."""
    import torch
    import transformers

    config = transformers.GPT2Config(vocab_size=256, n_embd=768, n_layer=1, n_head=12,
                                     n_positions=1024, resid_pdrop=0.0, embd_pdrop=0.0,
                                     attn_pdrop=0.0, bos_token_id=0, eos_token_id=0,
                                     use_cache=False)  # as a training run has it
    model = transformers.GPT2LMHeadModel(config).to(device)
    x = torch.randint(0, 256, (2, 1024), device=device)

    def describe(args, kwargs) -> str:
        def one(t):
            t = getattr(t, "meta", {}).get("example_value", t)
            return (f"{tuple(t.shape)} {t.dtype} stride {t.stride()}"
                    if isinstance(t, torch.Tensor) else repr(t))
        return (f"q {one(args[0])}; k {one(args[1])}; mask "
                f"{one(kwargs.get('attn_mask', args[3] if len(args) > 3 else None))}; "
                + ", ".join(f"{k}={v}" for k, v in kwargs.items() if k != "attn_mask"))

    def spy(gm, inputs):
        for node in gm.graph.nodes:
            if "scaled_dot_product" in str(node.target):
                print("compiled:", describe(node.args, node.kwargs), flush=True)
        return gm.forward

    from parallab.models import hf

    with torch.autocast(device, torch.bfloat16):
        torch.compile(model, backend=spy)(x)
        torch._dynamo.reset()
        print("as a parallab run builds it (masks built outside the graph):")
        torch.compile(hf.for_training(model), backend=spy)(x)
        original = torch.nn.functional.scaled_dot_product_attention

        def eager(*args, **kwargs):
            print("eager:", describe(args, kwargs), flush=True)
            return original(*args, **kwargs)
        torch.nn.functional.scaled_dot_product_attention = eager
        try:
            model(x)
        finally:
            torch.nn.functional.scaled_dot_product_attention = original
    print("transformers", transformers.__version__, "attn", model.config._attn_implementation)


def finder_batch(work: Path) -> int:
    metrics = run(work, "finder", [*GPT, "precision=bf16", "data.batch_size=8",
                                   "trainer.auto_batch_size=true", "trainer.max_steps=12"])
    if metrics.get("failed"):
        sys.exit("the batch-size finder's run failed (above): give --batch")
    return metrics["global_batch_size"]


def gpt_table(work: Path, batch: int, steps: int, configs: list[str]) -> list[dict]:
    rows = []
    for config in configs:
        precision, mode, *short = config.split(":")
        compiled = mode == "compile"
        if precision == "fp8" and not has_fp8():
            continue
        rows.append({"precision": precision, "compile": compiled, **run(
            work, f"gpt-{precision}-{mode}",
            [*GPT, f"precision={precision}", f"trainer.compile={str(compiled).lower()}",
             f"data.batch_size={batch}", f"trainer.max_steps={short[0] if short else steps}"])})
    return rows


def mnist(work: Path) -> dict:
    """One epoch of the MNIST recipe as written (model.cuda(), a DataLoader of ToTensor
    samples) against `train.py trainer.epochs=1 device=cuda`."""
    sys.path.insert(0, str(Path(__file__).parent))
    from bench_loop import extracted_mnist, run_recipe

    recipe = run_recipe(str(extracted_mnist()), "cuda")
    parallab = run(work, "mnist-parallab", ["trainer.epochs=1", "device=cuda"])
    return {"recipe_epoch_s": recipe["epoch_s"], "recipe_accuracy": recipe["accuracy"],
            "parallab_epoch_s": parallab.get("epoch_time_s"),
            "parallab_accuracy": parallab.get("eval_accuracy")}


def report(device: dict, rows: list[dict], extra: dict) -> None:
    print(f"\n{device['name']}, torch {device['torch']}, CUDA {device['cuda']}\n")
    if rows:
        base = next((r for r in rows if r["precision"] == "fp32" and not r["compile"]
                     and not r.get("failed")), None)
        print("| model | precision | compile | batch | tokens/s | vs fp32 eager | MFU | "
              "eval loss | steps | GPU busy | wall s |\n|---|---|---|---|---|---|---|---|---|---|---|")
        for r in rows:
            if r.get("failed"):
                print(f"| {r['name']} | failed |")
                continue
            ratio = r["tokens_per_sec"] / base["tokens_per_sec"] if base else float("nan")
            print(f"| {r.get('model', 'gpt')} | {r['precision']} | {r['compile']} | "
                  f"{r['global_batch_size']} | {r['tokens_per_sec']:,.0f} | {ratio:.2f} | "
                  f"{100 * (r.get('mfu') or 0):.1f}% | {r['eval_loss']:.4f} | {r['steps']} | "
                  f"{100 * r.get('gpu_busy', float('nan')):.1f}% | {r['wall_s']:.0f} |")
    if "mnist" in extra:
        m = extra["mnist"]
        print(f"\nMNIST, one epoch: recipe {m['recipe_epoch_s']:.2f} s (accuracy "
              f"{m['recipe_accuracy']:.4f}), parallab {m['parallab_epoch_s']:.2f} s (accuracy "
              f"{m['parallab_accuracy']:.4f}): {m['recipe_epoch_s'] / m['parallab_epoch_s']:.2f}x")


def main() -> None:
    import torch

    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--batch", type=int, default=None)
    parser.add_argument("--parts", nargs="+", default=["gpt", "mnist", "hf", "profile"],
                        help="gpt, mnist, hf, profile (a bf16 compiled run's trace, read), "
                             "levers, vocab, hfsdpa, wide")
    parser.add_argument("--batches", type=int, nargs="+", default=[32, 64],
                        help="levers: the per-rank batches")
    parser.add_argument("--modes", nargs="+", default=["default", "reduce-overhead"],
                        help="levers: torch.compile modes")
    parser.add_argument("--no-hf", action="store_true", help="levers: no transformers GPT-2")
    parser.add_argument("--vocab-size", type=int, default=50304, help="vocab: the head's size")
    parser.add_argument("--wide-width", type=int, default=2048)
    parser.add_argument("--wide-recipes", nargs="*", default=["tensorwise", "rowwise"])
    parser.add_argument("--wide-layers", type=int, default=8)
    parser.add_argument("--wide-batch", type=int, default=8)
    parser.add_argument("--configs", nargs="+", default=CONFIGS,
                        help="gpt runs as precision:eager|compile[:steps]")
    parser.add_argument("--json", type=Path, default=None, help="write every figure here")
    parser.add_argument("--keep", type=Path, default=None, help="copy each run's logs here")
    parser.add_argument("--deadline", type=float, default=None,
                        help="seconds from now after which no run starts or goes on")
    args = parser.parse_args()
    global DEADLINE, KEEP
    if args.deadline:
        DEADLINE = time.monotonic() + args.deadline
    if args.keep:
        KEEP = args.keep
        KEEP.mkdir(parents=True, exist_ok=True)
    device = {"name": torch.cuda.get_device_name(), "torch": torch.__version__,
              "cuda": torch.version.cuda}
    work = scratch_dir("parallab-bench-cuda-")
    batch = args.batch or (finder_batch(work) if {"gpt", "hf", "profile"} & set(args.parts)
                           else 0)
    rows, extra = [], {}

    def save() -> None:  # after each part: a run stopped by its time limit keeps the rest
        if args.json:
            args.json.write_text(json.dumps({"device": device, "batch": batch, "rows": rows,
                                             **extra}, indent=1, default=str))

    for part in args.parts:
        if part == "gpt":
            rows += gpt_table(work, batch, args.steps, args.configs)
        elif part == "hf":
            rows.append({"model": "transformers GPT-2", "precision": "bf16", "compile": True,
                         **run(work, "hf-gpt2-bf16-compile", [
                             *HF, "precision=bf16", "trainer.compile=true",
                             f"data.batch_size={batch}", f"trainer.max_steps={args.steps}"])})
        elif part == "levers":
            rows += levers(work, args.batches, args.steps, args.modes, not args.no_hf)
        elif part == "vocab":
            rows += vocab(work, batch or args.batches[0], args.steps, args.vocab_size,
                          args.modes)
        elif part == "hfsdpa":
            hf_sdpa()
        elif part == "wide":
            rows += wide(work, args.wide_layers, args.wide_batch, args.steps, args.wide_width,
                         tuple(args.wide_recipes))
        elif part == "mnist":
            extra["mnist"] = mnist(work)
        elif part == "profile":
            extra["profile"] = profiled(work, batch)
        save()
        report(device, rows, extra)


if __name__ == "__main__":
    main()
