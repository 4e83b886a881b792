"""Small user parts the tests name by _target_ (this directory is on the tests' path)."""

from __future__ import annotations

import os
import sys

import torch
import torch.nn.functional as F
from torch import nn


class SelfScoring(nn.Module):
    """A regressor whose forward(inputs, targets) returns its own loss (loss=model)."""

    def __init__(self, in_features: int = 8):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(in_features, 32), nn.ReLU(), nn.Linear(32, 1))

    def forward(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return F.mse_loss(self.net(inputs), targets)


class WrappedStages(SelfScoring):
    """Its stages() wraps its layers in a module made on each call: one the model does not
    hold, which activation checkpointing cannot put in a parent's place."""

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        return self.net(inputs)

    def stages(self) -> list[nn.Module]:
        return [nn.Sequential(*self.net)]


class LooseStagesLM(nn.Module):
    """A language model whose stages() wraps its embedding in a module made on each call."""

    def __init__(self, vocab_size: int = 64, width: int = 16, layers: int = 2):
        super().__init__()
        self.emb = nn.Embedding(vocab_size, width)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(width, width), nn.GELU())
                                    for _ in range(layers))
        self.head = nn.Linear(width, vocab_size)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.emb(idx)
        for block in self.blocks:
            x = block(x)
        return self.head(x)

    def stages(self) -> list[nn.Module]:
        return [nn.Sequential(self.emb), *self.blocks, self.head]


def sequential(in_features: int = 8, width: int = 32) -> nn.Sequential:
    """A factory returning an nn.Sequential: its children are its stages."""
    return nn.Sequential(nn.Linear(in_features, width), nn.ReLU(), nn.Linear(width, width),
                         nn.ReLU(), nn.Linear(width, 1))


def half_mse(output: torch.Tensor, targets: torch.Tensor, scale: float = 0.5) -> torch.Tensor:
    """A loss function with an argument bound from the YAML."""
    return scale * F.mse_loss(output, targets)


class TokenCrossEntropy(nn.Module):
    """A loss of one's own that is a module: a language model's next tokens scored."""

    def forward(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())


def gpt_noting_peft(noted: str, **kwargs) -> nn.Module:
    """parallab's gpt, once a line saying which process builds it and whether peft was
    imported in it already (by the fork server a rank was forked from)."""
    from parallab.models.gpt import GPT

    with open(noted, "a") as f:
        f.write(f"{os.getpid()} {'peft' in sys.modules}\n")
    return GPT(**kwargs)


class WaveStream(torch.utils.data.IterableDataset):
    """The example's regression samples as a stream; reshuffled by set_epoch; `sized`: with
    a __len__ (then an epoch's steps are known)."""

    def __init__(self, size: int = 512, seed: int = 0, sized: bool = True):
        from own_model.data import Waves

        self.samples, self.seed, self.epoch = Waves(size, seed=seed), seed, 0
        if sized:
            self.__class__ = SizedWaveStream

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __iter__(self):
        order = torch.randperm(len(self.samples),
                               generator=torch.Generator().manual_seed(self.seed + self.epoch))
        return (self.samples[i] for i in order.tolist())


class SizedWaveStream(WaveStream):
    def __len__(self) -> int:
        return len(self.samples)


class NextTokenModel(nn.Module):
    """A language model written as nanoGPT writes its model: forward(idx, targets=None)
    returns (logits, loss), its loss computed only when given the targets (ignore_index -1),
    and only the last position's logits without them."""

    def __init__(self, vocab_size: int = 256, width: int = 32):
        super().__init__()
        self.embed = nn.Embedding(vocab_size, width)
        self.mix = nn.Linear(width, width)
        self.head = nn.Linear(width, vocab_size)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None):
        logits = self.head(torch.tanh(self.mix(self.embed(idx))))
        if targets is None:
            return logits[:, [-1], :], None
        loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1),
                               ignore_index=-1)
        return logits, loss


class MeanLossModel(NextTokenModel):
    """Written as most hand-written models are: forward(idx, labels=None, **kwargs) returns
    the mean of its own loss; the **kwargs take whatever else a caller passes."""

    def forward(self, idx: torch.Tensor, labels: torch.Tensor | None = None, **kwargs):
        return super().forward(idx, labels)


class DictScorer(nn.Module):
    """A model whose forward takes named inputs (a dict batch's keys) and returns a dict."""

    def __init__(self, in_features: int = 8):
        super().__init__()
        self.net = nn.Linear(in_features, 1)

    def forward(self, features: torch.Tensor, labels: torch.Tensor | None = None):
        prediction = self.net(features)
        out = {"prediction": prediction}
        if labels is not None:
            out["loss"] = F.mse_loss(prediction, labels)
        return out


