"""Bad input refused before any worker starts, in one line naming the key and the fix:
each group's values, an interface gloo cannot use, data that cannot download, a checkpoint
to resume that is missing, cut short or another model's, a key the schema lacks."""

from __future__ import annotations

import re

import pytest
from conftest import checked, typed

from parallab.checks import validate


@pytest.mark.parametrize("overrides,message", [
    (["data.batch_size=0"], "data.batch_size=0"),
    (["data.batch_size=-8"], "data.batch_size=-8"),
    (["data.eval_batch_size=0"], "data.eval_batch_size=0"),
    (["trainer.epochs=-1"], "trainer.epochs=-1"),
    (["trainer.epochs=0"], "trainer.epochs=0 is out of range: it must be >= 1"),
    (["trainer.max_steps=0"], "trainer.max_steps=0"),
    (["trainer.log_every_n_steps=0"], "trainer.log_every_n_steps=0"),
    (["optim.lr=0"], "optim.lr=0"),
    (["optim=adamw", "optim.lr=-1e-3"], "optim.lr=-0.001"),
    (["optim.weight_decay=-1"], "optim.weight_decay=-1"),
    (["model.dropout=1.0"], "model.dropout=1.0"),
    (["parallel.world_size=2"], "parallel=none runs one"),
    (["parallel=ddp", "parallel.world_size=0"], "parallel.world_size=0"),
    (["parallel=ddp", "parallel.world_size=3", "parallel.nnodes=2"], "parallel.nnodes=2"),
    (["parallel=ddp", "parallel.threads_per_worker=0"], "parallel.threads_per_worker=0"),
    (["parallel=ddp", "parallel.max_restarts=-1"], "parallel.max_restarts=-1"),
    (["backend=nccl"], "backend=nccl needs CUDA"),
    (["backend=mpi"], "built without MPI"),
    (["backend.timeout_s=0"], "backend.timeout_s=0"),
    (["device=cuda"], "device=cuda"),
    (["parallel=ddp", "parallel.devices=[0,1]"], "parallel.devices"),
    (["data=synthetic", "data.shape=[3,32,32]"],
     "data=synthetic gives samples of shape [3, 32, 32]"),
    (["data=synthetic", "data.num_classes=20"], "model.num_classes=10"),
    (["data=synthetic", "data.train_size=0"], "data.train_size=0"),
    (["data.root=/nonexistent/mnist"], "data.root=/nonexistent/mnist"),
    (["seed=-1"], "seed=-1"),
    (["trainer.quantize=int4"], "trainer.quantize=int4"),
    (["trainer.accumulate_grad_batches=0"], "trainer.accumulate_grad_batches=0"),
    (["trainer.clip_grad_norm=0"], "trainer.clip_grad_norm=0"),
    (["trainer.activation_checkpointing=some"], "trainer.activation_checkpointing=some is "
                                                "unknown: use none, full, selective or "
                                                "selective_alternate"),
    (["trainer.activation_checkpointing_every=0"],
     "trainer.activation_checkpointing_every=0 is out of range"),
    (["trainer.monitor_mode=up"], "trainer.monitor_mode=up is unknown: use min or max"),
    (["trainer.early_stop_patience=0"], "trainer.early_stop_patience=0 is out of range"),
    (["trainer.monitor=eval_acc"], "trainer.monitor=eval_acc is not a figure this run reports"),
    (["parallel=tp", "parallel.world_size=2"], "parallel.tp=2: MnistCNN declares no "
                                                 "tensor-parallel plan"),
    (["parallel=hsdp", "parallel.world_size=4", "parallel.dp_replicate=3"],
     "parallel.dp_replicate=3, parallel.dp_shard=null, parallel.tp=1 multiply to 3 x ?"),
    (["model=gpt", "data=bytes", "parallel=fsdp_tp", "parallel.world_size=4",
      "model.heads=2", "parallel.tp=4", "parallel.dp_shard=1"],
     "parallel.tp=4 does not divide model.heads=2"),
    (["model=gpt", "data=bytes", "parallel=hsdp", "parallel.world_size=4",
      "parallel.sequence_parallel=true"], "parallel.sequence_parallel=true cuts a "
                                          "tensor-parallel group's activations: it needs "
                                          "parallel.tp > 1"),
    (["model=gpt", "data=bytes", "parallel=tp", "parallel.world_size=2",
      "parallel.regather_in_backward=true"], "parallel.regather_in_backward=true gathers again "
                                             "what sequence parallelism gathers, and there is "
                                             "none: it needs parallel.sequence_parallel=true "
                                             "(or set it false)"),
    (["model=gpt", "data=bytes", "parallel=ddp", "parallel.world_size=2",
      "parallel.regather_in_backward=true"], "it needs parallel.sequence_parallel=true and "
                                             "parallel.tp > 1 (or set it false)"),
    (["model=gpt", "data=bytes", "parallel=tp", "parallel.world_size=2",
      "parallel.sequence_parallel=true", "parallel.regather_in_backward=true",
      "trainer.compile=true"], "parallel.regather_in_backward=true with trainer.compile=true"),
    (["model=mlp", "data=synthetic", "parallel=tp", "parallel.world_size=2",
      "parallel.sequence_parallel=true"],
     "the plan of MLP (MLP.tp_plan()) takes no sequence_parallel argument"),
    (["model=gpt", "data=bytes", "data.seq_len=33", "model.context=64", "parallel=tp",
      "parallel.world_size=2", "parallel.sequence_parallel=true"],
     "parallel.tp=2 ranks, which data.seq_len=33 does not divide by"),
    (["model=gpt", "data=bytes", "model.tie_embeddings=true", "parallel=model"],
     "parallel=model puts stages 0 and 5 on different devices, but they share a parameter"),
    (["precision.name=fp4"], "precision.name=fp4 is unknown"),
    (["precision=fp8"], "precision=fp8 trains the Linear layers in float8, which pays on a "
                        "CUDA GPU"),
    (["precision=fp8", "trainer.quantize=dynamic_int8"], "trainer.quantize=dynamic_int8 with "
                                                         "precision=fp8"),
    (["precision=fp8", "precision.fp8_recipe=blockwise"], "precision.fp8_recipe=blockwise is "
                                                          "not one of torchao's float8 recipes"),
    (["precision=bf16", "precision.fp8_all_gather=true"], "precision.fp8_all_gather=true with "
                                                          "precision=bf16"),
    (["precision=fp8", "precision.fp8_recipe=rowwise", "precision.fp8_all_gather=true"],
     "FSDP2 gathers float8 weights with tensorwise scales only"),
    (["precision=fp8", "precision.fp8_all_gather=true"], "this layout shards over no ranks"),
    (["precision=bf16", "precision.reduce_dtype=float16"], "precision.reduce_dtype=float16 is "
                                                           "not a dtype data-parallel ranks"),
    (["trainer.memory_snapshot=true"], "trainer.memory_snapshot=true records CUDA's caching "
                                       "allocator, and device=cpu has none"),
    (["trainer.on_nan=ignore"], "trainer.on_nan=ignore"),
    (["trainer.warmup_steps=0.1"], "trainer.warmup_steps=0.1 is renamed: "
                                   "trainer.timing_skip_steps leaves the first steps out of "
                                   "throughput figures, scheduler.warmup_steps warms the "
                                   "learning rate up"),
    (["trainer.eval_every_n_steps=0"], "trainer.eval_every_n_steps=0 is out of range"),
    (["+logger.mine._target_=nowhere.Logger"], "logger.mine._target_=nowhere.Logger does not "
                                               "import"),
    (["logger=csv", "+logger.csv.rows=3"], "logger.csv.rows is not an argument of "
                                           "parallab.observe.loggers.csv_file.CSVLogger"),
    (["trainer.keep_last_k=0"], "trainer.keep_last_k=0"),
    (["trainer.checkpoint_every_n_steps=0"], "trainer.checkpoint_every_n_steps=0"),
    (["parallel=dp", "backend=nccl"], "backend=nccl needs CUDA"),
    (["parallel=pipeline", "parallel.world_size=1"], "needs at least 2 ranks"),
    # a V's two parts on its one rank: counted as 2 parts, and told so
    (["parallel=pipeline", "parallel.world_size=1", "parallel.schedule=zbv"],
     "parallel.world_size=1: parallel=pipeline needs at least 2 ranks, each holding its parts"),
    (["parallel=pipeline", "parallel.world_size=2", "parallel.pp=1"],
     "parallel.pp=1 (parallel.world_size=2 over parallel.dp_replicate=2): parallel=pipeline "
     "needs at least 2 ranks"),
    (["trainer.overwrite=true", "trainer.resume=auto"], "trainer.overwrite=true starts "
     "afresh, deleting the run dir's checkpoints, and trainer.resume=auto continues from them"),
    # a checkpoint elsewhere, which overwrite would not delete
    (["trainer.overwrite=true", "trainer.resume=/elsewhere/last.pt"],
     "trainer.resume=/elsewhere/last.pt continues the run it saved: drop one"),
    (["parallel=pipeline", "parallel.world_size=4"], "is 4 parts, more than the 3 stages"),
    (["parallel=pipeline", "parallel.world_size=4", "parallel.pp=3"],
     "parallel.dp_replicate=null, parallel.dp_shard=1, parallel.pp=3, parallel.tp=1 multiply "
     "to 3 x ?, but "
     "parallel.world_size=4"),
    (["parallel=pipeline", "parallel.world_size=4", "parallel.dp_replicate=3"],
     "parallel.dp_replicate=3, parallel.dp_shard=1, parallel.pp=null, parallel.tp=1 multiply "
     "to 3 x ?"),
    (["parallel=pipeline", "parallel.world_size=4", "parallel.dp_replicate=4"],
     "parallel.pp=1 (parallel.world_size=4 over parallel.dp_replicate=4): parallel=pipeline "
     "needs at least 2"),
    (["parallel=model", "parallel.split=[1,2]"], "parallel.split=[1, 2] gives 3 parts"),
    (["parallel=model", "parallel.split=[3]"], "parallel.split=[3] must be increasing"),
    (["parallel=pipeline", "parallel.microbatches=3"], "parallel.microbatches=3"),
    (["parallel=pipeline", "parallel.world_size=4", "parallel.tp=2"],
     "parallel.tp=2: MnistCNN declares no tensor-parallel plan"),
    (["parallel=pipeline", "parallel.world_size=4", "parallel.pp=3", "parallel.tp=2"],
     "parallel.dp_replicate=null, parallel.dp_shard=1, parallel.pp=3, parallel.tp=2 multiply "
     "to 6 x ?"),
    (["parallel=pipeline", "parallel.microbatches=1"], "parallel.microbatches=1"),
    (["parallel=pipeline", "parallel.schedule=zb"], "parallel.schedule=zb"),
    (["parallel=model", "trainer.auto_batch_size=true"], "trainer.auto_batch_size=true"),
    (["model=mlp", "model.input_dim=100"], "model.input_dim=100"),
    (["model=mlp", "model.hidden=[64,0]"], "model.hidden=[64, 0] holds a width < 1"),
    (["model=gpt", "data=bytes", "model.heads=0"], "model.heads=0 is out of range"),
    (["model=lstm", "data=text", "model.num_layers=0"], "model.num_layers=0 is out of range"),
    (["+model.layers=4"], "model.layers is not an argument of parallab.models.mnist_cnn.Mnist"),
    (["model.num_classes=ten"], "model.num_classes='ten' is not of type int"),
    (["loss=mse"], "loss=mse compares outputs of shape (2, 10) with targets of shape (2,)"),
    (["loss=bce_with_logits"], "loss=bce_with_logits compares outputs"),
    (["data.loader=memory", "data=cifar10", "data.augment=true"], "data.augment=true"),
    (["optim.momentum=1.0"], "optim.momentum=1.0 is out of range"),
    (["optim.momentum=-0.1"], "optim.momentum=-0.1 is out of range"),
    (["optim.momentum=0", "optim.nesterov=true"], "optim.nesterov=true needs momentum"),
    (["optim=adam", "optim.betas=[0.9]"], "optim.betas=[0.9] must be two values"),
    (["optim=adam", "optim.betas=[0.9,1.0]"], "optim.betas=[0.9, 1.0] must be two values"),
    (["optim=adam", "optim.eps=0"], "optim.eps=0.0 is out of range"),
    (["optim.implementation=fast"], "optim.implementation=fast is unknown: use auto, foreach, fused or for_loop"),
    (["scheduler=cosine", "scheduler.min_lr_ratio=1.5"], "scheduler.min_lr_ratio=1.5 is out of range"),
    (["scheduler=step", "scheduler.step_size=0"], "scheduler.step_size=0 is out of range"),
    (["scheduler=step", "scheduler.gamma=0"], "scheduler.gamma=0.0 is out of range"),
    (["scheduler.warmup_steps=-1"], "scheduler.warmup_steps=-1.0 is out of range"),
    (["trainer.activation_checkpointing_every=2"], "trainer.activation_checkpointing_every=2 with trainer.activation_checkpointing=none: it says which stages"),
    (["data=bytes"], "model=mnist_cnn takes images, but data=bytes holds token ids: use model=gpt"),
    (["model=mlp", "data=text"], "model=mlp takes numeric features, but data=text holds token ids: use model=lstm or model=gpt"),
    # the world size given, not the 1 a null is on a CPU (where auto ranks none alone)
    (["parallel=auto"], "rank them with `parallab simulate parallel=auto parallel.world_size=N cluster=NAME`"),
    (["scheduler.min_lr_ratio=0.1"], "scheduler.min_lr_ratio=0.1 is read by scheduler=cosine or linear or wsd, and scheduler=constant ignores it"),
    (["scheduler=cosine", "scheduler.gamma=0.5"], "scheduler.gamma=0.5 is read by scheduler=step, and scheduler=cosine ignores it"),
    (["scheduler=linear", "scheduler.decay_steps=0.5"], "scheduler.decay_steps=0.5 is read by scheduler=wsd"),
    (["scheduler.name=triangle"], "scheduler.name=triangle is unknown"),
    (["optim.scale_lr=cubic"], "optim.scale_lr=cubic is unknown: use none, linear or sqrt"),
    (["optim.base_batch_size=0"], "optim.base_batch_size=0 is out of range"),
    (["optim.lr=inf"], "optim.lr=inf is out of range"),
    (["optim.weight_decay=nan"], "optim.weight_decay=nan"),
    (["trainer.compile_mode=fastest"], "trainer.compile_mode=fastest is not a torch.compile"),
    (["trainer.compile_backend=inductr"], "trainer.compile_backend=inductr is not a torch"),
    # set without trainer.compile=true: nothing compiled, the key ignored without a word
    (["trainer.compile_mode=max-autotune"], "trainer.compile_mode=max-autotune without "
     "trainer.compile=true"),
    (["trainer.compile_backend=aot_eager"], "trainer.compile_backend=aot_eager without "
     "trainer.compile=true"),
    (["precision.fp8_recipe=rowwise"], "precision.fp8_recipe=rowwise with precision=fp32: it "
     "scales float8 matmuls"),
    (["scheduler=cosine", "scheduler.warmup_steps=1.5"], "scheduler.warmup_steps=1.5 is no "
     "whole number of optimizer steps"),
    (["seed=9223372036854775808"], "seed=9223372036854775808 is out of range"),
    (["backend.timeout_s=1e9"], "backend.timeout_s=1000000000.0 is out of range"),
    (["backend.timeout_s=0.01"], "backend.timeout_s=0.01 is out of range"),
    (["parallel=ddp", "parallel.bucket_cap_mb=0"], "parallel.bucket_cap_mb=0.0"),
    # where no replicas read it (fsdp), a bad size is still the user's error
    (["parallel=fsdp", "parallel.bucket_cap_mb=-3"], "parallel.bucket_cap_mb=-3.0 is out"),
    (["parallel=pipeline", "parallel.world_size=2", "model=gpt", "data=bytes",
      "parallel.bucket_cap_mb=-1"], "parallel.bucket_cap_mb=-1.0 is out of range: it must "
                                    "be > 0 (MiB of the replicas' gradients"),
    (["data=synthetic", "data.shape=[1,0,28]"], "data.shape=[1, 0, 28] must be sizes >= 1"),
    (["data.prefetch_factor=2"], "data.prefetch_factor=2 applies to DataLoader workers"),
    (["data.persistent_workers=true"], "data.persistent_workers=True applies to DataLoader"),
    (["parallel=ddp", "parallel.world_size=2", "data=synthetic", "data.train_size=256",
      "trainer.accumulate_grad_batches=3"],
     "trainer.accumulate_grad_batches=3 is more than the 2 batches an epoch of the data gives "
     "each rank"),
    # a pipeline drops a short batch: 4 samples give no batch of 8 (no accumulation helps)
    (["model=gpt", "data=tokens", "data.train_size=4", "data.batch_size=8", "parallel=pipeline",
      "parallel.world_size=2"], "an epoch of the data gives each rank no full batch of "
     "data.batch_size=8: lower data.batch_size, or give the data more samples"),
    # the key the user set, not the per-rank batch it sets
    (["model=gpt", "data=tokens", "data.train_size=4", "data.global_batch_size=8",
      "parallel=pipeline", "parallel.world_size=2"],
     "an epoch of the data gives each rank no full batch of data.global_batch_size=8 (8 per "
     "rank): lower data.global_batch_size, or give"),
    (["parallel=tp", "parallel.world_size=2", "model=mlp", "data=synthetic",
      "data.train_size=256", "trainer.epochs=1", "scheduler=cosine",
      "scheduler.warmup_steps=4"],
     "scheduler.warmup_steps=4.0 is 4 steps, the whole run of 4: leaves no step past the "
     "warmup"),
    (["parallel=ddp", "parallel.world_size=2", "model=mlp", "data=synthetic",
      "data.train_size=640", "trainer.epochs=2", "scheduler=constant",
      "scheduler.warmup_steps=12"],  # the rate it reports would never be reached
     "scheduler.warmup_steps=12.0 is 12 steps, the whole run of 10"),
    (["data.global_batch_size=0"], "data.global_batch_size=0 is out of range: it is the "
                                   "samples of each step, >= 1"),
    (["data.global_batch_size=8", "trainer.auto_batch_size=true"],
     "data.global_batch_size=8 fixes the samples of each step, which "
     "trainer.auto_batch_size=true would change: drop one of them"),
    # not the given batch per rank set over without a word
    (["data.global_batch_size=16", "data.batch_size=4"],
     "data.batch_size is given with data.global_batch_size=16, which sets the batch per "
     "rank itself"),
    (["parallel=pipeline", "parallel.world_size=2", "model=gpt", "data=bytes",
      "data.global_batch_size=30"],
     "data.global_batch_size=30 (30 per rank) does not split into parallel.microbatches=4 "
     "equal micro-batches: use a multiple of 4, or parallel.microbatches=3 or 5"),
    (["parallel=tp", "parallel.world_size=2", "model=gpt", "data=bytes", "parallel.tp_plan={}"],
     "parallel.tp_plan={} is not a plan"),  # not the model's own plan without a word
    (["parallel=tp", "parallel.world_size=2", "model=gpt", "data=bytes",
      "parallel.tp_plan=colwise"], "parallel.tp_plan=colwise is not a plan"),
    (["parallel=tp", "parallel.world_size=2", "model=gpt", "data=bytes",
      "parallel.tp_plan=[colwise,rowwise]"], "parallel.tp_plan=[colwise, rowwise] is not a plan"),
    # not the worker's traceback (FSDP2's NotImplementedError for a non-contiguous weight)
    (["experiment=mnist_fast", "parallel=fsdp"],
     "trainer.channels_last=true with parallel=fsdp (dp_shard=2): FSDP2 shards contiguous "
     "parameters only"),
    (["trainer.channels_last=true", "parallel=pipeline", "parallel.world_size=4",
      "parallel.dp_shard=2", "parallel.dp_replicate=1"],
     "trainer.channels_last=true with parallel=pipeline (dp_shard=2)"),
    (["trainer.channels_last=true", "parallel=pipeline", "parallel.world_size=2"],
     "trainer.channels_last=true with parallel=pipeline: the parts send their activations"),
])
def test_bad_values_fail_naming_the_key(overrides, message):
    """Checked in-process, as validate.prepare runs in the controller."""
    with pytest.raises(validate.ConfigError) as error:
        validate.prepare(typed(*overrides, "device=cpu") if "device=cuda" not in overrides
                         else typed(*overrides), in_place=None)
    text = str(error.value)
    assert message in text and "\n" not in text


