"""What simulate composes in place of train's data: its generated tokens stand for train's
default data alone, not for data an experiment (or the user) chose. Both take a
`composed(name, overrides, hydra=True)`: the config `name` composed as the caller composes
(in process, or inside a running Hydra app, whose search path holds a project's dir)."""

from __future__ import annotations

from omegaconf import DictConfig


def chosen_data(overrides: list[str], composed) -> str | None:
    """The data option train composes for `overrides` where something chose it (an
    experiment, the user) over train's own default; None where none did, or where the
    overrides do not compose (a sweep's: simulate's own composition says what is wrong).
    `composed(name, overrides)`: the config `name` composed with its Hydra node."""
    from hydra.errors import HydraException

    try:
        chosen, default = (composed("config", given).hydra.runtime.choices.data
                           for given in (overrides, []))
    except (HydraException, ValueError):
        return None
    return None if chosen == default else chosen


def with_data(dict_cfg: DictConfig, overrides: list[str], composed
              ) -> tuple[DictConfig, list[str]]:
    """simulate's composition and overrides with the data train composes for them: an
    experiment's (or the user's) choice in place of simulate's generated tokens, which stand
    for train's default data alone and are then named for train's command (a choice on the
    command line beats simulate.yaml's). `composed(name, overrides, hydra=True)`: the
    config `name` composed (chosen_data)."""
    if any(o.lstrip("+~").startswith("data=") for o in overrides):
        return dict_cfg, overrides
    chosen = chosen_data(overrides, composed)
    if chosen is None:
        return dict_cfg, ["data=tokens", *overrides]
    return composed("simulate", [*overrides, f"data={chosen}"], hydra=False), overrides


def composed_in_app(name: str, overrides: list[str], hydra: bool = True) -> DictConfig:
    """The config `name` composed inside a running Hydra app: its search path (a project's
    --config-dir) the app's, and a hydra.searchpath given on the command line, which each
    composition reads from its own overrides."""
    from hydra import compose as hydra_compose
    from hydra.core.hydra_config import HydraConfig

    paths = [o for o in HydraConfig.get().overrides.hydra if o.startswith("hydra.searchpath=")]
    return hydra_compose(name, overrides=[*overrides, *paths], return_hydra_config=hydra)
