"""The one step that lays a model out on this rank, in torchtitan's order: the layout's cut
(tensor parallel over the mesh's tp ranks; a pipeline keeps its part first), then
activation checkpointing and compile around the cut blocks, then the data-parallel wrapper
(FSDP2 over dp_shard, HSDP, or DDP over replicas; the one-process layouts' own)."""

from __future__ import annotations

import torch
from torch import nn

from parallab.parallel import activations


def parallelize(model: nn.Module, runtime, trainer, stages: list[str] | None = None
                ) -> nn.Module:
    """`model` (the one `runtime` was made with: converted by its precision already) as this
    rank runs it under `runtime` (trainer: the trainer config; stages: parallel.stages, the
    units activation checkpointing wraps)."""
    # a pipeline keeps its part (its rank on mesh["pp"]), then tensor parallel over mesh["tp"]
    model = runtime.cut_model(model)
    # checkpointing and compile of the blocks each rank runs, inside the wrapper below
    model = speed_up(model, trainer, stages, runtime.runs)
    # FSDP2 over mesh["dp_shard"] (HSDP: mesh["dp_replicate", "dp_shard"]), or DDP over the
    # replicas; the one-process layouts their own (DataParallel, stages on devices)
    return runtime.wrap(model)


def speed_up(model: nn.Module, trainer, stages: list[str] | None = None, runs=None
             ) -> nn.Module:
    """Memory format, activation checkpointing, then compilation, inside any parallel
    wrapper (FSDP2 and DDP then see the compiled blocks): of the modules `runs(model)` gives
    whose forward the step calls (a pipeline's parts; the model where None). Module.compile
    keeps the state_dict keys unprefixed, so checkpoints load anywhere."""
    if trainer.channels_last:
        model = model.to(memory_format=torch.channels_last)
    model = activations.apply(model, trainer.activation_checkpointing, stages,
                              trainer.activation_checkpointing_every)
    if trainer.compile:
        for module in runs(model) if runs else [model]:
            module.compile(backend=trainer.compile_backend, mode=trainer.compile_mode)
    return model


# torch.compile's modes (torch._inductor.list_mode_options)
COMPILE_MODES = (None, "default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")


def compile_problem(trainer) -> str | None:
    """What is wrong with the trainer's compile keys, before any worker starts."""
    if trainer.compile_mode not in COMPILE_MODES:
        return (f"trainer.compile_mode={trainer.compile_mode} is not a torch.compile mode: use "
                f"one of {', '.join(map(str, COMPILE_MODES[1:]))} (or null)")
    if trainer.compile_backend != "inductor":  # torch's own default: no need to load dynamo
        import torch._dynamo

        if trainer.compile_backend not in torch._dynamo.list_backends(exclude_tags=()):
            return (f"trainer.compile_backend={trainer.compile_backend} is not a torch.compile "
                    "backend: use inductor, or aot_eager or eager to debug (all: "
                    "torch._dynamo.list_backends(exclude_tags=()))")
    given = [f"trainer.{key}={getattr(trainer, key)}" for key, default in
             (("compile_mode", None), ("compile_backend", "inductor"))
             if getattr(trainer, key) != default]
    if given and not trainer.compile:
        return (f"{given[0]} without trainer.compile=true: it says how torch.compile compiles, "
                "and nothing is compiled: set trainer.compile=true (or drop it)")
    return None
