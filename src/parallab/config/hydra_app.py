"""The Hydra app a command runs, and what it does with Hydra's answers: the composed config
typed (a `+` key the schema does not know refused), Hydra's refusals as one line and exit
status 2, the command line's config flags kept for the commands parallab recommends."""

from __future__ import annotations

import contextlib
import os
import re
import sys
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from parallab.config.data_config import DataConfig, batch_overridden, data_config
from parallab.config.errors import ConfigError, refuse
from parallab.config.schema import TYPED_GROUPS

# conf/ ships inside the package; Hydra finds it as pkg://parallab/conf (a user project adds
# its own groups with --config-dir or hydra.searchpath)
CONF_DIR = str(Path(__file__).resolve().parent.parent / "conf")


def typed(dict_cfg):
    """The composed config as the typed Config every check and every rank reads: each group
    by its schema, `data` by its data set's own config class (ConfigError where a data key
    does not fit it). model, loss and metrics stay `_target_` specs."""
    from omegaconf.errors import MissingMandatoryValue

    try:
        cfg = OmegaConf.to_object(dict_cfg)
    except MissingMandatoryValue as error:  # a group option that leaves a key ??? (unset)
        raise ConfigError(f"{error.full_key} is missing: set it ({error.full_key}=VALUE, or in "
                          "the option's YAML)") from None
    for group in TYPED_GROUPS:  # a project's own option without its schema: a mapping
        if isinstance(getattr(cfg, group), dict):
            raise ConfigError(untyped(group))
    if not isinstance(cfg.data, DataConfig):  # a user's data node, typed by its _target_
        cfg.data = data_config(cfg.data)
    return cfg


def untyped(group: str) -> str:
    """The line for a project's own option of a typed group that does not extend its schema:
    the schema to name (the group's one, or its list: each built-in option names its own)."""
    from parallab.config.schema import SCHEMAS

    names = list(SCHEMAS[group])
    schema = names[0] if len(names) == 1 else "SCHEMA"
    which = "" if len(names) == 1 else (f", SCHEMA one of {', '.join(names)}: the one the "
                                        f"built-in {group} option you extend names")
    return (f"{group}: the option composed is a plain mapping, not typed by a schema of "
            f"parallab's: begin your {group}/NAME.yaml with `defaults: [/schema/{group}/"
            f"{schema}@_here_, _self_]`{which}, as parallab's own {group} options begin")


def typed_config(dict_cfg: DictConfig, overrides: list[str]):
    """The composed config as the typed Config; a key added with `+` that the schema does not
    know is refused (Hydra adds it, and the typed config would drop it without a word)."""
    import dataclasses

    for override in overrides:
        key = override.lstrip("+~").partition("=")[0]
        if not override.startswith("+"):
            continue
        node, parts = dict_cfg, key.split(".")
        for depth, part in enumerate(parts):
            schema = OmegaConf.get_type(node)
            if dataclasses.is_dataclass(schema):
                known = [f.name for f in dataclasses.fields(schema)]
                if part not in known:
                    import difflib

                    where = ".".join(parts[:depth]) or "the config"
                    close = difflib.get_close_matches(part, known, n=1)
                    hint = f"did you mean {'.'.join([*parts[:depth], close[0]])}?" if close \
                        else f"its keys: {', '.join(known)}"
                    raise ConfigError(f"{override}: {where} has no key {part!r} ({hint})"
                                      ": a + override adds a key only where the config "
                                      "takes any (model, data, loss, metrics)")
            if not isinstance(node, DictConfig) or node._is_none() or part not in node:
                break
            node = node[part]
    cfg = typed(dict_cfg)
    refuse(batch_overridden(overrides, cfg.data.global_batch_size))
    return cfg


# Hydra's flags that say where the config comes from: a recommended command keeps them
CONFIG_FLAGS = ("--config-dir", "-cd", "--config-path", "-cp", "--config-name", "-cn")


def entry_command(argv: list[str]) -> list[str]:
    """How this command was started, less its overrides: `parallab train` or `python
    train.py`, and where it finds a project's configs (config_flags)."""
    entry = ["parallab", "train"] if Path(argv[0]).name == "parallab" else ["python",
                                                                            "train.py"]
    return [*entry, *config_flags(argv[1:])]