def test_gloo_told_to_use_an_interface_this_machine_lacks_is_refused_before_launch(
        monkeypatch):
    """An inherited GLOO_SOCKET_IFNAME naming no interface here: one line before any rank
    starts (launched, every rank failed to connect, each with its traceback); one that
    exists passes, and a run of one process, which uses no gloo, is not held to it."""
    ddp = ["parallel=ddp", "parallel.world_size=2", "device=cpu"]
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "lo,eth9")
    with pytest.raises(validate.ConfigError) as refused:
        checked(*ddp)
    assert str(refused.value).startswith("GLOO_SOCKET_IFNAME=lo,eth9 names no interface of "
                                         "this machine (eth9; it has ")
    checked("device=cpu")
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "lo")
    checked(*ddp)


def test_download_that_cannot_connect_names_root_and_files(tmp_path, monkeypatch):
    from torchvision.datasets import MNIST

    monkeypatch.setattr(MNIST, "mirrors", ["http://127.0.0.1:9/"])  # nothing listens there
    cfg = typed(f"data.root={tmp_path}", "data.download=true", "device=cpu")
    with pytest.raises(validate.ConfigError) as error:
        validate.prepare(cfg, in_place=None)
    text = str(error.value)
    assert f"data.root={tmp_path}" in text and "train-images-idx3-ubyte" in text
    assert "data.download=true" in text and "\n" not in text


