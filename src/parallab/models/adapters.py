"""Low-rank adapters (LoRA) through peft: `adapter=lora` puts trainable adapters beside the
model's matching layers and freezes everything else, after the model is built (and given
trainer.init_from's base weights) and before it is laid out, so that every data-parallel
layout, activation checkpointing and compile see one model whose only trainable parameters
are the adapters: no gradients and no optimizer state for the base.

The adapters are injected in place (peft's inject_adapter_in_model): the model keeps its
class, so what parallab reads of it (a transformers model's blocks and loss, the gpt's
stages) is unchanged; its state_dict names the base's weights `<layer>.base_layer.weight`
and the adapters' `<layer>.lora_A.default.weight`, the names peft's own LoraModel gives
them, so that a checkpoint loads into peft's PeftModel for export (a peft adapter folder,
or the base with the adapters merged). Nothing here imports peft unless an adapter is asked.
"""

from __future__ import annotations

import json
import logging
import re
import sys
from pathlib import Path
from typing import Any

from torch import nn

from parallab.config.errors import ConfigError, first_line
from parallab.config.targets import import_warnings_quieted

log = logging.getLogger("parallab")
INSTALL = 'pip install "parallab[hf]"'
FOLDER_CONFIG = "adapter_config.json"  # what marks a peft adapter folder
# the module types peft's LoRA wraps (a target matching another is refused before launch)
WRAPPABLE = ("Linear", "Embedding", "Conv1d", "Conv2d", "Conv3d", "Conv1D", "MultiheadAttention")


def enabled(cfg: Any) -> bool:
    """An adapter config (typed, or a checkpoint's dict) that asks for adapters."""
    name = cfg.get("name") if isinstance(cfg, dict) else getattr(cfg, "name", None)
    return name not in (None, "none")


def _peft():
    try:
        with import_warnings_quieted():
            import peft
    except ImportError:
        raise ConfigError(f"adapter=lora needs the peft library, which is not installed: "
                          f"{INSTALL} (or pip install peft)") from None
    return peft


def _value(cfg: Any, key: str) -> Any:
    return cfg.get(key) if isinstance(cfg, dict) else getattr(cfg, key)


def targets(cfg: Any, model: nn.Module) -> list[str] | str | None:
    """adapter.target_modules as peft reads it (a list of names, each a module's name or its
    last parts; a string, a regular expression a module's whole name matches, or
    `all-linear`), else the model's own: lora_target_modules on its class (parallab's gpt),
    else None, for peft's table of transformers models."""
    chosen = _value(cfg, "target_modules")
    if chosen is None:
        chosen = getattr(model, "lora_target_modules", None)
    return chosen if chosen is None or isinstance(chosen, str) else list(chosen)


def _targets_problem(chosen: Any) -> str | None:
    """adapter.target_modules in a form peft does not read, or naming nothing."""
    said = f"adapter.target_modules={chosen}"
    if isinstance(chosen, str):
        return None if chosen else (f"{said} (empty) names no layer: give a regular "
                                    "expression, names, or null for the model's own")
    if chosen is None:
        return None
    if not isinstance(chosen, (list, tuple)) or not all(isinstance(n, str) and n
                                                        for n in chosen):
        return (f"{said}: give a list of layer names (their last parts will do), one "
                "regular expression as a string, or null for the model's own")
    if not chosen:
        return (f"{said} names no layer (an empty list was read as the model's own): name "
                "some, or leave it null for the model's own")
    return None


def peft_config(cfg: Any, model: nn.Module):
    """peft's LoraConfig for adapter config `cfg` on `model`."""
    return _peft().LoraConfig(r=_value(cfg, "r"), lora_alpha=_value(cfg, "alpha"),
                              lora_dropout=_value(cfg, "dropout"),
                              target_modules=targets(cfg, model))


def apply(model: nn.Module, cfg: Any, is_main: bool = False) -> nn.Module:
    """`model` with adapters per `cfg` (in place; unchanged for adapter=none), the base
    frozen; with is_main, the log says how many parameters train."""
    if not enabled(cfg):
        return model
    _peft().inject_adapter_in_model(peft_config(cfg, model), model)
    if is_main:
        log.info("adapter=lora: %s", trainable(model))
    return model


