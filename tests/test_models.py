"""The recipes' models and data: the LSTM text classifier, ResNet-18 fine-tuning, the
shipped text set, and every model x layout x precision (CIFAR-10 and image folders:
test_data.py)."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from conftest import FAST, read_metrics
from omegaconf import OmegaConf
from torch import nn

from parallab.config.hydra_app import CONF_DIR
from parallab.config import targets
from parallab.data import text
from parallab.data.loaders import DataLoaderLoader, MemoryLoader
from parallab.data.mnist import MNIST
from parallab.data.synthetic import Synthetic
from parallab.data.text import Text
from parallab.launching.distributed import Dist
from parallab.models.lstm import LSTMClassifier
from parallab.models.resnet import ResNet18

CPU = Dist(0, 0, 1, 1, torch.device("cpu"), None)
RECIPE_TEXTS, RECIPE_LABELS = ["I love this movie", "This movie is terrible"], [1, 0]


def model_spec(option: str) -> dict:
    """conf/model/<option>.yaml as composed: _target_ and the model's arguments."""
    return OmegaConf.to_container(OmegaConf.load(Path(CONF_DIR) / "model" / f"{option}.yaml"))


def model_args(option: str, **overrides) -> dict:
    """The arguments conf/model/<option>.yaml gives its model (nulls: inferred from the
    data by check_data), with `overrides`: what check_data receives."""
    return {**targets.arguments(model_spec(option)), **overrides}


def write_tsv(folder: Path, rows: list[tuple[object, str]]) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    for name in text.FILES:
        (folder / name).write_text("".join(f"{label}\t{line}\n" for label, line in rows))
    return folder


# --- LSTM recipe -----------------------------------------------------------------------------
def lstm_recipe_training(seed: int) -> list[int]:
    """The LSTM recipe as it runs: its vocabulary, sizes, Adam 1e-3, batch 2 shuffled, 10 epochs."""
    vocab = {"<PAD>": 0, "<UNK>": 1, "I": 2, "love": 3, "this": 4, "movie": 5, "is": 6,
             "terrible": 7}
    ids = [torch.tensor([vocab.get(w, 1) for w in t.split()]) for t in RECIPE_TEXTS]
    torch.manual_seed(seed)
    model = LSTMClassifier(vocab_size=8, embedding_dim=50, hidden_dim=50, num_classes=2)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.001)
    for _ in range(10):
        order = torch.randperm(2).tolist()
        inputs = nn.utils.rnn.pad_sequence([ids[i] for i in order], batch_first=True)
        loss = F.cross_entropy(model(inputs), torch.tensor([RECIPE_LABELS[i] for i in order]))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    model.eval()
    with torch.no_grad():
        return model(nn.utils.rnn.pad_sequence(ids, batch_first=True)).argmax(1).tolist()


def test_the_lstm_recipes_sentences_come_out_right():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a model this small only waits on a second thread
    try:
        for seed in range(5):
            assert lstm_recipe_training(seed) == RECIPE_LABELS, seed
    finally:
        torch.set_num_threads(threads)


def test_padding_changes_nothing():
    torch.manual_seed(0)
    model = LSTMClassifier(vocab_size=20, embedding_dim=8, hidden_dim=12, num_layers=2,
                           num_classes=3).eval()
    short, long = torch.tensor([5, 6, 7]), torch.arange(1, 10)
    alone = model(short[None])
    batch = nn.utils.rnn.pad_sequence([long, short], batch_first=True)  # short padded by 6
    wider = F.pad(batch, (0, 5))  # and 5 more padding columns
    torch.testing.assert_close(model(batch)[1], alone[0])
    torch.testing.assert_close(model(wider), model(batch))
    assert [type(s).__name__ for s in model.stages()] == ["MaskedEmbedding", "PackedLSTM",
                                                          "Sequential"]


