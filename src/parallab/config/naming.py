"""Names that conf/config.yaml (through the resolvers launching/launch.py registers) and the
code both use, written once: a rank's log file, a sweep job's dir, and an override's value
quoted so that Hydra reads it back as it is, or read back as Hydra reads it."""

from __future__ import annotations

import hashlib
import re
from typing import Iterator

NAME_MAX = 255  # bytes of one file name on Linux's file systems


def rank_suffix(rank: int) -> str:
    """What a rank's files add to their name: nothing for rank 0 (train.log), `_rank{k}`."""
    return "" if rank == 0 else f"_rank{rank}"


def log_file(rank: int) -> str:
    """A rank's log file in the run dir: rank 0's train.log, rank k's train_rank{k}.log."""
    return f"train{rank_suffix(rank)}.log"


def where_it_logs(key: str) -> bool:
    """An override of where a run logs (`logger=`, any `logger.` key, a project's own logger
    added with `+` too): not what it trains, so not in a sweep job's name (Hydra's
    exclude_keys name keys one by one)."""
    key = key.lstrip("+~")
    return key == "logger" or key.startswith("logger.")


def job_dir(num: int, overrides: str) -> str:
    """A sweep job's dir: its number and what it changed (Hydra's override_dirname, less
    where it logs), readable; where that is longer than a file name may be, cut and ended
    with a hash of the whole (stable: a rerun finds the same dir; the job's
    .hydra/overrides.yaml keeps every override)."""
    items = re.split(r",(?=[+~]*[A-Za-z_][\w.@/-]*=)", overrides) if overrides else []
    overrides = ",".join(i for i in items if not where_it_logs(i.partition("=")[0]))
    # a value's slashes (data.files=/data/a.bin) had made one dir a level each, the jobs
    # of one sweep in others' subdirs: written as a URL writes them
    name = f"{num}_{overrides.replace('/', '%2F')}"
    if len(name.encode()) <= NAME_MAX:
        return name
    digest = hashlib.sha1(overrides.encode()).hexdigest()[:10]
    kept = name.encode()[:NAME_MAX - len(digest) - 1].decode("utf-8", "ignore")
    return f"{kept}_{digest}"


def hydra_value(text: str) -> str:
    """`text` as an override's value Hydra reads back as it is: quoted where it holds what
    its grammar parses (a sweep job's dir: `0_data.shape=[1,8,8],optim.lr=0.01`)."""
    if re.fullmatch(r"[\w/.\-+:@~% ]*", text):
        return text
    return "'" + text.replace("'", "\\'") + "'"  # Hydra unescapes quotes only


def run_dirs_named(args: list[str]) -> Iterator[str]:
    """The hydra.run.dir the command line sets, as Hydra reads it: quoted, escaped (a
    backslash before a comma), or with `+` or `++`; one Hydra cannot parse, it refuses
    itself."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import HydraException

    parser = OverridesParser.create()
    for arg in args:
        if "hydra.run.dir" in arg:
            try:
                override = parser.parse_override(arg)
            except HydraException:  # its syntax errors too, not only OverrideParseException
                continue
            if override.key_or_group == "hydra.run.dir" and isinstance(override.value(), str):
                yield override.value()
