"""A run's hyperparameters as TensorBoard's HParams (and the trackers') compare runs: the
main choices, what the command line set, and the figures that tell runs apart."""

from __future__ import annotations

import enum
from typing import Any

from parallab.config.schema import Config
from parallab.config.targets import model_name


def of(cfg: Config, overrides: list[str], metrics: dict[str, Any]) -> dict[str, Any]:
    """The keys runs are compared by: the main choices plus whatever the command line set
    (`overrides`), and the figures in `metrics` a run is told apart by."""
    values: dict[str, Any] = {
        "model": model_name(cfg.model), "data": cfg.data.name,
        "loss": model_name(cfg.loss), "parallel": cfg.parallel.name,
        "precision": cfg.precision.name, "backend": cfg.backend.name, "optim": cfg.optim.name,
        "scheduler": cfg.scheduler.name,
        "data.batch_size": cfg.data.batch_size, "optim.lr": cfg.optim.lr, "lr": metrics["lr"],
        "optim.scale_lr": cfg.optim.scale_lr,
        "world_size": metrics["world_size"], "global_batch_size": metrics["global_batch_size"],
        "precision_dtype": metrics["precision_dtype"], "seed": cfg.seed,
        "precision.tf32": cfg.precision.tf32, "trainer.compile": cfg.trainer.compile,
        "precision.state_dtype": cfg.precision.state_dtype,
        "precision.reduce_dtype": cfg.precision.reduce_dtype,
        "trainer.channels_last": cfg.trainer.channels_last,
        "trainer.accumulate_grad_batches": cfg.trainer.accumulate_grad_batches,
        "trainer.clip_grad_norm": cfg.trainer.clip_grad_norm or 0.0,
        "trainer.quantize": cfg.trainer.quantize or "none",
        "trainer.auto_batch_size": cfg.trainer.auto_batch_size,
        **{f"scheduler.{k}": v for k, v in vars(cfg.scheduler).items() if k != "name"},
    }
    for override in overrides:
        key, _, value = override.partition("=")
        values.setdefault(key.lstrip("+~"), _scalar(cfg, key.lstrip("+~"), value))
    return {k: v if isinstance(v, (int, float, str, bool)) else str(v) for k, v in values.items()}


def _scalar(cfg: Config, key: str, text: str) -> Any:
    """A command-line key's value as the run took it (TensorBoard sorts swept numbers: YAML
    read `9e-1` as text); a group's choice, or a key not found, as given."""
    node: Any = cfg
    for part in key.split("."):
        node = node.get(part) if isinstance(node, dict) else getattr(node, part, None)
    plain = isinstance(node, (int, float, bool, str)) and not isinstance(node, enum.Enum)
    return node if plain else text
