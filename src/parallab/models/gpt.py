"""A small decoder-only transformer language model, after nanoGPT: pre-LayerNorm blocks of
causal self-attention and a GELU MLP, learned position embeddings, an output head untied
by default (tie_embeddings=true shares the token embedding, as GPT-2 and nanoGPT do; the
two then span the first and the last stage, which model and pipeline parallelism refuse).
With model.moe.experts set, the MLP of every `moe.every`-th block is a mixture of experts
(models/moe.py)."""

from __future__ import annotations

import math
import dataclasses
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from parallab.models import moe as moes
from parallab.models.base import Model, in_range


@dataclass
class GptConfig:
    vocab_size: int = 256
    context: int = 256  # the longest sequence it takes (learned position embeddings)
    layers: int = 4
    heads: int = 4
    width: int = 256
    dropout: float = 0.0
    tie_embeddings: bool = False
    attention: str = "sdpa"
    moe: moes.MoeConfig = dataclasses.field(default_factory=moes.MoeConfig)


ATTENTION = ("sdpa", "manual")


class Packing:
    """The documents of the batch in flight (data.document_mask), shared by the embedding
    and every attention layer: positions that restart at each document, and a (B, 1, T, T)
    block-diagonal causal mask. Held until the next forward, so that activation
    checkpointing's recompute in backward sees the same ones; None: plain causal."""

    def __init__(self) -> None:
        self.positions: torch.Tensor | None = None
        self.mask: torch.Tensor | None = None

    def update(self, documents: torch.Tensor | None) -> None:
        if documents is None:
            self.positions = self.mask = None
            return
        T = documents.shape[1]
        index = torch.arange(T, device=documents.device).expand_as(documents)
        starts = torch.ones_like(documents, dtype=torch.bool)
        starts[:, 1:] = documents[:, 1:] != documents[:, :-1]
        first = torch.where(starts, index, torch.zeros_like(index)).cummax(dim=1).values
        self.positions = index - first
        causal = torch.ones(T, T, dtype=torch.bool, device=documents.device).tril()
        same = documents[:, :, None] == documents[:, None, :]  # (B, T, T)
        self.mask = (same & causal).unsqueeze(1)


class Embed(nn.Module):
    def __init__(self, cfg: GptConfig, packing: Packing | None = None):
        super().__init__()
        self.cfg, self.packing = cfg, packing or Packing()
        self.tokens = nn.Embedding(cfg.vocab_size, cfg.width)
        self.positions = nn.Embedding(cfg.context, cfg.width)
        self.dropout = nn.Dropout(cfg.dropout)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:  # (B, T) int64 -> (B, T, C)
        positions = self.packing.positions  # (B, T) where documents restart them
        if positions is None:
            positions = torch.arange(idx.shape[1], device=idx.device)
        return self.dropout(self.tokens(idx) + self.positions(positions))


class SelfAttention(nn.Module):
    def __init__(self, cfg: GptConfig, packing: Packing | None = None):
        super().__init__()
        self.packing = packing or Packing()
        self.head_dim, self.dropout = cfg.width // cfg.heads, cfg.dropout
        self.manual = cfg.attention == "manual"
        self.qkv = nn.Linear(cfg.width, 3 * cfg.width)
        self.proj = nn.Linear(cfg.width, cfg.width)
        self.proj_dropout = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape
        # (B, T, heads x (q, k, v) x head_dim) -> 3 x (B, heads, T, head_dim); each head's
        # q, k, v rows adjacent, so a column split of qkv (tensor parallel) gives each rank
        # whole heads: the head count is whatever this rank holds
        q, k, v = self.qkv(x).view(B, T, -1, 3, self.head_dim).permute(3, 0, 2, 1, 4)
        mask = self.packing.mask  # (B, 1, T, T): causal within each document
        if self.manual:
            y = self._manual(q, k, v, mask)
        else:
            # a mask where documents are packed: torch's kernel for masks, not flash
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None,
                                               dropout_p=self.dropout if self.training else 0.0)
        return self.proj_dropout(self.proj(y.transpose(1, 2).flatten(2)))

    def _manual(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                mask: torch.Tensor | None = None) -> torch.Tensor:
        """nanoGPT's path without a fused kernel: the (T, T) scores made, masked and
        softmaxed in memory, as attention ran before flash attention (Megatron-LM's, GPT-2's
        own code)."""
        T = q.shape[-2]
        scores = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(self.head_dim))
        causal = torch.ones(T, T, dtype=torch.bool, device=q.device).tril() if mask is None \
            else mask
        weights = F.softmax(scores.masked_fill(~causal, float("-inf")), dim=-1)
        weights = F.dropout(weights, self.dropout, self.training)
        return weights @ v


