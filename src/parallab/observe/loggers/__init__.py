"""Rank 0's record of a run: metrics.json in the run dir, and the loggers the `logger`
group names (TensorBoard by default; CSV, MLflow, W&B, or a user's own by `_target_`), each
given the same figures at the same steps."""

from __future__ import annotations

import importlib.util
import json
import logging
import math
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf

from parallab.config import targets
from parallab.config.errors import first_line
from parallab.observe.loggers.base import Logger, RunInfo

log = logging.getLogger(__name__)

DEFAULT = {"tensorboard": {targets.TARGET: "parallab.observe.loggers.tensorboard.TensorBoardLogger"}}


def problem(loggers: Any) -> str | None:
    """None if every logger the config names can be built, else one line naming it."""
    if not isinstance(loggers, dict):
        return f"logger={loggers!r} is not a set of loggers: choose with logger=[tensorboard,csv]"
    for name, spec in loggers.items():
        key = f"logger.{name}"
        if not isinstance(spec, dict) or targets.TARGET not in spec:
            return (f"{key} has no _target_: choose a logger (logger=[tensorboard,mlflow]) "
                    f"or give your own as +{key}._target_=mypkg.MyLogger")
        cls = targets.locate(spec[targets.TARGET], f"{key}._target_")
        if not (isinstance(cls, type) and issubclass(cls, Logger)):
            return (f"{key}._target_={spec[targets.TARGET]} is not a logger: give a subclass of "
                    "parallab.observe.loggers.base.Logger")
        args = targets.arguments(spec)
        targets.check_arguments(cls, args, key)
        targets.check_types(cls, args, key)
        needs = getattr(cls, "requires", None)
        if needs and importlib.util.find_spec(needs) is None:
            return (f"logger={name} needs {needs}, which is not installed: "
                    f'pip install "parallab[{needs}]"')
        said = cls.check(**args) or _clash(name, cls.writes(**args))
        if said:
            return said
    return None


def chosen_problem(overrides: list[str], loggers: Any) -> str | None:
    """The loggers chosen on the command line (logger=[a,b]) each under a key of their own:
    two option files that set one key (a user's copy of csv.yaml as mycsv.yaml, its key
    still csv) were merged into one logger, the other dropped without a word."""
    for override in overrides:
        key, _, value = override.lstrip("+~").partition("=")
        names = list(dict.fromkeys(n.strip() for n in value.strip("[]").split(",") if n.strip()))
        if key != "logger" or not isinstance(loggers, dict) or len(names) <= len(loggers):
            continue
        merged = next((n for n in names if n not in loggers), names[-1])
        return (f"logger={value} chooses {len(names)} loggers, and their option files set "
                f"{len(loggers)} key(s) ({', '.join(loggers)}): logger/{merged}.yaml sets "
                f"another's, so one was dropped: give it a key of its own ({merged}: ...)")
    return None


# what a run writes into its dir beside its loggers' files (Hydra's record, the logs, the
# checkpoints, what advise, the profiler and a sweep's summary leave)
RUN_FILES = ("metrics.json", ".hydra", "train.log", "train_rank*.log", "checkpoints",
             "status.json", "advise.md", "advise.csv", "advise.png", "profiler",
             "memory_snapshot")


def _clash(name: str, files: list[str]) -> str | None:
    """A logger's file that would land outside the run dir or on a file the run writes."""
    for written in files:
        path = Path(written)
        if path.is_absolute() or ".." in path.parts:
            return (f"logger {name} writes {written}, outside the run dir: give a path inside "
                    "it (a name, or a subfolder's)")
        if not path.parts:  # '' or '.': the run dir itself
            return (f"logger {name} writes {written!r}, which names no file: give the "
                    "logger's file a name")
        if any(Path(path.parts[0]).match(own) for own in RUN_FILES):  # a name or a glob
            return (f"logger {name} writes {written}, which is the run's own {path.parts[0]}: "
                    "give the logger's file another name")
    return None


def files(loggers: dict[str, Any] | None) -> list[str]:
    """The files the configured loggers write into the run dir (glob patterns)."""
    found = []
    for name, spec in (loggers or DEFAULT).items():
        cls = targets.locate(spec[targets.TARGET], f"logger.{name}._target_")
        found += cls.writes(**targets.arguments(spec))
    return found


