"""A run dir holds one run's record: no command writes over another's (evaluate.py and
parallab advise refuse a dir holding a run, and leave its files as they were)."""

from __future__ import annotations

import pytest
from conftest import FAST, output, read_metrics, run_entry

from parallab.commands import evaluate_in_process

TINY = [*FAST, "model=mlp", "data.shape=[1,8,8]", "trainer.max_steps=4"]


@pytest.mark.slow
@pytest.mark.parametrize("command", ["evaluate", "advise", "advise-resume"])
def test_no_command_writes_over_a_training_run(train_here, command):
    _, run_dir = train_here(*TINY)
    (run_dir / ".hydra").mkdir()  # as train.py leaves it
    (run_dir / ".hydra" / "config.yaml").write_text("the training run's\n")
    (run_dir / "train.log").write_text("the training run's last line\n")
    files = {p: p.read_bytes() for p in (run_dir / "metrics.json", run_dir / "train.log",
                                         run_dir / ".hydra" / "config.yaml")}
    if command == "evaluate":
        result = run_entry("evaluate.py", [f"ckpt={run_dir}/checkpoints/last.pt", "device=cpu"],
                           run_dir)
    else:
        result = run_entry("train.py", ["advise.run=true", *TINY, *(
            ["trainer.resume=auto"] if command == "advise-resume" else [])], run_dir)
    assert result.returncode == 2, output(result)[-2000:]
    errors = [line for line in output(result).splitlines() if "ERROR" in line]
    assert len(errors) == 1 and "holds a run (metrics.json" in errors[0], errors
    assert "Traceback" not in output(result)
    for path, content in files.items():  # every file of the training run as it was, its
        assert path.read_bytes() == content, path  # log without the refusal's line
    assert not (run_dir / "advise.md").exists() and not (run_dir / "evaluate.log").exists()


@pytest.mark.slow
def test_a_refused_evaluate_leaves_no_record_and_the_corrected_one_runs_there(train_here,
                                                                             tmp_path):
    _, run_dir = train_here(*TINY)
    mistyped = run_entry("evaluate.py", [f"ckpt={run_dir}/checkpoints/lost.pt", "device=cpu"],
                         tmp_path / "eval")
    assert mistyped.returncode == 2 and not (tmp_path / "eval" / ".hydra").exists()
    assert not (tmp_path / "eval" / "evaluate.log").exists()
    corrected = run_entry("evaluate.py", [f"ckpt={run_dir}/checkpoints/last.pt", "device=cpu"],
                          tmp_path / "eval")
    assert corrected.returncode == 0, output(corrected)[-2000:]
    assert read_metrics(tmp_path / "eval")["eval_loss"] > 0


def test_evaluate_refuses_a_dir_holding_a_killed_runs_record(tmp_path):
    """A run killed before its first checkpoint leaves .hydra/ alone: evaluate.py refuses
    the dir (it would write over that record) and puts the files back."""
    from parallab.training import checkpoint

    ckpt = tmp_path / "ckpt.pt"
    checkpoint.save(ckpt, {"model": {}, "step": 0, "config": {}})
    killed = tmp_path / "killed"
    (killed / ".hydra").mkdir(parents=True)
    (killed / ".hydra" / "config.yaml").write_text("the killed run's\n")
    result = run_entry("evaluate.py", [f"ckpt={ckpt}", "device=cpu"], killed)
    assert result.returncode == 2 and "holds a run (.hydra/)" in output(result)
    assert (killed / ".hydra" / "config.yaml").read_text() == "the killed run's\n"


@pytest.mark.slow
def test_evaluate_scores_the_data_the_checkpoint_was_trained_on(train_here, tmp_path):
    """No data= given: the checkpoint's (here synthetic, not the default MNIST, drawn with the
    run's seed), with the command line's data keys; data= given: used, and said."""
    metrics, run_dir = train_here(*TINY, "data.num_classes=4", "seed=7")
    ckpt = f"ckpt={run_dir}/checkpoints/last.pt"
    evaluate_in_process([ckpt, "device=cpu", "data.eval_batch_size=7"], tmp_path / "eval")
    scored = read_metrics(tmp_path / "eval")
    assert scored["data"] == "synthetic"
    assert scored["eval_loss"] == pytest.approx(metrics["eval_loss"], rel=1e-5)
    # the trained data's own keys, which the default data lacks, with no `+`; a data= choice
    # of the same set keeps its keys as trained (not the option file's)
    fewer = evaluate_in_process([ckpt, "device=cpu", "data.eval_size=16"], tmp_path / "few")
    assert fewer["eval_loss"] != pytest.approx(metrics["eval_loss"], rel=1e-5)
    same = evaluate_in_process([ckpt, "device=cpu", "data=synthetic"], tmp_path / "same")
    assert same["eval_loss"] == pytest.approx(metrics["eval_loss"], rel=1e-5)


