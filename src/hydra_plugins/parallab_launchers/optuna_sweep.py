"""Optuna's sweeper (`hydra/sweeper=optuna`), a sweep whose every trial failed ending as a
sweep of the basic sweeper whose jobs failed does: the summary written and printed, then
one line, exit status 1. Optuna's own sweeper asked its study for the best trial, of
none, and the sweep ended in its traceback ("No trials are completed yet"), no summary."""

# no `from __future__ import annotations`: Hydra's scan of its plugins runs this module
# under a name that is not in sys.modules, where a dataclass cannot read string annotations
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any, List

from hydra.core.config_store import ConfigStore

try:  # without the optuna sweeper installed, no sweeper to stand in for
    from hydra_plugins.hydra_optuna_sweeper.config import OptunaSweeperConf
    from hydra_plugins.hydra_optuna_sweeper.optuna_sweeper import OptunaSweeper
except ImportError:
    OptunaSweeperConf = OptunaSweeper = object  # type: ignore[assignment,misc]

log = logging.getLogger("parallab")
NONE_COMPLETED = "no trials are completed"  # optuna's study.best_trial, of no trial


class Sweeper(OptunaSweeper):  # type: ignore[misc,valid-type]
    """Optuna's sweeper; where no trial completed, the multirun's end (the summary) run
    here, since Hydra runs it only once the sweeper returns."""

    def setup(self, *, hydra_context: Any, task_function: Any, config: Any) -> None:
        super().setup(hydra_context=hydra_context, task_function=task_function,
                      config=config)
        self.hydra_context, self.config = hydra_context, config

    def sweep(self, arguments: List[str]) -> None:
        try:
            return super().sweep(arguments)
        except ValueError as error:
            if NONE_COMPLETED not in str(error).lower():
                raise
        try:
            self.hydra_context.callbacks.on_multirun_end(config=self.config)
        except SystemExit:  # its exit for the failed jobs: the line below says why
            pass
        sweep_dir = Path(self.config.hydra.sweep.dir)
        log.error("every trial of the Optuna sweep failed, so it has no best parameters: "
                  "each trial's error is in %s (its log, with any traceback, in its job "
                  "dir's train.log there); mend it and run the sweep again",
                  sweep_dir / "summary.md")
        raise SystemExit(1)


@dataclass
class SweeperConf(OptunaSweeperConf):  # type: ignore[misc,valid-type]
    _target_: str = "hydra_plugins.parallab_launchers.optuna_sweep.Sweeper"


def register() -> None:
    """This sweeper in the place of Optuna's `optuna` (where it is installed): after
    Hydra's scan of its plugins, which registers Optuna's (checked.register)."""
    if OptunaSweeper is not object:
        ConfigStore.instance().store(group="hydra/sweeper", name="optuna", node=SweeperConf,
                                     provider="parallab")