def config_flags(argv: list[str]) -> list[str]:
    """The Hydra config flags in `argv` (a command line less its program), with their
    values (`--config-dir conf` and `--config-dir=conf` alike), and hydra.searchpath, the
    same project given as an override: a command printed without it would compose the
    built-ins of the project's names."""
    return [arg for i, arg in enumerate(argv) if arg in CONFIG_FLAGS or (
        i and argv[i - 1] in CONFIG_FLAGS) or arg.startswith(tuple(f"{f}=" for f in CONFIG_FLAGS))
        or arg.lstrip("+").startswith("hydra.searchpath=")]


def hydra_app(config_name: str, task, call):
    """`task(cfg, call)` as a Hydra app of conf/`config_name` over the command line
    `call.argv` (call: the command's cli.Invocation), run as hydra.main runs one: once per job (a multirun's jobs in turn), each
    with this command's invocation. hydra.main would parse sys.argv, which holds `parallab
    train` where Hydra must see only what follows: its own steps take the argv given, and
    sys.argv stays as the user typed it."""
    from hydra import version

    from parallab.config import hydra_internals as hydra

    shadowed: list[dict[str, str]] = []  # the user's options over built-ins, once known

    def job(dict_cfg: DictConfig):
        say_shadowed(shadowed[0] if shadowed else {})
        return task(dict_cfg, call)

    # a sweep's launcher is handed this function alone: what the command is (parallab
    # advise is train's app with a flag) reaches its checks of each job through it
    job.invocation = call  # type: ignore[attr-defined]

    def app() -> None:
        version.setbase(None)
        parser = hydra.get_args_parser()
        args = parser.parse_args(call.argv[1:])
        if args.config_path is not None:  # Hydra's: it replaces conf/, every built-in gone
            raise ConfigError(f"--config-path {args.config_path}: it would replace parallab's "
                              "own config, every built-in option with it: give your config "
                              f"groups with --config-dir {args.config_path} instead")
        if args.experimental_rerun is not None:
            job(hydra.rerun_conf(args.experimental_rerun, args.overrides))
            hydra.flush_loggers()
            return
        with hydra.one_store() if args.help else contextlib.nullcontext(), \
                hydra.users_first() as found:
            shadowed.append(found)  # filled as Hydra builds its search path, before any job
            hydra.run_hydra(args=args, args_parser=parser, task_function=job,
                            config_path="pkg://parallab/conf", config_name=config_name)

    return app


def say_shadowed(shadowed: dict[str, str]) -> None:
    """One line naming the built-in options this job's choices passed over for a user's of
    the same group and name (hydra_internals.users_first)."""
    import logging

    from hydra.core.hydra_config import HydraConfig

    if not shadowed or not HydraConfig.initialized():
        return
    hydra = HydraConfig.get()
    chosen = list(hydra.runtime.choices.items())
    for override in hydra.overrides.task:  # a list's options (logger=[a,b]) are no choice
        group, _, value = override.lstrip("+").partition("=")
        if value.startswith("[") and value.endswith("]"):
            chosen += [(group, option.strip()) for option in value[1:-1].split(",")]
    passed = [f"{group}={option} from {shadowed[f'{group}/{option}']}"
              for group, option in chosen if f"{group}/{option}" in shadowed]
    if passed:
        logging.getLogger("parallab").info(
            "your options over parallab's built-ins of the same name: %s", ", ".join(passed))


def hydra_line(error: Exception, argv: list[str] = ()) -> str:
    """Hydra's refusal (an unknown key or option, a value of the wrong type), which Hydra
    prints over several lines, as one: its sentences, and a group's options on one line
    (`argv`: the command line, whose config dirs hold a project's options)."""
    text = str(error)
    if error.__cause__ is not None and "full_key" in str(error.__cause__):  # OmegaConf's why
        text += "\n" + str(error.__cause__)
    text, _, options = text.partition("Available options in")
    text, _, searched = text.partition("Config search path:")
    said = [line.strip().rstrip(".") for line in text.splitlines() if line.strip() and not
            line.strip().startswith(("full_key:", "object_type=", "reference_type="))]
    override = getattr(error, "override", None)  # a parse error names the text, not the key
    hint = _unknown_key_hint(text, option_folders(argv), argv)
    if hint:  # Hydra's "use +KEY=VALUE", which the typed config then refuses
        said = [hint if line.startswith("To append to your config use +") else line
                for line in said]
    line = "; ".join([*([override] if override else []), *said])
    named = re.search(r"Additional config directory '(.+)' not found", text)
    if named and Path(named[1]).is_file():  # --config-dir given a file of the project's
        line += ": it is a file; give --config-dir the folder that holds your config " \
                "groups (model/, data/, ...)"
    if options:
        group, _, names = options.partition(":")
        names = [n.strip() for n in names.splitlines() if n.startswith("\t")
                 and not n.strip().startswith("provider=")]
        line += f" (options in{group}: {', '.join(names)})"
    elif missing := re.search(r"Could not load '(.+)/[^/']+'", text):
        # an option in a list (logger=[tensorboard,nope]): Hydra says where it looked, not
        # what is there
        group = missing[1]
        names = sorted({p.stem for folder in _searched_folders(searched)
                        for p in (folder / group).glob("*.yaml")})
        line += f" (options in '{group}': {', '.join(names)})"
    return line


