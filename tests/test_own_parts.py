"""A user's own model, data, loss and metrics by _target_: what each one gets, in-process, and
every bad one refused in one line before any worker starts."""

from __future__ import annotations

import logging
from typing import Optional

import pytest
import torch
from conftest import REPO, checked, losses

from parallab.cli import train_in_process
from parallab.config.errors import ConfigError
from parallab.parallel import stages

CONF = REPO / "examples" / "own_model" / "conf"
WAVES = ["experiment=waves", "device=cpu", "trainer.max_steps=12", "trainer.epochs=1",
         "trainer.log_every_n_steps=1", "data.train.size=512", "data.eval.size=256"]


@pytest.fixture(autouse=True)
def project_on_path(monkeypatch):
    monkeypatch.syspath_prepend(str(CONF.parent))


def train(run_dir, *overrides: str) -> dict:
    return train_in_process([*WAVES, *overrides], run_dir, CONF)


# the example's ResMLP keys, left out for a model of tests/own_parts.py
OWN_REGRESSOR = ["~model.out_features", "~model.width", "~model.depth", "~model.expansion",
                 "parallel.stages=null"]
BAD = [
    (["model._target_=own_model.nope.Net"], "model._target_=own_model.nope.Net does not import"),
    (["model._target_=own_model.data.Waves"], "is not a torch.nn.Module"),
    (["+model.widht=3"], "model.widht is not an argument of own_model.model.ResMLP"),
    (["~model.in_features"], "model.in_features is required by own_model.model.ResMLP"),
    (["model.width=wide"], "model.width='wide' is not of type int"),
    (["model.in_features=5"], "model: its forward fails on a batch of the data"),
    (["data.train._target_=own_model.data.Nope"], "data.train._target_=own_model.data.Nope "
                                                  "does not import"),
    (["data.train._target_=own_model.model.Block"], "is not a torch Dataset"),
    (["+data.train.sise=3"], "data.train.sise is not an argument of own_model.data.Waves"),
    (["data.train.size=0"], "data.train is empty"),
    (["+data._target_=own_model.data.Waves"], "is not a data set config"),
    (["data.loader=memory"], "data.loader=memory: data=datasets gives torch Datasets"),
    (["data.collate_fn=own_model.data.nope"], "data.collate_fn=own_model.data.nope does not"),
    (["parallel=pipeline", "parallel.stages=[inp,body,out]"], "parallel.stages names 'body', "
                                                              "which is not a submodule"),
    (["parallel=pipeline", "parallel.stages=[inp,out]"], "runs the model as its stages in "
                                                         "order (parallel.stages), but"),
    (["parallel=model", "parallel.stages=null"], "this model declares none: set "
                                                 "parallel.stages"),
    (["loss._target_=torch.nn.functional.mse_loss", "+loss.reduction=none"], "not a scalar"),
    (["loss=cross_entropy"], "loss: "),
    (["loss._target_=own_model.losses.nope"], "loss._target_=own_model.losses.nope does not"),
    (["+loss.sharpness=2"], "loss.sharpness is not an argument of parallab.loss.MSE"),
    (["+metrics.mae._target_=torchmetrics.Nope"], "metrics.mae._target_=torchmetrics.Nope"),
    # its figure would have replaced the run's eval_loss (and best.pt's choice), silently
    (["+metrics.loss._target_=torchmetrics.MeanAbsoluteError"],
     "metrics.loss would report as eval_loss, the run's own figure"),
    (["model._target_=own_parts.MisplannedRegressor", "~model.out_features", "~model.width",
      "~model.depth", "~model.expansion", "parallel.stages=null", "parallel=tp",
      "parallel.world_size=2"],
     "the tensor-parallel plan (MisplannedRegressor.tp_plan()) names middle, which is not a "
     "module of MisplannedRegressor"),
    # a function without _partial_ was called with nothing: "make it return a number"
    (["+metrics.half._target_=own_parts.half_mse"],
     "metrics.half._target_=own_parts.half_mse is a function, which is called on each batch "
     "as (output, targets): give it +metrics.half._partial_=true"),
    (["+metrics.s._target_=own_parts.text_metric", "+metrics.s._partial_=true"],
     "metrics.s: ValueError: could not convert string to float: 'good' on a batch of the "
     "model's output: make it return a number"),
    (["objective=eval_accuracy"], "objective=eval_accuracy is not a figure this run reports"),
    (["trainer.monitor=eval_accuracy"], "trainer.monitor=eval_accuracy is not a figure this "
                                        "run reports (eval_loss"),
    (["+metrics.mae._target_=torchmetrics.MeanAbsoluteError", "trainer.monitor=eval_mae"],
     "trainer.monitor=eval_mae: say whether higher is better with trainer.monitor_mode=max"),
    (["parallel.stages=null", "trainer.activation_checkpointing=full"],
     "trainer.activation_checkpointing=full: the model declares no stages"),
    (["model._target_=own_parts.WrappedStages", "~model.out_features", "~model.width",
      "~model.depth", "~model.expansion", "parallel.stages=null",
      "trainer.activation_checkpointing=full"],
     "trainer.activation_checkpointing=full: the model's stages() gives Sequential, no "
     "submodule of the model, which it cannot wrap in a parent's place"),
    (["model._target_=own_parts.FrozenRegressor", *OWN_REGRESSOR],
     "model._target_=own_parts.FrozenRegressor has no parameter that takes a gradient"),
    # its own check's failure, named as its own, not a traceback
    (["model._target_=own_parts.FailingCheck", *OWN_REGRESSOR],
     "model._target_=own_parts.FailingCheck: its check_data(cfg, data) raised "
     "AttributeError:"),
    (["optim.name=rmsprop"], "optim.name=rmsprop is not an optimizer parallab builds"),
    (["data.collate_fn=own_parts.collate_nothing"],
     "data.collate_fn=own_parts.collate_nothing fails on 2 samples (TypeError:"),
    # constructors' own refusals: Hydra's two lines for the loss, the metric's said as its
    # call's on a batch with the cause lost
    (["loss._target_=own_parts.RefusingInit"], "loss: own_parts.RefusingInit(...) raised "
                                               "ValueError: scale=1.0 is not allowed"),
    (["+metrics.m._target_=own_parts.RefusingInit"], "metrics.m: own_parts.RefusingInit(...) "
                                                     "raised ValueError: scale=1.0 is not"),
    # a value against its annotation, as a model's is checked (it had raised in the
    # constructor, or not at all)
    (["data.train.size=abc"], "data.train.size='abc' is not of type int, as "
                              "own_model.data.Waves declares: give an int"),
    (["loss._target_=own_parts.RefusingInit", "+loss.scale=big"],
     "loss.scale='big' is not of type int or float"),
    (["loss=model", "model._target_=own_parts.SelfScoring", "~model.out_features",
      "~model.width", "~model.depth", "~model.expansion", "parallel=pipeline",
      "parallel.stages=[net.0,net.1,net.2]"],
     "loss=model with parallel=pipeline"),
]


