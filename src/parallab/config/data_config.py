"""The base of data sets: the `data` keys parallab owns, and the composed `data` node typed
by its data set's own config class (a DataConfig subclass; data/*.py, or a user's)."""

from __future__ import annotations

import enum
import inspect
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, Optional

from omegaconf import MISSING, OmegaConf
from omegaconf.errors import ConfigKeyError, OmegaConfBaseException

from parallab.config import targets
from parallab.config.errors import ConfigError


class Loader(enum.Enum):
    auto = "auto"  # memory when the set is tensors that fit, no per-sample augmentation
    memory = "memory"  # the whole split as one tensor, batches gathered by index
    dataloader = "dataloader"  # torch DataLoader over a per-sample Dataset


# --- data: the keys parallab owns; each data set's class adds its own (data/*.py) -------
@dataclass
class DataConfig:
    """A data set's config, and the data set itself: problem() checks it before any worker
    starts, make() builds its (train, eval) splits in each worker."""

    _target_: str = MISSING  # the data set's config class (this one's subclass)
    batch_size: int = 64  # per rank
    # set: batch_size = this / (data-parallel ranks x trainer.accumulate_grad_batches); a
    # data.batch_size given beside it on the command line is refused
    global_batch_size: Optional[int] = None
    eval_batch_size: int = 1000  # per rank
    # auto | memory (the whole split as tensors held in memory) | dataloader; auto = memory
    # where the set is tensors that fit and need no per-sample augmentation
    loader: Loader = Loader.auto
    num_workers: int = 0  # DataLoader worker processes per rank
    # page-locked host batches, so the copy to a GPU overlaps compute; null = on CUDA
    pin_memory: Optional[bool] = None
    persistent_workers: bool = False  # keep the DataLoader's workers between epochs
    prefetch_factor: Optional[int] = None  # batches each worker loads ahead; null = torch's 2
    collate_fn: Any = None  # a function's dotted path, or a _target_ spec; null = torch's

    name: ClassVar[str] = "data"  # in messages and hparams
    # a data set's own keys that change neither its training samples nor their order
    # (download; files a fingerprint checks instead): a resume may give them otherwise,
    # as it may every key above but _target_ (how the samples are loaded, not which)
    same_data: ClassVar[tuple[str, ...]] = ()
    tensors: ClassVar[bool] = True  # make() gives in-memory Splits (data.loader=memory works)
    next_token: ClassVar[bool] = False  # targets are the next token of every input position
    # its loader's epoch is whole steps of full batches whatever the layout (data=token_files):
    # a share short of a batch is dropped, not a short last batch
    whole_steps: ClassVar[bool] = False

    def problem(self) -> Optional[str]:
        """None if the data can be made (files there, values in range), else one line
        naming the key and the fix. May fetch files when the config asks to download."""
        return None

    def sized(self) -> bool:
        """False for a stream of unknown length: then trainer.max_steps must bound the run."""
        return True

    def train_length(self) -> int | None:
        """Training samples, where known without building the data (the run's length is
        then checked before any worker starts); None: the workers check it."""
        return None

    def said(self) -> str:
        """The data as the user gave it, for messages: a project's by its class (its
        option's name is not known here, and data=datasets is the kind of config it is, no
        option of parallab's)."""
        own = getattr(self, "train", None)
        if isinstance(own, dict) and "_target_" in own:
            return f"data.train._target_={own['_target_']}"
        if self._target_.startswith("parallab."):
            return f"data={self.name}"
        return f"data._target_={self._target_}"

    def batch_said(self) -> str:
        """The per-rank batch size as the user set it, for messages: data.batch_size, or
        data.global_batch_size where that set it."""
        if self.global_batch_size is not None:
            return (f"data.global_batch_size={self.global_batch_size} ({self.batch_size} per "
                    "rank)")
        return f"data.batch_size={self.batch_size}"

    def make(self, seed: int) -> tuple[Any, Any]:
        """(train, eval): Splits (data/split.py) or torch Datasets."""
        raise TypeError(f"{type(self).__name__} does not say how to make its data")

    def fit_model(self, model: dict[str, Any]) -> None:
        """Settle what depends on the model (its `model` spec), before the model's own
        checks read the data: data=token_files' samples, pairs for gpt or dicts for a
        transformers model."""

    def layout_problem(self, layout: Any) -> Optional[str]:
        """None if the data's samples suit the resolved layout, else one line."""
        return None

    def resume_problem(self, saved: Any, resume: str) -> Optional[str]:
        """None if the data a checkpoint recorded (`saved`: its "data" entry, if any) is
        still the data here, else one line naming what changed."""
        return None

    def scored_problem(self, saved: Any, ckpt: str) -> Optional[str]:
        """evaluate.py's: None if the samples held out here are those the run at `ckpt`
        held out (`saved`: its checkpoint's "data" entry), else one line."""
        return None

    def changed_keys(self, saved: Any) -> list[tuple[str, Any, Any]]:
        """(key, here, saved) of each key deciding the training samples or their order that
        differs from the run config a checkpoint recorded (`saved`: its data entry)."""
        if not isinstance(saved, dict):
            return []  # a checkpoint that records none: nothing to compare
        here = OmegaConf.to_container(OmegaConf.structured(self), enum_to_str=True)
        loading = {f for f in DataConfig.__dataclass_fields__ if f != "_target_"}
        return [(key, value, saved[key]) for key, value in here.items()
                if key not in loading and key not in self.same_data and key in saved and
                saved[key] != value]