def test_vocabulary_is_deterministic_with_pad_unk_min_freq_and_max_size():
    texts = [text.tokenize(t) for t in ["b a a c", "a b d", "e"]]
    assert text.build_vocab(texts) == ["<PAD>", "<UNK>", "a", "b", "c", "d", "e"]
    assert text.build_vocab(texts, min_freq=2) == ["<PAD>", "<UNK>", "a", "b"]
    assert text.build_vocab(texts, max_size=3) == ["<PAD>", "<UNK>", "a"]
    ids = text.encode([["a", "zzz"], ["b", "a", "c"], []], ["<PAD>", "<UNK>", "a", "b"], None, 3)
    assert ids.tolist() == [[2, 1, 0], [3, 2, 1], [1, 0, 0]]
    assert text.tokenize("Heav'n's Fire, O Muse!") == ["heav'n's", "fire", ",", "o", "muse", "!"]
    assert text.class_names(["10", "2", "1"]) == ["1", "2", "10"]


def test_shipped_text_set_and_its_vocabulary(tmp_path):
    cfg = Text()
    found = text.corpus(cfg)
    assert found.classes == ["milton", "shakespeare"]
    assert (len(found.train), len(found.test)) == (8019, 2002)
    assert found.vocab[:2] == ["<PAD>", "<UNK>"] and cfg.vocab_size == len(found.vocab) > 3000
    assert cfg.num_classes == 2 and found.train.prepare(found.train.inputs).dtype == torch.long
    # right padding only, every example at least one token
    inputs = found.train.inputs
    lengths = (inputs != 0).sum(1)
    assert (lengths >= 1).all() and ((inputs != 0).cumsum(1).max(1).values == lengths).all()
    assert Text(path=str(tmp_path)).problem().startswith(
        f"data.path={tmp_path} has no train.tsv or test.tsv")
    (tmp_path / "train.tsv").write_text("no tab here\n")
    (tmp_path / "test.tsv").write_text("")
    assert "train.tsv line 1 is not `label<TAB>text`" in Text(path=str(tmp_path)).problem()


def test_text_on_the_dataloader_path_matches_memory(tmp_path):
    cfg = Text(path=str(write_tsv(tmp_path, [(i % 2, "a b " * (i % 4 + 1))
                                             for i in range(10)])), min_freq=1)
    train, _ = cfg.make(0)
    memory = MemoryLoader(train, CPU, 4, True, 3)
    loader = DataLoaderLoader(train, CPU, 4, True, 3, cfg)
    for (x1, y1), (x2, y2) in zip(memory, loader, strict=True):
        assert x2.dtype == torch.long and torch.equal(x1, x2) and torch.equal(y1, y2)


def test_synthetic_token_sequences_with_labels():
    cfg = Synthetic(vocab_size=50, seq_len=12, train_size=64, eval_size=16, num_classes=3)
    train, test = cfg.make(seed=1)
    assert train.inputs.shape == (64, 12) and test.inputs.shape == (16, 12)
    lengths = (train.inputs != 0).sum(1)
    assert lengths.min() >= 6 and lengths.max() <= 12 and train.inputs.max() < 50
    assert ((train.inputs != 0).cumsum(1).max(1).values == lengths).all()  # right-padded
    assert torch.equal(cfg.make(seed=1)[0].inputs, train.inputs)
    args = model_args("lstm")
    assert cfg.input_shape == [12] and LSTMClassifier.check_data(args, cfg) is None
    assert (args["vocab_size"], args["num_classes"]) == (50, 3)  # inferred from the data
    assert "data.vocab_size=N" in LSTMClassifier.check_data(model_args("lstm"), Synthetic())


# --- ResNet-18 recipe ------------------------------------------------------------------------
@pytest.fixture(scope="module")
def weights(tmp_path_factory) -> tuple[Path, dict[str, torch.Tensor]]:
    """A resnet18 state_dict in torchvision's format, 1000-class fc included."""
    from torchvision.models import resnet18

    torch.manual_seed(123)
    state = resnet18().state_dict()
    path = tmp_path_factory.mktemp("weights") / "resnet18.pth"
    torch.save(state, path)
    return path, state


