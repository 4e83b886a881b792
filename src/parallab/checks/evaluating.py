"""evaluate.py's config: the checkpoint's model and data, the command line's overrides it
takes (it refuses those it would ignore: a model, layout or trainer key), and a check's
refusal said in the keys it takes."""

from __future__ import annotations

import logging
import re
from typing import Any

from omegaconf import DictConfig, OmegaConf, open_dict

from parallab.config.errors import ConfigError, refuse
from parallab.config.hydra_app import typed_config

log = logging.getLogger("parallab")


def checked(dict_cfg: DictConfig, overrides: list[str]):
    """The config evaluate.py runs: the checkpoint's model and data (data keys that follow
    the model, such as data=bytes' seq_len from model.context, follow the trained one), and
    the run's seed for generated data, its loss and metrics, checked; with the checkpoint's
    record."""
    from parallab.checks import validate
    from parallab.training import checkpoint, weights

    state = weights.record(dict_cfg.ckpt)
    with open_dict(dict_cfg):
        dict_cfg.model = trained_model_config(state, dict_cfg.ckpt)
        dict_cfg.data = _trained_data_config(state, dict_cfg, overrides)
        saved = checkpoint.saved_config(state)
        if weights.holds_adapters(dict_cfg.ckpt):  # the model as trained: adapters on
            dict_cfg.adapter = saved["adapter"]
        given = {o.lstrip("+~").partition("=")[0].split(".")[0] for o in overrides}
        for key in ("seed", "loss", "metrics"):  # the run's, unless given
            if saved.get(key) is not None and key not in given:
                dict_cfg[key] = saved[key]
    try:
        cfg = typed_config(dict_cfg, overrides)
        # a stream of no known length is refused without a run length, which no evaluation
        # reads and evaluate.py takes no trainer key to give (a run bounded by epochs, or
        # trained on other data, recorded none): any bound passes it. A project's Dataset
        # is known to be one once read (its problem(), which check_data repeats from cache)
        if cfg.trainer.max_steps is None and cfg.data.problem() is None and \
                not cfg.data.sized():
            cfg.trainer.max_steps = 1
        validate.prepare(cfg, in_place=None)
    except ConfigError as error:
        raise _as_evaluate_says(error, dict_cfg.ckpt) from None
    refuse(cfg.data.scored_problem(state.get("data"), dict_cfg.ckpt))  # (evaluate's keys)
    return cfg, state


# a key a fix names: a dotted name or one given a value, at a word's start and not inside
# a path or a file's name (a hint's /data/model.bin names no model key)
_KEY = re.compile(r"(?<![\w./-])[A-Za-z_]\w*(?:(?:\.\w+)+|(?=[<>!]?=|[<>]))")
# what ends a file's name, not a key's (a hint's `model.bin` names no model key)
_FILE_SUFFIXES = {"bin", "pt", "pth", "dcp", "safetensors", "json", "yaml", "yml", "csv",
                  "md", "txt", "idx", "npy", "log"}
# keys evaluate.py refuses (refuse_ignored_overrides): a fix that names one is none there
_NOT_TAKEN = re.compile(r"(?:model|trainer|parallel(?!\.threads_per_worker|\.devices))"
                        r"(?:\.|$|(?=[<>!]?=|[<>]))")


def _as_evaluate_says(error: ConfigError, ckpt: str) -> ConfigError:
    """A check's refusal, its fix (after the last ': ') evaluate.py's own where every key the
    check's names is one evaluate.py refuses (data=bytes' data.seq_len beyond the trained
    gpt's context said `set model.context=...`): the model is the checkpoint's, scored in
    one process, so the data or precision given here is what changes. A fix that also names
    a key evaluate.py takes is kept, with what it cannot take said."""
    problem, _, fix = str(error).rpartition(": ")
    named = [key for key in _KEY.findall(fix) if key.rpartition(".")[2] not in _FILE_SUFFIXES]
    refused = [_NOT_TAKEN.match(key) is not None for key in named]
    if not problem or not any(refused):
        return error
    if not all(refused):  # an accepted fix beside the refused one: the accepted one stands
        said = f"{error} (evaluate.py takes no model, trainer or layout key)"
    elif any(key.split(".")[0] == "model" for key in named):
        said = (f"{problem}: evaluate.py builds the model ckpt={ckpt} was trained with (no "
                "model key is taken): give data that model takes, or drop the data overrides "
                "to score the data it was trained on")
    else:
        said = (f"{problem}: evaluate.py scores ckpt={ckpt} as saved, in one process, "
                "training nothing (no trainer or layout key is taken): drop the override "
                "this follows from")
    refusal = type(error)(said)
    refusal.status = error.status  # NothingFits carries its own
    return refusal