def batch_overridden(overrides: list[str], global_batch: int | None) -> str | None:
    """Where the command line gives data.batch_size and the config fixes the global batch,
    which sets the batch per rank over it (validate.resolve_global_batch): one line."""
    given = {o.lstrip("+").partition("=")[0] for o in overrides if not o.startswith("~")}
    if global_batch is None or "data.batch_size" not in given:
        return None
    return (f"data.batch_size is given with data.global_batch_size={global_batch}, which sets "
            "the batch per rank itself (the global batch / (data-parallel ranks x "
            "trainer.accumulate_grad_batches)): drop data.batch_size, or give "
            "data.global_batch_size=null to keep it")


def data_defaults() -> dict[str, Any]:
    """The keys parallab owns in every data set's config, as the composed config's `data`
    starts with them (a plain mapping: each data option adds its own keys, and validate
    types the whole node by its data set's class)."""
    import dataclasses

    return {f.name: getattr(f.default, "value", f.default) for f in dataclasses.fields(DataConfig)
            if f.default is not MISSING}


def data_class_of(path: Path) -> Optional[type]:
    """The data set class a data option's YAML names by its _target_ (None where it names
    none, or none that imports): for a line on a key that YAML leaves out."""
    try:
        cls = targets.locate(OmegaConf.load(path).get(targets.TARGET), "data._target_")
    except Exception:  # noqa: BLE001 - a hint only: the run's own check names the fault
        return None
    return cls if inspect.isclass(cls) and issubclass(cls, DataConfig) else None


def data_config(node: dict[str, Any]) -> DataConfig:
    """The composed `data` node as its typed config: the class its _target_ names, or for
    a node with data.train / data.eval (Dataset specs) the generic Datasets."""
    node = dict(node)
    if targets.TARGET not in node and ("train" in node or "eval" in node):
        node[targets.TARGET] = "parallab.data.datasets.Datasets"
    cls = targets.locate(node.get(targets.TARGET), "data._target_")
    if not (inspect.isclass(cls) and issubclass(cls, DataConfig)):
        raise ConfigError(
            f"data._target_={node.get(targets.TARGET)} is not a data set config (a "
            "parallab.config.schema.DataConfig dataclass): give your torch Datasets as "
            "data.train._target_ and data.eval._target_ instead")
    try:
        return OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(cls), node))
    except ConfigKeyError as error:  # a key the class lacks (+data.KEY=...): the one meant
        import dataclasses
        import difflib

        known = [f.name for f in dataclasses.fields(cls)]
        close = difflib.get_close_matches(str(error.full_key), known, n=1)
        raise ConfigError(f"data.{error.full_key} is not a key of data set {cls.__name__}: "
                          + (f"did you mean data.{close[0]}?" if close else "drop it")) from None
    except OmegaConfBaseException as error:
        message = str(error.msg).splitlines()[0].replace(f" in '{cls.__name__}'", "")
        raise ConfigError(f"data.{error.full_key}: {message} (data set {cls.__name__}): fix "
                          "the key or its value") from None