def trainable(model: nn.Module) -> str:
    """How many parameters train out of how many, in words."""
    params = {id(p): p for p in model.parameters()}.values()
    total = sum(p.numel() for p in params)
    train = sum(p.numel() for p in params if p.requires_grad)
    return f"{train:,} of {total:,} parameters train ({100 * train / max(total, 1):.2f}%)"


def experts_problem(cfg: Any, model: nn.Module, ep: int) -> str | None:
    """Adapters put inside a model's experts (`model`, with its adapters: peft's all-linear
    wraps a transformers MoE layer's experts in a ParamWrapper) under expert parallelism,
    which splits the experts' weights over the ep ranks and has no rule for peft's beside
    them (every worker had failed in the split): one line; None where none are there."""
    from parallab.models.experts import experts_of

    if ep == 1:
        return None
    params = [name for name, _ in model.named_parameters() if ".lora_" in name]
    inside = next((e for e, _ in experts_of(model)
                   if any(n.startswith(f"{e}.") for n in params)), None)
    return None if inside is None else (
        f"adapter.target_modules={targets(cfg, model)} puts adapters in the experts ({inside}), "
        f"which parallel.ep={ep} splits over ranks and peft's adapters there do not follow: "
        "name layers outside the experts (such as [q_proj,v_proj]), or parallel.ep=1")


def problem(cfg: Any, model: nn.Module) -> str | None:
    """Why adapters per `cfg` cannot be put on `model` (built on meta will do), in one line;
    None where they can (or none are asked). Tried on the model itself, which it changes."""
    if not enabled(cfg):
        return None
    peft = _peft()
    if _value(cfg, "r") < 1:
        return f"adapter.r={_value(cfg, 'r')} is out of range: the adapters' rank must be >= 1"
    if not _value(cfg, "alpha") > 0:
        return (f"adapter.alpha={_value(cfg, 'alpha')} is out of range: the adapters' output "
                "is scaled by alpha / r, and at 0 no parameter would move: give alpha > 0 "
                "(16 by default; r or 2 r are common)")
    if not 0 <= _value(cfg, "dropout") < 1:
        return f"adapter.dropout={_value(cfg, 'dropout')} is out of range: it must be in [0, 1)"
    said = _targets_problem(_value(cfg, "target_modules"))
    if said is not None:
        return said
    config = peft_config(cfg, model)
    if config.target_modules is None and not _in_peft_table(model):
        return (f"model {type(model).__name__} names no layers for adapters (no "
                "lora_target_modules on its class, no entry in peft's table): set "
                f"adapter.target_modules, such as {_layer_names(model)}")
    from peft.tuners.tuners_utils import check_target_module_exists

    said = f"adapter.target_modules={targets(cfg, model)}"
    unwrappable = [f"{name} ({type(module).__name__})" for name, module in
                   model.named_modules() if type(module).__name__ not in WRAPPABLE and
                   config.target_modules and check_target_module_exists(config, name)]
    if unwrappable:
        return (f"{said} matches {', '.join(unwrappable[:3])}, which peft's LoRA cannot wrap: "
                f"name layers of its kinds ({', '.join(WRAPPABLE)}), such as "
                f"{_layer_names(model)}")
    try:
        peft.inject_adapter_in_model(config, model)
    except ValueError as error:
        cause = "" if "not found" in str(error) else f" ({first_line(error)})"
        return (f"{said} matches no layer of model {type(model).__name__}{cause}: name some "
                f"of its layers, such as {_layer_names(model)}")
    return None


def _in_peft_table(model: nn.Module) -> bool:
    """A transformers model whose kind peft's table gives default target modules."""
    from peft.utils.constants import TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING as table

    return getattr(getattr(model, "config", None), "model_type", None) in table