def test_resume_refuses_missing_truncated_and_foreign_checkpoints(tmp_path):
    import torch

    good = tmp_path / "good.pt"
    model_cfg = {"_target_": "parallab.models.mnist_cnn.MnistCNN", "num_classes": 10,
                 "dropout": 0.5}
    torch.save({"model": {}, "optimizer": {}, "epoch_step": 0, "config": {"model": model_cfg}},
               good)
    truncated = tmp_path / "truncated.pt"
    truncated.write_bytes(good.read_bytes()[:100])
    cases = {
        str(tmp_path / "missing.pt"): "no such file",
        str(truncated): "not a readable checkpoint",
    }
    for path, message in cases.items():
        with pytest.raises(validate.ConfigError, match=message):
            validate.prepare(typed(f"trainer.resume={path}", "device=cpu"), in_place=None)
    with pytest.raises(validate.ConfigError, match="resume with the same model config"):
        validate.prepare(typed(f"trainer.resume={good}", "model.dropout=0.1", "device=cpu"),
                         in_place=None)
    validate.prepare(typed(f"trainer.resume={good}", "device=cpu"), in_place=None)


@pytest.mark.parametrize("kept_kb", [5, 20, 50])
def test_a_checkpoint_cut_short_is_one_line_wherever_it_is_cut(tmp_path, kept_kb):
    """Cut in the middle of its zip's records, torch's reader raised an OSError (Errno 22)."""
    import torch

    from parallab.training import checkpoint

    whole = tmp_path / "whole.pt"
    torch.save({"model": {"w": torch.zeros(64, 1024)}, "step": 1}, whole)  # 256 KB
    cut = tmp_path / "cut.pt"
    cut.write_bytes(whole.read_bytes()[:kept_kb * 1024])
    with pytest.raises(checkpoint.CheckpointError, match=r"is not a readable checkpoint, "
                                                         r"truncated or corrupt") as error:
        checkpoint.load(cut)
    assert "\n" not in str(error.value)


