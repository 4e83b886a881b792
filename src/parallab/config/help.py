"""`python train.py --help`: the config groups a user picks from and every key of the
composed config with what it means.

Hydra's own help lists the ConfigStore's schema/* groups too (internal: the typed base of
each option) and prints the keys bare. Its help template is resolved before use, so the
`parallab_help` resolver writes the text from the composed config: groups from Hydra's
config loader, each key's words from the comment beside it (or above it) in the option's
YAML file or in its schema or data set dataclass; whoever defines a key describes it there.
"""

from __future__ import annotations

import inspect
import re
from pathlib import Path
from typing import Any, Iterable

import yaml
from omegaconf import DictConfig, OmegaConf

HIDDEN_GROUPS = ("hydra", "schema")
CONF_DIR = Path(__file__).parents[1] / "conf"
_KEY = re.compile(r"^(\s*)([A-Za-z_]\w*):(?:\s*(?:[^#\n]*?))?(?:\s+#\s*(.*))?$")


def comments(lines: Iterable[str]) -> dict[str, str]:
    """Key -> its comment in YAML or dataclass source: the trailing `# ...` of the key's
    line, else the comment lines right above it. Only the outermost keys of the text."""
    found: dict[str, str] = {}
    above: list[str] = []
    indent = None
    for line in lines:
        stripped = line.strip()
        if stripped.startswith("#"):
            above.append(stripped.lstrip("#").strip())
            continue
        match = _KEY.match(line)
        if match and not stripped.startswith(("def ", "class ", "@")):
            level = len(match.group(1))
            indent = level if indent is None else indent
            if level == indent:
                text = match.group(3) or " ".join(above)
                if text:
                    found.setdefault(match.group(2), text)
        above = []
    return found


def class_comments(cls: type) -> dict[str, str]:
    """A dataclass's field comments, a subclass's over its bases'."""
    found: dict[str, str] = {}
    for klass in cls.__mro__:
        if klass is object:
            continue
        try:
            source = inspect.getsource(klass).splitlines()[1:]  # below the class line
        except (OSError, TypeError):
            continue
        for key, text in comments(source).items():
            found.setdefault(key, text)
    return found


def option_file(group: str, choice: str) -> Path:
    """The file the option `group/choice` is composed from: the first source of Hydra's
    search path holding it (a project's before parallab's: hydra_internals.users_first),
    parallab's where no Hydra is composing."""
    import importlib.resources

    from hydra.core.global_hydra import GlobalHydra

    name = f"{group}/{choice}"
    sources = GlobalHydra.instance().config_loader().get_sources() \
        if GlobalHydra.instance().is_initialized() else []
    for source in sources:
        if source.scheme() in ("file", "pkg") and source.is_config(name):
            root = Path(source.path) if source.scheme() == "file" else \
                Path(str(importlib.resources.files(source.path.replace("/", "."))))
            return root / f"{name}.yaml"
    return CONF_DIR / f"{name}.yaml"


def option_comments(group: str, choice: str | None) -> dict[str, str]:
    path = option_file(group, choice) if choice else None
    return comments(path.read_text().splitlines()) if path and path.is_file() else {}


def block(section: str) -> list[str]:
    """The lines config.yaml nests under `section:`."""
    lines, inside = [], False
    for line in (CONF_DIR / "config.yaml").read_text().splitlines():
        if line and not line[0].isspace() and not line.startswith("#"):
            inside = line.startswith(f"{section}:")
        elif inside:
            lines.append(line)
    return lines


def describe(section: str, node: Any, choices: dict[str, Any]) -> dict[str, str]:
    from parallab.config import schema as config
    from parallab.config import targets

    words = option_comments(section, choices.get(section))
    # the keys config.yaml gives every option of the group (data's), then the class's own
    words.update({k: v for k, v in comments(block(section)).items() if k not in words})
    field = config.Config.__dataclass_fields__.get(section)
    cls = schema_of(section, choices.get(section)) or getattr(field, "default_factory", None)
    if isinstance(node, DictConfig) and targets.TARGET in node:
        try:
            cls = targets.locate(node[targets.TARGET], f"{section}._target_")
        except Exception:  # a user's class that cannot be imported: its keys stay bare
            cls = None
    if isinstance(cls, type):
        words.update({k: v for k, v in class_comments(cls).items() if k not in words})
    return words


def schema_of(group: str, choice: str | None) -> type | None:
    """The schema dataclass an option of one of parallab's own groups starts from (its
    defaults list's `/schema/<group>/<name>`): the keys' defaults and their words."""
    from parallab.config import schema as config

    path = option_file(group, choice) if choice else None
    found = re.search(rf"/schema/{group}/(\w+)@", path.read_text()) if path and \
        path.is_file() else None
    return config.SCHEMAS.get(group, {}).get(found.group(1)) if found else None


def _value(value: Any) -> str:
    """One value as flow-style YAML on one line (safe_dump ends a scalar with '...')."""
    return yaml.safe_dump(value, default_flow_style=True, width=10**6).removesuffix(
        "...\n").strip()