class DictWaves(torch.utils.data.Dataset):
    """The example's regression samples as dicts: {"features", "labels"}."""

    def __init__(self, size: int = 512, seed: int = 0):
        from own_model.data import Waves

        self.samples = Waves(size, seed=seed)

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        features, target = self.samples[index]
        return {"features": features, "labels": target}


class HalfIgnored(torch.utils.data.Dataset):
    """Verses (the transformers example's dict samples) whose even samples have every label
    ignored (-100): a batch of one such sample has nothing to learn from."""

    def __init__(self, size: int = 16, seq_len: int = 32):
        from hf_llama.data import Verses

        self.verses = Verses(seq_len=seq_len, size=size)

    def __len__(self) -> int:
        return len(self.verses)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        sample = dict(self.verses[index])
        if index % 2 == 0:
            sample["labels"] = torch.full_like(sample["labels"], -100)
        return sample


class AllIgnored(HalfIgnored):
    """Every label of every sample ignored: nothing to learn from."""

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        sample = dict(self.verses[index])
        sample["labels"] = torch.full_like(sample["labels"], -100)
        return sample


def prediction_mse(output: dict, targets: torch.Tensor) -> torch.Tensor:
    """A user's loss that reads the model's output as the model returns it (a dict)."""
    return F.mse_loss(output["prediction"], targets)


class TakesTargetsReturnsScores(nn.Module):
    """A forward that takes the targets but returns no loss with them."""

    def __init__(self, in_features: int = 8):
        super().__init__()
        self.net = nn.Linear(in_features, 1)

    def forward(self, inputs: torch.Tensor, targets: torch.Tensor | None = None):
        return self.net(inputs)


def text_metric(output: torch.Tensor, targets: torch.Tensor) -> str:
    """A metric that returns no number."""
    return "good"


class MisplannedRegressor(nn.Module):
    """A regressor whose tensor-parallel plan names a module it does not have."""

    def __init__(self, in_features: int = 8):
        super().__init__()
        self.up = nn.Linear(in_features, 32)
        self.down = nn.Linear(32, 1)

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        return self.down(torch.relu(self.up(inputs)))

    def tp_plan(self) -> dict:
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

        return {"up": ColwiseParallel(), "middle": RowwiseParallel()}


class DrawnWaves(torch.utils.data.Dataset):
    """The example's regression samples drawn as many a user's dataset draws them: from the
    global generators (torch's, numpy's, Python's random) at construction, no seed given."""

    def __init__(self, size: int = 512, seed: int = 0):
        import random

        import numpy

        del seed  # the example's key, unused: the run's seed decides
        self.x = torch.randn(size, 8)
        shift = random.random()
        noise = torch.from_numpy(numpy.random.normal(0, 0.05, (size, 1))).float()
        self.y = torch.sin(self.x.sum(1, keepdim=True) + shift) + noise

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.x[index], self.y[index]


class CheckedLM(LooseStagesLM):
    """A language model whose forward checks its token ids' values (as a user's may)."""

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        assert (idx < self.emb.num_embeddings).all(), "a token id past the vocabulary"
        return super().forward(idx)

    def stages(self) -> list[nn.Module]:
        return [self.emb, *self.blocks, self.head]


class StagesList(nn.Module):
    """A regressor holding its middle layers in an attribute named `stages` (timm's naming):
    a ModuleList, not the stages() method parallab reads; and a check_data method of its
    own, taking the instance, which is not the classmethod parallab calls."""

    def __init__(self, in_features: int = 8):
        super().__init__()
        self.inp = nn.Linear(in_features, 16)
        self.stages = nn.ModuleList(nn.Linear(16, 16) for _ in range(2))
        self.out = nn.Linear(16, 1)

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        x = self.inp(inputs)
        for stage in self.stages:
            x = torch.relu(stage(x))
        return self.out(x)

    def check_data(self) -> bool:
        return all(p.isfinite().all() for p in self.parameters())


class FrozenRegressor(StagesList):
    """Every weight frozen: nothing to train."""

    def __init__(self, in_features: int = 8):
        super().__init__(in_features)
        self.requires_grad_(False)


class FailingCheck(StagesList):
    @classmethod
    def check_data(cls, cfg: dict, data) -> str | None:
        return data.no_such_key


class RefusingInit:
    """A loss or metric whose constructor refuses its arguments."""

    def __init__(self, scale: float = 1.0):
        raise ValueError(f"scale={scale} is not allowed")


def collate_nothing() -> None:
    """A collate function that takes no samples."""


class FailsPastTwo(torch.utils.data.Dataset):
    """Regression samples (8 features, 1 target) of which only the first two, those the
    trial reads, can be read: the DataLoader's workers fail on the first batch."""

    def __init__(self, size: int, seed: int = 0):
        self.size = size

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        if index >= 2:
            raise ValueError(f"sample {index} cannot be read")
        return torch.zeros(8), torch.zeros(1)