def test_evaluate_scores_with_the_runs_own_loss_and_metrics(train_here, tmp_path):
    """The run's loss (its label smoothing) and its extra metric, as its checkpoint records
    them: evaluate had scored with loss=auto and no metric, its eval_loss another figure;
    a loss given on the command line is the one used."""
    own = ["loss._target_=torch.nn.CrossEntropyLoss", "+loss.label_smoothing=0.3",
           "+metrics.top1._target_=torchmetrics.functional.accuracy",
           "+metrics.top1.task=multiclass", "+metrics.top1.num_classes=10",
           "+metrics.top1._partial_=true"]
    metrics, run_dir = train_here(*TINY, *own)
    ckpt = f"ckpt={run_dir}/checkpoints/last.pt"
    scored = evaluate_in_process([ckpt, "device=cpu"], tmp_path / "eval")
    assert scored["eval_loss"] == pytest.approx(metrics["eval_loss"], rel=1e-5)
    assert scored["eval_top1"] == pytest.approx(metrics["eval_top1"])
    plain = evaluate_in_process([ckpt, "device=cpu", "loss=cross_entropy"], tmp_path / "plain")
    assert plain["eval_loss"] < scored["eval_loss"]  # no smoothing's floor


@pytest.mark.parametrize("where", ["a file", "read-only"])
def test_a_run_dir_that_cannot_be_made_ends_the_command_in_one_line(tmp_path, where):
    """`outputs` a file, or a dir on a read-only mount (a read-only folder: this suite runs
    as root, whom a folder's mode does not stop): Hydra ended the command in a
    NotADirectoryError or PermissionError traceback; now one line naming the dir and why,
    exit status 2, before any worker starts."""
    import subprocess
    import sys

    from conftest import REPO

    outputs = tmp_path / "outputs"
    command = [sys.executable, str(REPO / "train.py"), *TINY, "parallel=ddp",
               "parallel.world_size=2"]
    if where == "a file":
        outputs.write_text("not a dir\n")
        said = f"{outputs} is a file"
    else:  # mounted read-only, in a mount namespace of the command's own
        if subprocess.run(["unshare", "-m", "true"], capture_output=True).returncode:
            pytest.skip("no mount namespace here (unshare -m needs root or user namespaces)")
        outputs.mkdir()
        command = ["unshare", "-m", "sh", "-c", f'mount --bind "{outputs}" "{outputs}" && '
                   f'mount -o remount,bind,ro "{outputs}" && exec "$@"', "ro", *command]
        said = f"{outputs} is not writable here"
    done = subprocess.run(command, cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stderr[-2000:]
    assert "Traceback" not in done.stdout + done.stderr
    [line] = done.stderr.strip().splitlines()
    assert line.startswith(f"hydra.run.dir={outputs}/") and said in line, line
    assert outputs.is_file() if where == "a file" else not list(outputs.iterdir())


def test_a_file_system_that_takes_no_dir_is_refused_and_a_writable_dir_keeps_no_probe(tmp_path):
    """/proc and /sys pass access() for root but take no new directory: Hydra ended in a
    FileNotFoundError or PermissionError traceback; the probe that finds it leaves nothing
    behind where a dir can be made."""
    from parallab.launching.start import dir_problem

    for mount in ("/proc", "/sys"):
        said = dir_problem("hydra.run.dir", f"{mount}/runs/x")
        assert said and f"{mount} takes no new directory" in said, said
    assert dir_problem("hydra.run.dir", tmp_path / "runs" / "x") is None
    assert not list(tmp_path.iterdir())


def test_a_full_disk_ends_simulate_in_one_line_and_leaves_no_half_answer(tmp_path):
    """A run dir on a 16 KiB file system (mounted in a namespace of the command's own): room
    for Hydra's record, none for the answer. simulate ended in OSError tracebacks and left
    a 0-byte simulate.json; now one line, exit status 1, and no answer file at all."""
    import subprocess
    import sys
    from pathlib import Path

    if subprocess.run(["unshare", "-m", "true"], capture_output=True).returncode:
        pytest.skip("no mount namespace here (unshare -m needs root or user namespaces)")
    disk = tmp_path / "disk"
    disk.mkdir()
    gpt = ["model=gpt", "model.layers=2", "model.heads=4", "model.width=64", "model.context=64",
           "data.seq_len=32", "parallel=fsdp", "parallel.world_size=64", "cluster=h100"]
    command = [str(Path(sys.executable).parent / "parallab"), "simulate", *gpt,
               f"hydra.run.dir={disk}/sim"]
    shell = (f'mount -t tmpfs -o size=16k tmpfs "{disk}" && "$@"; code=$?; '
             f'echo left: $(ls -A "{disk}/sim"); exit $code')
    done = subprocess.run(["unshare", "-m", "sh", "-c", shell, "full", *command],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 1, done.stderr[-2000:]
    lines = (done.stdout + done.stderr).splitlines()
    assert "Traceback" not in done.stderr and "Logging error" not in done.stderr
    said = [line for line in lines if "ERROR" in line or "parallab:" in line]
    assert any(line.endswith(f"could not be written to {disk}/sim (No space left on device): "
                             "free space there, or give another hydra.run.dir")
               for line in said), said
    assert len(said) <= 2  # and, where the log filled first, the line saying so
    assert [line for line in lines if line.startswith("left:")] == ["left: .hydra simulate.log"]