@pytest.mark.parametrize("overrides,message", BAD, ids=[" ".join(o) for o, _ in BAD])
def test_bad_own_parts_are_one_line(overrides, message, caplog):
    with caplog.at_level(logging.INFO), pytest.raises(ConfigError) as error:
        checked(*WAVES, *overrides, config_dir=CONF)
    assert message in str(error.value) and "\n" not in str(error.value)
    # the one line is the whole story: no library's own error logged before it
    assert not [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]


def test_an_optional_argument_is_checked_however_its_type_is_written():
    """`int | None` as `Optional[int]`: a value of neither type refused in one line, a
    null and a number taken (an `X | None` annotation was not checked at all)."""
    from parallab.config import targets

    def net(width: int | None = None, rate: Optional[float] = None) -> None:
        pass

    for key, value, wanted in (("width", "wide", "int or NoneType"),
                               ("rate", "fast", "int or float or NoneType")):
        with pytest.raises(ConfigError, match=rf"^model.{key}='{value}' is not of type "
                                              rf"{wanted}, as "):
            targets.check_types(net, {key: value}, "model")
    targets.check_types(net, {"width": None, "rate": 1}, "model")
    targets.check_types(net, {"width": 3, "rate": None}, "model")


def test_stages_come_from_the_config_a_method_or_a_sequential():
    from own_model.model import ResMLP
    from own_parts import sequential

    model = ResMLP(8, 1, depth=3)
    named = stages.find(model, ["inp", "blocks.*", "out"])
    assert named == [model.inp, *model.blocks, model.out]
    assert stages.chain_differs(model, named, torch.randn(2, 8)) is None
    assert "something else" in stages.chain_differs(model, [model.inp, model.out],
                                                    torch.randn(2, 8))
    assert stages.find(model) is None  # no stages() and not a Sequential
    chain = sequential()
    assert stages.find(chain) == list(chain.children())


