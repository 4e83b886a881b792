"""`parallab simulate` held against published training runs (bench/published.csv; where
each figure comes from: bench/published_notes.md).

    python bench/bench_simulate.py [--fit] [--only SUBSTRING] [--all] [--moe]

Each row that parallab can run as published (its layout a parallab layout, bf16, fp16 or
fp8 (torchao's float8 Linear layers), no context parallelism, a schedule
parallab has) is simulated as `parallab simulate`
would, on the cluster preset of its hardware, and its prediction printed beside the
published figure: tokens/s per GPU, or TFLOP/s per GPU counted by the row's own FLOP
formula; memory beside it (published where it is), and the rows predicted not to fit the
GPUs they trained on. The rows of the principal table (the torchtitan and
Megatron-LM rows named in docs/parallel.md) come first; each GPU kind's
cluster.matmul_efficiency is fitted to exactly one of them (FIT), every other row is a
prediction. --fit prints the efficiency each fitting row gives (bisection on it), to be
written into its preset; --all adds the rows beyond the principal table. A row that
measures another implementation's cost more than its layout's (OTHER_IMPLEMENTATION) is
simulated as parallab's layout and its error counted apart. --moe prints the
mixture-of-experts rows instead (published_moe.py), the ones the MoE goal names apart.
"""

from __future__ import annotations

import argparse
import csv
import math
import re
import statistics
import time
from pathlib import Path

import published_moe

REPO = Path(__file__).resolve().parent.parent
CSV = REPO / "bench" / "published.csv"
# hardware as the CSV gives it -> cluster preset
CLUSTERS = (("96GB 500W", "h100_titan"), ("H100 SXM HBM2e", "h100_titan"), ("A100", "a100"),
            ("H200", "h200"), ("H100", "h100"), ("B200", "b200"))
# (source substring, table substring, model substring, compile, precision) of the principal
# rows (a row without a precision: Megatron-LM's 2021 fp16)
PRINCIPAL = [
    ("llama3_h100_202412", "Table 1 ", "8B", "false", "bf16"),
    ("llama3_h100_202412", "Table 1 ", "8B", "true", "bf16"),
    ("performance.md @3faaa1a0", "64 A100", "Llama 3 8B", "false", "bf16"),
    ("performance.md @3faaa1a0", "64 A100", "Llama 3 70B", "false", "bf16"),
    ("Megatron-LM) + Megatron", "Table 1", "GPT 1.7B", "", "fp16"),
    ("Megatron-LM) + Megatron", "Table 1", "GPT 3.6B", "", "fp16"),
    ("Megatron-LM) + Megatron", "Table 1", "GPT 7.5B", "", "fp16"),
]
FIT = {"h100_titan": 0, "a100": 2}  # the principal row each kind's efficiency comes from
SCHEDULES = {"1F1B": "1f1b", "1f1b": "1f1b", "gpipe": "gpipe", "GPipe": "gpipe"}
INTERLEAVED = re.compile(r"interleaved 1F1B \(v=(\d+)\)")  # Megatron-LM's, its stages a rank
MEGATRON_2021 = "2104.04473"
ZERO_1 = "distributed optimizer (zero-1"  # a row's notes stating Megatron's, lower-cased
SEQUENCE_PARALLEL = "sequence parallel inferred"  # a row's notes, lower-cased
# torchtitan's Triton RMSNorm (norm_type "fused_rmsnorm"), a row's notes: trainer.fused_norms
FUSED_NORMS = "fused_rmsnorm"
# a fused cross-entropy (flash-attn's: MosaicML's loss_fn), a row's notes: that loss
FUSED_LOSS = "fused_crossentropy"
# torchao's float8 with rowwise scales, a row's notes: precision.fp8_recipe
ROWWISE = "float8 rowwise"
# gradients reduced in bf16 (NeMo's grad_sync_dtype), a row's notes: FSDP2's reduce dtype
BF16_REDUCE = "grad_sync_dtype bf16"
# the first N blocks recomputed whole (Megatron's recompute_method=block), a row's notes
BLOCKS_RECOMPUTED = re.compile(r"recompute_num_layers=(\d+)")
# Megatron-Core on Transformer Engine: its normalization, activation, RoPE and cross-entropy
# run as fused kernels (the Llama providers' bias_activation_fusion, apply_rope_fusion,
# persist_layer_norm; cross_entropy_fusion_impl=te; GPT's fused bias-GeLU and softmax), which
# trainer.compile's fused chains of memory-bound ops stand for where a row says nothing
TRANSFORMER_ENGINE = ("NeMo docs", "Megatron-Bridge docs", "MLPerf Training")
# Rows of an implementation whose cost is its own, not its layout's: shown, counted apart.
# DeepSpeed's ZeRO-3 in Megatron-LM's Table 2 falls to 44 TFLOP/s/GPU at batch 1 a GPU over
# 1,536 A100, where PyTorch's FSDP, the same layout with the same work and bytes a GPU,
# published more than 173 at batch 1 over 512 (Zhao et al. 2023, the CSV's last rows):
# parallab's fsdp is held against the latter.
OTHER_IMPLEMENTATION = ((MEGATRON_2021, "ZeRO-3 rows", "DeepSpeed ZeRO-3 of 2021"),)


