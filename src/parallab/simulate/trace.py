"""One rank's training step, traced once per distinct shape on fake tensors.

The model is built on meta and cut to its first block (the repeated unit fsdp shards and
activation checkpointing wraps): what one block computes is what each of them computes,
so tracing one gives every layer's figures, whatever the model's depth. The cut model is
laid out as a rank lays it out (tensor parallel by the model's own plan, over torch's fake
process group of tp ranks; activation checkpointing around the block), given fake
storage, and run forward and backward on a fake micro-batch under autocast. A dispatch
mode records every op a rank runs: its FLOPs (torch's flop counter's formulas), the bytes
it reads and writes (by tensor, so that a fused chain can be counted once), the
collectives tensor parallelism calls; ModTracker says whether
an op belongs to the block, to what comes before it (embeddings) or after it (the head
and the loss). Saved-for-backward bytes per region come from autograd's hooks, and the
peak of the bytes the step's ops made and held at once (activations, temporaries; not the
weights' gradients, which are the state), each storage followed until it is freed
(ops.py). An MoE block's router sends each expert an even share of the tokens
(models/experts.py's uniform routing: fake values cannot be read, and vendor benchmarks
force it so); its experts' ops and weights are marked, for expert parallelism's share of
them (simulate/experts.py).

Nothing is allocated and no collective runs: a 405B model's block traces in a second.
"""

from __future__ import annotations

import contextlib
import copy
import logging
import warnings
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.nn.modules.module import register_module_forward_pre_hook

from parallab.launching.distributed import fake_group
from parallab.simulate import float8, on_a_device
from parallab.simulate.ops import Op, Recorder, _local, _nbytes
from parallab.simulate.sources import Lifetimes, Needed

log = logging.getLogger(__name__)
aten = torch.ops.aten
REGIONS = ("before", "block", "after")


@dataclass(frozen=True)
class Shape:
    """What one rank computes: the key a trace is made and kept by."""

    tp: int = 1
    sequence_parallel: bool = False
    regather: bool = False  # its gathered inputs gathered again in backward
    rows: int = 1  # sequences of a micro-batch
    seq_len: int = 128
    checkpointing: str = "none"
    gathered: bool = False  # FSDP2 gathers the weights in the compute dtype (no casts)
    precision: str = "bf16"  # the precision group's option
    fp8_recipe: str = "tensorwise"  # precision=fp8's scales (float8.py prices them)
    dense: bool = False  # a mixture of experts' dense block, not its MoE one
    experts_split: bool = False  # ep splits the experts: the plan's tp styles for them out


@dataclass
class Trace:
    shape: Shape
    ops: list[Op] = field(default_factory=list)
    saved: dict[str, float] = field(default_factory=dict)  # bytes kept for backward, by region
    saved_compiled: dict[str, float] = field(default_factory=dict)  # those a compiled step keeps
    # of them, autocast's low-precision copies of weights: its cache keeps one a step,
    # however many of a pipeline's micro-batches are in flight
    casts: dict[str, float] = field(default_factory=dict)
    peak_transient: float = 0.0  # activations and temporaries at the step's peak, bytes
    # the weights' gradients outside the block alive at that peak, bytes (float32, as traced)
    ends_grads: float = 0.0
    # elements a rank holds, by region; "experts": those of the block's experts modules
    params: dict[str, float] = field(default_factory=dict)
    boundary_bytes: float = 0.0  # a block's input: what a pipeline stage sends on


def cut_to_one_block(model: nn.Module, blocks: list[nn.Module]) -> str:
    """Keep the first of the model's blocks in their container (a ModuleList the forward
    loops over), the others taken out; the block's name."""
    from parallab.config.errors import ConfigError

    names = {id(m): name for name, m in model.named_modules()}
    first = names[id(blocks[0])]
    parent_name = first.rpartition(".")[0]
    parent = model.get_submodule(parent_name) if parent_name else model
    others = {id(b) for b in blocks[1:]}
    if not isinstance(parent, nn.ModuleList) or any(
            names[id(b)].rpartition(".")[0] != parent_name for b in blocks):
        raise ConfigError(f"the blocks of {type(model).__name__} are not the children of one "
                          "ModuleList its forward loops over, which parallab simulate cuts to "
                          "one: give the model its blocks in an nn.ModuleList")
    kept = [b for b in parent if id(b) not in others]
    parent._modules.clear()
    parent.extend(kept)
    return next(name for name, m in model.named_modules() if m is blocks[0])


