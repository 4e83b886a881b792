"""Batches of any structure and models as they are written: dict samples (model(**batch)),
models that return (logits, loss) or a dict, and a step's loss that is the mean over every
valid label of the global batch however the batch is cut (in-process: one device and
accumulation; across ranks and layouts: test_transformers.py)."""

from __future__ import annotations

import math
import time

import pytest
import torch
from conftest import REPO, losses, scalars

from parallab import batch as batches
from parallab.cli import train_in_process
from parallab.config.errors import ConfigError

OWN = REPO / "examples" / "own_model"
LLAMA = REPO / "examples" / "hf_llama"
VERSES = ["experiment=llama", "device=cpu", "trainer.log_every_n_steps=1",
          "data.train.size=256", "data.eval.size=96", "trainer.max_steps=6",
          "model.config.num_hidden_layers=1"]


@pytest.fixture(autouse=True)
def projects_on_path(monkeypatch):
    monkeypatch.syspath_prepend(str(OWN))
    monkeypatch.syspath_prepend(str(LLAMA))


def llama(run_dir, *overrides: str) -> dict:
    return train_in_process([*VERSES, *overrides], run_dir, LLAMA / "conf")


def waves(run_dir, *overrides: str) -> dict:
    return train_in_process(["experiment=waves", "device=cpu", "trainer.max_steps=12",
                             "trainer.log_every_n_steps=1", "data.train.size=256",
                             "data.eval.size=128", *overrides], run_dir, OWN / "conf")


def test_batch_structures_are_walked_as_they_are():
    pair = (torch.zeros(4, 3), torch.arange(4))
    named = {"input_ids": torch.zeros(4, 5, dtype=torch.long),
             "labels": torch.tensor([[1, 2, -100, -100, -100]] * 4)}
    assert batches.rows(pair) == 4 and batches.rows(named) == 4
    assert batches.labels_of(named) is named["labels"] and batches.labels_of(pair) is pair[1]
    assert set(batches.inputs_of(named)) == {"input_ids"}
    assert int(batches.tokens(named)) == 8 and batches.seq_len(named) == 5
    padded = batches.pad_rows(batches.take(pair, 3), 4)
    assert torch.equal(padded[0][3], pair[0][0]) and batches.rows(padded) == 4


def test_outputs_give_their_loss_and_logits():
    logits, loss = torch.randn(2, 3), torch.tensor(0.5)
    from transformers.modeling_outputs import CausalLMOutput

    for output in ((logits, loss), {"logits": logits, "loss": loss},
                   CausalLMOutput(loss=loss, logits=logits)):
        assert batches.loss_in(output) is loss and batches.logits_in(output) is logits
    assert batches.loss_in((logits, None)) is None and batches.loss_in(logits) is None


@pytest.mark.slow
def test_padded_labels_give_one_loss_however_the_steps_batch_is_cut(tmp_path):
    """Verses are padded (-100 labels) to different lengths: a step of 16 = 2 micro-batches
    of 8 gives the same losses as one of 16 (the mean over the step's valid labels), where
    the mean of the two halves' means would not; eval_loss does not depend on the eval
    batch size."""
    whole = llama(tmp_path / "whole", "data.batch_size=16", "data.eval_batch_size=96")
    halves = llama(tmp_path / "halves", "data.batch_size=8",
                   "trainer.accumulate_grad_batches=2", "data.eval_batch_size=7")
    assert losses(tmp_path / "halves") == pytest.approx(losses(tmp_path / "whole"), rel=1e-5)
    assert halves["eval_loss"] == pytest.approx(whole["eval_loss"], rel=1e-6)
    # what would differ: the two halves' valid labels differ in number, so their means
    # averaged are not the step's mean
    from hf_llama.data import Verses

    labels = Verses(seq_len=64, size=16).labels[:, 1:]  # the counted (shifted) labels
    counts = (labels != -100).sum(1)
    assert counts[:8].sum() != counts[8:].sum()


@pytest.mark.slow
def test_a_batch_with_no_label_to_learn_from_is_skipped_not_nan(tmp_path, caplog):
    metrics = llama(tmp_path, "data.train._target_=own_parts.HalfIgnored",
                    "~data.train.seq_len", "~data.train.size", "data.batch_size=1",
                    "trainer.max_steps=16", "trainer.epochs=1")
    skipped = scalars(tmp_path, "train/skipped_steps")[-1][1]
    assert skipped == 8 and metrics["steps"] == 16  # the 8 even samples, one step each
    assert all(math.isfinite(v) for v in losses(tmp_path)) and math.isfinite(
        metrics["train_loss"])
    said = [r.message for r in caplog.records if "no label of its global batch" in r.message]
    assert len(said) == 8


def test_a_training_set_with_no_label_to_learn_from_is_refused_before_launch(tmp_path):
    with pytest.raises(ConfigError, match=r"every label of the first \d+ training samples is "
                                          r"-100 \(ignored\), so the run would train on nothing"):
        llama(tmp_path, "data.train._target_=own_parts.AllIgnored", "~data.train.seq_len",
              "~data.train.size", "trainer.max_steps=2")


