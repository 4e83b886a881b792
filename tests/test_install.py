"""parallab as a wheel in a fresh venv, run from outside the checkout: the default MNIST run
and a user's project, with conf/ and the shipped data found inside the package."""

from __future__ import annotations

import shutil
import subprocess
import sys
import sysconfig

import pytest
from conftest import REPO, read_metrics

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("wheel")]


def run(*command, cwd=None, timeout=300) -> subprocess.CompletedProcess:
    result = subprocess.run([str(c) for c in command], cwd=cwd, capture_output=True, text=True,
                            timeout=timeout)
    assert result.returncode == 0, (result.stdout + result.stderr)[-4000:]
    return result


@pytest.fixture(scope="module")
def venv(tmp_path_factory):
    """A fresh venv holding the wheel built from this checkout (--no-deps); its dependencies
    (torch, hydra, ...) come from this environment's site-packages through a .pth file, so no
    multi-GB download. The checkout's editable install is not on its path."""
    root = tmp_path_factory.mktemp("wheel")
    run(sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
        "-w", root / "dist", REPO, cwd=root)
    wheel = next((root / "dist").glob("parallab-*.whl"))
    env = root / "venv"
    run(sys.executable, "-m", "venv", "--without-pip", env)
    python = env / "bin" / "python"
    purelib = run(python, "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"
                  ).stdout.strip()
    ours = sysconfig.get_path("purelib")  # the test environment's packages, deps only
    with open(f"{purelib}/deps.pth", "w") as pth:
        pth.write(ours + "\n")
    run(sys.executable, "-m", "pip", "--python", python, "install", "--no-deps", "-q", wheel)
    return env


def test_the_wheel_trains_mnist_from_anywhere(venv, tmp_path):
    where = run(venv / "bin" / "python", "-c", "import parallab.cli; print(parallab.cli.__file__)",
                cwd=tmp_path).stdout
    assert where.startswith(str(venv)), where  # the wheel's copy, not the checkout
    run(venv / "bin" / "parallab", "train", "trainer.max_steps=100", "trainer.epochs=1",
        "device=cpu", f"hydra.run.dir={tmp_path / 'run'}", cwd=tmp_path)
    metrics = read_metrics(tmp_path / "run")
    assert metrics["steps"] == 100 and metrics["eval_accuracy"] > 0.3  # real MNIST, shipped


def test_the_wheel_trains_a_users_project(venv, tmp_path):
    project = tmp_path / "own_model"
    shutil.copytree(REPO / "examples" / "own_model", project,
                    ignore=shutil.ignore_patterns("__pycache__", "outputs"))
    # one process: the layouts on the project are test_example_project's; here, the wheel's part
    run(venv / "bin" / "parallab", "train", "--config-dir", "conf", "experiment=waves",
        "trainer.max_steps=10", "device=cpu", "hydra.run.dir=run", cwd=project)
    metrics = read_metrics(project / "run")
    assert metrics["steps"] == 10 and "eval_loss" in metrics and "eval_accuracy" not in metrics


def test_the_wheel_trains_a_transformers_project(venv, tmp_path):
    """examples/hf_llama as its user runs it: a tiny Llama by _target_ (its config, no
    download), dict samples with padded labels, trained by the installed command (its
    layouts, its own tensor-parallel plan among them: test_transformers, from the
    checkout)."""
    from conftest import losses

    project = tmp_path / "hf_llama"
    shutil.copytree(REPO / "examples" / "hf_llama", project,
                    ignore=shutil.ignore_patterns("__pycache__", "outputs"))
    result = run(venv / "bin" / "parallab", "train", "--config-dir", "conf", "experiment=llama",
                 "trainer.max_steps=10", "trainer.log_every_n_steps=1", "data.train.size=320",
                 "device=cpu", "hydra.run.dir=run", cwd=project)
    assert "UserWarning" not in result.stdout + result.stderr  # none per step
    one = losses(project / "run")
    assert len(one) == 10 and one[-1] < one[0]
    assert read_metrics(project / "run")["eval_loss"] < one[0]


def test_make_setup_hands_pips_configuration_to_uv(monkeypatch):
    """`make setup` installs with uv, which reads no pip configuration: what pip would use
    (as `pip config list` prints it) reaches uv as options, a PIP_* variable over a file's
    value as for pip, a list written over several lines split into its items."""
    monkeypatch.syspath_prepend(str(REPO / "tools"))
    from pip_to_uv import settings, uv_options

    listed = ("global.cert='/etc/ssl/certs/ca.crt'\n"
              "global.extra-index-url='\\nfile:///mirror/simple\\nfile:///more/simple'\n"
              "global.find-links='/wheels'\n:env:.find-links='/env-wheels'\n"
              "global.constraint='/etc/pip/caps.txt'\n")
    assert uv_options(listed) == [
        "--index-strategy", "unsafe-best-match",
        "--extra-index-url", "file:///mirror/simple", "--extra-index-url", "file:///more/simple",
        "--find-links", "/env-wheels", "--constraint", "/etc/pip/caps.txt"]
    assert settings(listed)["cert"] == "/etc/ssl/certs/ca.crt"  # handed on as SSL_CERT_FILE
    assert uv_options("global.no-index='true'") == ["--index-strategy", "unsafe-best-match",
                                                    "--no-index"]
