"""Every Hydra internal parallab uses, in one place. Hydra's public entry, hydra.main, reads
sys.argv, where `parallab train ...` holds the subcommand Hydra must not see; running an app
over another argv takes these steps of hydra.main itself. pyproject pins hydra-core to the
releases tested (>=1.3.2,<1.4), and tests/test_config.py fails where the installed Hydra
lacks any of them."""

import contextlib
from typing import Iterator

from hydra._internal.config_repository import ConfigRepository
from hydra._internal.utils import _run_hydra as run_hydra
from hydra._internal.utils import get_args_parser
from hydra.core.config_store import ConfigStore
from hydra.core.object_type import ObjectType
from hydra.core.utils import _flush_loggers as flush_loggers
from hydra.main import _get_rerun_conf as rerun_conf

__all__ = ["flush_loggers", "get_args_parser", "rerun_conf", "run_hydra", "one_store",
           "users_first"]

# the search path's providers that are not a user's: Hydra's own configs, parallab's conf/
# (the app's primary config dir) and the schemas
BUILT_IN = ("hydra", "main", "schema")


@contextlib.contextmanager
def users_first() -> Iterator[dict[str, str]]:
    """While inside, a user's config dirs (--config-dir, hydra.searchpath) come before
    parallab's conf/ in every search path Hydra builds, so that a user's option wins over
    a built-in of the same group and name (Hydra puts them after the primary config dir,
    and the first dir holding a name gives it). Yields group/option -> the user's dir that
    shadows a built-in of that name, filled as the paths are built."""
    shadowed: dict[str, str] = {}
    original = ConfigRepository.initialize_sources
    if getattr(original, "users_first", False):  # nested: the outer one orders them
        yield shadowed
        return

    def ordered(repository: ConfigRepository, search_path) -> None:
        original(repository, search_path)
        sources = repository.sources
        users = [s for s in sources if s.provider not in BUILT_IN]
        first_built_in = next((i for i, s in enumerate(sources) if s.provider == "main"), None)
        if not users or first_built_in is None:
            return
        _refuse_missing(users)
        rest = [s for s in sources if s not in users]
        repository.sources = [*rest[:first_built_in], *users, *rest[first_built_in:]]
        shadowed.update(_shadowed(users, sources[first_built_in]))
        _keep_primary(users, sources[first_built_in])
        _refuse_extending_itself(users, shadowed)

    ordered.users_first = True
    ConfigRepository.initialize_sources = ordered
    try:
        yield shadowed
    finally:
        ConfigRepository.initialize_sources = original


def _refuse_missing(users: list) -> None:
    """A user's config dir that is not there (a mistyped hydra.searchpath entry): Hydra
    only warns, and composes parallab's built-ins in place of the user's options."""
    from parallab.config.errors import ConfigError

    for source in users:
        if not source.available():
            where = "no such folder" if source.scheme() == "file" else "no such package dir"
            raise ConfigError(f"hydra.searchpath: {source.full_path()} is not found ({where}"
                              f"; {source.provider}): give the folder that holds your config "
                              "groups (model/, data/, ...), e.g. hydra.searchpath=[file://"
                              "/abs/path/conf], or --config-dir DIR")


def _refuse_extending_itself(users: list, shadowed: dict[str, str]) -> None:
    """A user's option of a built-in's name whose defaults list names that name
    (`model/mnist_cnn.yaml` with `- /model/mnist_cnn@_here_`, Hydra's way to extend a
    config) names itself, the user's coming first, and Hydra recursed till Python's limit:
    refused when it is composed, in one line."""
    from parallab.config.errors import ConfigError

    for name, path in shadowed.items():
        source = next(u for u in users if u.path == path)
        if name not in _named_in_defaults(source, name):
            continue
        group, _, option = name.partition("/")

        def refused(config_path: str, load=source.load_config, name=name, option=option,
                    group=group, where=source.path if source.scheme() == "file" else
                    source.full_path()):
            if config_path.removesuffix(".yaml") == name:
                raise ConfigError(
                    f"{where}/{name}.yaml extends /{name}, which is itself: your option "
                    f"hides parallab's of the same name; to extend parallab's {option}, "
                    f"name yours otherwise ({group}/my_{option}.yaml) and choose that")
            return load(config_path)

        source.load_config = refused


def _named_in_defaults(source, name: str) -> set[str]:
    """The group/option paths a config's defaults list names (strings and `group: option`
    entries; relative ones in its own group)."""
    group = name.rpartition("/")[0]
    try:
        defaults = source.load_config(name).config.get("defaults") or []
    except Exception:  # a file Hydra will refuse itself, in its own words
        return set()

    def path(key: str, option: str | None = None) -> str:
        key = key.removeprefix("override ").removeprefix("optional ").partition("@")[0]
        full = key if option is None else f"{key}/{option}"
        return full[1:] if full.startswith("/") else f"{group}/{full}"

    named = set()
    for entry in defaults:
        if isinstance(entry, str):
            named.add(path(entry.strip()))
        elif hasattr(entry, "items"):
            named.update(path(str(k).strip(), str(v)) for k, v in entry.items())
    return named


def _keep_primary(users: list, built_in) -> None:
    """parallab's own top-level configs (config, evaluate, simulate: an app's whole config)
    over a user's of the same name, which a Hydra project's config dir often holds beside
    its groups: first, it replaced every key parallab composes (a traceback). Said once a
    file: Hydra itself reads such a file after the primary's, so never."""
    import logging

    primary = {name.removesuffix(".yaml") for name in built_in.list("", ObjectType.CONFIG)}
    for source in users:
        hidden = sorted(n for n in primary if source.is_config(n))
        if not hidden:
            continue
        if source.path not in _SAID:
            _SAID.add(source.path)
            logging.getLogger("parallab").warning(
                "%s holds %s, the name of parallab's own config, which is not read: "
                "parallab composes its own; put your options in groups (model/, data/, "
                "experiment/, ...)", source.path, ", ".join(f"{n}.yaml" for n in hidden))
        source.is_config = _without(source.is_config, primary)


_SAID: set[str] = set()  # the dirs whose files of a primary's name were said


def _without(is_config, names: set[str]):
    def found(config_path: str) -> bool:
        return config_path.removesuffix(".yaml") not in names and is_config(config_path)

    return found


def _shadowed(users: list, built_in) -> dict[str, str]:
    """group/option -> the user's source path, for each option a user's source holds that
    parallab's holds too."""
    found = {}
    for group in built_in.list("", ObjectType.GROUP):
        for option in built_in.list(group, ObjectType.CONFIG):
            name = f"{group}/{option}"
            source = next((u for u in users if u.is_config(name)), None)
            if source is not None:
                found[name] = source.path
    return found


@contextlib.contextmanager
def one_store() -> Iterator[None]:
    """Copies of Hydra's config repository share its one ConfigStore while inside. Hydra
    copies the repository, the store of every schema with it, for each compose (a fifth of
    a compose's time) and for each group --help lists (171 copies, most of --help's time:
    docs/benchmarks.md); nothing stores a config meanwhile, a config loaded from the store is a copy
    of its own, and the store is a process-wide singleton anyway. Nested: the outermost
    puts it back."""
    if vars(ConfigStore).get("__deepcopy__") is _itself:
        yield
        return
    ConfigStore.__deepcopy__ = _itself
    try:
        yield
    finally:
        del ConfigStore.__deepcopy__


def _itself(store: ConfigStore, memo: dict) -> ConfigStore:
    return store