# the parallel keys one process uses: its threads, and the GPU it runs on (the first named)
EVALUATE_KEEPS = ("parallel.threads_per_worker", "parallel.devices")


def refuse_ignored_overrides(overrides: list[str]) -> None:
    """A model, layout or trainer override, which evaluate.py would ignore, refused before
    Hydra composes them (a key of the checkpoint's model may be no key of the default)."""
    ckpt = next((o.partition("=")[2] for o in overrides if o.startswith("ckpt=")), "CKPT")
    for override in overrides:
        key = override.lstrip("+~").split("=")[0]
        if key == "model" or key.startswith("model."):  # a group choice as much as a key
            raise ConfigError(
                f"{override}: evaluate.py builds the model ckpt={ckpt} was trained with (its "
                "_target_ and arguments come from the checkpoint): drop the model override")
        if (key == "parallel" or key.startswith("parallel.")) and key not in EVALUATE_KEEPS:
            raise ConfigError(
                f"{override}: evaluate.py scores ckpt={ckpt} in one process, whatever layout "
                "trained it (a sharded checkpoint too): drop the parallel override "
                "(parallel.threads_per_worker sets its threads, parallel.devices its GPU)")
        if key.startswith("trainer."):  # trainer.quantize had scored the float model
            raise ConfigError(f"{override}: evaluate.py scores ckpt={ckpt} as saved and trains "
                              "nothing, so no trainer key is read: drop it")


def onto_trained_data(overrides: list[str]) -> list[str]:
    """Without a data= choice, evaluate.py scores the checkpoint's data, which Hydra has not
    composed (it composes the default data): a data.KEY=VALUE for it is added where that
    lacks the key (the trained data's eval_size), as `++` asks, not refused for want of a
    `+`."""
    if any(o.lstrip("+~").partition("=")[0] == "data" for o in overrides):
        return overrides
    return [f"++{o}" if o.startswith("data.") else o for o in overrides]


def _trained_data_config(meta: dict[str, Any], dict_cfg: DictConfig, overrides: list[str]):
    """The data evaluate.py scores: the checkpoint's, with the command line's data.KEY
    values (also under a data= choice of the same data set: its keys as trained); a data=
    choice of another data set is used as composed, and said."""
    from parallab.training import checkpoint

    saved = checkpoint.saved_config(meta).get("data")
    chosen = any(o.lstrip("+~").partition("=")[0] == "data" for o in overrides)
    trained = saved.get("_target_") if isinstance(saved, dict) else None
    if trained is None:
        return dict_cfg.data  # a checkpoint that records no data: as composed
    if chosen and trained != dict_cfg.data.get("_target_"):
        log.info("evaluate.py scores ckpt=%s, trained on data %s, on data %s, as asked",
                 dict_cfg.ckpt, trained, dict_cfg.data.get("_target_"))
        return dict_cfg.data
    data = OmegaConf.create(saved)
    for override in overrides:  # the command line's data.KEY=VALUE, as Hydra parsed them
        key = override.lstrip("+~").partition("=")[0]
        if key.startswith("data."):
            OmegaConf.update(data, key[5:], OmegaConf.select(dict_cfg, key), force_add=True)
    return data


def trained_model_config(meta: dict[str, Any], path) -> dict[str, Any]:
    """The model spec a checkpoint was trained with; a pretrained-weights file it named is
    not needed again (the checkpoint holds the weights)."""
    from parallab.training import checkpoint

    spec = checkpoint.saved_model(meta, path)
    return {**spec, "weights": None} if spec.get("weights") else spec
