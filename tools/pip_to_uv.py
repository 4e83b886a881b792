"""Print the `uv pip install` options that give it pip's own configuration (uv reads none
of it): the indexes, local wheel folders and constraints that `pip config list` shows,
whether set in a pip.conf or by PIP_* variables; and pip's way of taking the best match
over every index rather than the first index that has a package."""

from __future__ import annotations

import shlex
import subprocess
import sys

OPTIONS = {"index-url": "--index-url", "extra-index-url": "--extra-index-url",
           "find-links": "--find-links", "constraint": "--constraint"}


def uv_options(pip_config: str) -> list[str]:
    """`pip config list`'s lines (`global.find-links='/opt/wheels'`) as uv's options."""
    options = ["--index-strategy", "unsafe-best-match"]
    for line in pip_config.splitlines():
        key, _, value = line.partition("=")
        flag = OPTIONS.get(key.rpartition(".")[2])
        for item in (shlex.split(value)[0].split() if flag and value else []):
            if (flag, item) not in zip(options, options[1:]):  # set in two places
                options += [flag, item]
    return options


if __name__ == "__main__":
    listed = subprocess.run([sys.executable, "-m", "pip", "config", "list"],
                            capture_output=True, text=True).stdout
    print(shlex.join(uv_options(listed)))