def config_text(cfg: DictConfig) -> list[str]:
    from parallab.config import schema as config

    choices = dict(cfg.hydra.runtime.choices) if "hydra" in cfg else {}
    schema = config.EvalConfig if "ckpt" in cfg.keys() else config.Config  # ??? is not "in"
    top = class_comments(schema) | comments(
        (CONF_DIR / "config.yaml").read_text().splitlines()[1:])
    values = OmegaConf.to_container(cfg, resolve=False, enum_to_str=True)
    lines = []
    for section, value in values.items():
        if section == "hydra":
            continue
        note = f"  # {top[section]}" if section in top else ""
        if not (isinstance(value, dict) and value):
            lines.append(f"{section}: {_value(value)}{note}")
            continue
        words = describe(section, cfg._get_node(section), choices)
        lines.append(f"{section}:{note}")
        lines += [f"  {key}: {_value(v)}" + (f"  # {words[key]}" if key in words else "")
                  for key, v in value.items()]
    return lines


def groups_text() -> list[str]:
    from hydra.core.global_hydra import GlobalHydra

    loader = GlobalHydra.instance().config_loader()
    return [f"{group}: {', '.join(loader.get_group_options(group))}"
            for group in sorted(loader.list_groups("")) if group not in HIDDEN_GROUPS]


def help_text(*, _root_: DictConfig) -> str:
    """The help's body; `$` doubled, as Hydra passes the text through string.Template."""
    text = "\n".join([
        "== Config groups (group=option) ==", *groups_text(), "",
        "== Config (key=value; + adds a key only where a group allows new ones) ==",
        *config_text(_root_)])
    return text.replace("$", "$$")


# the help's first line, by command (config.yaml's and evaluate.yaml's help templates)
USAGE = {
    "train": "python train.py [group=option ...] [key=value ...]   (-m: a sweep over comma lists)",
    "advise": "parallab advise [group=option ...] [key=value ...]   (the run to advise on; "
              "the advise.* keys below say how)",
    "evaluate": "python evaluate.py ckpt=PATH [key=value ...]   (the model, and the data unless "
                "given, are the checkpoint's)",
    "simulate": "parallab simulate [group=option ...] [key=value ...] cluster=NAME "
                "parallel.world_size=N   (parallel=auto: every layout, ranked)",
}


def register_resolver(command: str = "train") -> None:
    OmegaConf.register_new_resolver("parallab_help", help_text, replace=True)
    OmegaConf.register_new_resolver("parallab_usage", lambda: USAGE[command], replace=True)


# docs/config.md's key reference: written from the dataclasses (`python -m parallab.config.help`),
# between these lines; a test fails when the file is stale
BEGIN = "<!-- keys: written by `python -m parallab.config.help` from src/parallab/config/schema.py -->"
END = "<!-- end of keys -->"


def _cell(value: Any) -> str:
    return str(value).replace("|", "\\|")


def key_table(cls: type, prefix: str, by_option: str | None = None) -> list[str]:
    """One schema's keys as a markdown table: key, default, what it means; a key each
    option sets (no default) listed with `by_option` in its place where given, else left
    out, as a group of its own is."""
    import dataclasses

    from omegaconf import MISSING

    words = class_comments(cls)
    rows = ["| key | default | |", "|---|---|---|"]
    for f in dataclasses.fields(cls):
        if dataclasses.is_dataclass(f.default_factory) or \
                f.default is MISSING and by_option is None:
            continue
        default = f.default_factory() if f.default_factory is not dataclasses.MISSING \
            else f.default
        default = by_option if default is MISSING else \
            f"`{_value(getattr(default, 'value', default))}`"  # an enum's by its value
        rows.append(f"| `{prefix}{f.name}` | {default} | {_cell(words.get(f.name, ''))} |")
    return rows


def keys_markdown() -> str:
    from parallab.config import schema as config

    sections = [("Top level", config.Config, ""), ("trainer", config.TrainerConfig, "trainer."),
                ("data: the keys every data set has", config.DataConfig, "data.")]
    for group, options in config.SCHEMAS.items():
        if group == "trainer":
            continue
        for name, cls in options.items():
            title = group if len(options) == 1 else f"{group} ({cls.__name__})"
            sections.append((title, cls, f"{group}."))
    sections += [("advise", config.AdviseConfig, "advise."),
                 ("simulate", config.SimulateConfig, "simulate."),
                 ("sweep", config.SweepConfig, "sweep.")]
    lines = [BEGIN, ""]
    for title, cls, prefix in sections:
        by_option = "the option's" if cls is config.ClusterConfig else None
        lines += [f"#### {title}", "", *key_table(cls, prefix, by_option), ""]
    return "\n".join([*lines, END])


def write_keys(path: Path) -> None:
    """The key reference in `path` replaced by the one the dataclasses give now."""
    text = path.read_text()
    start, end = text.index(BEGIN), text.index(END) + len(END)
    path.write_text(text[:start] + keys_markdown() + text[end:])


if __name__ == "__main__":
    write_keys(Path(__file__).resolve().parents[3] / "docs" / "config.md")
