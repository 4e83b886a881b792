"""parallab simulate as a user runs it: bad input refused in one line before anything is
traced, the sbatch lines and the nodes they are priced on, the command from a shell and as a
sweep, and the commands and warnings it prints."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import output
from test_simulate import GPT, configured

from parallab.config.errors import ConfigError
from parallab.parallel.layout import Layout
from parallab.testing import run_entry


@pytest.mark.parametrize("overrides, says", [
    (["cluster.hbm_gbps=-1"], "cluster.hbm_gbps=-1.0 is out of range: it must be > 0"),
    # infinite or vanishing rates: no step of infinite seconds, no Infinity in JSON
    (["cluster.op_overhead_us=inf"], "cluster.op_overhead_us=inf is out of range: give a "
                                     "finite rate"),
    (["cluster.hbm_gbps=1e-320"], "cluster.hbm_gbps=1e-320 is out of range"),
    (["cluster.hbm_gbps=null"], "cluster.hbm_gbps=null: only cluster.gpu=this measures"),
    (["cluster.memory_gb=???"], "cluster.memory_gb is missing: set it"),
    (["cluster.gpu=RTX-9090"], "cluster.gpu=RTX-9090 is not in observe/gpus.yaml's peak FLOP/s"),
    # listed, but fp16 alone: it had been called not listed
    (["cluster.gpu=V100-SXM2", "precision=fp16"],
     "cluster.gpu=V100-SXM2 has no bf16 peak in observe/gpus.yaml (no bf16 tensor cores)"),
    (["cluster.gpu=MI300X", "+cluster.peak_tflops={bf16: 1307, int4: 2}"],
     "cluster.peak_tflops.int4 names no precision: give the GPU's dense TFLOP/s by fp32"),
    (["cluster.gpu=MI300X", "+cluster.peak_tflops={bf16: -1}"],
     "cluster.peak_tflops.bf16=-1.0 is out of range: give the GPU's dense TFLOP/s"),
    (["cluster.remeasure=true"], "cluster.remeasure=true: cluster=h100's rates are given"),
    # the earlier line's advice followed: a KeyError traceback for fp32 had come next
    (["cluster.gpu=Foo", "+cluster.peak_tflops.bf16=500"],
     "cluster.peak_tflops.fp32 is not given for cluster.gpu=Foo: give its dense float32 "
     "TFLOP/s too"),
    # advise's keys, which a simulation reads none of: taken without a word
    (["parallel=auto", "parallel.world_size=8", "advise.schedules=[foo]"],
     "advise.schedules is parallab advise's: parallab simulate spans every schedule"),
    (["parallel=fsdp"], "parallel.world_size is not set: give the GPU count to simulate"),
    # a trainer key auto spans for each layout: dropped without a word, the command otherwise
    (["parallel=auto", "parallel.world_size=8", "trainer.accumulate_grad_batches=2"],
     "trainer.accumulate_grad_batches=2 with parallel=auto: auto spans"),
    # a key every plan's config has: auto had taken it without a word, ranking no ep
    (["parallel=auto", "parallel.world_size=8", "parallel.ep=2"],
     "parallel=auto sets parallel.ep itself, for each layout it ranks: drop parallel.ep=2"),
    (["parallel=fsdp_tp", "parallel.world_size=8", "parallel.tp=3"],
     "multiply to 3 x ?, but parallel.world_size=8"),
    (["parallel=tp", "parallel.world_size=8"], "parallel.tp=8 does not divide model.heads=4"),
    (["parallel=pipeline", "parallel.world_size=16", "parallel.pp=16"],
     "is 16 parts, more than the 4 stages of the model"),
    (["parallel=auto", "parallel.world_size=1"], "parallel=auto with parallel.world_size=1"),
    (["parallel=auto", "parallel.world_size=8", "cluster.memory_gb=0.0001"],
     "no layout of parallel.world_size=8 GPUs fits GPT on cluster=h100: the smallest needs"),
    (["parallel=auto", "parallel.world_size=-8"],
     "parallel.world_size=-8 is out of range: it must be >= 1"),
    (["parallel=auto", "parallel.world_size=8", "data.global_batch_size=3"],
     "takes this model and batch: data.global_batch_size=3 does not split over 8 "
     "data-parallel ranks: give a multiple of 8"),
    (["parallel=auto", "parallel.world_size=8", "parallel.bucket_cap_mb=0"],
     "parallel.bucket_cap_mb=0.0 is out of range: it must be > 0"),
    (["parallel=auto", "parallel.world_size=8", "simulate.rows=0"],
     "simulate.rows=0 is out of range: it must be >= 1"),
    (["parallel=auto", "parallel.world_size=8", "simulate.world_sizes=[0,8]"],
     "simulate.world_sizes=[0, 8]: each must be a GPU count >= 1"),
    (["parallel=auto", "parallel.world_size=8", "simulate.measured=/no/such/runs"],
     "simulate.measured=/no/such/runs is not a directory"),
    # the printed command is one train takes: not both a fixed and a found batch
    (["parallel=auto", "parallel.world_size=8", "data.global_batch_size=64",
      "trainer.auto_batch_size=true"],
     "data.global_batch_size=64 fixes the samples of each step, which "
     "trainer.auto_batch_size=true would change: drop one of them"),
    (["adapter=lora", "parallel=fsdp", "parallel.world_size=8"],
     "adapter=lora: parallab simulate trains every weight"),
    # a sequence model's own limit, said as train says it (not "GPT does not take sequences")
    (["parallel=fsdp", "parallel.world_size=8", "data.seq_len=4096"],
     "data.seq_len=4096 is longer than model.context="),
    (["parallel=fsdp", "parallel.world_size=8", "trainer.fused_norms=true"],
     "trainer.fused_norms=true: GPT has no RMSNorm written out as torch's rms_norm"),
    # train's data on the cluster, not here: the way out named beside the data's own
    (["parallel=auto", "parallel.world_size=8", "data=bytes", "data.path=/on/the/cluster"],
     "no file /on/the/cluster: give a text file or a directory of *.txt files (or data.path="
     "null for the shipped text); or leave data= out: parallab simulate reads no data"),
])
def test_bad_input_ends_in_one_line(tmp_path, overrides, says):
    from parallab.commands import simulate_in_process

    fixed = any(o.startswith("data.global_batch_size=") for o in overrides)
    base = [o for o in GPT if not (fixed and o.startswith("data.batch_size="))]  # one of two
    with pytest.raises(ConfigError) as raised:
        simulate_in_process([*base, *overrides], tmp_path)
    assert says in str(raised.value) and "\n" not in str(raised.value)
    assert not (tmp_path / "simulate.json").exists()


def test_sbatch_lines_ask_for_what_the_slurm_launcher_asks_for():
    """One rule: 12 GPUs on 8-GPU nodes are 2 nodes x 6 (the launcher's), not 8 + 4; a
    world that no node count splits evenly gets no allocation, as the launcher refuses it."""
    from parallab.simulate.report import sbatch
    from parallab.parallel.grid import Candidate

    lines = sbatch(Candidate(Layout.planned(12, 12)), 8, "parallab train")
    assert "#SBATCH --nodes=2" in lines and "#SBATCH --ntasks-per-node=6" in lines
    assert "#SBATCH --gpus-per-node=6" in lines and lines[-1].endswith("parallab train")
    assert "#SBATCH --nodes=1" in sbatch(Candidate(Layout.planned(4, 4)), 8, "x")
    odd = sbatch(Candidate(Layout.planned(9, 9)), 8, "x")
    assert not [line for line in odd if line.startswith("#SBATCH")]
    assert "does not split evenly over the 2 nodes" in odd[-1]


def test_a_layout_is_priced_on_the_nodes_its_sbatch_lines_ask_for():
    """12 GPUs on 8-GPU nodes are allocated 2 x 6 (the sbatch lines, the launcher), where tp
    4's ranks 4-7 cross nodes: priced so, as on nodes of 6, not on nodes of 8 (its tp
    all-reduces had been priced over NVLink)."""
    from parallab.commands import compose
    from parallab.config.hydra_app import typed_config
    from parallab.simulate import run

    def predicted(*overrides):
        given = [*GPT, "parallel=fsdp_tp", "parallel.world_size=12", "parallel.tp=4",
                 "cluster=h100", *overrides]
        return run.given(typed_config(compose(given, None, "simulate"), given))[0].prediction

    eights, sixes = predicted(), predicted("cluster.gpus_per_node=6")
    assert eights.parts == pytest.approx(sixes.parts)
    assert eights.parts != pytest.approx(predicted("cluster.gpus_per_node=12").parts)


def test_the_command_as_a_user_runs_it(tmp_path):
    """`parallab simulate` from a shell: the answer, its files; an unknown cluster refused in
    one line, exit status 2, before anything is traced."""
    run_dir = tmp_path / "sim"
    done = run_entry("parallab", ["simulate", *GPT, "parallel=fsdp", "parallel.world_size=64",
                                  "cluster=h100"], run_dir, timeout=180)
    assert done.returncode == 0, done.stderr[-3000:]
    said = done.stdout.strip().splitlines()
    assert said[-2].startswith("parallab simulate: fsdp(F64) b2 ac=none: ")
    assert said[-1].startswith("parallab train data=tokens model=gpt")
    assert "No artists with labels" not in done.stderr  # one layout: no empty legend
    layouts = json.loads((run_dir / "simulate.json").read_text())["layouts"]
    assert len(layouts) == 1 and layouts[0]["fits"]
    refused = run_entry("parallab", ["simulate", *GPT, "cluster=nope"], tmp_path / "bad",
                        timeout=120)
    assert refused.returncode == 2 and "Traceback" not in refused.stderr
    assert len(refused.stderr.strip().splitlines()) == 1 and "cluster" in refused.stderr
    assert not Path(tmp_path / "bad" / "simulate.json").exists()
    # a refusal found once the model is built: its line alone, not after the warnings on
    # the defaults taken (float32, here)
    routed = run_entry("parallab", ["simulate", *[o for o in GPT if "precision" not in o],
                                    "parallel=fsdp", "parallel.world_size=8",
                                    "simulate.routing=round_robin"], tmp_path / "dense",
                       timeout=120)
    said = output(routed).strip().splitlines()
    assert routed.returncode == 2 and len(said) == 1, said
    assert "simulate.routing=round_robin prices how tokens pick experts" in said[0]


def test_a_simulated_sweep_checks_every_job_first_and_runs_past_a_failed_one(tmp_path):
    """`parallab simulate -m`: a world size of 0 had run job #0 and then ended the sweep at
    job #1, the rest unrun and no summary; it is refused before any job. A job whose layout
    the model refuses (tp 8 of 4 heads) fails alone: the others run, the summary says it,
    exit status 1."""
    sweep = [*[o for o in GPT if "precision" not in o], "precision=bf16", "cluster=h100"]
    # (parallel=auto, no layout a job trains, is checked by its values: job #0 passes)
    refused = run_entry("parallab", ["simulate", "-m", *sweep, "parallel=auto",
                                     "parallel.world_size=4,0",
                                     f"hydra.sweep.dir={tmp_path / 'refused'}"], timeout=180)
    assert refused.returncode == 2 and "Traceback" not in output(refused)
    assert "job #1 (" in refused.stderr and "parallel.world_size=0 is out of range" in \
        refused.stderr
    assert not [p for p in (tmp_path / "refused").iterdir() if p.is_dir()]  # no job's dir
    done = run_entry("parallab", ["simulate", "-m", *sweep, "parallel=tp",
                                  "parallel.world_size=8,4",
                                  f"hydra.sweep.dir={tmp_path / 'sweep'}"], timeout=300)
    assert done.returncode == 1, output(done)[-3000:]
    summary = (tmp_path / "sweep" / "summary.md").read_text()
    assert "parallel.tp=8 does not divide model.heads=4" in summary
    assert (next((tmp_path / "sweep").glob("1_*")) / "simulate.json").is_file()


def test_a_mesh_preset_on_one_gpu_prints_a_command_train_takes():
    """parallel=ddp at one GPU resolves to one process (parallel=none), whose config has no
    degrees to set: the command says the world size alone, and train composes and checks
    it."""
    from conftest import checked

    from parallab.simulate import run, search

    cfg = configured(*GPT, "parallel=ddp", "parallel.world_size=1")
    said = search.given(cfg, run.check(cfg)).overrides
    assert said[:2] == ["parallel=none", "parallel.world_size=1"] and \
        not any(o.startswith("parallel.dp_") for o in said)
    assert checked(*GPT, "data=bytes", "device=cpu", *said)[1].world_size == 1


def test_a_first_simulation_is_told_the_defaults_it_took(tmp_path, caplog):
    """A sequence as long as the model's whole context and float32 matmuls, taken from
    train's defaults unasked, are said (and written into simulate.md); given, nothing is."""
    from conftest import TINY_LLAMA

    from parallab.commands import simulate_in_process

    run = [*TINY_LLAMA, "parallel=fsdp", "parallel.world_size=8", "cluster=h100"]
    simulate_in_process(run, tmp_path / "defaults")
    said = ("data.seq_len=131072 is the model's whole context",
            "precision=fp32 (train's default) prices float32 matmuls")
    written = (tmp_path / "defaults" / "simulate.md").read_text()
    assert all(s in caplog.text and s in written for s in said)
    caplog.clear()
    simulate_in_process([*run, "data.seq_len=512", "precision=bf16"], tmp_path / "given")
    assert not any(s in caplog.text for s in said)


