"""What a `_target_` names, checked before anything is built: that it imports, that it is
the kind of thing its key wants, and that its signature takes the arguments the config
gives. A user's class gets exactly the care parallab's own get: ours are named the same way.
"""

from __future__ import annotations

import contextlib
import inspect
import types
import typing
from typing import Any

from parallab.config.errors import ConfigError, first_line, quieted

TARGET = "_target_"


def import_warnings_quieted() -> contextlib.AbstractContextManager[None]:
    """transformers and peft import torchao where it is installed, whose enums'
    registration this torch warns of at import, twice, in every process: nothing a user
    can act on."""
    return quieted("torch.utils._pytree")


def locate(path: Any, key: str) -> Any:
    """The object `key` (e.g. `model._target_`) names, or a ConfigError saying why not."""
    if not isinstance(path, str) or not path.strip():
        raise ConfigError(f"{key}={path!r} names nothing: give the dotted path of a class or "
                          "function, e.g. mypkg.model.MyNet")
    import pkgutil

    try:  # as Hydra's get_object finds it, without that logging its own three-line error
        with import_warnings_quieted():
            return pkgutil.resolve_name(path)
    except Exception as error:  # noqa: BLE001 - whatever stops the import: one line
        missing = _missing_extra(error)
        if missing:
            raise ConfigError(f"{key}={path} needs {missing}, which is not installed: "
                              f'pip install "parallab[{EXTRAS[missing]}]"') from None
        raise ConfigError(f"{key}={path} does not import ({first_line(error)}): check the "
                          "dotted path, and that its package is installed or its directory "
                          "is on PYTHONPATH") from None


# packages a `_target_` may name that parallab's extras install
EXTRAS = {"transformers": "hf", "datasets": "hf", "safetensors": "hf", "tokenizers": "hf",
          "torchao": "quantize", "mlflow": "mlflow", "wandb": "wandb"}


def _missing_extra(error: BaseException) -> str | None:
    """The extra's package whose absence stopped an import, if it is one of parallab's."""
    while error is not None:
        if isinstance(error, ModuleNotFoundError) and error.name:
            top = error.name.partition(".")[0]
            return top if top in EXTRAS else None
        error = error.__cause__ or error.__context__
    return None


def model_name(spec: dict[str, Any]) -> str:
    """A model's (or loss's) short name for logs and hparams: its class's (`GPT`,
    `ResMLP`)."""
    return str(spec.get(TARGET, "?")).rpartition(".")[2]


def qualname(obj: Any) -> str:
    return f"{getattr(obj, '__module__', '?')}.{getattr(obj, '__qualname__', repr(obj))}"


def _accepted(annotation: Any) -> tuple[type, ...] | None:
    """The Python types a config value may have for a simple annotation; None: not checked."""
    origin = typing.get_origin(annotation)
    if origin is typing.Union or origin is types.UnionType:  # Optional[int], int | None
        parts = [_accepted(a) for a in typing.get_args(annotation)]
        return None if any(p is None for p in parts) else tuple(t for p in parts for t in p)
    simple = {int: (int,), float: (int, float), bool: (bool,), str: (str,),
              type(None): (type(None),), list: (list, tuple), tuple: (list, tuple)}
    return simple.get(origin or annotation)


def _hints(obj: Any) -> dict[str, Any]:
    try:
        return typing.get_type_hints(obj.__init__ if inspect.isclass(obj) else obj)
    except Exception:  # noqa: BLE001 - an annotation that does not resolve is not checked
        return {}


def check_arguments(obj: Any, kwargs: dict[str, Any], key: str, at_call: int = 0) -> None:
    """`kwargs` (the config under `key`, less _target_) against `obj`'s signature: no
    unknown name, every required one given (check_types checks their values). The first `at_call` parameters are given when it is
    called (a loss function's output and targets), not by the config."""
    try:
        signature = inspect.signature(obj)
    except (TypeError, ValueError):  # no signature to read: the call itself will say
        return
    named = {n: p for n, p in list(signature.parameters.items())[at_call:]
             if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
    open_ended = any(p.kind is p.VAR_KEYWORD for p in signature.parameters.values())
    for name in kwargs:
        if name not in named and not open_ended:
            raise ConfigError(f"{key}.{name} is not an argument of {qualname(obj)} (it takes: "
                              f"{', '.join(named) or 'nothing'}): fix the key, or drop it with "
                              f"~{key}.{name}")
    missing = [n for n, p in named.items() if p.default is p.empty and n not in kwargs]
    if missing:
        raise ConfigError(f"{key}.{missing[0]} is required by {qualname(obj)} but not set: "
                          f"add it to the YAML, or +{key}.{missing[0]}=VALUE")


def defaults(obj: Any) -> dict[str, Any]:
    """The keyword arguments `obj`'s signature gives defaults to."""
    try:
        parameters = inspect.signature(obj).parameters.values()
    except (TypeError, ValueError):
        return {}
    return {p.name: p.default for p in parameters if p.default is not p.empty}


def check_types(obj: Any, kwargs: dict[str, Any], key: str, nulls: bool = False) -> None:
    """Values against simple annotations (int, float, bool, str, list, Optional of them);
    with `nulls`, a null passes (a value the data will fill in)."""
    hints = _hints(obj)
    for name, value in kwargs.items():
        if nulls and value is None:
            continue
        accepted = _accepted(hints.get(name))
        # a bool is an int to Python, and true a count of 1 to no one (experts=true had
        # failed in the model's constructor, naming no key)
        wrong = accepted and (not isinstance(value, accepted) or
                              isinstance(value, bool) and bool not in accepted)
        if wrong and not _is_spec(value):
            wanted = " or ".join(t.__name__ for t in accepted)
            first = accepted[0].__name__
            raise ConfigError(f"{key}.{name}={value!r} is not of type {wanted}, as "
                              f"{qualname(obj)} declares: give "
                              f"{'an' if first[0] in 'aeiou' else 'a'} {first}")


def _is_spec(value: Any) -> bool:
    return isinstance(value, dict) and TARGET in value


HYDRA_KEYS = (TARGET, "_partial_", "_convert_", "_recursive_", "_args_")  # instantiate's own


def arguments(spec: dict[str, Any]) -> dict[str, Any]:
    """The arguments a spec gives its target (instantiate's own keys left out)."""
    return {k: v for k, v in spec.items() if k not in HYDRA_KEYS}


def build(spec: dict[str, Any], **extra: Any) -> Any:
    """Hydra's instantiate of a `_target_` spec (a plain dict; nested specs built too)."""
    from hydra.utils import instantiate

    return instantiate(spec, **extra)


def build_checked(spec: dict[str, Any], key: str, **extra: Any) -> Any:
    """build(), with a failing constructor reported in one line (controller-side checks)."""
    try:
        return build(spec, **extra)
    except Exception as error:  # noqa: BLE001 - a user's constructor may raise anything
        cause = error.__cause__ or error
        raise ConfigError(f"{key}: {spec.get(TARGET)}(...) raised {first_line(cause)}: fix "
                          f"the arguments under {key}") from None