def test_resnet18_loads_weights_and_replaces_fc(weights):
    from torchvision.models import resnet18

    path, state = weights
    cfg = model_args("resnet18", weights=str(path))
    assert ResNet18.check_data(cfg, Synthetic(shape=[3, 32, 32])) is None
    assert (cfg["num_classes"], cfg["in_channels"]) == (10, 3)
    model = ResNet18(**cfg).eval()
    torch.testing.assert_close(model.stem[0].weight, state["conv1.weight"])
    torch.testing.assert_close(model.layer4[1].bn2.running_var, state["layer4.1.bn2.running_var"])
    assert model.head[-1].out_features == 10
    reference = resnet18(num_classes=10).eval()  # same weights, torchvision's own forward
    reference.load_state_dict({**state, "fc.weight": model.head[-1].weight,
                               "fc.bias": model.head[-1].bias})
    x = torch.randn(2, 3, 32, 32)
    torch.testing.assert_close(model(x), reference(x))


def test_freeze_backbone_trains_only_the_head(weights):
    path, state = weights
    torch.manual_seed(0)
    model = ResNet18(weights=str(path), num_classes=4, in_channels=3,
                     freeze_backbone=True).train()
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert trainable == ["head.2.weight", "head.2.bias"]
    before = {k: v.clone() for k, v in model.state_dict().items()}
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
    F.cross_entropy(model(torch.randn(4, 3, 32, 32)), torch.tensor([0, 1, 2, 3])).backward()
    optimizer.step()
    after = model.state_dict()
    changed = {k for k in before if not torch.equal(before[k], after[k])}
    assert changed == {"head.2.weight", "head.2.bias"}  # BatchNorm statistics kept too


def test_resnet18_weight_errors_name_the_file(tmp_path, monkeypatch):
    data = Synthetic(shape=[3, 32, 32])
    problem = ResNet18.check_data(model_args("resnet18", weights=str(tmp_path / "x.pth")), data)
    assert problem.startswith(f"model.weights={tmp_path / 'x.pth'}: no such file")
    monkeypatch.setattr(torch.hub, "get_dir", lambda: str(tmp_path / "hub"))

    def offline(url, **kwargs):
        raise OSError("network is unreachable")

    monkeypatch.setattr(torch.hub, "load_state_dict_from_url", offline)
    problem = ResNet18.check_data(model_args("resnet18", weights="IMAGENET1K_V1"), data)
    assert str(tmp_path / "hub" / "checkpoints" / "resnet18-f37072fd.pth") in problem
    assert "could not be downloaded" in problem and "\n" not in problem
    assert "neither a file" in ResNet18.check_data(model_args("resnet18", weights="IMAGENET9"),
                                                   data)
    torch.save({"w": torch.zeros(1)}, tmp_path / "other.pt")
    assert "is not a resnet18 state_dict" in ResNet18.check_data(
        model_args("resnet18", weights=str(tmp_path / "other.pt")), data)
    assert "takes images" in ResNet18.check_data(model_args("resnet18"), Text())


def test_resnet18_takes_one_channel_images():
    cfg = model_args("resnet18")
    assert ResNet18.check_data(cfg, MNIST()) is None and cfg["in_channels"] == 1
    assert ResNet18(**cfg)(torch.randn(2, 1, 28, 28)).shape == (2, 10)


# --- end to end ------------------------------------------------------------------------------
def test_the_lstm_recipe_end_to_end_and_evaluate_rebuilds_the_vocabulary(tmp_path, train_here):
    """The LSTM recipe's two sentences through train.py's training as the recipe runs them, then
    evaluate.py (a fresh process: it rebuilds the vocabulary from data.path alone)."""
    data = write_tsv(tmp_path / "recipe", list(zip(RECIPE_LABELS, RECIPE_TEXTS)))
    setting = ["model=lstm", "data=text", f"data.path={data}", "data.min_freq=1",
               "data.lowercase=false", "device=cpu"]
    _, run_dir = train_here(*setting, "model.embedding_dim=50", "model.hidden_dim=50",
                            "optim=adam", "optim.lr=0.001", "data.batch_size=2",
                            "trainer.epochs=10")
    metrics = read_metrics(run_dir)
    assert metrics["eval_accuracy"] == 1.0 and metrics["steps"] == 10
    from parallab.commands import evaluate_in_process

    # the model is the checkpoint's (a model choice would be refused): the data as trained
    evaluate_in_process([*setting[1:], f"ckpt={run_dir}/checkpoints/last.pt"], tmp_path / "eval")
    again = read_metrics(tmp_path / "eval")
    assert again["eval_accuracy"] == 1.0
    assert again["eval_loss"] == pytest.approx(metrics["eval_loss"], rel=1e-5)