class Block(nn.Module):
    def __init__(self, cfg: GptConfig, index: int = 0, packing: Packing | None = None):
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.width)
        self.attn = SelfAttention(cfg, packing)
        self.ln2 = nn.LayerNorm(cfg.width)
        if cfg.moe.is_moe(index):
            self.mlp = moes.MoE(cfg.width, cfg.moe, index)
        else:
            self.mlp = nn.Sequential(nn.Linear(cfg.width, 4 * cfg.width), nn.GELU(),
                                     nn.Linear(4 * cfg.width, cfg.width),
                                     nn.Dropout(cfg.dropout))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class Head(nn.Module):
    def __init__(self, cfg: GptConfig):
        super().__init__()
        self.ln = nn.LayerNorm(cfg.width)
        self.out = nn.Linear(cfg.width, cfg.vocab_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, T, C) -> (B, T, vocab) logits
        return self.out(self.ln(x))


class GPT(Model):
    # adapter=lora's default layers: the fused query-key-value projection, as peft's table
    # gives GPT-2 its c_attn
    lora_target_modules = ("qkv",)

    def __init__(self, vocab_size: int = 256, context: int = 256, layers: int = 4,
                 heads: int = 4, width: int = 256, dropout: float = 0.0,
                 tie_embeddings: bool = False, attention: str = "sdpa",
                 moe: dict[str, Any] | None = None):
        super().__init__()
        self.cfg = cfg = GptConfig(vocab_size, context, layers, heads, width, dropout,
                                   tie_embeddings, attention, moes.config_of(moe))
        self.packing = Packing()
        self.embed = Embed(cfg, self.packing)
        self.blocks = nn.ModuleList(Block(cfg, i, self.packing) for i in range(cfg.layers))
        self.head = Head(cfg)
        self.apply(_init_weights)
        out_std = 0.02 / math.sqrt(2 * cfg.layers)  # GPT-2: residual projections scaled
        for block in self.blocks:
            nn.init.normal_(block.attn.proj.weight, std=out_std)
            if isinstance(block.mlp, moes.MoE):
                moes.init_weights(block.mlp, 0.02, out_std)
            else:
                nn.init.normal_(block.mlp[2].weight, std=out_std)
        if tie_embeddings:
            self.head.out.weight = self.embed.tokens.weight

    def stages(self) -> list[nn.Module]:
        return [self.embed, *self.blocks, self.head]

    def forward(self, x: torch.Tensor, *, documents: torch.Tensor | None = None
                ) -> torch.Tensor:
        """(B, T) token ids -> (B, T, vocab) logits; `documents` (B, T): which document of
        its packed window each token is in (data.document_mask), so that attention and
        positions stay within each, as if each document were trained alone."""
        self.packing.update(documents)
        return super().forward(x)

    def get_output_embeddings(self) -> nn.Module:
        """The layer that makes the logits (transformers' name for it)."""
        return self.head.out

    def tp_plan(self, sequence_parallel: bool = False) -> dict[str, Any]:
        """Tensor parallel, as torchtitan's llama plan: q/k/v and the MLP's first linear
        split by columns (whole heads per rank), the output projections by rows, the token
        embedding by vocabulary rows, the head by columns gathered to full logits (kept cut by
        vocabulary where the loss takes them so: tp_plans.shard_logits).

        Without sequence parallelism the norms and positions are replicated and each output
        projection ends in one all-reduce. With it (Megatron-LM's sequence parallelism) the
        residual stream between the split layers is cut along the sequence: the norms run
        on each rank's slice of it, an all-gather brings the whole sequence to attention and
        the MLP and a reduce-scatter (not an all-reduce) cuts their outputs again; the same
        bytes move, and activations outside the split layers are held once per group, not
        once per rank. The embedding stays whole (positions are added to the full sequence)
        and is cut after, a local slice."""
        from torch.distributed.tensor import Replicate, Shard
        from torch.distributed.tensor.parallel import (
            ColwiseParallel,
            PrepareModuleOutput,
            RowwiseParallel,
            SequenceParallel,
        )

        seq = Shard(1) if sequence_parallel else Replicate()  # the residual stream's layout
        # with sequence parallelism the split layers take the sequence's slices and gather
        # them (backward: a reduce-scatter of the input's gradient, where a gather before the
        # module would all-reduce it and slice)
        plan = {"embed.tokens": RowwiseParallel(input_layouts=Replicate()),
                "head.out": ColwiseParallel(input_layouts=seq, output_layouts=Replicate())}
        for i in range(self.cfg.layers):
            plan.update(self._block_plan(i, seq))
            if sequence_parallel:
                plan.update({f"blocks.{i}.ln1": SequenceParallel(),
                             f"blocks.{i}.ln2": SequenceParallel()})
        if sequence_parallel:
            plan.update({"embed": PrepareModuleOutput(output_layouts=Replicate(),
                                                      desired_output_layouts=Shard(1),
                                                      use_local_output=True),
                         "head.ln": SequenceParallel()})
        return plan

    def _block_plan(self, i: int, seq) -> dict[str, Any]:
        """Block i's split layers, the residual stream between them laid out as `seq`. An
        MoE block's router and experts stay whole on each tp rank (expert parallelism
        splits the experts: parallel/expert_parallel.py); its shared experts split as the
        dense MLP does. With sequence parallelism the MoE layer takes the whole sequence
        (its router picks for every token on each rank, as without it) and hands the
        stream back cut: inside it, plain tp."""
        from torch.distributed.tensor import Replicate
        from torch.distributed.tensor.parallel import (
            ColwiseParallel,
            PrepareModuleInputOutput,
            RowwiseParallel,
        )

        plan, mlp_seq = {}, seq
        into, out = ("mlp.0",), "mlp.2"
        if self.cfg.moe.is_moe(i):
            into, out = (("mlp.shared.gate", "mlp.shared.up"), "mlp.shared.down") \
                if self.cfg.moe.shared else ((), None)
            if seq != Replicate():
                mlp_seq = Replicate()
                plan[f"blocks.{i}.mlp"] = PrepareModuleInputOutput(
                    input_layouts=seq, desired_input_layouts=Replicate(), use_local_input=True,
                    output_layouts=Replicate(), desired_output_layouts=seq)
        plan.update({f"blocks.{i}.attn.qkv": ColwiseParallel(input_layouts=seq),
                     f"blocks.{i}.attn.proj": RowwiseParallel(output_layouts=seq),
                     **{f"blocks.{i}.{name}": ColwiseParallel(input_layouts=mlp_seq)
                        for name in into}})
        if out:
            plan[f"blocks.{i}.{out}"] = RowwiseParallel(output_layouts=mlp_seq)
        return plan

    def tp_problem(self, tp: int) -> str | None:
        if self.cfg.heads % tp:
            return (f"parallel.tp={tp} does not divide model.heads={self.cfg.heads}: each rank "
                    "computes whole heads; pick a tp that divides the heads")
        return None

    def checkpoint_stages(self) -> list[nn.Module]:
        """Activation checkpointing per transformer block, as torchtitan applies it."""
        return list(self.blocks)

    def flops_per_token(self, seq_len: int) -> float:
        """Training FLOPs per token of `seq_len`-token sequences (see below), for MFU."""
        return flops_per_token(self.cfg, seq_len)

    @classmethod
    def check_data(cls, cfg, data) -> str | None:
        problem = in_range(cfg, {"vocab_size": 1, "context": 1, "layers": 1, "heads": 1,
                                 "width": 1}, below_one=("dropout",))
        if problem:
            return problem
        problem = moes.problem(cfg.get("moe"), cfg["layers"])
        if problem:
            return problem
        cfg = GptConfig(**{**cfg, "moe": moes.config_of(cfg.get("moe"))})
        if cfg.attention not in ATTENTION:
            return (f"model.attention={cfg.attention} is unknown: use sdpa (the fused kernel) "
                    "or manual (the scores in memory)")
        if cfg.width % cfg.heads:
            return (f"model.width={cfg.width} does not split into model.heads={cfg.heads} "
                    "heads: make model.width a multiple of model.heads")
        seq_len, vocab = getattr(data, "seq_len", None), getattr(data, "vocab_size", None)
        if seq_len is not None and getattr(data, "sample", None) == "causal_lm":
            return ("data.sample=causal_lm gives a transformers model's {input_ids, labels}, "
                    "and model=gpt takes (x, y) pairs: use data.sample=pair, or auto")
        if seq_len is None or vocab is None or not data.next_token:  # next-token targets
            why = "no data.seq_len" if seq_len is None else \
                "its samples are no (x, y) pairs of next-token targets"
            return (f"model=gpt predicts the next token of sequences, which data={data.name} "
                    f"does not hold ({why}): use data=bytes, or data=token_files (`parallab "
                    "prepare-data` writes them from text)")
        if seq_len > cfg.context:
            return (f"data.seq_len={seq_len} is longer than model.context={cfg.context}: set "
                    f"model.context={seq_len} or data.seq_len<={cfg.context}")
        if vocab > cfg.vocab_size:
            return (f"model.vocab_size={cfg.vocab_size} is smaller than the {vocab} tokens of "
                    f"data={data.name}: set model.vocab_size={vocab}")
        return None