def blocks_of(model: nn.Module, stages: list[str] | None) -> list[nn.Module]:
    """The model's repeated blocks: those activation checkpointing wraps one by one (gpt's
    transformer blocks, a transformers model's _no_split_modules), else its stages."""
    from parallab.parallel import activations

    found = activations.units(model, stages) or []
    # not the model itself, nor a wrapper its stages() makes on each call
    held = {id(m) for m in model.modules() if m is not model}
    return [m for m in found if next(m.parameters(), None) is not None and
            type(m) is type(found[len(found) // 2]) and id(m) in held]


def _region(ops: list[Op]) -> None:
    """An op outside the block is `before` it (the embeddings) or `after` it (the head and
    the loss): in the forward, by whether it runs before the block's first op; in the
    backward, the other way round."""
    for phase in ("forward", "backward"):
        inside = [i for i, op in enumerate(ops) if op.phase == phase and op.region == "block"]
        if not inside:
            continue
        first = inside[0]
        for i, op in enumerate(ops):
            if op.phase == phase and op.region == "outside":
                early = i < first
                op.region = ("before" if early else "after") if phase == "forward" else \
                    ("after" if early else "before")


def _fake_batch(fake, shape: Shape, vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    with fake:
        inputs = torch.randint(0, vocab, (shape.rows, shape.seq_len))
        return inputs, torch.randint(0, vocab, (shape.rows, shape.seq_len))


def _split(model: nn.Module, cfg, shape: "Shape", loss) -> bool:
    """Tensor parallel as the mesh layouts split a model (MeshRuntime.cut_model), over a
    mesh of tp ranks (the plan's styles for experts left out where ep splits them);
    whether the logits stay cut by vocabulary (where the loss takes them so)."""
    from torch.distributed.device_mesh import init_device_mesh

    from parallab.parallel import options_of, tp_plans

    mesh = init_device_mesh("cpu", (shape.tp,), mesh_dim_names=("tp",))
    return tp_plans.split(model, mesh, options_of(cfg.parallel).tp_plan,
                          shape.sequence_parallel, loss, ep=2 if shape.experts_split else 1,
                          regather=shape.regather)


def trace(cfg, template: nn.Module, block: str, vocab: int, shape: Shape) -> Trace:
    """One micro-batch's forward and backward of `template` (the model on meta, cut to
    one block named `block`) as a rank of `shape` computes it, on fake tensors."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed._tools.mod_tracker import ModTracker

    from parallab.loss import build_loss, resolve
    from parallab.models import hf
    from parallab.models.experts import experts_of, uniform_routing
    from parallab.parallel import activations, tp_plans
    from parallab.precision import Precision

    from parallab.config.schema import PrecisionConfig

    precision = Precision(PrecisionConfig(name=shape.precision), torch.device("cpu"))
    fake = FakeTensorMode(allow_non_fake_inputs=True)
    model = _on_fake(template, fake, precision.dtype if shape.gathered else None)
    found = Trace(shape)
    the_block = model.get_submodule(block)
    entered = _BlockInput()
    the_block.register_forward_pre_hook(entered)
    called: list[nn.Module] = []
    with fake_group(shape.tp):
        loss = build_loss(resolve(dict(cfg.loss), None, None))
        sharded = shape.tp > 1 and _split(model, cfg, shape, loss)
        # the block's experts modules, by their path in it (a transformers model's ep plan
        # names them from the model's root, before a checkpoint wrapper comes between)
        held = [(name.removeprefix(f"{block}."), m) for name, m in experts_of(model)
                if name.startswith(f"{block}.")]
        converted = float8.layers(model) if shape.precision == "fp8" else set()
        model = activations.apply(model, shape.checkpointing, cfg.parallel.stages)
        float8_names, casts8 = _float8(model, converted, shape)
        loss = loss.bind(model)
        batch = _fake_batch(fake, shape, vocab)
        tracker = ModTracker()
        recorder = entered.recorder = Recorder(tracker, _fqn(model, block),
                                               hf.shifts_labels(model),
                                               tuple(name for name, _ in held), float8_names,
                                               casts8)
        saved = _SavedByRegion(model, tracker, recorder)
        calls = register_module_forward_pre_hook(lambda module, _: called.append(module))
        try:
            with _tracker_quiet(), fake, tracker, recorder, on_a_device.masks(), \
                    tp_plans.loss_context(sharded), uniform_routing(), \
                    on_a_device.attention(), on_a_device.norms():
                with torch.autograd.graph.saved_tensors_hooks(saved.pack, lambda t: t):
                    with precision.autocast():
                        value = loss.step_loss(model, batch, shape.rows * shape.seq_len)[1]
                calls.remove()
                recorder.phase = "backward"
                value.backward()
        finally:
            calls.remove()  # a global hook: never left behind
    found.ops = recorder.ops
    _region(found.ops)
    found.params = {**_params_by_region(model, the_block, called),
                    **_block_kinds(the_block, [m for _, m in held], converted)}
    _saved_and_peak(found, saved, entered, recorder, model, the_block)
    return found


def _float8(model: nn.Module, converted: set[nn.Module], shape: Shape
            ) -> tuple[frozenset[str], float8.SplitCasts | None]:
    """The Linear layers precision=fp8 converts, as ModTracker names them; and where tp
    splits them by torchao's float8 styles (the tensorwise recipe), what those keep and
    gather (float8.SplitCasts)."""
    names = {id(m): _fqn(model, name) for name, m in model.named_modules()}
    casts8 = float8.SplitCasts(model, converted, names, shape.sequence_parallel) \
        if shape.tp > 1 and shape.precision == "fp8" and shape.fp8_recipe == "tensorwise" \
        else None
    return frozenset(names[id(m)] for m in converted), casts8


def _block_kinds(block: nn.Module, experts: list[nn.Module], converted: set[nn.Module]
                 ) -> dict[str, float]:
    """The block's weights (a rank's) that its experts modules hold, and those of the
    Linear layers precision=fp8 converts."""
    inside = set(block.modules())
    return {"experts": float(sum(_local(p).numel() for m in experts for p in m.parameters())),
            "float8": float(sum(_local(m.weight).numel() for m in converted if m in inside))}


@contextlib.contextmanager
def _tracker_quiet():
    """ModTracker's warning that the module hierarchy "maybe be messed up" kept from the
    user, and the process's warning format it swaps as it warns put back: transformers' hub
    kernels (the kernels package) call functions such as rotary embedding's through modules
    nested in modules of one class, unregistered, which ModTracker names alike. The block's
    name stays open around them, so each op's region is still right."""
    kept = warnings.formatwarning
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="The module hierarchy tracking maybe")
        try:
            yield
        finally:
            warnings.formatwarning = kept


def _on_fake(template: nn.Module, fake, gathered_dtype: torch.dtype | None) -> nn.Module:
    """A copy of `template` (on meta) with fake tensors for its weights, tied as it is; in
    `gathered_dtype` where FSDP2 gathers them in that compute dtype (not float32)."""
    model = copy.deepcopy(template)
    if gathered_dtype is not None and gathered_dtype != torch.float32:
        model = model.to(gathered_dtype)
    with fake:
        model = model.to_empty(device="cpu")
    _tie_again(template, model)
    return model


def _saved_and_peak(found: Trace, saved: _SavedByRegion, entered: _BlockInput,
                    recorder: Recorder, model: nn.Module, the_block: nn.Module) -> None:
    """What the traced step saved for backward by region (compiled, and its casts), the
    block's input, and its temporaries' peak without the weights' gradients."""
    found.saved = saved.by_region()
    found.saved_compiled = saved.by_region(compiled=True)
    found.casts = saved.by_region(casts=True)
    found.boundary_bytes = float(_nbytes(entered.tensor)) if entered.tensor is not None \
        else 0.0
    # the weights' gradients are the training state (or FSDP2's gathered ones): not again;
    # those outside the block alive at the peak, as FSDP2's root holds them whole
    grads = {id(p): _local(p.grad).untyped_storage()._cdata for p in model.parameters()
             if p.grad is not None}
    inside = {id(p) for p in the_block.parameters()}
    ends = {key for pid, key in grads.items() if pid not in inside}
    peak, found.ends_grads = recorder.peak_but(set(grads.values()), ends)
    found.peak_transient = float(peak)


class _BlockInput:
    """The traced block's forward pre-hook: its input, whose bytes a pipeline stage sends
    on, and where its backward ends. ModTracker holds the block open past its input's
    gradient, so that what backward then runs for the input's maker (the embedding's
    backward, the gather of a sequence-cut embedding's output) would count once per block:
    the recorder is told when the input has its gradient."""

    def __init__(self):
        self.tensor: torch.Tensor | None = None
        self.recorder: Recorder | None = None

    def __call__(self, _, args) -> None:
        if self.tensor is not None:
            return
        self.tensor = _local(args[0])
        if isinstance(args[0], torch.Tensor) and args[0].requires_grad:
            args[0].register_hook(lambda _: setattr(self.recorder, "block_done", True))


def _fqn(model: nn.Module, block: str) -> str:
    """The block's name as ModTracker names modules: the root's class, then the path."""
    return f"{type(model).__name__}.{block}"


def _tie_again(template: nn.Module, model: nn.Module) -> None:
    """to_empty on fake tensors gives each name of a tied parameter (a head sharing the
    embedding's matrix) a tensor of its own: share them again as `template` does, so that
    the model holds, gathers and steps that matrix once."""
    from parallab.models import tied_names

    for name, first in tied_names(template).items():
        owner, _, attr = name.rpartition(".")
        setattr(model.get_submodule(owner), attr, model.get_parameter(first))


def _params_by_region(model: nn.Module, block: nn.Module, called: list[nn.Module]
                      ) -> dict[str, float]:
    """Elements of the parameters a rank holds (a tensor-parallel shard's), by region: the
    block's, those of modules its forward calls first (the embeddings) and the rest (the
    head; a tied embedding counts where it is looked up)."""
    inside = {id(p) for p in block.parameters()}
    order = {id(m): i for i, m in reversed(list(enumerate(called)))}
    start = order.get(id(block), 0)
    counts = {region: 0.0 for region in (*REGIONS, "tied")}
    seen: dict[int, str] = {}
    for module in model.modules():
        for param in module.parameters(recurse=False):
            region = "block" if id(param) in inside else (
                "before" if order.get(id(module), start + 1) < start else "after")
            if id(param) not in seen:
                seen[id(param)] = region
                counts[region] += _local(param).numel()
            elif {seen[id(param)], region} == {"before", "after"}:  # a head's tied weight
                seen[id(param)] = "tied"
                counts["tied"] += _local(param).numel()
    return counts


class _SavedByRegion:
    """Bytes autograd keeps for backward, by the region that saved them (parameters left
    out: they are the state, counted apart), each storage once; and of them, those a
    compiled block keeps: torch.compile's partitioner recomputes in backward what a chain
    of memory-bound ops made inside the block, and saves the rest (matmul and attention
    outputs, what came in from before the block); the loss, outside the compiled model,
    keeps what it keeps eager (a language model's log-probabilities over its vocabulary)."""

    def __init__(self, model: nn.Module, tracker, recorder: "Recorder"):
        self.tracker, self.recorder = tracker, recorder
        # a tensor-parallel weight's shard: what autograd saves a view of (its local tensor)
        self.params = {_local(p).untyped_storage()._cdata for p in model.parameters()}
        self.param_ids = {id(p) for p in model.parameters()}
        # storage -> (region, bytes, kept compiled, a parameter's cast)
        self.seen: dict[object, tuple[str, int, bool, bool]] = {}
        self.lifetimes = Lifetimes()
        self.needed = Needed()

    def pack(self, tensor: torch.Tensor) -> torch.Tensor:
        from parallab.parallel.activations import is_cast

        storage = _local(tensor).untyped_storage()
        if storage._cdata in self.params:
            return tensor
        key = self.lifetimes.of(storage)  # (not its address: another's once it is freed)
        cast = is_cast(tensor, self.param_ids)
        # a split float8 layer's one-byte copy (float8.SplitCasts), in place of the tensor
        float8 = self.recorder.casts8 and self.recorder.casts8.kept(
            self.recorder.sources, _local(tensor), key, self.tracker.parents, cast)
        if (float8[0] if float8 else key) in self.seen:
            return tensor
        inside = any(p.startswith(self.recorder.block) for p in self.tracker.parents)
        # outside the block: the embeddings' before the block ran, the head's after
        region = "block" if inside else ("after" if self.recorder.block_seen else "before")
        made_in, kind, in_model = self.recorder.produced.get(storage._cdata, ("", "", False))
        recomputed = kind == "memory" and in_model and (made_in == "block") == inside
        if float8:
            copy, nbytes, kept = float8
            recomputed = recomputed if kept is None else not kept
            self.seen[copy] = (region, nbytes, not recomputed, False)
            if copy[0] == "collective":  # a float8 gather's output, counted here
                self.needed.saved.add(copy[1])
        else:
            nbytes = storage.nbytes()
            self.seen[key] = (region, nbytes, not recomputed, cast)
        # what compiled backward makes it again from: a collective's output (sources.py)
        self.needed.add(self.recorder.sources, _local(tensor), nbytes, region, recomputed)
        return tensor

    def by_region(self, compiled: bool = False, casts: bool = False) -> dict[str, float]:
        """Bytes saved by region (`compiled`: those a compiled step keeps; `casts`: of
        them, autocast's copies of weights, which a pipeline's micro-batches share)."""
        totals = {region: 0.0 for region in REGIONS}
        for region, nbytes, kept, cast in self.seen.values():
            if (kept or not compiled) and (cast or not casts):
                totals[region] += nbytes
        if compiled and not casts:
            totals = {region: n + self.needed.kept(region) for region, n in totals.items()}
        return totals
