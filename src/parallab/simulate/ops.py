"""What a traced step's ops cost: each op a rank runs, recorded by a dispatch mode with its
FLOPs (torch's flop counter's formulas; fused attention by its own count), the bytes it
reads and writes by tensor (a fused chain is then counted once), its region (the block,
before it, after it), and the collectives tensor parallelism calls, on the local shard a
rank holds of each DTensor. The bytes the step's ops made and held at once are tracked
as it runs (each storage held weakly: freed when the step lets it go)."""

from __future__ import annotations

import itertools
import weakref
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map
from torch.utils.weak import WeakIdKeyDictionary

from parallab.observe import comm
from parallab.simulate.sources import Sources

aten = torch.ops.aten


@dataclass
class Op:
    phase: str  # forward | backward | optimizer
    region: str  # before | block | after
    kind: str  # matmul | attention | memory | collective
    flops: float
    reads: tuple[tuple[int, int], ...]  # (tensor id, bytes)
    writes: tuple[tuple[int, int], ...]
    collective: str | None = None  # comm.KINDS
    sent: float = 0.0  # bytes a rank sends (comm.py's bus bytes)
    group: int = 1  # ranks of the collective's group
    wide: bool = False  # its output is 4-byte floats (float32 matmuls run at the fp32 peak)
    dtensor: bool = False  # dispatched through DTensor (tensor parallel): its own overhead
    # run by the model's forward or backward, which trainer.compile compiles; the loss's
    # ops (outside the model) run eager, compiled or not
    in_model: bool = True
    experts: bool = False  # run inside an MoE layer's experts module (expert parallelism's)
    weight_bytes: int = 0  # of its bytes, its experts' weights (3-D) and their gradients
    fp8: bool = False  # a matmul of a Linear layer precision=fp8 trains in float8 (float8.py)
    # of a float8 matmul's operands (by their place in reads), those cast before it (under
    # tp's float8 styles: float8.SplitCasts), and the bytes of a gathered input's slice
    # cast before its gather, charged to the first matmul that reads it
    precast: tuple[int, ...] = ()
    slice_cast: float = 0.0
    recomputed: bool = False  # a forward op run again in backward (activation checkpointing)
    # the op and its arguments, tensors as (shape, stride, dtype): run again on this machine
    # (cluster=this times each op for real)
    replay: Any = None


# the CPU's fused attention, which the trace runs (CUDA's flash kernels do the same work)
ATTENTION = {getattr(aten, name).default for name in (
    "_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_flash_attention",
    "_scaled_dot_product_efficient_attention", "_scaled_dot_product_cudnn_attention")
    if hasattr(aten, name)}
ATTENTION_BACKWARD = {getattr(aten, name).default for name in (
    "_scaled_dot_product_flash_attention_for_cpu_backward",
    "_scaled_dot_product_flash_attention_backward",
    "_scaled_dot_product_efficient_attention_backward",
    "_scaled_dot_product_cudnn_attention_backward") if hasattr(aten, name)}
# ops that move no data: views and metadata
FREE = {aten.view.default, aten._unsafe_view.default, aten.t.default, aten.transpose.int,
        aten.permute.default, aten.expand.default, aten.detach.default, aten.alias.default,
        aten.slice.Tensor, aten.select.int, aten.unsqueeze.default, aten.squeeze.dim,
        aten.split.Tensor, aten.split_with_sizes.default, aten.unbind.int,
        aten.as_strided.default, aten._reshape_alias.default, aten.lift_fresh.default,
        aten.empty.memory_format, aten.empty_strided.default, aten.new_empty_strided.default,
        aten.new_empty.default, aten.empty_like.default}


def moves_data(func) -> bool:
    """An op that does work of its own: not a view, nor metadata, nor a primitive torch
    decomposes into (what the trace records, and what cluster=this counts and times)."""
    return not (func in FREE or func.is_view or func.namespace == "prim")


def attention_flops(q: torch.Tensor, k: torch.Tensor, causal: bool, backward: bool) -> float:
    """FLOPs of fused attention over (batch, heads, seq, dim) queries and keys: two matmuls
    forward (QK^T, PV), five backward (QK^T again, then dV, dP, dQ, dK), each 2·b·h·s·t·d;
    a causal mask halves the work the kernels do."""
    b, h, s, d = q.shape
    t = k.shape[-2]
    flops = (5 if backward else 2) * 2.0 * b * h * s * t * d
    return flops / 2 if causal else flops


