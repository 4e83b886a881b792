"""Numeric precision of the training step: autocast dtype, and a GradScaler for float16.

    fp32  float32 throughout
    bf16  bfloat16 autocast; no scaler (bfloat16 has float32's exponent range)
    fp16  float16 autocast + GradScaler, on any device (slow on CPU: warned)
    amp   automatic: fp16 + GradScaler on CUDA, bf16 on CPU, where float16 autocast is
          several times slower than either (docs/benchmarks.md, precision and compile)
    fp8   bf16 autocast, the Linear layers' matmuls in float8 (torchao's Float8Linear,
          dynamic scales per tensor or, precision.fp8_recipe=rowwise, per row) on a CUDA GPU
          with float8 tensor cores (compute capability 8.9: Ada, Hopper and later); the
          output layer stays in bf16. precision.fp8_all_gather: FSDP2 gathers the weights
          in float8

precision.reduce_dtype=bfloat16: the data-parallel ranks reduce their gradients in bfloat16,
half float32's bytes: FSDP2's reduce-scatter (and a pipeline's sharded parts accumulate them
so between reductions), DDP's all-reduce (torch's bf16_compress_hook) and a pipeline's
replicas' buckets; the gradients the optimizer steps stay in precision.state_dtype. A
layout without data-parallel ranks has nothing to reduce.

precision.state_dtype=bfloat16 (precision=bf16): the model's weights are cast to bfloat16
before it is laid out (its buffers and a transformers model's float32 modules are not), so
its weights, their gradients and the optimizer's state (torch's optimizers keep theirs in
their parameters' dtype) take 8 bytes a parameter under Adam where float32's take 16;
autocast has no weight to copy. Gradients are still reduced in precision.reduce_dtype:
FSDP2 casts them up for its reduce-scatter and back, DDP's buckets go through
float32_all_reduce.

Under a sharded layout (fsdp, hsdp, tp) each rank holds part of the gradients, so float16's
scaler is torch's ShardedGradScaler: the ranks agree on an overflow (one all-reduce) and
skip the step together.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import warnings
from typing import Any, Callable

import torch

from parallab.config.schema import PrecisionConfig
from parallab.models import named_layer

log = logging.getLogger(__name__)


MODES = ("fp32", "amp", "bf16", "fp16", "fp8")
FP8_RECIPES = ("tensorwise", "rowwise")  # torchao's Float8LinearConfig.from_recipe_name
REDUCE_DTYPES = ("float32", "bfloat16")
STATE_DTYPES = ("float32", "bfloat16")
FP8_CAPABILITY = (8, 9)  # torch._scaled_mm's float8 tensor cores: Ada, Hopper and later


def problem(cfg: PrecisionConfig) -> str | None:
    if cfg.name not in MODES:
        return (f"precision.name={cfg.name} is unknown: use precision="
                f"{', '.join(MODES[:-1])} or {MODES[-1]}")
    if cfg.fp8_recipe not in FP8_RECIPES:
        return (f"precision.fp8_recipe={cfg.fp8_recipe} is not one of torchao's float8 "
                f"recipes: use {' or '.join(FP8_RECIPES)}")
    if cfg.fp8_recipe != "tensorwise" and cfg.name != "fp8":
        return (f"precision.fp8_recipe={cfg.fp8_recipe} with precision={cfg.name}: it scales "
                "float8 matmuls, so it needs precision=fp8 (or drop it)")
    if cfg.fp8_all_gather and cfg.name != "fp8":
        return (f"precision.fp8_all_gather=true with precision={cfg.name}: it gathers float8 "
                "weights, so it needs precision=fp8 (or drop it)")
    if cfg.fp8_all_gather and cfg.fp8_recipe != "tensorwise":
        return (f"precision.fp8_all_gather=true with precision.fp8_recipe={cfg.fp8_recipe}: "
                "FSDP2 gathers float8 weights with tensorwise scales only: use "
                "precision.fp8_recipe=tensorwise")
    if cfg.reduce_dtype not in REDUCE_DTYPES:
        return (f"precision.reduce_dtype={cfg.reduce_dtype} is not a dtype data-parallel "
                f"ranks reduce gradients in: use {' or '.join(REDUCE_DTYPES)}")
    return _state_problem(cfg)


def _state_problem(cfg: PrecisionConfig) -> str | None:
    if cfg.state_dtype not in STATE_DTYPES:
        return (f"precision.state_dtype={cfg.state_dtype} is not a dtype a rank keeps its "
                f"weights and optimizer state in: use {' or '.join(STATE_DTYPES)}")
    if cfg.state_dtype == "bfloat16" and cfg.name != "bf16":
        return (f"precision.state_dtype=bfloat16 with precision={cfg.name}: bfloat16 state is "
                "taken with precision=bf16 alone (bfloat16 autocast, no loss scale, no float8 "
                "casts of its weights): use precision=bf16 (or drop it)")
    return None


def reduce_dtype(cfg: PrecisionConfig) -> torch.dtype:
    """The dtype data-parallel ranks reduce gradients in (precision.reduce_dtype)."""
    return getattr(torch, cfg.reduce_dtype)


def state_dtype(cfg: PrecisionConfig) -> torch.dtype:
    """The dtype a rank keeps weights, gradients and optimizer state in."""
    return getattr(torch, cfg.state_dtype)


def device_hint(cfg: PrecisionConfig, device_type: str) -> str | None:
    """A warning for a run that works but slowly on its device (given by the checks, once:
    a trace of a GPU's step on this CPU, as parallab simulate makes one, is not a run)."""
    if compute_dtype(cfg.name, device_type) == torch.float16 and device_type == "cpu":
        return (f"precision={cfg.name} computes in float16 on CPU, which is slower than fp32 "
                "here; precision=bf16 (or amp) is the fast one on CPU")
    return None


BF16_ROUNDING = 2**-9  # a bfloat16 number is changed by no less than this share of it


def state_hints(cfg: PrecisionConfig, optim, lr: float) -> list[str]:
    """What a bfloat16 state silently loses under this optimizer at its peak rate `lr`
    (optim.lr as the run scales it), said before launch (the run works; these parts of its
    update do nothing): AdamW's decoupled decay and Adam's second-moment decay, each a
    step's change under bfloat16's rounding."""
    if cfg.state_dtype != "bfloat16":
        return []
    said = []
    shrink = lr * optim.weight_decay
    if optim.name == "adamw" and 0 < shrink < BF16_ROUNDING:
        said.append(f"optim.weight_decay={optim.weight_decay} at the peak rate {lr:g} shrinks "
                    f"a weight by {shrink:.1e} of itself a step, under bfloat16's rounding: "
                    "with precision.state_dtype=bfloat16 it never changes a weight (keep "
                    "float32 state, or give optim.weight_decay=0)")
    betas = getattr(optim, "betas", None)
    if betas and 1 - betas[1] < BF16_ROUNDING:
        said.append(f"optim.betas[1]={betas[1]}: Adam's second moment, kept in bfloat16, is "
                    "never lowered (each step's decay is under bfloat16's rounding), so steps "
                    "after a large gradient stay small (keep float32 state, or a smaller beta)")
    return said


def layout_problem(cfg: PrecisionConfig, dp_shard: int = 1) -> str | None:
    """What the layout rules out of cfg, wherever it runs (dp_shard: the ranks FSDP2 shards
    over; simulate's layouts too); None if nothing."""
    return _gather_problem(cfg, dp_shard)


def _gather_problem(cfg: PrecisionConfig, dp_shard: int) -> str | None:
    if cfg.fp8_all_gather and dp_shard < 2:
        return ("precision.fp8_all_gather=true gathers FSDP2's sharded weights, and this "
                "layout shards over no ranks: use parallel=fsdp or hsdp with 2 or more "
                "ranks, or drop it")
    return None


def device_problem(cfg: PrecisionConfig, device_type: str, dp_shard: int = 1) -> str | None:
    """What the resolved device and layout rule out of cfg (fp8's needs, layout_problem's);
    None if nothing."""
    gathered = _gather_problem(cfg, dp_shard)
    if gathered or cfg.name != "fp8":
        return gathered
    from parallab import quantize

    least = ".".join(map(str, FP8_CAPABILITY))
    if device_type != "cuda":
        return ("precision=fp8 trains the Linear layers in float8, which pays on a CUDA GPU "
                f"of compute capability {least} or later (H100, L4, L40S) only; "
                f"device={device_type} has no float8 tensor cores: use precision=bf16")
    found = torch.cuda.get_device_capability()
    if found < FP8_CAPABILITY:
        return (f"precision=fp8 needs float8 tensor cores (compute capability {least} or "
                f"later: H100, L4, L40S); {torch.cuda.get_device_name()} has "
                f"{found[0]}.{found[1]}: use precision=bf16")
    if not quantize.available():  # torchao, whose float8 training this is
        return "precision=fp8 needs torchao: pip install 'parallab[quantize]'"
    return None


def compute_dtype(name: str, device_type: str) -> torch.dtype:
    if name == "amp":
        return torch.float16 if device_type == "cuda" else torch.bfloat16
    return {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16,
            "fp8": torch.bfloat16}[name]  # fp8: what Float8Linear leaves (and its output)


def float8_converts(module: torch.nn.Module, name: str, output: str | None) -> bool:
    """Whether precision=fp8 trains this Linear layer in float8: not the output layer
    (`output`: output_layer's name), and only widths float8 matmuls take (multiples of 16).
    simulate prices the same layers."""
    return name != output and module.in_features % 16 == 0 and module.out_features % 16 == 0


def output_layer(model: torch.nn.Module) -> str | None:
    """The name of the Linear layer that gives the model's output: its output embeddings
    (a transformers model's, gpt's head.out), else the last Linear registered (a
    classifier's last layer)."""
    head = named_layer(model, "get_output_embeddings")
    if head is not None:
        return head
    names = [name for name, m in model.named_modules() if isinstance(m, torch.nn.Linear)]
    return names[-1] if names else None


class Precision:
    def __init__(self, cfg: PrecisionConfig, device: torch.device, sharded: bool = False):
        self.name = cfg.name
        self.fp8_recipe, self.fp8_all_gather = cfg.fp8_recipe, cfg.fp8_all_gather
        self.device_type = device.type
        self.tf32 = cfg.tf32 and device.type == "cuda"
        self.dtype = compute_dtype(cfg.name, device.type)
        self.reduce_dtype = reduce_dtype(cfg)
        self.state_dtype = state_dtype(cfg)
        # scaled loss keeps small float16 gradients from flushing to zero; a step whose
        # gradients overflowed is skipped and the scale lowered
        scaled = self.dtype == torch.float16
        if sharded and scaled:
            # its found-inf flag (shape (1,)) meets DTensor gradients, which DTensor
            # replicates, as meant, warning each time
            warnings.filterwarnings("ignore", message="Found a non-scalar tensor with numel=1")
            self.scaler = _sharded_scaler(device.type)
        else:
            self.scaler = torch.amp.GradScaler(device.type, enabled=scaled)
        if device.type == "cuda":
            torch.backends.cuda.matmul.allow_tf32 = cfg.tf32
            torch.backends.cudnn.allow_tf32 = cfg.tf32

    @property
    def dtype_name(self) -> str:
        return str(self.dtype).removeprefix("torch.")

    def convert(self, model: torch.nn.Module) -> torch.nn.Module:
        """The model's weights in precision.state_dtype (kept_in); fp8: its
        Linear layers as torchao's Float8Linear (before tensor parallel, compile and
        sharding, as torchtitan converts them), but the output layer (its logits feed the
        loss, torchtitan keeps it too) and any whose widths float8 matmuls cannot take
        (multiples of 16); the model as it is otherwise."""
        if self.state_dtype != torch.float32:
            model = kept_in(model, self.state_dtype)
        if self.name != "fp8":
            return model
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training

        output = output_layer(model)
        if output is not None:
            log.info("precision=fp8: %s (the output layer) stays in bf16", output)
        config = dataclasses.replace(Float8LinearConfig.from_recipe_name(self.fp8_recipe),
                                     enable_fsdp_float8_all_gather=self.fp8_all_gather)
        convert_to_float8_training(
            model, config=config,
            module_filter_fn=lambda m, name: float8_converts(m, name, output))
        return model

    def ddp_hook(self) -> Callable | None:
        """DDP's comm hook for this precision: its gradients reduced in reduce_dtype where
        they are kept in another (None: DDP's own all-reduce, in their dtype)."""
        if self.reduce_dtype == self.state_dtype:
            return None
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

        return default_hooks.bf16_compress_hook if self.reduce_dtype == torch.bfloat16 \
            else float32_all_reduce

    def autocast(self) -> contextlib.AbstractContextManager:
        if self.dtype == torch.float32:
            return contextlib.nullcontext()
        return torch.autocast(self.device_type, dtype=self.dtype)

    def backward(self, loss: torch.Tensor) -> None:
        self.scaler.scale(loss).backward()

    def scaled(self, loss: torch.Tensor) -> torch.Tensor:
        """The loss as backward() runs it (times float16's scale): for a pipeline's
        schedule, which runs the backward itself."""
        if not self.scaler.is_enabled():
            return loss  # itself: a view of it is one the zero-bubble schedules cannot detach
        if self.loss_scale() is None:  # the scaler makes its scale at its first use
            self.scaler.scale(loss.detach())
        # a product of the loss's shape (the scaler's own is of the scale's, (1,))
        return loss * self.loss_scale().to(loss.device).reshape(())

    def unscaled(self, value: torch.Tensor) -> torch.Tensor:
        """A scaled loss's own value."""
        scale = self.loss_scale()
        return value if scale is None else value / scale.reshape(())

    def loss_scale(self) -> torch.Tensor | None:
        """What backward() multiplies the loss by (float16's GradScaler); None: nothing. A
        gradient added beside the loss (an MoE router's loss) is scaled alike."""
        return self.scaler._scale if self.scaler.is_enabled() else None

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        """Bring gradients back to their true scale (before clipping them)."""
        self.scaler.unscale_(optimizer)

    def step(self, optimizer: torch.optim.Optimizer) -> None:
        self.scaler.step(optimizer)
        self.scaler.update()

    def state_dict(self) -> dict[str, Any]:
        return self.scaler.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.scaler.load_state_dict(state)


def kept_in(model: torch.nn.Module, dtype: torch.dtype) -> torch.nn.Module:
    """`model` with its floating parameters in `dtype`, each made anew once (a tied one
    stays one; fake tensors too, which Module.to cannot swap). Its buffers stay as they are
    (a rotary table, a router's balancing bias: Module.to had rounded them to bf16); so do
    the weights of a batch norm (F.batch_norm takes them in its statistics' float32 alone)
    and of a transformers model's _keep_in_fp32_modules_strict, wherever it sits in the
    model (DeepSeek-V3's router), as from_pretrained keeps them; a tie held by one of those
    too."""
    from torch.nn.modules.batchnorm import _NormBase

    kept = _float32_weights(model)
    made: dict[int, torch.nn.Parameter] = {}
    for module in model.modules():
        for name, param in list(module._parameters.items()):
            if param is None or not param.is_floating_point() or id(param) in kept or \
                    isinstance(module, _NormBase):
                continue
            if id(param) not in made:
                made[id(param)] = torch.nn.Parameter(param.detach().to(dtype),
                                                     requires_grad=param.requires_grad)
            module._parameters[name] = made[id(param)]
    return model


def _float32_weights(model: torch.nn.Module) -> set[int]:
    """The ids of the weights a transformers model in `model` keeps in float32 (its
    _keep_in_fp32_modules_strict: module or parameter names), under the model that declares
    them, wherever that sits (a user's module wrapping it)."""
    import re

    found = set()
    for owner in model.modules():
        keep = getattr(owner, "_keep_in_fp32_modules_strict", None) or ()
        if keep:
            pattern = re.compile("|".join(rf"(?:^|\.){re.escape(k)}(?:$|\.)" for k in keep))
            found |= {id(p) for name, p in owner.named_parameters(remove_duplicate=False)
                      if pattern.search(name)}
    return found


def float32_all_reduce(group, bucket):  # (DDP refuses any return annotation but its own)
    """DDP's comm hook for bfloat16 gradients reduced in float32 (bf16_compress_hook's
    converse): each bucket averaged in float32, then copied back into its bfloat16 buffer."""
    import torch.distributed as dist

    group = group if group is not None else dist.group.WORLD
    buffer = bucket.buffer()
    wide = buffer.to(torch.float32).div_(group.size())
    future = dist.all_reduce(wide, group=group, async_op=True).get_future()
    return future.then(lambda done: buffer.copy_(done.value()[0]))


def _sharded_scaler(device_type: str):
    """torch's ShardedGradScaler, unscaling DTensor gradients apart from plain ones: one
    foreach call cannot take both, and a pipeline's part under tp holds its norms and
    positions plain beside its DTensor weights."""
    from types import SimpleNamespace

    from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler
    from torch.distributed.tensor import DTensor

    class Scaler(ShardedGradScaler):
        def _unscale_grads_(self, optimizer, inv_scale, found_inf, allow_fp16=True):
            kinds: dict[bool, list] = {}
            for group in optimizer.param_groups:
                for param in group["params"]:
                    kinds.setdefault(isinstance(param.grad, DTensor), []).append(param)
            if len(kinds) < 2:
                return super()._unscale_grads_(optimizer, inv_scale, found_inf, allow_fp16)
            found: dict = {}
            for params in kinds.values():  # each call flags a copy of found_inf: summed
                part = SimpleNamespace(param_groups=[{"params": params}])
                each = super()._unscale_grads_(part, inv_scale, found_inf, allow_fp16)
                for device, flag in each.items():
                    found[device] = found[device] + flag if device in found else flag
            return found

    return Scaler(device_type)
