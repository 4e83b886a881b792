"""Weights in and out, in any of formats.FORMATS (each format's reader and writer is there):
a checkpoint's model exported with the run's config beside it, and weights read back, whole
or each rank its part, for evaluate.py, `parallab export` and trainer.init_from.

Keys are the model's parameter names: the prefixes wrappers add (DDP's `module.`, compile's
`_orig_mod.`, activation checkpointing's `_checkpoint_wrapped_module.`) never matter. Tied
weights are written once, as safetensors requires, and restored from the tensor they share.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn

from parallab import batch as batches
from parallab.config.errors import ConfigError, OneLineError, first_line
from parallab.models import hf, tied_names
from parallab.training import formats
from parallab.training.formats import plain_name

log = logging.getLogger("parallab")


def holds_adapters(path: str | Path) -> bool:
    """A peft adapter folder, or weights of a model with LoRA adapters (a checkpoint of an
    adapter=lora run): loaded into a model once its adapters are on."""
    from parallab.models import adapters

    return adapters.is_folder(path) or any(".lora_" in key for key in shapes(path))


def record(path: str | Path) -> dict[str, Any]:
    """What a checkpoint or an export records besides weights: {"step", "config", ...}
    (an export's config: the run's, where parallab wrote it)."""
    return formats.format_of(path).record()


def shapes(path: str | Path) -> dict[str, tuple[int, ...]]:
    """Each saved weight's shape, by plain name, reading no tensor data; CheckpointError
    for a file that cannot be read (truncated, not what its name says)."""
    return formats.format_of(path).shapes()


def read(path: str | Path, model: nn.Module) -> dict[str, torch.Tensor]:
    """The saved weights by plain name, whole tensors on the CPU (`model`, whole: the
    template a sharded checkpoint is read into)."""
    if _converted(model, path):
        state, info = hf.pretrained(path, model)
        # what the folder lacks or holds in another shape, the model's class made afresh:
        # not read, so left at the model's own start (trainer.init_strict=false) and said
        unread = {*info["missing_keys"], *(k for k, *_ in _mismatched(info))}
        return {plain_name(k): v for k, v in state.items() if k not in unread}
    return formats.format_of(path).read(model)


def _mismatched(info: dict) -> list[tuple[str, tuple, tuple]]:
    """transformers' weights of another shape: (name, saved shape, the model's)."""
    return [(k, tuple(saved), tuple(own)) for k, saved, own in info.get("mismatched_keys", [])]


def _converted(model: nn.Module, path: str | Path) -> bool:
    """A transformers folder whose names transformers converts for `model` (an MoE model's
    experts published one by one): read through the model's class, as from_pretrained
    reads it."""
    return isinstance(formats.format_of(path), formats.WeightsFolder) and \
        hf.converts_checkpoints(model) and bool(sum(map(len, fit(model, shapes(path)))))


def fit(model: nn.Module, saved: dict[str, tuple[int, ...]],
        covers=formats.Format.covers) -> tuple[list, list, list]:
    """(missing, unexpected, mis-shaped) names between `model` (meta will do) and saved
    shapes, of the model's weights that the format `covers` (a peft adapter folder: the
    adapters alone); a tied weight saved under any of its names is present."""
    aliases = tied_names(model)
    own = {name: tuple(v.shape) for k, v in model.state_dict().items()
           if covers(name := plain_name(k))}
    present = set(saved) | {alias for alias, first in aliases.items() if first in saved} | {
        first for alias, first in aliases.items() if alias in saved}
    missing = [k for k in own if k not in present]
    unexpected = [k for k in saved if k not in own]
    wrong = [f"{k} {list(saved[k])} vs {list(own[k])}" for k in own
             if k in saved and saved[k] != own[k]]
    return missing, unexpected, wrong


def fit_problem(model: nn.Module, path: str | Path, key: str, strict: bool,
                loosen: str | None = None) -> str | None:
    """One line where the weights at `path` do not fit `model` (strict: every name and
    shape; else: some weight must match). `loosen`: the setting that loads only what fits,
    named as the fix where some weight matches and the caller takes one (as load_into's)."""
    covers = formats.format_of(path).covers
    missing, unexpected, wrong = fit(model, shapes(path), covers)
    if _converted(model, path):  # as the model's class reads it: its own names
        info = hf.pretrained(path, model, meta=True)[1]
        missing, unexpected = info["missing_keys"], info["unexpected_keys"]
        wrong = [f"{k} {list(saved)} vs {list(own)}" for k, saved, own in _mismatched(info)]
    said = [f"{len(found)} {what} ({', '.join(found[:5])})" for what, found in
            (("missing", missing), ("unexpected", unexpected), ("mis-shaped", wrong)) if found]
    held = [k for k in model.state_dict() if covers(plain_name(k))]
    some = len(missing) + len(wrong) < len(held)  # some weight matches
    if not said or not strict and some:
        return None
    fix = (f"{loosen} loads those that match" if loosen and strict and some else
           "give weights of this model")
    return (f"{key}={path} does not fit {type(model).__name__}: {'; '.join(said)}: {fix}")


@contextlib.contextmanager
def parameters_on_meta() -> Iterator[None]:
    """Modules built inside hold their parameters on meta, their buffers for real (a rotary
    table computed in __init__): the weights take no memory until the model is laid out
    (accelerate's init_empty_weights(include_buffers=False)). Each parameter is made, then
    let go, one at a time; one assigned again (a tied head) stays the same object."""
    register = nn.Module.register_parameter

    def on_meta(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        if param is not None and not param.is_meta:
            param = nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)
        register(module, name, param)

    nn.Module.register_parameter = on_meta
    try:
        yield
    finally:
        nn.Module.register_parameter = register


def load_held(model: nn.Module, path: str | Path, device: torch.device,
              ties: dict[str, str]) -> None:
    """`model`, laid out with its parameters on meta (parameters_on_meta), given storage on
    `device`, its buffers as built, and each rank's
    part of the weights at `path` (torchtitan's order: no rank holds the whole model): a
    .dcp read shard by shard, a file tensor by tensor, each cut here and copied straight
    into the rank's own part. `ties`: the whole model's tied names (tied_names, taken
    before any cut), by which a weight saved once is found under each of its names."""
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        set_model_state_dict,
    )

    path = Path(path)
    buffers = {name: b for name, b in model.named_buffers() if not b.is_meta}
    held_ties = tied_names(model)  # a V's two parts on one rank share its embedding
    model.to_empty(device=device)
    for alias, first in held_ties.items():  # to_empty gives each module a new parameter
        owner, _, leaf = alias.rpartition(".")
        setattr(model.get_submodule(owner), leaf, model.get_parameter(first))
    with torch.no_grad():  # buffers were built for real: computed ones (a rotary table) kept
        for name, value in buffers.items():
            model.get_buffer(name).copy_(value)
    reader = formats.format_of(path)
    if isinstance(reader, formats.CheckpointFormat) and reader.sharded:  # reshards itself
        held = get_model_state_dict(model)
        reader.read_state({"model": held})
        set_model_state_dict(model, held)
        return
    saved = reader.lazy()
    if _converted(model, path):  # whole through the model's class: each rank cuts its part
        converted = {plain_name(k): v for k, v in hf.pretrained(path, model)[0].items()}
        saved = formats.Lazy({k: k for k in converted}, converted.__getitem__)
    for alias, first in ties.items():  # a tied weight, saved under one name
        if alias not in saved.where and first in saved.where:
            saved.where[alias] = saved.where[first]
        elif first not in saved.where and alias in saved.where:
            saved.where[first] = saved.where[alias]
    with torch.no_grad():
        for key, mine in model.state_dict().items():  # views of the parameters themselves
            name = plain_name(key)
            part = formats.held_as({name: mine}, saved, path)[name]
            batches.local(mine).copy_(batches.local(part))
            saved.release(name)