def _nbytes(t: torch.Tensor) -> int:
    """Bytes an op touches of `t`: its elements (a broadcast dimension once)."""
    numel = 1
    for size, stride in zip(t.shape, t.stride()):
        if stride != 0:
            numel *= size
    return numel * t.element_size()


@dataclass(frozen=True)
class Spec:
    """A tensor argument as a replay makes it again."""

    shape: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: torch.dtype


def _spec(value: Any) -> Any:
    value = _local(value)
    if isinstance(value, torch.Tensor):
        return Spec(tuple(value.shape), tuple(value.stride()), value.dtype)
    return value


def _local(value: Any) -> Any:
    from torch.distributed.tensor import DTensor

    return value._local_tensor if isinstance(value, DTensor) else value


class Recorder(TorchDispatchMode):
    """Each op as Op: its FLOPs and bytes on the local tensors a rank holds (a DTensor's
    shard), its region from `tracker` (ModTracker) and the phase set from outside."""

    def __init__(self, tracker, block: str, causal_lm: bool, experts: tuple[str, ...] = (),
                 float8: frozenset[str] = frozenset(), casts8=None):
        super().__init__()
        self.casts8 = casts8  # float8.SplitCasts under tp's tensorwise float8 styles
        if casts8 is not None:
            casts8.amax = self.amax
        self.sources = Sources()  # the collectives' outputs a compiled step keeps
        self.tracker, self.block, self.causal_lm = tracker, block, causal_lm
        self.float8 = float8  # the Linear layers precision=fp8 converts, as ModTracker names
        # the block's experts modules by their path in it (a checkpoint wrapper between)
        self.experts = tuple(f".{name}" for name in experts)
        self.root = block.split(".")[0]  # the model's root module's name
        self.phase = "forward"
        self.ops: list[Op] = []
        # storage -> (region, kind, in_model) of the op that made it
        self.produced: dict[int, tuple[str, str, bool]] = {}
        # the storages the step made, each as it was made and freed (held weakly: freed
        # when the step lets it go), in turn: (storage, +bytes made or -bytes freed)
        self.events: list[tuple[int, int]] = []
        self.block_seen = False  # the block's forward has begun (what is after it, after)
        self.rerun = 0  # modules whose forward runs again in backward, nested (checkpoints')
        tracker.register_user_hooks(self.forward_entered, self.forward_left)
        self.block_done = False  # the block's input has its gradient: backward left it
        self.held: dict[int, weakref.ref] = {}
        # a serial number per tensor, held weakly: the trace frees what the step frees
        self.serials = WeakIdKeyDictionary()
        self.counter = itertools.count()

    def forward_entered(self, module, args) -> None:
        """ModTracker's hook at a module's forward: in backward, a checkpoint's rerun."""
        self.rerun += self.phase == "backward"

    def forward_left(self, module, args, output) -> None:
        self.rerun -= self.phase == "backward"

    def _ids(self, values) -> tuple[tuple[int, int], ...]:
        found = []
        for value in values:
            value = _local(value)
            if isinstance(value, torch.Tensor):
                if value not in self.serials:
                    self.serials[value] = next(self.counter)
                found.append((self.serials[value], _nbytes(value)))
        return tuple(found)

    def _in_model(self) -> bool:
        """Run by the model (its root's name or under it), not by a loss of its own, module
        or not, nor outside any module."""
        return any(p == self.root or p.startswith(self.root + ".")
                   for p in self.tracker.parents)

    def _region(self) -> str:
        if self.block_done:
            return "outside"
        if any(p.startswith(self.block) for p in self.tracker.parents):
            self.block_seen = self.block_seen or self.phase == "forward"
            return "block"
        return "outside"

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = _run(func, args, kwargs)
        if not moves_data(func):
            return out
        flat_in, _ = tree_flatten((args, kwargs))
        flat_out, _ = tree_flatten(out)
        name = func.name().replace("::", ".").removesuffix(".default")
        known = comm._OPS.get(name)
        if known is not None:
            self._collective(known, args, kwargs, out)
            return out
        if func.namespace == "_c10d_functional":  # waits, and the like: no work of their own
            self.sources.waited(_local(args[0]), _local(out))
            return out
        from torch.distributed.tensor import DTensor

        first = _local(flat_out[0]) if flat_out else None
        wide = isinstance(first, torch.Tensor) and first.element_size() >= 4
        experts = bool(self.experts) and any(p.startswith(self.block) and p.endswith(self.experts)
                                             for p in self.tracker.parents)
        op = Op(self.phase, self._region(), *self._cost(func, args, kwargs, out),
                self._ids(flat_in), self._ids(flat_out), wide=wide,
                dtensor=any(isinstance(a, DTensor) for a in flat_in),
                in_model=self._in_model(), experts=experts,
                weight_bytes=sum(_nbytes(_local(t)) for t in (*flat_in, *flat_out)
                                 if isinstance(_local(t), torch.Tensor) and
                                 _local(t).dim() == 3) if experts else 0,
                replay=(func, tree_map(_spec, args), tree_map(_spec, kwargs)))
        # a converted Linear's matmul; not an experts' one, which train keeps in bf16, run
        # in backward while a shared expert's Linear is still among the parents
        op.fp8 = op.kind == "matmul" and not experts and \
            bool(self.float8.intersection(self.tracker.parents))
        op.recomputed = self.rerun > 0
        if op.fp8 and self.casts8 is not None:
            op.precast, op.slice_cast = self.casts8.casts(
                self.sources, self.phase == "backward" and not op.recomputed,
                self.tracker.parents,
                [_local(t) for t in flat_in if isinstance(_local(t), torch.Tensor)])
        moved = True  # train runs it (not so a float8 gather's autocast copy)
        if self.phase == "forward" or op.recomputed:
            tensors = [[t for t in map(_local, values) if isinstance(t, torch.Tensor)]
                       for values in (flat_in, flat_out)]
            if self.casts8 is not None:
                moved = self._float8_gathered(op, func, tensors[0])
                self.casts8.derived(func, *tensors)
            if op.kind == "memory":
                self.sources.passed(*tensors, op.region == "block")
        if not moved:  # not run by train: neither its time nor its memory
            return out
        self.ops.append(op)
        for value in flat_out:
            value = _local(value)
            if isinstance(value, torch.Tensor):
                self._made(value.untyped_storage(), op)
        return out

    def _float8_gathered(self, op: Op, func, inputs: list[torch.Tensor]) -> bool:
        """A memory-bound op on a float8 gather's output priced at the bytes train moves
        (SplitCasts.moved): the chunks put together in one byte an element; False for
        autocast's copy, which train does not run."""
        share = self.casts8.moved(self.sources, func, inputs) if op.kind == "memory" else None
        if share is not None:
            op.reads, op.writes = (tuple((s, b * share) for s, b in ends)
                                   for ends in (op.reads, op.writes))
        return share != 0

    def _collective(self, known: tuple, args: tuple, kwargs: dict, out: Any) -> None:
        """A collective: the bytes a rank sends (one an element where it gathers what was
        cast to float8 first, SplitCasts), and its output, which a compiled step keeps
        where a recomputed chain starts from it (sources.py)."""
        kind_name, index, factor = known
        n = comm._group_size(args, kwargs)
        source, made = _local(args[index]), _local(out)
        sent = comm._nbytes(source) * factor(n) if n > 1 else 0.0
        float8 = kind_name == "all_gather" and self.casts8 is not None and \
            self.casts8.cast_first(source)
        size = source.element_size() if float8 else 1  # bytes an element moves: float8's one
        if float8:
            self.amax(n)  # the cast before the gather: its scale over the slices
        self.ops.append(Op(self.phase, self._region(), "collective", 0.0, (), (), kind_name,
                           sent / size, n))
        if isinstance(made, torch.Tensor):
            serial = self.sources.collective(made, made.untyped_storage().nbytes() // size,
                                             self._region() == "block")
            if float8:
                self.casts8.float8.add(serial)

    def amax(self, ranks: int, casts: int = 1, phase: str | None = None) -> None:
        """`casts` float8 casts of tensors cut over `ranks`, in `phase` (None: now): each
        one's tensorwise scale's amax (one float32) all-reduced over them. Those of a
        backward are counted as its forward runs (not again as a checkpoint reruns it)."""
        if phase is not None and phase != self.phase and self.phase != "forward":
            return
        self.ops.extend(Op(phase or self.phase, self._region(), "collective", 0.0, (), (),
                           "all_reduce", 4 * 2 * (ranks - 1) / ranks, ranks)
                        for _ in range(casts))

    def _made(self, storage: torch.UntypedStorage, op: Op) -> None:
        key = storage._cdata
        self.produced[key] = (op.region, op.kind, op.in_model)
        if key in self.held:
            return
        size = storage.nbytes()
        self.events.append((key, size))

        def freed(_, key=key, size=size) -> None:
            self.events.append((key, -size))
            self.held.pop(key, None)
            # its address is free for the next storage, which this op did not make
            self.produced.pop(key, None)

        self.held[key] = weakref.ref(storage, freed)

    @property
    def live(self) -> int:
        """Bytes of the storages the step made that are alive now."""
        return sum(size for _, size in self.events)

    def peak_but(self, kept: set[int], asked: set[int]) -> tuple[int, int]:
        """The most bytes alive at once but those of the storages `kept` at the end (the
        weights' gradients: state, counted apart), each left out from when it was made; and
        the bytes of those of them in `asked` alive at that peak."""
        made = {key: i for i, (key, size) in enumerate(self.events) if size > 0 and key in kept}
        last = {i: key for key, i in made.items()}  # a storage's last making: the one kept
        live = peak = beside = at_peak = 0
        for i, (_, size) in enumerate(self.events):
            if i in last:
                beside += size if last[i] in asked else 0
                continue
            live += size
            if live > peak:
                peak, at_peak = live, beside
        return peak, at_peak

    def _cost(self, func, args, kwargs, out) -> tuple[str, float]:
        from torch.utils.flop_counter import flop_registry

        if func in ATTENTION or func in ATTENTION_BACKWARD:
            backward = func in ATTENTION_BACKWARD
            q, k = (_local(args[1]), _local(args[2])) if backward else \
                (_local(args[0]), _local(args[1]))
            # a causal LM's mask, which transformers builds where tensors are fake, is the
            # causal one it leaves to the kernel's is_causal on a GPU
            causal = bool(kwargs.get("is_causal", _causal_arg(func, args))) or (
                self.causal_lm and q.shape[-2] == k.shape[-2])
            return "attention", attention_flops(q, k, causal, backward)
        if func is aten._grouped_mm.default:  # experts' rows by their groups' weights
            return "matmul", _grouped_mm_flops(_local(args[0]), _local(out))
        packet = func._overloadpacket
        if packet in flop_registry:
            local_args = [_local(a) for a in args]
            local_out = tuple(_local(o) for o in out) if isinstance(out, tuple) else _local(out)
            try:
                flops = flop_registry[packet](*local_args, **kwargs, out_val=local_out)
            except Exception:  # noqa: BLE001 - a formula that does not take this overload
                flops = 0
            return "matmul", float(flops)
        return "memory", 0.0


