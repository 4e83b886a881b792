"""The mixture-of-experts rows of bench/published.csv (those with `experts`) as `parallab
simulate` takes them: each model by its preset (deepseek_v3, qwen3_moe_30b,
qwen3_moe_235b, mixtral_8x7b; Kimi K2 and Mixtral 8x22B as their shapes over those), the
row's shape written over it, its layout with parallel.ep. bench_simulate.py --moe prints
them; where each figure comes from: bench/published_notes.md, "Mixtures of experts".

FLOPs are counted as the rows count them: 6 x the active weights a token meets (the
router, its top_k experts, the shared ones, attention's projections, the head) plus
attention's 12 x layers x sequence x width, which is what parallab's MFU counts.
"""

from __future__ import annotations

# model name substring -> (preset, the config keys the row's shape writes over it)
SHAPES = {
    "deepseek_v3": {"layers": "num_hidden_layers", "hidden": "hidden_size",
                    "ffn_hidden": "intermediate_size", "heads": "num_attention_heads",
                    "kv_heads": "num_key_value_heads", "vocab": "vocab_size",
                    "experts": "n_routed_experts", "top_k": "num_experts_per_tok",
                    "moe_ffn_hidden": "moe_intermediate_size",
                    "shared_experts": "n_shared_experts", "dense_layers": "first_k_dense_replace"},
    "qwen3_moe_30b": {"layers": "num_hidden_layers", "hidden": "hidden_size",
                      "heads": "num_attention_heads", "kv_heads": "num_key_value_heads",
                      "vocab": "vocab_size", "experts": "num_experts",
                      "top_k": "num_experts_per_tok", "moe_ffn_hidden": "moe_intermediate_size"},
    "mixtral_8x7b": {"layers": "num_hidden_layers", "hidden": "hidden_size",
                     "ffn_hidden": "intermediate_size", "heads": "num_attention_heads",
                     "kv_heads": "num_key_value_heads", "vocab": "vocab_size",
                     "experts": "num_local_experts", "top_k": "num_experts_per_tok"},
}
PRESETS = (("Kimi K2", "deepseek_v3"), ("DeepSeek", "deepseek_v3"), ("Qwen3", "qwen3_moe_30b"),
           ("Mixtral", "mixtral_8x7b"))
# the rows the MoE goal names (held apart from its goal over the others): DeepSeek-V3's
# report, and NeMo AutoModel's DeepSeek-V3 on 256 H100 (source, model, GPUs)
NAMED = (("2412.19437", "deepseek", ""), ("automodel", "deepseek", "256"))


def preset_of(row: dict) -> str | None:
    return next((preset for name, preset in PRESETS if name.lower() in row["model"].lower()),
                None)


def is_named(row: dict) -> bool:
    return any(source in row["source"].lower() and model in row["model"].lower() and
               gpus in ("", row["gpus"]) for source, model, gpus in NAMED)


def why_not(row: dict) -> str | None:
    """Why parallab cannot run the MoE row as published, or None."""
    if row["precision"] != "bf16":
        return "float8" if row["precision"] == "fp8" else "precision not published"
    if preset_of(row) is None:
        return "no preset of its model family"
    if "GB200" in row["hardware"]:
        return "GB200 (no cluster preset of its 72-GPU NVLink domain)"
    tp, shards, ep = (int(row[k] or 1) for k in ("tp", "dp_shard", "ep"))
    if ep > tp and shards == 1:
        return "ep carved from DDP replicas (parallab carves it from FSDP2 shards)"
    if not row["checkpointing"] or not row["microbatches"]:
        return "recompute or micro-batches not published"
    return None


def overrides_of(row: dict) -> list[str]:
    preset = preset_of(row)
    keys = SHAPES[preset]
    model = [f"model={preset}", *(f"++model.config.{key}={row[column]}"
                                  for column, key in keys.items() if row[column])]
    R, F, T, P, E = (int(row[k] or 1) for k in ("dp_replicate", "dp_shard", "tp", "pp", "ep"))
    micro, local = int(row["microbatches"]), int(row["local_batch"])
    layout = [f"parallel.world_size={R * F * T * P}", f"parallel.dp_replicate={R}",
              f"parallel.dp_shard={F}", f"parallel.tp={T}", f"parallel.ep={E}"]
    if P > 1:
        v = row["schedule"].partition("v=")[2].rstrip(")") or "1"
        layout = ["parallel=pipeline", *layout, f"parallel.pp={P}",
                  "parallel.schedule=interleaved_1f1b" if int(v) > 1 else "parallel.schedule=1f1b",
                  f"parallel.stages_per_rank={v}", f"parallel.microbatches={micro}",
                  f"data.batch_size={local}"]
    else:
        layout = [f"parallel={'fsdp_tp' if T > 1 else 'fsdp'}", *layout,
                  f"data.batch_size={local // micro}", f"trainer.accumulate_grad_batches={micro}"]
    # Transformer Engine's fused kernels (attention, linear with its norm, the router's
    # permutation): a compiled step's fused chains of memory-bound ops stand for them
    fused = "TE" in row["kernels"] or "Transformer" in row["kernels"]
    # NeMo AutoModel's fake balanced gate gives token t the experts t*k ... t*k+k-1
    routing = "round_robin" if "fake balanced gate" in row["notes"].lower() else "random"
    # and its runs keep weights, gradients and Adam's moments in bf16 (published_notes.md M2)
    state = "bfloat16" if "automodel" in row["source"].lower() else "float32"
    return [*model, *layout, f"simulate.routing={routing}", f"data.seq_len={row['seq_len']}",
            "precision=bf16", f"precision.state_dtype={state}", "optim=adamw",
            f"trainer.activation_checkpointing={row['checkpointing']}",
            f"trainer.compile={str(fused).lower()}", "cluster=h100" if "H100" in row["hardware"]
            else "cluster=b200" if "B200" in row["hardware"] else "cluster=h200"]