def model_from(path: str | Path, model: nn.Module) -> nn.Module:
    """`model` with every weight saved at `path` (a checkpoint or an export)."""
    load_into(model, path)
    return model


def load_into(model: nn.Module, path: str | Path, strict: bool = True,
              loosen: str | None = None) -> list[str]:
    """`model` (whole, on the CPU) given the weights at `path`; returns the names left at
    their initial values (strict=False), after fit_problem said they may be. `loosen`: the
    setting that loads only what fits, named in the refusal where the caller takes one
    (trainer.init_strict=false for trainer.init_from; evaluate.py and export take none)."""
    saved = read(path, model)
    aliases = tied_names(model)
    for alias, first in aliases.items():  # a tied weight written under one of its names
        if first not in saved and alias in saved:
            saved[first] = saved[alias]
    covers = formats.format_of(path).covers  # a peft adapter folder: the adapters alone
    own = {name: k for k in model.state_dict() if covers(name := plain_name(k))}
    state = model.state_dict()
    kept = {own[k]: v for k, v in saved.items()
            if k in own and tuple(v.shape) == tuple(state[own[k]].shape)}
    left = [k for k in own if own[k] not in kept and k not in aliases]
    if strict and left:
        raise ConfigError(f"{path} leaves {', '.join(left[:5])} unset: give weights of this "
                          f"model{f', or {loosen}' if loosen else ''}")
    model.load_state_dict({**state, **kept})
    return left


