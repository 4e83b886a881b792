"""Install with uv as pip would: `python tools/pip_to_uv.py UV ARGS...` runs
`UV pip install ARGS...` with pip's own configuration, which uv reads none of: the
indexes, local wheel folders, constraints, trusted hosts and certificate bundle that
`pip config list` shows (pip.conf files and PIP_* variables, the variables winning as they
do for pip), and pip's way of taking the best match over every index."""

from __future__ import annotations

import ast
import os
import subprocess
import sys

# pip's setting -> uv's option (None: a switch)
OPTIONS = {"index-url": "--index-url", "extra-index-url": "--extra-index-url",
           "find-links": "--find-links", "constraint": "--constraint",
           "trusted-host": "--allow-insecure-host", "no-index": None}
# where a setting comes from, weakest first (pip's order: files, then its variables)
SOURCES = ("global", "install", ":env:")


def settings(pip_config: str) -> dict[str, str]:
    """`pip config list`'s lines (`global.find-links='/opt/wheels'`, values as Python
    reprs, a list in a pip.conf being one value over several lines): each setting's
    value from its strongest source."""
    found: dict[str, tuple[int, str]] = {}
    for line in pip_config.splitlines():
        key, _, value = line.partition("=")
        source, _, name = key.rpartition(".")
        if source in SOURCES and value:
            rank = SOURCES.index(source)
            if name not in found or rank >= found[name][0]:
                found[name] = (rank, ast.literal_eval(value))
    return {name: value for name, (_, value) in found.items()}


def uv_options(pip_config: str) -> list[str]:
    options = ["--index-strategy", "unsafe-best-match"]
    for name, value in settings(pip_config).items():
        flag = OPTIONS.get(name, "")
        if flag is None and value.lower() in ("1", "true", "yes", "on"):
            options.append(f"--{name}")
        elif flag:
            for item in value.split():
                options += [flag, item]
    return options


def main() -> int:
    listed = subprocess.run([sys.executable, "-m", "pip", "config", "list"],
                            capture_output=True, text=True).stdout
    env = dict(os.environ)
    cert = settings(listed).get("cert")
    if cert and "SSL_CERT_FILE" not in env:
        env["SSL_CERT_FILE"] = cert  # the bundle pip trusts (a proxy's, say)
    uv, *args = sys.argv[1:]
    return subprocess.run([uv, "pip", "install", *uv_options(listed), *args], env=env).returncode


if __name__ == "__main__":
    sys.exit(main())
