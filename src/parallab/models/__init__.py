"""Models by `_target_`: any nn.Module class (or a function returning one) with its arguments,
parallab's own (this package) and a user's alike.

    model:
      _target_: mypkg.model.ResMLP
      width: 256
"""

from __future__ import annotations

import inspect
from typing import Any

import torch
from torch import nn

from parallab.config import targets
from parallab.config.errors import ConfigError, first_line, refuse

KEY = "model"


def tied_names(model: nn.Module) -> dict[str, str]:
    """Each tied parameter's other names -> the first name it has."""
    first: dict[int, str] = {}
    aliases = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        aliases.update({name: first[id(param)]} if id(param) in first else {})
        first.setdefault(id(param), name)
    return aliases


def named_layer(model: nn.Module, getter: str) -> str | None:
    """The name of the Linear or Embedding a transformers-style getter gives
    (get_output_embeddings, get_input_embeddings: a transformers model's, gpt's); None
    where there is none (a model without the getter, or one that does not implement it; a
    pipeline's part holding nn.Identity in its place)."""
    try:
        found = getattr(model, getter)()
    except (AttributeError, NotImplementedError):
        return None
    if not isinstance(found, (nn.Linear, nn.Embedding)):
        return None
    return next((n for n, m in model.named_modules() if m is found and n), None)


def build_model(spec: dict[str, Any], fused_norms: bool = False) -> nn.Module:
    """The model `spec` names, as a run trains it (trainer.fused_norms: its written-out
    RMSNorms as torch's)."""
    from parallab.models import hf, norms

    model = targets.build(spec)
    if not isinstance(model, nn.Module):
        raise TypeError(f"model._target_={spec.get(targets.TARGET)} returned "
                        f"{type(model).__name__}, not a torch.nn.Module")
    if fused_norms and not norms.fuse(model):
        raise ConfigError(norms.NONE.format(type(model).__name__))
    return hf.for_training(model)


def build_on_meta(spec: dict[str, Any], fused_norms: bool = False) -> nn.Module:
    """The model, built without allocating its weights where it can be (transformers'
    from_pretrained refuses meta: it is built whole then)."""
    try:
        with torch.device("meta"):
            return build_model(spec, fused_norms)
    except ConfigError:  # the model's own keys: said, not built again whole
        raise
    except Exception:  # noqa: BLE001 - Hydra wraps the model's own refusal of meta
        return build_model(spec, fused_norms)


def check(spec: dict[str, Any], data) -> dict[str, Any]:
    """model._target_ imports, takes the YAML's arguments and (where the class says how,
    with check_data) the data's samples; returns the spec with the arguments it infers
    from the data (null ones) filled in. ConfigError otherwise."""
    target = targets.locate(spec.get(targets.TARGET), "model._target_")
    if inspect.isclass(target) and not issubclass(target, nn.Module):
        raise ConfigError(f"model._target_={spec[targets.TARGET]} is not a torch.nn.Module: "
                          "name a Module class, or a function that returns a Module")
    if not callable(target):
        raise ConfigError(f"model._target_={spec[targets.TARGET]} is not callable: name a "
                          "Module class, or a function that returns a Module")
    spec = data_vocabulary(spec, data)
    from parallab.models.hf import experts_problem

    refuse(experts_problem(spec.get("config")))
    kwargs = targets.arguments(spec)
    # a spec's _args_ fill the first parameters
    targets.check_arguments(target, kwargs, KEY, at_call=len(spec.get("_args_") or []))
    targets.check_types(target, kwargs, KEY, nulls=True)
    # a class's check_data (Model's, a classmethod); a method of that name taking an
    # instance is the class's own business, not this
    if isinstance(inspect.getattr_static(target, "check_data", None),
                  (classmethod, staticmethod)):
        defaults = targets.defaults(target)  # it sees every argument, defaults filled in
        full = {**defaults, **kwargs}
        try:
            problem = target.check_data(full, data)
        except Exception as error:  # noqa: BLE001 - a user's check may raise anything
            raise ConfigError(f"model._target_={spec[targets.TARGET]}: its check_data(cfg, "
                              f"data) raised {first_line(error)}: fix it (parallab calls it "
                              "with the model's arguments and the data config, for None or "
                              "one line)") from None
        if problem:
            raise ConfigError(problem)
        # the spec's own keys, and any argument the data decided (a null filled in)
        kwargs = {k: v for k, v in full.items() if k in kwargs or v != defaults.get(k)}
    targets.check_types(target, kwargs, KEY)
    hydra_keys = {k: v for k, v in spec.items() if k in targets.HYDRA_KEYS}  # _target_, ...
    return {**hydra_keys, **kwargs}


def data_vocabulary(spec: dict[str, Any], data) -> dict[str, Any]:
    """A model built from a config whose vocab_size is null takes the data's vocabulary (a
    tokenizer's under data=hf_text, 256 bytes under data=bytes), as parallab's own models'
    null vocab_size does: the same model YAML then trains on any tokenizer."""
    config = spec.get("config")
    if not isinstance(config, dict) or config.get("vocab_size", 0) is not None:
        return spec
    vocab = getattr(data, "vocab_size", None)
    if not isinstance(vocab, int):
        raise ConfigError(f"model.config.vocab_size=null takes the data's vocabulary, which "
                          f"data={data.name} does not state: set model.config.vocab_size, or "
                          "data.vocab_size")
    return {**spec, "config": {**config, "vocab_size": vocab}}