def cluster_of(row: dict) -> str:
    return next(name for key, name in CLUSTERS if key in row["hardware"])


def principal_rows(rows: list[dict]) -> dict[int, int]:
    """Row index -> its place in PRINCIPAL: the first row of its precision each names."""
    found: dict[int, int] = {}
    for i, (source, table, model, compiled, precision) in enumerate(PRINCIPAL):
        for index, row in enumerate(rows):
            if source in row["source"] and table in row["table"] and model in row["model"] \
                    and (not compiled or row["compile"] == compiled) and \
                    (row["precision"] or "fp16") == precision and index not in found:
                found[index] = i
                break
    return found


def why_not(row: dict) -> str | None:
    """Why parallab cannot run the row as published, or None."""
    if (row["cp"] or "1") != "1":
        return "context parallel"
    if not all(row[k] for k in ("layers", "tp", "seq_len", "local_batch", "vocab")):
        return "layout, batch, sequence or vocabulary not published"
    pp = int(row["pp"] or 1)
    if pp > 1 and schedule_of(row) is None:
        return f"schedule {row['schedule']}"
    if "async tp" in row["notes"].lower() or "AsyncTP" in row["table"]:
        return "asynchronous tensor parallel"
    if not row["precision"] and MEGATRON_2021 not in row["source"]:
        return "precision not published"
    if pp > 1 and not row["microbatches"]:
        return "micro-batches not published"
    if recomputed_every(row) == 0:
        return "recomputed blocks that no checkpointing frequency spreads"
    if not (row["published_tokens_per_sec_per_gpu"] or row["published_tflops_per_gpu"]):
        return "no throughput figure"
    return None


def implementation_of(row: dict) -> str | None:
    """The implementation a row measures where its cost is not parallab's layout's."""
    return next((name for source, table, name in OTHER_IMPLEMENTATION
                 if source in row["source"] and table in row["table"]), None)


def schedule_of(row: dict) -> list[str] | None:
    """The pipeline's schedule as parallab's overrides (None: one it does not have)."""
    name = row["schedule"] or "1F1B"
    if name in SCHEDULES:
        return [f"parallel.schedule={SCHEDULES[name]}"]
    interleaved = INTERLEAVED.fullmatch(name)
    if interleaved:
        return ["parallel.schedule=interleaved_1f1b",
                f"parallel.stages_per_rank={interleaved[1]}"]
    return None