def test_a_module_list_named_stages_and_an_own_check_data_are_the_models_business():
    """An attribute `stages` (a ModuleList) is no stages() method, and a check_data taking
    the instance no classmethod: parallab reads neither (fsdp called the ModuleList, and the
    check was called with the config for its self)."""
    from own_parts import StagesList

    assert stages.find(StagesList()) is None
    cfg, layout = checked(*WAVES, "model._target_=own_parts.StagesList", *OWN_REGRESSOR,
                          "parallel=fsdp", "parallel.world_size=2", config_dir=CONF)
    assert layout.dp_shard == 2 and cfg.model["_target_"] == "own_parts.StagesList"


def test_a_collate_fn_of_data_held_in_memory_is_refused():
    """Data held in memory is sliced into batches: its collate_fn was dropped without a
    word; the DataLoader path collates with it."""
    collate = "data.collate_fn=own_parts.collate_nothing"
    with pytest.raises(ConfigError, match=f"^{collate}: data=synthetic is held in memory"):
        checked("data=synthetic", collate, "device=cpu")
    with pytest.raises(ConfigError, match=f"^{collate} fails on 2 samples"):
        checked("data=synthetic", collate, "data.loader=dataloader", "device=cpu")


def test_a_data_set_failing_in_the_loaders_workers_ends_the_run_at_once(tmp_path):
    """The failure reaches the run from a DataLoader worker: the run ends with it. The
    workers ignored SIGTERM (a stop is the trainer's), which multiprocessing's exit handler
    sends its children before it waits for them: the ended run waited for good."""
    from conftest import run_entry

    done = run_entry("train.py", ["--config-dir", str(CONF), *WAVES,
                                  "data.train._target_=own_parts.FailsPastTwo",
                                  "data.loader=dataloader", "data.num_workers=2"],
                     tmp_path / "run", timeout=120,
                     env={"PYTHONPATH": f"{REPO / 'tests'}:{CONF.parent}"})
    said = done.stdout + done.stderr
    assert done.returncode == 1 and "ValueError: sample" in said, said[-2000:]


@pytest.mark.slow
def test_metrics_by_target_and_the_objective(tmp_path):
    metrics = train(tmp_path, "+metrics.mae._target_=torchmetrics.MeanAbsoluteError",
                    "+metrics.half._target_=own_parts.half_mse", "+metrics.half._partial_=true",
                    "objective=eval_mae")
    assert "eval_accuracy" not in metrics
    assert metrics["eval_half"] == pytest.approx(metrics["eval_loss"] / 2, rel=1e-4)
    assert 0 < metrics["eval_mae"] ** 2 <= metrics["eval_loss"] * 1.0001  # MAE^2 <= MSE


@pytest.mark.slow
def test_a_loss_function_with_bound_arguments(tmp_path):
    train(tmp_path / "mse")
    mse = losses(tmp_path / "mse")
    train(tmp_path / "half", "loss._target_=own_parts.half_mse", "+loss.scale=0.5")
    # Adam's step does not depend on the loss's scale, so the losses are exactly halved
    assert losses(tmp_path / "half") == pytest.approx([v / 2 for v in mse], rel=1e-3)