def _layer_names(model: nn.Module, few: int = 6) -> str:
    """A few of the model's layer names peft's LoRA can wrap: each one's last part, or its
    full name where that is an index."""
    names: list[str] = []
    for name, module in model.named_modules():
        last = name.rpartition(".")[2]
        short = name if last.isdigit() else last
        if type(module).__name__ in WRAPPABLE and short and short not in names:
            names.append(short)
    return ", ".join(names[:few]) or "none: it has no Linear, Embedding or Conv layer"


# --- peft adapter folders: what export writes and trainer.init_from reads ---------------
def is_folder(path: str | Path) -> bool:
    return (Path(path) / FOLDER_CONFIG).is_file()


def injected_name(peft_name: str) -> str:
    """A weight's name in peft's adapter file (`base_model.model.<layer>.lora_A.weight`) as
    a model with its adapters on names it (`<layer>.lora_A.default.weight`)."""
    name = peft_name.removeprefix("base_model.model.")
    return re.sub(r"\.(lora_[AB]|lora_embedding_[AB])\.", r".\1.default.", name)


def folder_problem(cfg: Any, path: str | Path) -> str | None:
    """trainer.init_from=`path`, a peft adapter folder, against this run's adapter config:
    adapters of the same shape and scale, or one line naming the key to set."""
    if not enabled(cfg):
        return (f"trainer.init_from={path} is a peft adapter folder: add adapter=lora (its "
                "base is this run's model)")
    saved = json.loads((Path(path) / FOLDER_CONFIG).read_text())
    return recorded_problem(cfg, path, {"r": saved.get("r"), "alpha": saved.get("lora_alpha"),
                                        "target_modules": saved.get("target_modules")})


def recorded_problem(cfg: Any, path: str | Path, saved: dict[str, Any]) -> str | None:
    """trainer.init_from=`path`, whose adapters were `saved` (r, alpha, target_modules: a
    checkpoint's adapter config, or a folder's), against this run's: the same shape and
    scale (another alpha scales the adapters otherwise, without a word), or one line."""
    for key in ("r", "alpha", "target_modules"):
        here, there = _value(cfg, key), saved.get(key)
        if key == "target_modules":
            if here is None:  # the model's own: whatever the folder's were
                continue
            here, there = (sorted(v) if isinstance(v, (list, tuple)) else v
                           for v in (here, there))
        if there is not None and here != there:
            return (f"trainer.init_from={path} holds adapters of {key}={there}, and "
                    f"adapter.{key}={here} here: set adapter.{key}={there}")
    return None


def merge_problem(model: nn.Module) -> str | None:
    """Why the adapters of `model` (peft's PeftModel) cannot be folded into its base: a
    layer they adapt whose weight is tied to another (a head tied to the token embedding),
    which the merge would change too, so that the merged model scores other than the run."""
    names: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(param), []).append(name.removeprefix("base_model.model."))
    for layer, module in model.named_modules():
        base = getattr(module, "base_layer", None)
        if base is None or not hasattr(module, "lora_A") or base.weight is None:
            continue
        layer = layer.removeprefix("base_model.model.")
        tied = [n for n in names[id(base.weight)] if not n.startswith(f"{layer}.")]
        if tied:
            return (f"--merged: the adapters on {layer} would be folded into its weight, which "
                    f"is tied to {tied[0]} (model.tie_embeddings=true ties the head to the "
                    "token embedding), changing both: export the adapters as a peft folder "
                    f"(without --merged), or train them on layers other than {layer}")
    return None


def is_peft_model(model: nn.Module) -> bool:
    """peft's PeftModel (what with_adapters gives), checked without importing peft."""
    if "peft" not in sys.modules:
        return False
    return isinstance(model, sys.modules["peft"].PeftModel)


def with_adapters(model: nn.Module, cfg: Any):
    """peft's PeftModel around `model` with adapters per `cfg`: its inner model has this
    run's names, and it saves an adapter folder or merges the adapters into the base."""
    import warnings

    peft = _peft()
    with warnings.catch_warnings():  # peft reads transformers' deprecated name (5.x): not
        # the user's to act on, printed by every export of a transformers model's adapters
        warnings.filterwarnings("ignore", "`is_gradient_checkpointing` is deprecated",
                                FutureWarning)
        return peft.get_peft_model(model, peft_config(cfg, model))
