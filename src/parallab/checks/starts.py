"""Where a run starts from, checked before any worker starts: a checkpoint it resumes
(readable, of this model, its recipe unchanged, its files unchanged, readable by this
layout) or weights it starts from (names and shapes that fit the model)."""

from __future__ import annotations

from parallab import models
from parallab.checks import trial
from parallab.config.errors import ConfigError, refuse, require
from parallab.config.schema import Config
from parallab.config.targets import model_name
from parallab.models import adapters
from parallab.parallel.layout import Layout
from parallab.training import checkpoint


def check_resume(cfg: Config, layout: Layout, run_dir: str | None) -> None:
    """trainer.resume names a readable parallab checkpoint of this model (auto: if any)."""
    from pathlib import Path

    resume = cfg.trainer.resume
    if resume is None:
        return
    if resume == "auto":
        found = checkpoint.latest(Path(run_dir) / "checkpoints") if run_dir else None
        if found is None:
            return
        resume = str(found)
    instead = "give another checkpoint" + (
        ", or trainer.resume=auto" if cfg.trainer.resume != "auto" else "")
    try:  # of a sharded one, all but the tensors
        meta = checkpoint.load_meta(resume, "trainer.resume", instead)
    except checkpoint.CheckpointError as error:  # a .dcp's names its key and fix already
        said = str(error)
        raise ConfigError(said if said.startswith("trainer.resume=") else
                          f"trainer.resume: {said}: {instead}") from None
    require(checkpoint.resumable(resume, meta),
            f"trainer.resume={resume} is not a parallab training checkpoint (no optimizer or "
            "position in it): evaluate it with evaluate.py, or start afresh")
    if not checkpoint.same_model(meta, cfg.model):
        before = checkpoint.saved_config(meta).get("model")
        # (where no key differs by value, a type does: the whole spec named)
        key, saved, here = checkpoint.first_difference(before, cfg.model, "model") or \
            ("model", before, cfg.model)
        raise ConfigError(f"trainer.resume={resume} was saved from another model config than "
                          f"model {model_name(cfg.model)} here ({key}={here!r} here, "
                          f"{saved!r} in the checkpoint): resume with the same model config")
    refuse(changed_recipe(cfg, checkpoint.saved_config(meta), resume))
    if not cfg.trainer.auto_batch_size:  # (else chosen in the workers, which check it then)
        here = cfg.data.batch_size * cfg.trainer.accumulate_grad_batches * layout.dp
        refuse(checkpoint.changed_batch(meta, here, resume))
    refuse(cfg.data.resume_problem(meta.get("data"), resume))  # its files, unchanged
    # any layout continues any other's checkpoint, except a one-file one by an earlier
    # parallab, whose optimizer state is by parameter index: only a whole model reads it
    require(not layout.sharded or checkpoint.by_name(resume, meta),
            f"trainer.resume={resume} was saved by parallel={checkpoint.saved_parallel(meta)} "
            f"of an earlier parallab, whose optimizer state only a whole model reads, not "
            f"parallel={cfg.parallel.name} with these degrees: resume it under that layout "
            "once (its next checkpoint is read by any)")