def export_kind(ckpt: Path, out: Path, force: bool) -> type[formats.Format]:
    """The format export writes at `out` (formats.writer_for), checked before anything is
    read or written: never the checkpoint itself, inside it or around it, and an existing
    OUT only with --force. ConfigError in one line otherwise."""
    kind = formats.writer_for(out)
    if kind is None:
        raise ConfigError(f"{out}: export writes {formats.written()} (no other suffix)")
    if not out.parent.is_dir():
        raise ConfigError(f"{out.parent} is not a directory: create it, or give a "
                          "path in an existing one")
    source, target = ckpt.resolve(), out.resolve()
    clash = ("the checkpoint" if target == source else "inside the checkpoint"
             if source in target.parents else "a folder holding the checkpoint"
             if target in source.parents else None)
    if clash is not None:
        raise ConfigError(f"{out} is {clash} {ckpt}: export to another path (the checkpoint "
                          "is kept as it is)")
    if (out.exists() or out.is_symlink()) and not force:
        raise ConfigError(f"{out} exists: give a new name, or --force to replace what export "
                          "writes there")
    if out.exists() and kind.suffix and not out.is_file():
        raise ConfigError(f"{out} is not a file: export writes a {kind.suffix} file there "
                          "only in place of one")
    if out.exists() and not kind.suffix and not out.is_dir():
        raise ConfigError(f"{out} is a file: export writes a folder there only in place of "
                          "one (give OUT a suffix for a file: .pt, .safetensors)")
    return kind


def require_adapters(ckpt: Path, out: Path, kind, adapter: Any, merged: bool) -> None:
    """--merged only of a checkpoint with adapters; adapters alone only as a folder."""
    if merged and not adapter:
        raise ConfigError(f"--merged: ckpt={ckpt} holds no adapters (its run had adapter=none):"
                          " export it without --merged")
    if adapter and not merged and kind is not formats.WeightsFolder:
        raise ConfigError(f"{out}: ckpt={ckpt} holds LoRA adapters, which export as a peft "
                          "adapter folder (give OUT without a suffix), or with --merged, the "
                          "base with the adapters folded in, as .pt or .safetensors")


def unbuildable(ckpt: Path, spec: dict[str, Any], error: Exception) -> str:
    """Why the model a checkpoint was trained with cannot be built again, in one line: most
    often what its constructor read is gone (a from_pretrained folder)."""
    gone = [f"{key}={value}" for key, value in spec.items() if isinstance(value, str)
            and not key.startswith("_") and ("/" in value or value.startswith("."))
            and not Path(value).exists()]
    cause = first_line(error.__cause__ or error)
    need = (f"it reads {', '.join(gone)}, which is gone: put it back (the checkpoint holds "
            "the weights; the architecture comes from there)" if gone else
            "make the model's class and what it reads importable here")
    return f"ckpt={ckpt}: its model {spec.get('_target_')} cannot be built ({cause}): {need}"