def _unknown_key_hint(text: str, folders: list[Path], argv: list[str] = ()) -> str | None:
    """For an override of a key the config lacks: the key meant (a typed group's close
    match), or, under logger, the logger to choose; None where neither is known."""
    import dataclasses
    import difflib

    from parallab.config import schema

    key = re.search(r"Could not override '([^']+)'", text)
    if key is None:
        return None
    parts = key[1].split(".")
    if key[1] == "ckpt":  # evaluate.py's, given train.py or a config to train with
        return ("ckpt is the checkpoint evaluate.py takes, under its own config: python "
                "evaluate.py ckpt=PATH [overrides], no --config-name (train.py goes on from "
                "one with trainer.resume=PATH)")
    if len(parts) == 2 and parts[0] in TYPED_GROUPS and "not in struct" in text:
        return untyped(parts[0])  # a project's option without its schema: no keys
    typed_in = re.search(r"Key '([^']+)' not in '(\w+)'", text)
    kind = getattr(schema, typed_in[2], None) if typed_in else None
    if dataclasses.is_dataclass(kind):
        where = parts[:parts.index(typed_in[1])] if typed_in[1] in parts else parts[:-1]
        if typed_in[1] in getattr(kind, "decides", ()):  # the option sets it itself
            return (f"{'.'.join(where)}={kind.name} sets {key[1]} itself, for each layout "
                    "it ranks: drop it (or give one layout)")
        known = [f.name for f in dataclasses.fields(kind)]
        close = difflib.get_close_matches(typed_in[1], known, n=1)
        return (f"did you mean {'.'.join([*where, close[0]])}?" if close else
                f"{'.'.join(where) or 'the config'} has no key {typed_in[1]!r}")
    if parts[0] == "data" and len(parts) == 2:  # a mapping until typed
        return _data_key_hint(parts[1], folders, argv)
    if parts[0] == "logger" and len(parts) > 2:
        return _logger_key_hint(parts, text, folders)
    return None


def _data_key_hint(key: str, folders: list[Path], argv: list[str]) -> str | None:
    """data.KEY that the data option's YAML leaves out: a key of its data set's class
    (+data.KEY=VALUE adds it), else the key meant among the class's (parallab's own keys
    where the class is not known here)."""
    import dataclasses
    import difflib

    from parallab.config.data_config import data_class_of, data_defaults

    option = next((a.partition("=")[2] for a in reversed(argv) if a.startswith("data=")), None)
    found = next((folder / "data" / f"{option}.yaml" for folder in folders if option and
                  (folder / "data" / f"{option}.yaml").is_file()), None)
    cls = data_class_of(found) if found else None
    keys = [f.name for f in dataclasses.fields(cls)] if cls else list(data_defaults())
    if cls and key in keys:
        value = next((a.partition("=")[2] for a in argv if a.startswith(f"data.{key}=")),
                     "VALUE")
        return (f"data={option} leaves out {key}, a key of data set {cls.__name__}: add it "
                f"with +data.{key}={value}")
    close = difflib.get_close_matches(key, keys, n=1)
    return f"did you mean data.{close[0]}?" if close else None


