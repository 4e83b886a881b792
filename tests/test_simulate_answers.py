"""parallab simulate's answer as a user gets it: the cluster presets, parallel=auto's ranked
layouts and their commands (which train takes as printed), the sbatch lines, and its
refusals in one line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import output
from test_simulate import GPT, configured

from parallab.config.errors import ConfigError
from parallab.parallel.layout import Layout
from parallab.testing import REPO, run_entry


@pytest.mark.parametrize("name", sorted(p.stem for p in (REPO / "conf" / "cluster").glob("*.yaml")))
def test_every_cluster_preset_composes_and_is_sound(name):
    from parallab.simulate import cluster

    cfg = configured(f"cluster={name}")
    assert cfg.cluster.name == name and cluster.problem(cfg.cluster) is None
    if cfg.cluster.gpu != cluster.THIS:
        rates = cluster.Rates.of(cfg.cluster)
        assert rates.peaks["bf16"] > 1e14 and 0 < rates.matmul_efficiency <= 1
        assert cfg.cluster.source  # each names where its figures come from


def test_a_gpu_the_table_does_not_list_needs_its_cluster_yaml_alone():
    """A cluster's own peak_tflops stand for gpus.yaml's entry: a GPU it does not list is
    priced at them (fp16 at bf16's rate where not given), and the preset's peaks are the
    table's, the same that train's MFU reads."""
    import torch

    from parallab.observe import mfu
    from parallab.simulate import cluster

    own = configured("cluster.gpu=MI300X", "+cluster.peak_tflops={bf16: 1307.4, fp32: 163.4}")
    assert cluster.problem(own.cluster) is None
    rates = cluster.Rates.of(own.cluster)
    assert rates.peaks["bf16"] == rates.peaks["fp16"] == pytest.approx(1307.4e12)
    assert rates.fp32_peak(tf32=True) == pytest.approx(163.4e12)
    preset = cluster.Rates.of(configured("cluster=h100").cluster)
    assert preset.peaks["bf16"] == mfu.peak_flops("NVIDIA H100 80GB HBM3", torch.bfloat16)
    # a listed GPU's own peaks each over its entry's, the rest kept
    added = cluster.Rates.of(configured("cluster=a100", "+cluster.peak_tflops.fp8=624").cluster)
    assert added.peaks["fp8"] == pytest.approx(624e12)
    assert added.peaks["bf16"] == mfu.peak_flops("NVIDIA A100-SXM4-80GB", torch.bfloat16)
    clocked = cluster.Rates.of(configured("cluster=h100", "+cluster.peak_tflops={bf16: 900}")
                               .cluster)
    assert clocked.peaks["bf16"] == clocked.peaks["fp16"] == pytest.approx(900e12)
    assert clocked.peaks["fp8"] == preset.peaks["fp8"]


def test_auto_ranks_every_layout_and_writes_its_answer(tmp_path):
    from parallab.commands import simulate_in_process

    answer = simulate_in_process([*GPT, "parallel=auto", "parallel.world_size=4",
                                  "data.batch_size=2", "cluster=a100",
                                  "cluster.gpus_per_node=2"], tmp_path)
    found = json.loads((tmp_path / "simulate.json").read_text())["layouts"]
    fits = [e for e in found if e["fits"]]
    assert fits and found[:len(fits)] == fits  # those that fit first, fastest first
    speeds = [e["tokens_per_sec_per_gpu"] for e in fits]
    assert speeds == sorted(speeds, reverse=True)
    kinds = {e["layout"].split("(")[0] for e in found}
    assert {"ddp", "fsdp", "hsdp", "fsdp_tp", "pipeline"} <= kinds
    best = fits[0]
    assert set(best) >= {"command", "tokens_per_sec_per_gpu", "step_time_s", "mfu",
                         "memory_per_gpu_gb", "fits", "parts"}
    assert best["command"] == answer["command"] and "parallel=auto" not in best["command"]
    assert best["command"].startswith("parallab train data=tokens model=gpt")
    assert sum(best["parts"].values()) == pytest.approx(best["step_time_s"])
    assert "#SBATCH --nodes=2" in answer["sbatch"] and "#SBATCH --gpus-per-node=2" in \
        answer["sbatch"]
    said = (tmp_path / "simulate.md").read_text()
    assert best["layout"] in said and "srun --kill-on-bad-exit=1 parallab train" in said
    small = best["memory_per_gpu_gb"]  # a small size to two figures: not 0.0 beside 0.0
    assert small < 0.1 and f"| {small:.2g} | yes |" in said and "| 0.0 |" not in said
    assert (tmp_path / "simulate.png").stat().st_size > 0
    # none that train refuses: a zero-bubble schedule's split backward checkpointed selectively
    split = [e for e in found if any(f"parallel.schedule={s} " in e["command"]
                                     for s in ("interleaved_zb", "zbv", "dualpipev"))]
    assert split and not [e for e in split if "=selective" in e["command"]]
    # the command of the fastest of each kind passes train's checks as it is printed
    import shlex

    from conftest import checked

    for kind in sorted(kinds):
        first = next(e for e in found if e["layout"].startswith(kind + "(") and e["fits"])
        words = shlex.split(first["command"])
        assert words[:2] == ["parallab", "train"]
        cfg, layout = checked(*words[2:], "device=cpu")
        assert layout.world_size == 4 and cfg.parallel.name == kind


def test_a_forward_that_reads_its_values_is_one_line(tmp_path):
    """A user's forward asserting on its token ids' values cannot run on fake tensors: one
    line saying so, not the fake tensor's traceback from inside the trace."""
    from parallab.commands import simulate_in_process

    with pytest.raises(ConfigError, match="^CheckedLM's forward reads its tensors' values "
                       r"\(aten._local_scalar_dense.default: an assert on them"):
        simulate_in_process(["model._target_=own_parts.CheckedLM", "~model.num_classes",
                             "~model.dropout", "data.vocab_size=64", "data.seq_len=32",
                             "parallel=fsdp", "parallel.world_size=4"], tmp_path)


def test_a_model_whose_stages_are_made_on_each_call_is_simulated_without_checkpointing(
        tmp_path):
    """A user's model whose stages() wraps a layer in a module made on each call: no
    checkpointed layout offered (train refuses one), the reason in the notes, its blocks
    the ones the model holds."""
    from parallab.commands import simulate_in_process

    simulate_in_process(["model._target_=own_parts.LooseStagesLM", "~model.num_classes",
                         "~model.dropout", "data.vocab_size=64", "data.seq_len=32",
                         "parallel=auto", "parallel.world_size=4"], tmp_path)
    found = json.loads((tmp_path / "simulate.json").read_text())["layouts"]
    assert found and all("activation_checkpointing=none" in e["command"] for e in found)
    assert "No activation checkpointing: trainer.activation_checkpointing=full: the " \
        "model's stages() gives Sequential, no submodule of the model" in \
        (tmp_path / "simulate.md").read_text()
    with pytest.raises(ConfigError, match="^trainer.activation_checkpointing=selective: the "
                       "model's stages.. gives Sequential, no submodule of the model"):
        simulate_in_process(["model._target_=own_parts.LooseStagesLM", "~model.num_classes",
                             "~model.dropout", "data.vocab_size=64", "data.seq_len=32",
                             "parallel=fsdp", "parallel.world_size=4",
                             "trainer.activation_checkpointing=selective"], tmp_path / "given")


def test_auto_splits_a_users_model_by_the_tensor_parallel_plan_given(tmp_path):
    """A user's model with no plan of its own: parallel=auto takes parallel.tp_plan as the
    mesh and the pipeline do, predicts its tp layouts (without it they carry the reason),
    and prints the plan in their commands alone, which train's checks pass as printed."""
    import shlex

    from conftest import checked

    from parallab.commands import simulate_in_process

    own = ["model._target_=own_parts.LooseStagesLM", "~model.num_classes", "~model.dropout",
           "data.vocab_size=64", "data.seq_len=32", "parallel=auto", "parallel.world_size=2"]
    plan = "parallel.tp_plan={blocks.*.0:colwise_rep}"
    for given, out in (([], "none"), ([plan], "given")):
        simulate_in_process([*own, *given], tmp_path / out)
    found = {out: json.loads((tmp_path / out / "simulate.json").read_text())["layouts"]
             for out in ("none", "given")}
    split = {out: [e for e in found[out] if "parallel.tp=1 " not in e["command"]]
             for out in found}
    assert split["none"] and not any(e["fits"] for e in split["none"])
    fitting = [e for e in split["given"] if e["fits"]]
    assert fitting and all(shlex.quote(plan) in e["command"] for e in split["given"])
    assert not any("tp_plan" in e["command"] for e in found["given"] if e not in split["given"])
    cfg, layout = checked(*shlex.split(fitting[0]["command"])[2:], "device=cpu")
    assert layout.tp > 1 and cfg.parallel.tp_plan == {"blocks.*.0": "colwise_rep"}


def test_auto_prices_and_carries_the_layout_keys_given(tmp_path):
    """parallel=auto takes the keys of the layouts it ranks, as the mesh and the pipeline
    do: the replicas' buckets (the smaller, the more all-reduces, each its latency) and
    FSDP's resharding (weights kept gathered to backward: more held), each priced and
    carried in the commands of the layouts that take it, which train's checks pass as
    printed."""
    import shlex

    from conftest import checked

    from parallab.commands import simulate_in_process

    auto = [*GPT, "model.layers=4", "parallel=auto", "parallel.world_size=2",
            "data.batch_size=2", "cluster=a100"]  # 4 blocks: more than FSDP's 2 gathered
    given = ["parallel.bucket_cap_mb=0.01", "parallel.reshard_after_forward=false"]
    for keys, out in (([], "default"), (given, "given")):
        simulate_in_process([*auto, *keys], tmp_path / out)
    found = {out: json.loads((tmp_path / out / "simulate.json").read_text())["layouts"]
             for out in ("default", "given")}

    def one(out: str, preset: str) -> dict:
        return next(e for e in found[out] if f"parallel={preset} " in e["command"] and
                    "accumulate_grad_batches=1 " in e["command"] and
                    "activation_checkpointing=none" in e["command"])

    assert one("given", "ddp")["parts"]["all_reduce_s"] > \
        one("default", "ddp")["parts"]["all_reduce_s"]
    assert one("given", "fsdp")["memory_gb"]["gathered"] > \
        one("default", "fsdp")["memory_gb"]["gathered"]
    meshes = [e for e in found["given"] if "parallel=pipeline" not in e["command"]]
    assert meshes and all(all(k in e["command"] for k in given) for e in meshes)
    pipelines = [e for e in found["given"] if e not in meshes]
    assert pipelines and not any("reshard" in e["command"] for e in pipelines)
    assert not any("bucket_cap_mb" in e["command"] for e in found["default"])
    for preset in ("ddp", "fsdp"):
        cfg, _ = checked(*shlex.split(one("given", preset)["command"])[2:], "device=cpu")
        assert cfg.parallel.bucket_cap_mb == 0.01 and not cfg.parallel.reshard_after_forward
    cfg, _ = checked(*shlex.split(pipelines[0]["command"])[2:], "device=cpu")
    assert cfg.parallel.bucket_cap_mb == 0.01


def test_auto_carries_which_blocks_are_checkpointed_only_where_some_are(tmp_path):
    """trainer.activation_checkpointing_every with auto: the layouts that checkpoint carry
    it; those that do not, where train refuses it, leave it out, and pass train's checks
    as printed."""
    import shlex

    from conftest import checked

    from parallab.commands import simulate_in_process

    every = "trainer.activation_checkpointing_every=2"
    simulate_in_process([*GPT, "model.layers=4", "parallel=auto", "parallel.world_size=2",
                         "data.batch_size=2", "cluster=a100",
                         "trainer.activation_checkpointing=full", every], tmp_path)
    found = json.loads((tmp_path / "simulate.json").read_text())["layouts"]
    # the mode given is spanned, and said so (it had been dropped without a word)
    assert "parallel=auto weighs every mode for each layout" in \
        (tmp_path / "simulate.md").read_text()
    plain = [e for e in found if "activation_checkpointing=none" in e["command"]]
    saving = [e for e in found if e not in plain]
    assert plain and saving and all(every in e["command"] for e in saving)
    assert not any(every in e["command"] for e in plain)
    cfg, _ = checked(*shlex.split(plain[0]["command"])[2:], "device=cpu")
    assert cfg.trainer.activation_checkpointing == "none"


def test_auto_leaves_out_the_tied_pipelines_train_refuses():
    """Tied embeddings under a V (its first and last part on one rank) whose parts are
    sharded apart (dp_shard > 1): train refuses it (FSDP2 holds a parameter in one root),
    so the grid marks it with train's reason; interleaved parts (the two on different
    ranks, a copy each), one part a rank, or no shards, it takes."""
    from conftest import checked

    from parallab.parallel.schedules import SCHEDULES
    from parallab.simulate import Facts, search

    cfg = configured(*GPT, "model.tie_embeddings=true", "parallel=auto",
                     "parallel.world_size=4", "data.batch_size=4", "cluster=h100")
    grid = [c for c in search.grid(cfg, Facts.of(cfg), 4) if c.layout.pp > 1]
    refused = [c for c in grid if c.layout.dp_shard > 1 and
               SCHEDULES[c.layout.schedule].v_shape]
    assert refused and all("share a parameter (tied weights)" in c.reason for c in refused)
    taken = [c for c in grid if c not in refused and not c.reason and c.layout.dp_shard > 1
             and c.layout.stages_per_rank > 1]
    assert taken
    with pytest.raises(ConfigError, match=r"share a parameter \(tied weights\)"):
        checked(*GPT, "model.tie_embeddings=true", "data=tokens", *refused[0].overrides,
                "device=cpu")
    checked(*GPT, "model.tie_embeddings=true", "data=tokens", *taken[0].overrides, "device=cpu")


def test_a_learned_position_table_shorter_than_the_sequence_is_refused(tmp_path):
    """The example's GPT-2 (64 learned positions) at data.seq_len=1024: refused as train
    refuses it, not predicted with a command that then fails."""
    from parallab.commands import simulate_in_process

    with pytest.raises(ConfigError, match=r"^data.seq_len=1024 is longer than the model's 64 "
                       r"learned positions \(model.config.n_positions\)"):
        simulate_in_process(["model=my_gpt2", "data.seq_len=1024", "data.vocab_size=256",
                             "parallel=fsdp",
                             "parallel.world_size=8"], tmp_path,
                            config_dir=REPO / "examples" / "hf_llama" / "conf")


@pytest.mark.parametrize("model", ["mnist_cnn", "resnet18"])
def test_a_model_of_images_is_told_simulate_traces_sequences(tmp_path, model):
    """Told at once, not sent round data keys (data.shape, data=cifar10) that simulate then
    refuses in turn."""
    from parallab.commands import simulate_in_process

    name = {"mnist_cnn": "MnistCNN", "resnet18": "ResNet18"}[model]
    with pytest.raises(ConfigError, match="^parallab simulate traces a language model's "
                       f"block on token sequences, which {name} does not take"):
        simulate_in_process([f"model={model}", "parallel=fsdp", "parallel.world_size=8"],
                            tmp_path)


def test_a_projects_data_of_no_sequences_is_named_by_its_class(tmp_path):
    """Not as data=datasets, the kind of config it is, which is no option to choose."""
    from parallab.commands import simulate_in_process

    with pytest.raises(ConfigError, match=r"^data.train._target_=own_model.data.Waves holds no "
                                          r"sequences \(no data.seq_len\)"):
        simulate_in_process(["data=waves", "model=gpt", "parallel=fsdp", "parallel.world_size=8"],
                            tmp_path, config_dir=REPO / "examples" / "own_model" / "conf")


@pytest.mark.parametrize("overrides, says", [
    (["cluster.hbm_gbps=-1"], "cluster.hbm_gbps=-1.0 is out of range: it must be > 0"),
    # infinite or vanishing rates: no step of infinite seconds, no Infinity in JSON
    (["cluster.op_overhead_us=inf"], "cluster.op_overhead_us=inf is out of range: give a "
                                     "finite rate"),
    (["cluster.hbm_gbps=1e-320"], "cluster.hbm_gbps=1e-320 is out of range"),
    (["cluster.hbm_gbps=null"], "cluster.hbm_gbps=null: only cluster.gpu=this measures"),
    (["cluster.memory_gb=???"], "cluster.memory_gb is missing: set it"),
    (["cluster.gpu=RTX-9090"], "cluster.gpu=RTX-9090 is not in observe/gpus.yaml's peak FLOP/s"),
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


def test_a_pipelines_accumulated_passes_are_each_priced_and_said(tmp_path):
    """Layout.accumulation apart from a pipeline's micro-batches: each of a step's passes
    runs the schedule (its compute, sends and idle slots) on its share of the batch, and
    its sharded parts are gathered and reduced at each flush, as torch's stages do; the
    memory stays one pass's, and the command says both, which train takes."""
    import dataclasses
    import shlex

    from conftest import checked

    from parallab.commands import simulate_in_process
    from parallab.parallel.grid import Candidate
    from parallab.simulate import Predict

    cfg = configured(*GPT, "cluster=h100", "precision=bf16")
    judge = Predict(cfg.cluster)
    for shards in (1, 2):
        one = Candidate(Layout.planned(2 * shards, dp_shard=shards, pp=2, schedule="1f1b",
                                       microbatches=2, batch_size=4), cfg=cfg)
        two = Candidate(dataclasses.replace(one.layout, accumulation=2, batch_size=8), cfg=cfg)
        once, twice = judge.of(one), judge.of(two)
        each = ("compute_s", "bubble_s", "p2p_s", *(("all_gather_s", "reduce_scatter_s")
                                                    if shards > 1 else ()))
        for part in each:
            assert twice.parts[part] == pytest.approx(2 * once.parts[part]), part
        assert twice.parts["optimizer_s"] == once.parts["optimizer_s"]  # once a step
        assert twice.memory == once.memory
    said = two.overrides
    assert {"parallel.microbatches=2", "trainer.accumulate_grad_batches=2",
            "data.batch_size=4"} <= set(said) and "accum2" in two.label
    answer = simulate_in_process([*GPT, "parallel=pipeline", "parallel.world_size=4",
                                  "parallel.pp=2", "parallel.dp_shard=2",
                                  "parallel.dp_replicate=1", "parallel.microbatches=2",
                                  "trainer.accumulate_grad_batches=2"], tmp_path)
    assert "trainer.accumulate_grad_batches=2" in answer["command"]
    ran, layout = checked(*shlex.split(answer["command"])[2:], "device=cpu")
    assert layout.pp == 2 and ran.trainer.accumulate_grad_batches == 2


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