def overrides_of(row: dict) -> list[str]:
    L, h, heads = int(row["layers"]), int(row["hidden"]), int(row["heads"])
    seq, vocab = int(row["seq_len"]), int(row["vocab"])
    compiled = row["compile"] or "false"
    if not row["compile"] and row["source"].startswith(TRANSFORMER_ENGINE):
        compiled = "true"
    if "GPT" in row["model"] or "MPT" in row["model"]:
        model = ["model=gpt", f"model.layers={L}", f"model.width={h}", f"model.heads={heads}",
                 f"model.vocab_size={vocab}", f"model.context={seq}"]
        if "MPT" in row["model"]:  # its head is its embedding
            model += ["model.tie_embeddings=true"]
        if MEGATRON_2021 in row["source"]:
            # its kernels: attention's scores in memory (no flash attention yet) through a
            # fused scale-mask-softmax, fused bias-GeLU and bias-dropout-add: the manual
            # attention, its pointwise chains fused
            model += ["+model.attention=manual", "model.dropout=0.1"]  # its defaults
            compiled = "true"
        elif "minGPT" in row["model"]:  # its attention written out, dropout 0.1, eager
            model += ["+model.attention=manual", "model.dropout=0.1"]
    else:  # a Llama, or Nemotron-4's squared-ReLU MLP and zero-centred LayerNorm
        preset = "nemotron4_340b" if "Nemotron" in row["model"] else "llama3_8b"
        model = [f"model={preset}", f"model.config.num_hidden_layers={L}",
                 f"model.config.hidden_size={h}",
                 f"model.config.intermediate_size={row['ffn_hidden']}",
                 f"model.config.num_attention_heads={heads}",
                 f"model.config.num_key_value_heads={row['kv_heads'] or heads}",
                 f"model.config.vocab_size={vocab}"]
    R, F, T, P = (int(row[k] or 1) for k in ("dp_replicate", "dp_shard", "tp", "pp"))
    notes = row["notes"].lower()
    zero_1 = ZERO_1 in notes
    if zero_1:
        # Megatron's distributed optimizer shards the optimizer's state over the replicas; a
        # parallab pipeline's parts sharded over dp_shard stay gathered from the first
        # micro-batch to the flush and reduce once after it: the same bytes a step, and the
        # state sharded as ZeRO-1 shards it (the weights too). Without a pipeline, fsdp
        # whose weights stay gathered from forward to backward holds the same; it gathers
        # and reduces each accumulated micro-batch where ZeRO-1 reduces once a step
        R, F = 1, R * F
    n = R * F * T * P
    micro = int(row["microbatches"] or 1)
    local = int(row["local_batch"])
    # Megatron-LM's 2021 runs are fp16 (its CONFIG.sh); a parallab pipeline takes no loss
    # scaling, and bf16 runs at fp16's rate: its pipelines as bf16
    precision = row["precision"] or "fp16"
    if precision == "fp16" and int(row["pp"] or 1) > 1:
        precision = "bf16"
    ac = checkpointing_of(row)
    layout = [f"parallel.world_size={n}", f"parallel.dp_replicate={R}", f"parallel.dp_shard={F}",
              f"parallel.tp={T}"]
    if T > 1 and ("torchtitan" in row["source"].lower() or "tp_comm_overlap" in notes or
                  SEQUENCE_PARALLEL in notes):
        # torchtitan's plans cut the sequence; so does Transformer Engine's overlap of the
        # tp collectives, which takes sequence parallelism, and a row whose notes say so
        layout += ["parallel.sequence_parallel=true"]
    if P > 1:
        layout = ["parallel=pipeline", *layout, f"parallel.pp={P}", *schedule_of(row),
                  f"parallel.microbatches={micro}", f"data.batch_size={local}"]
    else:
        preset = "fsdp_tp" if T > 1 else ("ddp" if F == 1 else "fsdp" if R == 1 else "hsdp")
        layout = [f"parallel={preset}", *layout, f"data.batch_size={local // micro}",
                  f"trainer.accumulate_grad_batches={micro}",
                  *(["parallel.reshard_after_forward=false"] if zero_1 else [])]
    # the 40 GB A100: its HBM2's 1,555 GB/s (NVIDIA A100 datasheet) and 39 GiB of memory
    # (its device query reports 40,441 MiB), as the 80 GB preset keeps 79
    small = ["cluster.memory_gb=39", "cluster.hbm_gbps=12440"] if "A100 40GB" in row["hardware"] \
        else []
    fused = ["trainer.fused_norms=true"] if FUSED_NORMS in notes else []
    fused += ["loss=fused_cross_entropy"] if FUSED_LOSS in notes else []
    fused += ["precision.reduce_dtype=bfloat16"] if BF16_REDUCE in notes else []
    fused += ["precision.fp8_recipe=rowwise"] if ROWWISE in notes else []
    return [*model, *layout, f"data.seq_len={seq}", f"precision={precision}", "optim=adamw",
            *ac, *fused, f"trainer.compile={compiled}", f"cluster={cluster_of(row)}", *small]