def test_missing_image_data_stops_before_any_worker(train_here, tmp_path):
    from parallab.config.errors import ConfigError

    with pytest.raises(ConfigError) as refused:  # in the controller, before the launch
        train_here("model=resnet18", "data=cifar10", f"data.root={tmp_path}", "parallel=ddp",
                   "device=cpu")
    said = str(refused.value)
    assert f"data.root={tmp_path} has no CIFAR-10 files" in said and "\n" not in said
    assert not (tmp_path / "run").exists()


SMOKE = ["trainer.max_steps=2", "trainer.timing_skip_steps=0", "data.train_size=64",
         "data.eval_size=32", "data.batch_size=8", "data.eval_batch_size=32",
         "trainer.checkpoint_every_n_steps=null"]
DATA_FOR = {"mnist_cnn": [], "mlp": [], "resnet18": ["data.shape=[3,32,32]"],
            "convnet": ["data.shape=[3,20,20]"],  # any image size: its last pool is global
            "lstm": ["data.vocab_size=100", "data.seq_len=12"]}
# (layout, precision) each model runs under: one device in both, 2 ranks in the lower one
RUNS = [("none", "fp32"), ("none", "amp"), ("ddp", "amp")]


@pytest.mark.slow
@pytest.mark.parametrize("model", list(DATA_FOR))
def test_every_model_runs_under_none_and_ddp_in_fp32_and_amp(train_here, model):
    """Each model a few steps under none in fp32 and amp (bfloat16 here), and under ddp with
    2 workers in amp."""
    for parallel, precision in RUNS:
        metrics, _ = train_here(*FAST, *SMOKE, f"model={model}", *DATA_FOR[model],
                                f"parallel={parallel}", "parallel.world_size=" + (
                                    "2" if parallel == "ddp" else "1"),
                                f"precision={precision}", name=f"{parallel}-{precision}")
        assert metrics["world_size"] == (2 if parallel == "ddp" else 1)
        assert metrics["precision_dtype"] == ("float32" if precision == "fp32" else "bfloat16")
        assert np.isfinite(metrics["train_loss"]) and 0 <= metrics["eval_accuracy"] <= 1


@pytest.mark.slow
def test_the_fast_mnist_preset_reaches_the_recipes_accuracy_in_one_epoch(train_here):
    """experiment=mnist_fast: the MNIST recipe's ten-epoch accuracy (98.4%) in one epoch
    (bench/bench_speedrun.py times it against the recipe, over five seeds)."""
    metrics, run_dir = train_here("experiment=mnist_fast", "device=cpu")
    assert metrics["eval_accuracy"] >= 0.984, metrics
    assert metrics["steps"] == 469 and metrics["global_batch_size"] == 128
    assert [p.name for p in (run_dir / "checkpoints").iterdir()] == ["last.pt"]


@pytest.mark.parametrize("overrides,refusal", [
    (["data.vocab_size=100", "data.seq_len=12"], "model=convnet takes images (channels, height,"),
    (["model.in_channels=3"], "model.in_channels=3 does not match the 1 channels"),
    (["model.channels=[]"], "model.channels=[] is not a list of block widths"),
    (["data.shape=[1,4,4]", "model.channels=[8,8,8,8]"], "each halving the 4x4 images"),
])
def test_the_convnet_refuses_data_it_cannot_take_in_one_line(overrides, refusal):
    from conftest import checked

    from parallab.config.errors import ConfigError

    with pytest.raises(ConfigError, match=re.escape(refusal)):
        checked("model=convnet", "data=synthetic", *overrides, "device=cpu")