def flatten(node: Any, prefix: str = "") -> dict[str, Any]:
    """A config as `a.b.c` -> value; lists and empty mappings as their text."""
    if isinstance(node, dict) and node:
        return {k: v for key, value in node.items()
                for k, v in flatten(value, f"{prefix}{key}.").items()}
    return {prefix.rstrip("."): node if isinstance(node, (int, float, str, bool)) or node is None
            else str(node)}


def as_run(cfg: Any, layout: Any = None) -> dict[str, Any]:
    """The run's config as a plain dict, its parallel keys as `layout` (the checks'
    Layout) resolved them: what its record holds."""
    config = OmegaConf.to_container(OmegaConf.structured(cfg), enum_to_str=True)
    if layout is not None:
        config["parallel"] = layout.as_run(config["parallel"])
    return config


def run_info(cfg: Any, run_dir: str | Path, overrides: list[str], sweep: str | None,
             world_size: int, layout: Any = None) -> RunInfo:
    run_dir = Path(run_dir)
    config = as_run(cfg, layout)
    # the sweep by where it is: a sweep continued from its printed command (an absolute
    # hydra.sweep.dir) had become a second MLflow parent, a second W&B group
    sweep = str(Path(sweep).resolve()) if sweep else None
    return RunInfo(
        run_dir=run_dir, name=run_dir.name if sweep else f"{run_dir.parent.name}/{run_dir.name}",
        sweep=sweep, params=flatten(config), config_yaml=OmegaConf.to_yaml(config),
        overrides=list(overrides), tags={"parallel": cfg.parallel.name,
                                         "world_size": str(world_size),
                                         "precision": cfg.precision.name})


class RunLogger:
    """Writes only where `active` (rank 0); every rank may call it alike. `specs`: the
    `logger` group's name -> _target_ spec (None: TensorBoard alone)."""

    def __init__(self, run_dir: str | Path, active: bool, specs: dict[str, Any] | None = None):
        self.run_dir = Path(run_dir)
        self.active = active
        self.loggers: dict[str, Logger] = {}
        if active:
            for name, spec in (DEFAULT if specs is None else specs).items():
                try:
                    self.loggers[name] = targets.build(spec)
                except Exception as error:  # noqa: BLE001 - a user's constructor: said once
                    log.warning("logger.%s could not be made (%s): the run goes on without "
                                "it", name, first_line(error))

    def each(self, call: str, *args: Any) -> None:
        """`call` on every logger; one that raises is said in one line and left out from
        then on (a tracker that is down): the run and the others go on."""
        for name, logger in list(self.loggers.items()):
            try:
                getattr(logger, call)(*args)
            except Exception as error:  # noqa: BLE001 - whatever a tracker raises
                log.warning("logger.%s failed in %s (%s): the run goes on without it", name,
                            call, first_line(error))
                del self.loggers[name]

    def start(self, run: RunInfo) -> None:
        self.each("start", run)

    def scalars(self, values: dict[str, float], step: int) -> None:
        if self.loggers:
            self.each("scalars", values, step)

    def histograms(self, values: dict[str, list[float]], step: int) -> None:
        for tag, counts in values.items():
            self.each("histogram", tag, counts, step)

    def text(self, tag: str, markdown: str) -> None:
        self.each("text", tag, markdown)

    def finish(self, metrics: dict[str, Any], hparams: dict[str, Any], step: int) -> None:
        """metrics.json, and the final figures and hparams to every logger."""
        if not self.active:
            return
        # JSON has no NaN: a figure that is not finite is null
        finite = {k: None if isinstance(v, float) and not math.isfinite(v) else v
                  for k, v in metrics.items()}
        (self.run_dir / "metrics.json").write_text(
            json.dumps(finite, indent=2, allow_nan=False) + "\n")
        final = {f"final/{k}": v for k, v in metrics.items()
                 if isinstance(v, (int, float)) and not isinstance(v, bool)}
        self.each("finish", final, hparams, step)

    def close(self, status: str = "finished") -> None:
        self.each("close", status)
        self.loggers.clear()


def started(cfg: Any, run_dir: str | Path, active: bool, overrides: list[str] = (),
            sweep: str | None = None, world_size: int = 1, layout: Any = None) -> RunLogger:
    """The run's logger of the loggers its config names, started on its run (rank 0 only
    writes; every rank may call it alike)."""
    logger = RunLogger(run_dir, active, cfg.logger)
    logger.start(run_info(cfg, run_dir, list(overrides), sweep, world_size, layout))
    return logger