@pytest.mark.slow
def test_a_model_that_returns_its_own_loss(tmp_path):
    metrics = train(tmp_path, "loss=model", "model._target_=own_parts.SelfScoring",
                    "~model.out_features", "~model.width", "~model.depth", "~model.expansion",
                    "trainer.max_steps=40", "trainer.epochs=3")
    assert metrics["eval_loss"] < 1.0 and "eval_accuracy" not in metrics
    steps = losses(tmp_path)
    assert len(steps) == 40 and sum(steps[-5:]) < sum(steps[:5])


@pytest.mark.slow
def test_a_sequential_model_trains_under_pipeline(tmp_path):
    sequential = ["model._target_=own_parts.sequential", "~model.out_features",
                  "~model.depth", "~model.expansion", "parallel.stages=null",
                  "data.global_batch_size=32"]
    train(tmp_path / "none", *sequential)
    train(tmp_path / "pipe", *sequential, "parallel=pipeline", "parallel.world_size=2")
    assert losses(tmp_path / "pipe") == pytest.approx(losses(tmp_path / "none"), abs=1e-4)


@pytest.mark.slow
def test_fsdp_without_stages_shards_the_root_and_says_so(tmp_path):
    metrics = train(tmp_path, "parallel=fsdp", "parallel.world_size=2", "parallel.stages=null")
    assert metrics["parallel"] == "fsdp" and metrics["steps"] == 8  # 512 / 64 a step
    # said once, by the worker, in the run's log
    assert (tmp_path / "train.log").read_text().count("sharded as one unit") == 1


STREAM = ["data.train._target_=own_parts.WaveStream", "~data.train.size", "~data.eval.size",
          "+data.train.size=512", "+data.eval.size=256", "data.global_batch_size=64",
          "trainer.epochs=2", "trainer.max_steps=14"]


@pytest.mark.slow
@pytest.mark.distributed
def test_a_stream_is_shared_by_the_ranks_in_turn(tmp_path):
    """Rank r takes samples r, r + 2, ...: two ranks see, step by step, the 64 samples one
    device sees, so the losses match; an epoch is 8 steps (512 / 64), the second reshuffled."""
    one = train(tmp_path / "one", *STREAM)
    two = train(tmp_path / "two", *STREAM, "parallel=ddp", "parallel.world_size=2")
    assert one["steps"] == two["steps"] == 14
    assert losses(tmp_path / "two") == pytest.approx(losses(tmp_path / "one"), abs=1e-4)


@pytest.mark.distributed
def test_a_dataset_drawn_from_the_global_generators_is_the_same_on_every_rank(tmp_path):
    """Each rank draws dropout masks from its own seed, but the datasets are made under the
    run's seed on every rank (and in evaluate): two ranks train on the samples one device
    trains on, and another seed draws other samples."""
    drawn = ["data.train._target_=own_parts.DrawnWaves", "data.eval._target_=own_parts.DrawnWaves",
             "data.global_batch_size=64", "trainer.max_steps=8"]
    one = train(tmp_path / "one", *drawn)
    two = train(tmp_path / "two", *drawn, "parallel=ddp", "parallel.world_size=2")
    assert losses(tmp_path / "two") == pytest.approx(losses(tmp_path / "one"), abs=1e-4)
    assert two["eval_loss"] == pytest.approx(one["eval_loss"], abs=1e-4)
    assert train(tmp_path / "other", *drawn, "seed=1")["eval_loss"] != one["eval_loss"]


def test_a_stream_without_length_needs_max_steps():
    with pytest.raises(ConfigError, match="set trainer.max_steps"):
        checked(*WAVES, *STREAM, "+data.train.sized=false", "trainer.max_steps=null",
                config_dir=CONF)


def test_a_checkpoint_trained_on_a_stream_without_length_is_evaluated(tmp_path):
    """evaluate.py trains nothing: the run length such a stream asks of a run is its run's
    (it takes no trainer key to be given one), not refused for want of it."""
    from parallab.commands import evaluate_in_process

    train(tmp_path / "run", *STREAM, "+data.train.sized=false", "trainer.max_steps=2")
    figures = evaluate_in_process([f"ckpt={tmp_path / 'run' / 'checkpoints' / 'last.pt'}",
                                   "device=cpu"], tmp_path / "eval")
    assert figures["eval_loss"] > 0


