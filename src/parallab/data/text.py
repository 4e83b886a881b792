"""Labelled text from files: a vocabulary built from the training split, right-padded token ids.

data.path holds train.tsv and test.tsv, one example a line: `label<TAB>text`. The vocabulary
is <PAD> (0), <UNK> (1), then the training tokens seen at least data.min_freq times, most
frequent first (ties alphabetical), cut at data.max_size: the same files and settings always
give the same ids, so evaluating a checkpoint rebuilds its vocabulary. Sequences are
right-padded with 0 (pad_sequence), so a model can tell each one's length from its tokens.
"""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import ClassVar, Optional

import torch
from torch.nn.utils.rnn import pad_sequence

from parallab.config.schema import DataConfig
from parallab.data.split import TokenSplit

DEFAULT_PATH = Path(__file__).resolve().parent / "files" / "text_cls"  # shipped

PAD, UNK = "<PAD>", "<UNK>"
FILES = ("train.tsv", "test.tsv")
TOKEN = re.compile(r"\w+(?:'\w+)*|[^\w\s]")  # words (with inner apostrophes), punctuation


def tokenize(text: str, lowercase: bool = True) -> list[str]:
    return TOKEN.findall(text.lower() if lowercase else text)


def read_examples(path: Path) -> list[tuple[str, str]]:
    """(label, text) of each non-blank line."""
    rows = []
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        label, tab, text = line.partition("\t")
        if not tab or not label.strip():
            raise ValueError(f"{path.name} line {number} is not `label<TAB>text`")
        rows.append((label.strip(), text))
    return rows


def build_vocab(texts: list[list[str]], min_freq: int = 1, max_size: int | None = None
                ) -> list[str]:
    counts = Counter(token for tokens in texts for token in tokens)
    kept = sorted((t for t, n in counts.items() if n >= min_freq and t not in (PAD, UNK)),
                  key=lambda t: (-counts[t], t))
    return [PAD, UNK, *kept][:max_size]


def class_names(labels: list[str]) -> list[str]:
    """Sorted label names; numerically when all are integers, so labels 0/1 keep their ids."""
    names = set(labels)
    numeric = all(re.fullmatch(r"-?\d+", name) for name in names)
    return sorted(names, key=int) if numeric else sorted(names)


def encode(texts: list[list[str]], vocab: list[str], max_len: int | None, width: int
           ) -> torch.Tensor:
    """(N, width) int64 ids, right-padded with PAD; an empty text becomes one <UNK>."""
    index = {token: i for i, token in enumerate(vocab)}
    rows = [torch.tensor([index.get(t, 1) for t in tokens[:max_len]] or [1]) for tokens in texts]
    rows.append(torch.zeros(width, dtype=torch.long))  # pads every split to the same width
    return pad_sequence(rows, batch_first=True, padding_value=0)[:-1]


@dataclass(frozen=True)
class Corpus:
    vocab: list[str]
    classes: list[str]
    train: TokenSplit
    test: TokenSplit


def corpus(cfg: Text) -> Corpus:
    root = cfg.folder
    stamps = tuple((root / name).stat().st_mtime_ns for name in FILES)  # edited files: rebuild
    return _corpus(str(root.resolve()), stamps, cfg.min_freq, cfg.max_size, cfg.max_len,
                   cfg.lowercase)


@lru_cache(maxsize=4)
def _corpus(root: str, stamps: tuple[int, ...], min_freq: int, max_size: int | None,
            max_len: int | None, lowercase: bool) -> Corpus:
    train, test = (read_examples(Path(root) / name) for name in FILES)
    classes = class_names([label for label, _ in train])
    unknown = sorted({label for label, _ in test} - set(classes))
    if unknown:
        raise ValueError(f"test.tsv has labels {unknown} that train.tsv never uses")
    tokens = [[tokenize(text, lowercase) for _, text in rows] for rows in (train, test)]
    vocab = build_vocab(tokens[0], min_freq, max_size)
    longest = max((len(t) for texts in tokens for t in texts), default=1)
    width = max(1, min(longest, max_len or longest))  # both splits padded to one width
    label_id = {name: i for i, name in enumerate(classes)}
    splits = [TokenSplit(encode(texts, vocab, max_len, width),
                         torch.tensor([label_id[label] for label, _ in rows]))
              for rows, texts in zip((train, test), tokens)]
    return Corpus(vocab, classes, *splits)


def problem(cfg: Text) -> str | None:
    """None if data.path holds a readable labelled set and the settings are in range."""
    for key, value, low in (("min_freq", cfg.min_freq, 1), ("max_size", cfg.max_size, 3),
                            ("max_len", cfg.max_len, 1)):
        if value is not None and value < low:
            return f"data.{key}={value} is out of range: it must be >= {low}"
    root = cfg.folder
    missing = [name for name in FILES if not (root / name).is_file()]
    if missing:
        return (f"data.path={cfg.path} has no {' or '.join(missing)}: point data.path at a "
                "folder with train.tsv and test.tsv, one `label<TAB>text` a line")
    try:
        found = corpus(cfg)
    except (ValueError, UnicodeDecodeError) as error:
        return f"data.path={cfg.path}: {error}: fix the file (UTF-8, `label<TAB>text` a line)"
    if not len(found.train) or not len(found.test):
        return f"data.path={cfg.path}: train.tsv or test.tsv holds no example: add some"
    return None


@dataclass
class Text(DataConfig):
    """Labelled text: train.tsv and test.tsv under data.path, one `label<TAB>text` a line."""

    _target_: str = "parallab.data.text.Text"
    path: Optional[str] = None  # null = the shipped verse lines (data/text_cls)
    min_freq: int = 2  # rarer training tokens become <UNK>
    max_size: Optional[int] = 20_000  # vocabulary cap, <PAD> and <UNK> included; null = none
    max_len: Optional[int] = 64  # tokens kept per example; null = all
    lowercase: bool = True

    name: ClassVar[str] = "text"

    @property
    def folder(self) -> Path:
        return Path(self.path).expanduser() if self.path is not None else DEFAULT_PATH

    @property
    def vocab_size(self) -> int:
        return len(corpus(self).vocab)

    @property
    def num_classes(self) -> int:
        return len(corpus(self).classes)

    @property
    def input_shape(self) -> list[int]:
        return list(corpus(self).train.inputs.shape[1:])

    def problem(self) -> str | None:
        return problem(self)

    def make(self, seed: int) -> tuple[TokenSplit, TokenSplit]:
        found = corpus(self)
        return found.train, found.test