def check_init(cfg: Config, probe: trial.Probe) -> None:
    """trainer.init_from names weights that fit the model (names and shapes; some, with
    trainer.init_strict=false), read without their tensors."""
    from pathlib import Path

    from parallab.training import formats, ties, weights
    from parallab.training.formats.sharded import check_shards

    path = cfg.trainer.init_from
    if path is None:
        return
    require(cfg.trainer.resume is None, f"trainer.init_from={path} starts a new run from "
            f"weights, and trainer.resume={cfg.trainer.resume} continues one from its "
            "checkpoint (which holds the weights it started from): drop one of them")
    require(Path(path).exists(), f"trainer.init_from={path} does not exist: give weights "
            f"as {formats.read()}")
    if adapters.is_folder(path):  # its adapters' shapes then, as any file's weights
        refuse(adapters.folder_problem(cfg.adapter, path))
        base = weights.adapters_base(path, "trainer.init_from")  # what they were trained on
        if base is not None:  # read whole before the adapters, in every rank: it must fit
            # (strictly, whatever trainer.init_strict says: training/run.py loads it so)
            refuse(weights.fit_problem(models.build_on_meta(cfg.model), base,
                                       "the base of trainer.init_from", True))
    try:
        reader = formats.format_of(path, "trainer.init_from", "start from other weights")
        if isinstance(reader, formats.Sharded):  # its shards, as its .metadata lists them:
            # one gone had failed every rank reading it, once launched
            check_shards(reader.path, reader.index, reader.key, reader.instead)
        adapted = weights.holds_adapters(path)
        require(not adapted or adapters.enabled(cfg.adapter),
                f"trainer.init_from={path} holds a model with LoRA adapters: add adapter=lora "
                "with the adapter keys it was trained with")
        if adapted and not adapters.is_folder(path):  # a run's checkpoint: its config says
            saved = checkpoint.saved_config(weights.record(path)).get("adapter") or {}
            refuse(adapters.recorded_problem(cfg.adapter, path, saved))
        model = probe.model if probe.model is not None and not adapted else \
            models.build_on_meta(cfg.model)
        if adapted:  # its names are those of the model with its adapters on
            adapters.apply(model, cfg.adapter)
        refuse(weights.fit_problem(model, path, "trainer.init_from", cfg.trainer.init_strict,
                                   "trainer.init_strict=false")
               or ties.tie_problem(model, path, "trainer.init_from", cfg.model))
    except checkpoint.CheckpointError as error:  # (a reader's own, naming the path alone)
        said = str(error)
        raise ConfigError(said if said.startswith("trainer.init_from=") else
                          f"trainer.init_from: {said}") from None


def changed_recipe(cfg: Config, saved: dict, resume: str) -> str | None:
    """A resumed run continues the samples, their order, the adapters, optimizer and
    schedule its checkpoint holds (their shape, state, dtype and rates): a seed, data,
    adapter, optim, scheduler or state dtype key set otherwise here would be ignored or
    change them without a word, so the first one that differs is named."""
    from omegaconf import OmegaConf

    if saved.get("seed", cfg.seed) != cfg.seed:  # (a checkpoint that records none: taken)
        return (f"trainer.resume={resume} was saved at seed={saved['seed']}, which orders its "
                f"data, and seed={cfg.seed} here would train other samples next: give "
                f"seed={saved['seed']} as saved (or start a new run)")
    changed = cfg.data.changed_keys(saved.get("data"))
    if changed:  # other samples, or the same in another order: not this run going on
        key, value, before = changed[0]
        return (f"trainer.resume={resume} goes on with the samples it was training on, and "
                f"data.{key}={_value(value)} differs from its {_value(before)}, which makes "
                f"other ones: give data.{key}={_value(before)} as when it was saved (or start "
                "a new run from its weights: trainer.init_from)")
    for group in ("adapter", "optim", "scheduler"):
        here = OmegaConf.to_container(OmegaConf.structured(getattr(cfg, group)))
        before = saved.get(group)
        if not isinstance(before, dict):
            continue  # a checkpoint that records none: nothing to compare
        for key, value in here.items():
            if key in before and before[key] != value:
                return (f"trainer.resume={resume} continues the adapters, optimizer and "
                        f"schedule it holds, and {group}.{key}={_value(value)} differs from "
                        f"its {_value(before[key])}: give {group}.{key}="
                        f"{_value(before[key])} as when it was saved (or start a new run)")
    kept = (saved.get("precision") or {}).get("state_dtype", "float32")  # (earlier: float32)
    if isinstance(saved.get("precision"), dict) and kept != cfg.precision.state_dtype:
        # its weights and optimizer state: rounded to bfloat16, or widened from it, unsaid
        return (f"trainer.resume={resume} was saved keeping its weights and optimizer state "
                f"in {kept}: give precision.state_dtype={kept} as saved (or start a new run "
                "from its weights: trainer.init_from)")
    return None


def _value(value) -> str:
    """A saved value as an override gives it back (null, true; a string Hydra would parse
    otherwise quoted), where Python's words (None, True) were read as strings."""
    import json

    from parallab.config.naming import hydra_value

    if value is None or isinstance(value, bool):
        return json.dumps(value)
    return hydra_value(value) if isinstance(value, str) else str(value)