def _run(func, args: tuple, kwargs: dict) -> Any:
    """The op on the fake tensors. A float32 grouped matmul (a transformers model's experts
    whose weights stay float32 beside autocast, where a GPU runs it float32) has a shape
    rule for 16-bit inputs only: its output's shape from a bfloat16 one."""
    if func is aten._grouped_mm.default and args[0].dtype == torch.float32:
        half = [a.to(torch.bfloat16) if isinstance(a, torch.Tensor) and a.is_floating_point()
                else a for a in args]
        return func(*half, **kwargs).to(torch.float32)
    return func(*args, **kwargs)


def _grouped_mm_flops(a: torch.Tensor, out: torch.Tensor) -> float:
    """2 per multiply-add of a grouped matmul: rows (M, K) by each group's (K, N) into (M,
    N); or a weight's gradient, (K, M) by (M, N) into each group's (K, N), its M rows cut
    among the groups."""
    if out.dim() == 3 and a.dim() == 2:
        return 2.0 * out[0].numel() * a.shape[-1]
    return 2.0 * out.numel() * a.shape[-1]


def _causal_arg(func, args) -> bool:
    """is_causal passed by position: the schema's own index of it."""
    for index, argument in enumerate(func._schema.arguments):
        if argument.name == "is_causal" and index < len(args):
            return bool(args[index])
    return False
