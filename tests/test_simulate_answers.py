"""parallab simulate's answer as a user gets it: the cluster presets, parallel=auto's ranked
layouts and their commands (which train takes as printed), a project's own model and data,
and a pipeline's accumulated passes (refusals and the command from a shell:
test_simulate_commands.py)."""

from __future__ import annotations

import json

import pytest
from test_simulate import GPT, configured

from parallab.config.errors import ConfigError
from parallab.parallel.layout import Layout
from parallab.testing import REPO


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