@pytest.mark.parametrize("override,message", [
    ("+trainer.max_step=5", "trainer has no key 'max_step' (did you mean trainer.max_steps?)"),
    ("+seedx=1", "the config has no key 'seedx' (did you mean seed?)"),
    ("++optim.momentun=0.9", "optim has no key 'momentun' (did you mean optim.momentum?)"),
])
def test_a_plus_key_the_schema_lacks_is_refused_not_dropped(override, message):
    from parallab.cli import compose
    from parallab.config.hydra_app import typed_config

    with pytest.raises(validate.ConfigError, match=re.escape(message)):
        typed_config(compose([override]), [override])
    typed_config(compose(["+model.extra=1"]), ["+model.extra=1"])  # a model argument: its check


def test_a_projects_own_option_without_its_schema_is_one_line(tmp_path):
    """A project's optim/NAME.yaml that does not extend a schema composed as a plain mapping,
    and the run ended in an AttributeError; with the schema's default first, it is taken."""
    (tmp_path / "optim").mkdir()
    mine = tmp_path / "optim" / "adamw.yaml"
    mine.write_text("name: adamw\nlr: 0.123\n")
    with pytest.raises(validate.ConfigError, match=re.escape(
            "optim: the option composed is a plain mapping, not typed by a schema of "
            "parallab's: begin your optim/NAME.yaml with `defaults: [/schema/optim/SCHEMA@"
            "_here_, _self_]`")):
        checked("optim=adamw", "device=cpu", config_dir=tmp_path)
    # one of its schema's keys given too: Hydra refuses it first, as a key its mapping lacks
    from parallab.config.hydra_app import hydra_line

    with pytest.raises(Exception) as refused:
        checked("optim=adamw", "optim.weight_decay=0.1", config_dir=tmp_path)
    assert "begin your optim/NAME.yaml with `defaults: [/schema/optim/" in \
        hydra_line(refused.value)
    mine.write_text("defaults:\n  - /schema/optim/adamw@_here_\n  - _self_\nname: adamw\n"
                    "lr: 0.123\n")
    cfg, _ = checked("optim=adamw", "device=cpu", config_dir=tmp_path)
    assert cfg.optim.lr == 0.123


