"""Every Hydra internal parallab uses, in one place. Hydra's public entry, hydra.main, reads
sys.argv, where `parallab train ...` holds the subcommand Hydra must not see; running an app
over another argv takes these steps of hydra.main itself. pyproject pins hydra-core to the
releases tested (>=1.3.2,<1.4), and tests/test_config.py fails where the installed Hydra
lacks any of them."""

import contextlib
from typing import Iterator

from hydra._internal.utils import _run_hydra as run_hydra
from hydra._internal.utils import get_args_parser
from hydra.core.config_store import ConfigStore
from hydra.core.utils import _flush_loggers as flush_loggers
from hydra.main import _get_rerun_conf as rerun_conf

__all__ = ["flush_loggers", "get_args_parser", "rerun_conf", "run_hydra", "one_store"]


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