def _init_weights(module: nn.Module) -> None:
    if isinstance(module, (nn.Linear, nn.Embedding)):
        nn.init.normal_(module.weight, std=0.02)
    if isinstance(module, nn.Linear) and module.bias is not None:
        nn.init.zeros_(module.bias)


def flops_per_token(cfg: GptConfig, seq_len: int | None = None) -> float:
    """Training FLOPs (forward + backward) per token, the PaLM estimate that nanoGPT's MFU
    uses: 6 per weight a token is multiplied by (embedding look-ups are not), plus
    12·layers·seq_len·width for the attention scores and their use (seq_len: the full
    context unless given). An MoE block counts the weights a token meets: the router, its
    top_k experts and the shared ones, not every expert's."""
    C = cfg.width
    attention = 4 * C * C + 4 * C + 4 * C  # qkv, proj with biases; 2 LayerNorms
    moe_blocks = sum(cfg.moe.is_moe(i) for i in range(cfg.layers))
    mlps = (cfg.layers - moe_blocks) * (8 * C * C + 5 * C)  # 2 MLP linears with biases
    if moe_blocks:
        mlps += moe_blocks * moes.active_weights(cfg.moe, C)
    multiplied = cfg.layers * attention + mlps + 2 * C + C * cfg.vocab_size  # + final LN, head
    return 6.0 * multiplied + 12.0 * cfg.layers * (seq_len or cfg.context) * C