def _logger_key_hint(parts: list[str], text: str, folders: list[Path]) -> str:
    """logger.NAME.KEY refused: NAME not chosen, or a KEY the chosen logger lacks (its
    close match among the keys of the option of that name composed: the first of
    `folders`, a project's before parallab's, that holds one)."""
    import difflib

    import yaml

    missing = re.search(r"Key '([^']+)'", text)
    if missing is None or missing[1] == parts[1]:
        return (f"logger.{parts[1]} is set only for a logger chosen: choose it, e.g. "
                f"logger=[tensorboard,{parts[1]}]")
    option = next((o for f in folders if (o := f / "logger" / f"{parts[1]}.yaml").is_file()),
                  Path(CONF_DIR) / "logger" / f"{parts[1]}.yaml")
    known = [k for k in (yaml.safe_load(option.read_text()) or {}).get(parts[1], {})
             if k != "_target_"] if option.is_file() else []
    close = difflib.get_close_matches(missing[1], known, n=1)
    return (f"did you mean {'.'.join([*parts[:-1], close[0]])}?" if close else
            f"logger.{parts[1]} has no key {missing[1]!r}" +
            (f" (its keys: {', '.join(known)})" if known else ""))


def _searched_folders(searched: str) -> list[Path]:
    """The folders of Hydra's config search path as its message lists them (file:// and
    pkg:// entries; structured:// holds the schemas, not options)."""
    return _folders(re.findall(r"path=(file|pkg)://(\S+)", searched))


def _folders(entries: list[tuple[str, str]]) -> list[Path]:
    """The folders of search path entries, each (scheme, place): a pkg:// one where its
    package imports."""
    import importlib.resources

    folders = []
    for kind, place in entries:
        try:
            folders.append(Path(place) if kind == "file" else
                           Path(str(importlib.resources.files(place.replace("/", ".")))))
        except (ImportError, TypeError):
            continue
    return folders


def option_folders(argv: list[str]) -> list[Path]:
    """The folders a command line's options come from: a project's (--config-dir, and
    hydra.searchpath's file:// and pkg:// entries), then parallab's conf/."""
    flags = config_flags(argv)
    given = [flags[i + 1] for i, f in enumerate(flags[:-1]) if f in ("--config-dir", "-cd")]
    given += [f.partition("=")[2] for f in flags if f.startswith("--config-dir=")]
    listed = ",".join(f.partition("=")[2].strip("[]") for f in flags if "hydra.searchpath=" in f)
    entries = [e.strip().partition("://")[::2] for e in listed.split(",") if "://" in e]
    return [*map(Path, given), *_folders(entries), Path(CONF_DIR)]


def null_group_line(argv: list[str]) -> str:
    """The one line for `GROUP=null` on the command line: a group takes one of its options
    (a project's too)."""
    for arg in argv:
        group, _, value = arg.lstrip("+").partition("=")
        options = sorted({p.stem for folder in option_folders(argv)
                          for p in (folder / group).glob("*.yaml")})
        if value in ("null", "None") and options:
            return (f"{arg}: the {group} group takes one of its options ({', '.join(options)}), "
                    f"not null: choose one, or leave {group} out for its default")
    return "a config group was given null: choose one of its options"


def run_app(app, call) -> None:
    """A Hydra app whose own refusals end as parallab's do: one line, exit status 2 (Hydra
    prints them itself, over several lines, and exits 1, unless HYDRA_FULL_ERROR asks it to
    raise them); `call.restore()` first puts back what Hydra wrote over an earlier run."""
    from hydra.errors import CompactHydraException

    if os.environ.get("HYDRA_FULL_ERROR"):  # the user asked for Hydra's whole story
        app()
        return
    os.environ["HYDRA_FULL_ERROR"] = "1"
    try:
        app()
    except CompactHydraException as error:
        call.restore()
        print(hydra_line(error, call.argv[1:]), file=sys.stderr)
        raise SystemExit(2) from None
    except ConfigError as error:  # a launcher's refusal (launching/allocation.py), before any job
        call.restore()
        print(error, file=sys.stderr)
        raise SystemExit(2) from None
    except ValueError as error:  # Hydra's own, for `group=null` and flags that clash
        said = str(error)
        if "Config group override must be" not in said and not said.startswith("Only one of"):
            raise
        call.restore()
        print(null_group_line(call.argv[1:]) if said.startswith("Config") else
              said.strip().splitlines()[0], file=sys.stderr)
        raise SystemExit(2) from None
    finally:
        os.environ.pop("HYDRA_FULL_ERROR", None)