def export(model: nn.Module, record: dict[str, Any], out: Path,
           kind: type[formats.Format]) -> str:
    """`model`'s weights written as `kind` (export_kind) at `out` with the run's `record`
    (step, config); what was written, in words. Written under a temporary name beside OUT and
    moved into place last: an export that fails leaves OUT as it was, and one into an
    existing folder replaces only the files it writes, and removes those an earlier export
    wrote there that this one does not (formats.earlier_export): the folder reads back as
    this export alone, its user's other files kept."""
    whole = kind.suffix or not out.is_dir()  # else its files are replaced one by one
    try:
        scratch = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    except OSError as error:
        raise OneLineError(f"could not write beside {out} ({error.strerror}): export to a "
                           "writable place") from None
    try:
        written = scratch / (out.name if kind.suffix else "folder")
        what = kind.write(model, record, written)
        if whole:
            os.replace(written, out)
        else:
            for stale in set(formats.earlier_export(out)) - {p.name for p in written.iterdir()}:
                (out / stale).unlink()
            for file in written.iterdir():
                os.replace(file, out / file.name)
    except Exception as error:  # a full disk had ended in the writer's traceback
        reason = formats.disk_reason(scratch, error)
        if reason is None:
            raise
        kept = "it is as it was" if whole else "some of its files may be this export's"
        raise OneLineError(f"could not write {out} ({reason}); {kept}: free space, or export "
                           "to another place") from None
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return what


def base_record(path: str | Path) -> dict[str, str]:
    """Where the weights a run starts from are (absolute: a record is read from anywhere)
    and their fingerprint: each file's name, size and first and last 64 KiB, cheap at any
    size and unlike other weights of the same shapes (a folder exported again over it)."""
    import hashlib

    where = Path(path).absolute()
    files = sorted(f for f in where.rglob("*") if f.is_file()) if where.is_dir() else [where]
    digest = hashlib.sha256()
    for file in files:
        size = file.stat().st_size
        digest.update(f"{file.relative_to(where) if where.is_dir() else ''}:{size}".encode())
        with open(file, "rb") as f:
            digest.update(f.read(1 << 16))
            if size > 1 << 17:
                f.seek(-(1 << 16), 2)
                digest.update(f.read())
    return {"path": str(where), "fingerprint": digest.hexdigest()[:16]}


def _base_problem(base: str, recorded: dict[str, str] | None) -> str | None:
    if not Path(base).exists():
        return "is gone"
    if holds_adapters(base):
        return "holds adapters of its own"
    if recorded and base_record(base)["fingerprint"] != recorded.get("fingerprint"):
        return "holds other weights now than those they were trained on"
    return None


def adapters_base(folder: str | Path, key: str, state: dict[str, Any] | None = None
                  ) -> str | None:
    """The weights a peft adapter folder's adapters were trained on (its record's base, else
    its run's trainer.init_from), which the folder does not hold; None where its run built
    its base from its seed. ConfigError where they are gone or other weights stand there
    (`key`: the key that named the folder; `state`: its record, read here if not given)."""
    from parallab.training import checkpoint

    state = record(folder) if state is None else state
    recorded = state.get("base")
    base = recorded["path"] if recorded else \
        (checkpoint.saved_config(state).get("trainer") or {}).get("init_from")
    said = _base_problem(base, recorded) if base is not None else None
    if said:
        raise ConfigError(f"{key}={folder} holds LoRA adapters alone, trained on the weights "
                          f"at trainer.init_from={base}, which {said}: use the run's "
                          "checkpoint, or its export with --merged")
    return base


def base_of_adapters(folder: str | Path, state: dict[str, Any], spec: dict[str, Any],
                     seed: int) -> nn.Module:
    """The base a peft adapter folder's adapters were trained on, which the folder does not
    hold: built as its run built it (its seed, then the weights it started from,
    trainer.init_from, where it had any, checked against their fingerprint where the record
    holds one); `state`: the folder's record, `spec` the model's."""
    from parallab.models import build_model
    from parallab.training import checkpoint

    base = adapters_base(folder, "ckpt", state)
    torch.manual_seed(checkpoint.saved_config(state).get("seed", seed))
    model = build_model(spec)
    if base is not None:
        load_into(model, base)
    return model
