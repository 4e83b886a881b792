"""Shared helpers: run the real entrypoints (parallab.testing) or the training function in
this process, each run in its own output dir."""

from __future__ import annotations

import os

# Two test workers and the runs they start share two cores: OpenMP threads that spin while
# they wait burn the time the other processes need (set before torch loads libgomp here;
# every run this process starts inherits it)
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import signal  # noqa: E402
import subprocess  # noqa: E402
import textwrap  # noqa: E402
from pathlib import Path  # noqa: E402

# Ctrl-C as a terminal delivers it: a suite started in the background (`make test &`, a
# script's `cmd &`) begins with SIGINT ignored, which every command it starts would inherit
# and keep (Python does), so the Ctrl-C tests would find their commands deaf to it
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)

import pytest  # noqa: E402

from parallab.testing import REPO, free_port, losses, read_metrics, run_entry, scalars  # noqa: F401,E402 - shared

# small, quick settings for end-to-end runs on a 2-core CPU
FAST = ["data=synthetic", "data.train_size=2048", "data.eval_size=512", "trainer.epochs=1",
        "trainer.log_every_n_steps=5", "device=cpu"]

# a small gpt with dropout, every step logged: recomputation must redraw the same masks
# a transformers Llama with Llama 3's config, tiny (built from its config, nothing loaded)
TINY_LLAMA = ["model=llama3_8b", "model.config.vocab_size=512", "model.config.hidden_size=64",
              "model.config.intermediate_size=128", "model.config.num_hidden_layers=2",
              "model.config.num_attention_heads=4", "model.config.num_key_value_heads=2",
              "model.config.bos_token_id=1", "model.config.eos_token_id=2"]
GPT_RUN = ["data=bytes", "data.eval_fraction=0.002", "model=gpt", "model.layers=2",
           "model.heads=2", "model.width=32", "model.context=32", "model.dropout=0.1",
           "data.batch_size=8", "trainer.max_steps=20", "trainer.log_every_n_steps=1",
           "trainer.checkpoint_every_n_steps=null", "device=cpu"]


# sitecustomize for the run's processes: act once the trainer has done `step` steps
INJECT = """
import os, signal
import parallab.training.trainer as trainer

step = trainer.Trainer.train_step

def train_step(self, batches):
    if self.step == {step} and {condition}:
        {action}
    return step(self, batches)

trainer.Trainer.train_step = train_step
"""


def sitecustomize(tmp_path, text: str) -> dict[str, str]:
    """The environment whose Python processes load `text` as their sitecustomize."""
    folder = tmp_path / "inject"
    folder.mkdir(exist_ok=True)
    (folder / "sitecustomize.py").write_text(text)
    # ahead of a PYTHONPATH the suite runs under (a checkout's src/ over the installed one)
    return {"PYTHONPATH": os.pathsep.join(filter(None, [str(folder),
                                                        os.environ.get("PYTHONPATH")]))}


def inject(tmp_path, step: int, action: str, condition: str = "True") -> dict[str, str]:
    return sitecustomize(tmp_path, textwrap.dedent(INJECT).format(
        step=step, action=action, condition=condition))


def only_run_dir(root: Path) -> Path:
    """The one run dir under outputs/ (asserting the ranks did not split it)."""
    dirs = [p.parent for p in root.glob("outputs/*/*/.hydra")]
    assert len(dirs) == 1, dirs
    return dirs[0]


def output(result: subprocess.CompletedProcess) -> str:
    return result.stdout + result.stderr


def assert_ok(result: subprocess.CompletedProcess) -> None:
    assert result.returncode == 0, output(result)[-4000:]


def typed(*overrides: str, config_dir: Path | None = None):
    """The real conf/ composed with `overrides` (and a project's config dir), typed as the
    Config train.py checks (model and loss still as composed: plain dicts)."""
    from parallab.cli import compose
    from parallab.config.hydra_app import typed_config

    return typed_config(compose(list(overrides), config_dir), list(overrides))


def checked(*overrides: str, config_dir: Path | None = None):
    """typed(), then validate.prepare: the config and layout every worker gets
    (ConfigError if bad)."""
    from parallab.checks import validate

    return validate.prepare(typed(*overrides, config_dir=config_dir), in_place=None)


@pytest.fixture
def train(tmp_path):
    """train(args...) -> (result, run_dir): the real train.py in a fresh output dir."""

    def _train(*args: str, timeout: float = 300, env: dict[str, str] | None = None,
               name: str = "run"):
        run_dir = tmp_path / name
        return run_entry("train.py", list(args), run_dir, timeout, env), run_dir

    return _train


@pytest.fixture
def train_here(tmp_path):
    """train_here(args...) -> (metrics, run_dir): the training function train.py calls, run
    in this process (parallab.cli.train_in_process) in a fresh output dir; for tests whose
    point is not the command line, the launcher or signals (no interpreter start-up)."""
    from parallab.cli import train_in_process

    def _train(*args: str, name: str = "run", config_dir: Path | None = None):
        run_dir = tmp_path / name
        return train_in_process(list(args), run_dir, config_dir), run_dir

    return _train


@pytest.fixture(scope="module")  # a module's cluster tests share it, on one worker (xdist_group)
def cluster(tmp_path_factory):
    """A real SLURM (slurm_cluster.py: munged, slurmctld, slurmd per node), started for the
    module's tests and stopped after; skipped in one line where its daemons cannot be had."""
    import slurm_cluster

    why = slurm_cluster.missing()
    if why is not None:
        pytest.skip(f"no SLURM cluster for these tests: {why}")
    running = slurm_cluster.Cluster(tmp_path_factory.mktemp("slurm"))
    try:
        running.start()
        yield running
    finally:
        running.stop()