def test_threads_are_weighed_against_the_cores_only_where_each_rank_is_a_process(
        monkeypatch, caplog):
    """parallel=dp runs its replicas in one process: no contention of workers to warn of;
    one thread each for more workers than cores is null's share too, not warned of."""
    monkeypatch.setattr(validate, "cpu_cores", lambda: 2)
    for name, threads, warned in (("ddp", 2, True), ("dp", 2, False), ("ddp", 1, False)):
        caplog.clear()
        with caplog.at_level("WARNING", logger="parallab.checks.validate"):
            checked(f"parallel={name}", "parallel.world_size=4",
                    f"parallel.threads_per_worker={threads}", "device=cpu")
        assert ("more threads than the 2 cores here: they will contend (null gives each its "
                "share, 1)" in caplog.text) is warned, (name, threads)


@pytest.mark.parametrize("fix, kept", [
    ("give a file such as /data/model.bin", True),  # a path's model.bin is no model key
    ("the weights in model.pt are float16", True),
    ("set model.context=64 or data.seq_len<=32", False),  # the data fix stands, said so
])
def test_evaluates_refusal_keeps_a_fix_it_takes(fix, kept):
    """A check's fix is said in evaluate.py's words only where every key it names is one
    evaluate.py refuses: a file's name is kept, and a fix it takes beside one it refuses
    is kept with what it cannot take said; the refusal's class (and status) is kept."""
    from parallab.checks.evaluating import _as_evaluate_says
    from parallab.config.errors import NothingFits

    said = _as_evaluate_says(NothingFits(f"data.seq_len=64 is too long: {fix}", 1), "c.pt")
    assert type(said) is NothingFits and said.status == 1
    assert str(said) == f"data.seq_len=64 is too long: {fix}" + (
        "" if kept else " (evaluate.py takes no model, trainer or layout key)")
    assert "evaluate.py builds the model" in str(
        _as_evaluate_says(NothingFits("x: set model.context=64", 1), "c.pt"))