@pytest.mark.slow
@pytest.mark.parametrize("model", ["NextTokenModel", "MeanLossModel"])
def test_a_model_written_as_nanogpt_trains_with_its_own_loss(tmp_path, model):
    """forward(idx, targets) -> (logits, loss), as written: its own loss, whose mean over a
    micro-batch is weighted by the micro-batch's labels (2 x 4 = 8); so too a forward(idx,
    labels, **kwargs) returning its mean, which is given no num_items_in_batch."""
    run = ["model=gpt", "data=bytes", "data.seq_len=32", f"model._target_=own_parts.{model}",
           "~model.context", "~model.layers", "~model.heads", "~model.width", "~model.dropout",
           "~model.tie_embeddings", "~model.moe", "trainer.max_steps=20",
           "trainer.log_every_n_steps=1",
           "device=cpu", "optim=adam", "optim.lr=0.01", "loss=model"]
    whole = train_in_process([*run, "data.batch_size=8"], tmp_path / "whole")
    train_in_process([*run, "data.batch_size=4", "trainer.accumulate_grad_batches=2"],
                     tmp_path / "halves")
    assert losses(tmp_path / "halves") == pytest.approx(losses(tmp_path / "whole"), rel=1e-5)
    assert losses(tmp_path / "whole")[-1] < losses(tmp_path / "whole")[0] - 0.5
    assert math.isfinite(whole["eval_loss"]) and "eval_accuracy" not in whole


@pytest.mark.slow
@pytest.mark.distributed
def test_a_rank_whose_eval_batch_is_only_padding_runs_the_sharded_forward_too(tmp_path):
    """Three eval sequences on two fsdp ranks, one a batch: rank 1's second batch is sampler
    padding, and its forward's all-gather is the one rank 0 waits in (before: a deadlock until
    backend.timeout_s). The eval loss counts the three real sequences once each."""
    run = ["model=gpt", "data=bytes", "data.seq_len=32", "model._target_=own_parts.NextTokenModel",
           "~model.context", "~model.layers", "~model.heads", "~model.width", "~model.dropout",
           "~model.tie_embeddings", "~model.moe", "trainer.max_steps=2", "device=cpu", "loss=model",
           "data.eval_fraction=2.56e-05", "data.eval_batch_size=1", "backend.timeout_s=60"]
    started = time.monotonic()
    sharded = train_in_process([*run, "parallel=fsdp", "parallel.world_size=2",
                                "data.batch_size=4"], tmp_path / "fsdp")
    assert time.monotonic() - started < 50
    one = train_in_process([*run, "data.batch_size=8"], tmp_path / "one")
    assert sharded["eval_loss"] == pytest.approx(one["eval_loss"], rel=1e-5)


@pytest.mark.slow
def test_dict_samples_reach_the_forward_by_name(tmp_path):
    dicts = ["data.train._target_=own_parts.DictWaves", "data.eval._target_=own_parts.DictWaves",
             "model._target_=own_parts.DictScorer", "~model.out_features", "~model.width",
             "~model.depth", "~model.expansion", "parallel.stages=null"]
    own = waves(tmp_path / "own", *dicts, "loss=auto")  # its dict's "loss": the model's own
    # a user's loss gets the output as returned, and reads it
    waves(tmp_path / "mse", *dicts, "loss._target_=own_parts.prediction_mse")
    assert "eval_accuracy" not in own and len(losses(tmp_path / "own")) == 12
    # one objective, read two ways: the same steps
    assert losses(tmp_path / "own") == pytest.approx(losses(tmp_path / "mse"), rel=1e-5)


BAD = [
    (["data.train._target_=own_parts.DictWaves", "data.eval._target_=own_parts.DictWaves"],
     "data: a batch holds 'features', 'labels', and the model's forward takes x, not "
     "'features', 'labels'"),
    (["loss=model"], "loss=model gives the forward the targets, but ResMLP.forward takes x "
                     "alone"),
    (["loss=model", "model._target_=own_parts.TakesTargetsReturnsScores", "~model.out_features",
      "~model.width", "~model.depth", "~model.expansion", "parallel.stages=null"],
     "loss=model: the model returns tensor of shape (2, 1), with no loss in it"),
    (["model._target_=own_parts.DictScorer", "~model.out_features", "~model.width",
      "~model.depth", "~model.expansion", "parallel.stages=null", "loss=mse",
      "data.train._target_=own_parts.DictWaves", "data.eval._target_=own_parts.DictWaves"],
     "the model returns dict with keys prediction: no logits to score"),
]


@pytest.mark.parametrize("overrides,message", BAD, ids=[" ".join(o) for o, _ in BAD])
def test_a_model_and_data_that_do_not_fit_are_one_line(overrides, message, tmp_path):
    with pytest.raises(ConfigError) as error:
        waves(tmp_path, *overrides)
    assert message in str(error.value) and "\n" not in str(error.value)