def checkpointing_of(row: dict) -> list[str]:
    """The row's activation checkpointing as parallab's overrides."""
    if row["checkpointing"] == "selective" and "torchtitan" in row["source"].lower():
        # torchtitan's selective: op-level, every second matmul kept (its default), or
        # layer-level, every Nth block checkpointed whole (N not published: 2, the
        # selective_ac_option its example configs set)
        return ["trainer.activation_checkpointing=full",
                "trainer.activation_checkpointing_every=2"] \
            if "selective layer" in row["notes"] else \
            ["trainer.activation_checkpointing=selective_alternate"]
    mode = row["checkpointing"] or ("full" if "Megatron" in row["source"] else "none")
    every = recomputed_every(row)
    return [f"trainer.activation_checkpointing={mode}",
            *([f"trainer.activation_checkpointing_every={every}"] if every else [])]


def recomputed_every(row: dict) -> int | None:
    """Where the notes name Megatron's recompute of the first N blocks of each pipeline
    part: the N of trainer.activation_checkpointing_every that checkpoints as many blocks
    (spread over the model rather than first in each part: the same recompute), 0 where no
    N does; None where the notes name none."""
    found = BLOCKS_RECOMPUTED.search(row["notes"])
    if found is None:
        return None
    interleaved = INTERLEAVED.fullmatch(row["schedule"] or "")
    blocks = int(found[1]) * int(row["pp"] or 1) * int(interleaved[1] if interleaved else 1)
    every = math.ceil(int(row["layers"]) / blocks)
    return every if math.ceil(int(row["layers"]) / every) == blocks else 0


def published_figure(row: dict) -> tuple[float, str]:
    if row["published_tokens_per_sec_per_gpu"]:
        return float(row["published_tokens_per_sec_per_gpu"]), "tokens/s/GPU"
    return float(row["published_tflops_per_gpu"]), "TFLOP/s/GPU"


def predicted_figure(row: dict, prediction, facts) -> float:
    """The prediction in the row's own unit: tokens/s per GPU, or TFLOP/s per GPU by its
    FLOP formula."""
    tokens = prediction.tokens_per_sec_per_gpu
    if row["published_tokens_per_sec_per_gpu"]:
        return tokens
    B, s = int(row["global_batch"]), int(row["seq_len"])
    L, h, V = int(row["layers"]), int(row["hidden"]), int(row["vocab"])
    n = int(row["gpus"])
    formula = row["flop_formula"]
    if formula == "megatron_eq3":
        flops = 96 * B * s * L * h * h * (1 + s / (6 * h) + V / (16 * L * h))
    elif formula.startswith("megatron_core"):
        flops = 72 * B * s * L * h * h * (1 + s / (6 * h) + V / (12 * L * h))
    else:  # tokens x 6N + 12 l s h (the PaLM count)
        return tokens * facts.flops_per_token / 1e12
    return flops / prediction.step_time_s / n / 1e12


def simulate(overrides: list[str]):
    from parallab.commands import compose
    from parallab.config.hydra_app import typed_config
    from parallab.simulate import run

    cfg = typed_config(compose(overrides, None, "simulate"), overrides)
    candidate, facts = run.given(cfg)
    return candidate.prediction, facts, cfg.cluster.memory_gb