def test_a_checkpoint_of_a_run_bounded_by_epochs_is_evaluated_on_a_stream(tmp_path):
    """A run bounded by trainer.epochs records no max_steps: evaluated on a stream of no
    known length it is still scored (evaluate.py reads no run length), not refused with a
    fix it cannot take."""
    from parallab.commands import evaluate_in_process

    train(tmp_path / "run", *STREAM, "trainer.max_steps=null", "trainer.epochs=1")
    figures = evaluate_in_process([f"ckpt={tmp_path / 'run' / 'checkpoints' / 'last.pt'}",
                                   "device=cpu", "data.train.sized=false"], tmp_path / "eval")
    assert figures["eval_loss"] > 0


def test_advise_on_a_stream_without_length_asks_for_the_run_length(tmp_path):
    """Its candidates are measured for advise.steps, but the command it recommends trains."""
    from parallab.cli import JobFailed, advise_in_process

    with pytest.raises(JobFailed) as raised:
        advise_in_process([*WAVES, *STREAM, "+data.train.sized=false", "trainer.max_steps=null",
                           "advise.steps=2", "advise.precisions=[fp32]"], tmp_path, CONF)
    assert raised.value.status == 2 and "streams samples with no known length, so the " \
        "command advise recommends needs a run length: set trainer.max_steps" in str(raised.value)


@pytest.mark.slow
def test_a_stream_shorter_than_one_step_is_refused(tmp_path):
    """512 samples in batches of 32 are 16 batches an epoch: a step of 40 would be short."""
    from parallab.cli import JobFailed

    with pytest.raises(JobFailed) as failed:
        train(tmp_path, *STREAM, "+data.train.sized=false", "trainer.max_steps=4",
              "trainer.accumulate_grad_batches=40", "data.global_batch_size=null",
              "data.batch_size=32")
    assert failed.value.status == 2 and str(failed.value) == (
        "trainer.accumulate_grad_batches=40 is more than the 16 batches an epoch of the data "
        "gives each rank: set it to at most 16, or lower data.batch_size")


def test_a_classifier_keeps_its_own_class_count_on_a_users_dataset():
    """A user's Dataset says no class count: the built-in classifiers take model.num_classes
    as set, and ask for it only where it is null."""
    from parallab.models.base import fits_classes

    cfg, _ = checked(*WAVES, config_dir=CONF)
    assert fits_classes({"num_classes": 4}, cfg.data) is None
    assert "model.num_classes=null" in fits_classes({"num_classes": None}, cfg.data)


def test_dataloader_workers_read_a_stream_in_whole_batches():
    """Workers take whole batches of a rank's share in turn: the batches are those of one
    process reading alone, every one full but the last."""
    from own_parts import WaveStream
    from torch.utils.data import DataLoader

    from parallab.data.stream import RankShare

    def batches(workers: int) -> list[list[float]]:
        share = RankShare(WaveStream(300, sized=False), rank=1, world_size=2, batch_size=32)
        return [targets.flatten().tolist() for _, targets in
                DataLoader(share, batch_size=32, num_workers=workers)]

    alone = batches(0)
    assert [len(b) for b in alone] == [32] * 4 + [22]  # 150 samples of rank 1
    assert batches(2) == alone


def test_a_users_module_named_train_is_not_the_checkouts_script(tmp_path):
    """`python train.py` puts the checkout's dir first on sys.path, where its train.py would
    stand for a user's own module of that name (model._target_=train.Net)."""
    from conftest import run_entry

    (tmp_path / "train.py").write_text(
        "from torch import nn\n\n\nclass Net(nn.Sequential):\n"
        "    def __init__(self, hidden: int):\n"
        "        super().__init__(nn.Flatten(), nn.Linear(784, hidden), nn.Linear(hidden, 10))\n")
    done = run_entry("train.py", ["data=mnist", "trainer.max_steps=1", "device=cpu",
                                  "model._target_=train.Net", "~model.dropout",
                                  "~model.num_classes", "+model.hidden=8"],
                     tmp_path / "run", env={"PYTHONPATH": str(tmp_path)}, timeout=120)
    assert done.returncode == 0, (done.stdout + done.stderr)[-2000:]