def test_a_batch_train_searches_is_said_to_be_priced_as_given(tmp_path):
    """trainer.auto_batch_size=true: train finds the batch on the GPUs as it starts, which
    a simulation cannot; it had been priced at the batch given without a word."""
    from parallab.commands import simulate_in_process

    run = [*GPT, "parallel=fsdp", "parallel.world_size=8", "cluster=h100"]
    simulate_in_process([*run, "trainer.auto_batch_size=true"], tmp_path / "searched")
    said = "trainer.auto_batch_size=true: train searches the largest batch each GPU holds"
    assert said in (tmp_path / "searched" / "simulate.md").read_text()
    simulate_in_process(run, tmp_path / "given")
    assert said not in (tmp_path / "given" / "simulate.md").read_text()


def test_a_gpu_count_a_curve_cannot_take_is_said(tmp_path):
    """simulate.world_sizes: a count the layout does not split into had been left out of
    simulate.png without a word; simulate.md names it and why."""
    from parallab.commands import simulate_in_process

    simulate_in_process([*GPT, "parallel=tp", "parallel.world_size=4", "cluster=h100",
                         "simulate.world_sizes=[2,4,6,8]"], tmp_path)
    said = (tmp_path / "simulate.md").read_text()
    assert "simulate.world_sizes: 2 GPUs left out of tp(T4)" in said
    assert "simulate.world_sizes: 6 GPUs left out of" in said and "8 GPUs left out" not in said


def test_a_measured_run_that_timed_no_step_is_said_so(tmp_path, caplog):
    """simulate.measured: a short run's metrics.json (every step within
    trainer.timing_skip_steps) had been called a file parallab did not write."""
    from parallab.simulate import run

    (tmp_path / "short").mkdir()
    (tmp_path / "short" / "metrics.json").write_text(json.dumps(
        {"steps": 5, "world_size": 1, "samples_per_sec": None, "step_time_ms": None}))
    assert run._measured(str(tmp_path)) == []
    assert "metrics.json is a run that timed no step (each within " \
        "trainer.timing_skip_steps); left out" in caplog.text