def fit(row: dict, overrides: list[str]) -> float:
    """The matmul efficiency at which the row's prediction is its published figure."""
    target = published_figure(row)[0]
    low, high = 0.05, 1.0
    for _ in range(18):
        mid = (low + high) / 2
        prediction, facts, _ = simulate([*overrides, f"cluster.matmul_efficiency={mid}"])
        if predicted_figure(row, prediction, facts) < target:
            low = mid
        else:
            high = mid
    return (low + high) / 2


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--fit", action="store_true")
    parser.add_argument("--all", action="store_true", help="the rows beyond the principal table")
    parser.add_argument("--only", default=None)
    parser.add_argument("--moe", action="store_true", help="the mixture-of-experts rows")
    args = parser.parse_args()
    rows = list(csv.DictReader(CSV.open()))
    moe = [i for i, row in enumerate(rows) if row["experts"]]
    places = principal_rows(rows)
    picked = sorted(places, key=places.get)
    if args.all:
        picked += [i for i in range(len(rows)) if i not in places and i not in moe]
    if args.moe:
        picked = moe
    picked = [(rows[i], places.get(i)) for i in picked]
    if args.only:
        picked = [(r, i) for r, i in picked
                  if args.only in f"{r['source']} {r['table']} {r['model']}"]
    print("| row | cluster | layout | published | predicted | error | memory GiB pub / pred |"
          " role |\n|---|---|---|---|---|---|---|---|")
    # MosaicML's 34 rows are one source's one layout: the other rows beyond are summed alone too
    errors = {"principal": [], "beyond": [], "beyond but MosaicML's": [],
              "another implementation": [], "MoE, named": [], "MoE, not named": []}
    memory_errors, ran, over = [], [], []
    for row, index in picked:
        label = f"{row['source'].split(' ')[0]} {row['table'][:40]} {row['model']} " \
                f"compile={row['compile'] or '-'}"
        mixed = bool(row["experts"])
        reason = published_moe.why_not(row) if mixed else why_not(row)
        if reason:
            print(f"| {label} | | | | not simulated: {reason} | | | |")
            continue
        overrides = published_moe.overrides_of(row) if mixed else overrides_of(row)
        cluster = cluster_of(row)
        fitted = index is not None and FIT.get(cluster) == index
        if fitted and args.fit:
            print(f"fit: cluster={cluster} matmul_efficiency={fit(row, overrides):.3f}",
                  flush=True)
        start = time.perf_counter()
        try:
            prediction, facts, memory_gb = simulate(overrides)
        except Exception as error:  # noqa: BLE001 - the table says why
            said = str(error).splitlines()[0][:120]
            print(f"| {label} | {cluster} | | | refused: {said} | | | |")
            continue
        figure, unit = published_figure(row)
        guess = predicted_figure(row, prediction, facts)
        error = guess / figure - 1
        other = implementation_of(row)
        role = "fit" if fitted else "prediction" if index is not None else \
            f"another implementation: {other}" if other else "beyond"
        if not fitted:
            kind = "principal" if index is not None else \
                "another implementation" if other else "beyond"
            if mixed:
                kind = "MoE, named" if published_moe.is_named(row) else "MoE, not named"
            errors[kind].append(abs(error))
            if kind == "beyond" and not row["source"].startswith("MosaicML"):
                errors["beyond but MosaicML's"].append(abs(error))
        held = prediction.memory_per_gpu_gb
        memory = f"- / {held:.1f}"
        if row["published_memory_gib"]:
            published = float(row["published_memory_gib"])
            memory = f"{published:.1f} / {held:.1f}"
            memory_errors.append(abs(held / published - 1))
        ran.append(label)
        if held > memory_gb:  # a run that trained, predicted not to fit its GPUs
            memory += f" (over {memory_gb:.0f})"
            over.append(label)
        layout = " ".join(o.split("=", 1)[1] for o in overrides if o.startswith("parallel."))
        print(f"| {label} | {cluster} | {layout} | {figure:,.0f} {unit} | {guess:,.0f} | "
              f"{error:+.1%} | {memory} | {role} ({time.perf_counter() - start:.0f} s) |",
              flush=True)
    for name, found in errors.items():
        if found:
            print(f"{name}: median |error| {statistics.median(found):.1%}, largest "
                  f"{max(found):.1%}, over {len(found)} rows")
    if memory_errors:
        print(f"memory: median |error| {statistics.median(memory_errors):.1%}, largest "
              f"{max(memory_errors):.1%}, over {len(memory_errors)} rows")
    print(f"predicted over their GPUs' memory: {len(over)} of {len(ran)} rows that trained"
          + "".join(f"\n  {label}" for label in over))


if __name__ == "__main__":
    main()
