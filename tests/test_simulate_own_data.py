"""parallab simulate with a project's own choices: the data an experiment chooses is the
data simulated and the data its printed command trains on, where simulate's generated
tokens stand only for train's default data."""

from __future__ import annotations

import shlex
from pathlib import Path

from conftest import typed

from parallab.testing import run_entry

GPT = ["model=gpt", "model.layers=2", "model.heads=4", "model.width=64", "model.context=64",
       "optim=adamw", "precision=bf16", "parallel=fsdp", "parallel.world_size=4",
       "cluster=h100"]


def _project(root: Path) -> Path:
    """A config dir whose experiment chooses its own data: generated tokens, 4 sequences of
    32 a rank (simulate's default takes 8 of the model's context)."""
    conf = root / "conf"
    (conf / "data").mkdir(parents=True)
    (conf / "experiment").mkdir()
    (conf / "data" / "short.yaml").write_text(
        "_target_: parallab.data.tokens.Tokens\nvocab_size: 256\nseq_len: 32\n"
        "batch_size: 4\n")
    (conf / "experiment" / "short.yaml").write_text(
        "# @package _global_\ndefaults:\n  - override /data: short\n")
    return conf


def test_an_experiments_data_is_simulated_and_trained_as_printed(tmp_path):
    from parallab.commands import simulate_in_process

    conf = _project(tmp_path)
    answer = simulate_in_process(["experiment=short", *GPT], tmp_path / "run", conf)
    command = shlex.split(answer["command"])
    assert "data=tokens" not in command and "data.batch_size=4" in command
    cfg = typed(*command[4:], config_dir=conf)  # as train composes the printed command
    assert (cfg.data.seq_len, cfg.data.batch_size) == (32, 4)
    # where nothing chose the data, simulate's own tokens, named in the command
    plain = simulate_in_process(GPT, tmp_path / "plain", conf)
    assert plain["command"].startswith("parallab train --config-dir")
    assert " data=tokens " in plain["command"] and "data.batch_size=8" in plain["command"]


def test_the_command_simulates_an_experiments_data(tmp_path):
    """The command line composes inside Hydra's app (another path than in process), the
    project's dir given as --config-dir or as hydra.searchpath."""
    conf = _project(tmp_path)
    for name, where in (("dir", ["--config-dir", str(conf)]),
                        ("path", [f"hydra.searchpath=[file://{conf}]"])):
        done = run_entry("parallab", ["simulate", *where, "experiment=short", *GPT],
                         tmp_path / name, timeout=180)
        assert done.returncode == 0, done.stderr[-3000:]
        said = done.stdout.strip().splitlines()
        assert said[-2].startswith("parallab simulate: fsdp(F4) b4 "), said[-2]
        assert "data=tokens" not in said[-1] and "experiment=short" in said[-1]
        # the printed command finds the project's experiment where simulate found it
        assert where[-1] in shlex.split(said[-1]), said[-1]
