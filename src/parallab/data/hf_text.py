"""Text as transformers users bring it: local files read by the `datasets` library (text,
json/jsonl, parquet, csv; never the hub) and a tokenizer folder
(`AutoTokenizer.from_pretrained(data.tokenizer)`), packed into fixed-length samples.

Each document is tokenized, the documents joined (with the tokenizer's end-of-text token
between them where it has one) and cut into blocks of data.seq_len tokens; a sample is
{"input_ids": block, "labels": block}, as transformers' causal LMs take it (the model shifts
the labels itself). Packed blocks have no padding, so every label counts. Without
data.eval_files, the last data.eval_fraction of the training tokens is the eval split.

    parallab train model=my_llama data=hf_text data.files=corpus/*.txt \
        data.tokenizer=my_tokenizer data.seq_len=256
"""

from __future__ import annotations

import glob
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any, ClassVar, Optional

import torch
from torch.utils.data import Dataset

from parallab.config.schema import DataConfig

# file suffix -> the datasets library's builder for it
BUILDERS = {".txt": "text", ".text": "text", ".md": "text", ".json": "json",
            ".jsonl": "json", ".parquet": "parquet", ".csv": "csv"}
INSTALL = 'pip install "parallab[hf]"'


class Packed(Dataset):
    """(N, seq_len) token blocks as transformers samples."""

    def __init__(self, blocks: torch.Tensor):
        self.blocks = blocks

    def __len__(self) -> int:
        return len(self.blocks)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        block = self.blocks[index]
        return {"input_ids": block, "labels": block}


@dataclass
class HFText(DataConfig):
    _target_: str = "parallab.data.hf_text.HFText"
    files: Any = None  # training text: a path, a glob or a list of them
    eval_files: Any = None  # null = the last eval_fraction of the training tokens
    eval_fraction: float = 0.05
    text_key: str = "text"  # the column json, parquet and csv files keep the text in
    tokenizer: Optional[str] = None  # a local tokenizer folder (tokenizer.json and config)
    seq_len: int = 128  # tokens per sample
    batch_size: int = 8
    eval_batch_size: int = 32

    name: ClassVar[str] = "hf_text"
    tensors: ClassVar[bool] = False  # torch Datasets of dict samples: the DataLoader path
    next_token: ClassVar[bool] = False  # labels are the inputs: the model shifts them

    def problem(self) -> str | None:
        try:
            import datasets  # noqa: F401
            import transformers  # noqa: F401
        except ImportError as error:
            return f"data=hf_text needs {error.name}, which is not installed: {INSTALL}"
        if self.seq_len < 2:
            return f"data.seq_len={self.seq_len} is out of range: it must be >= 2"
        if self.eval_files is None and not 0 < self.eval_fraction < 1:
            return (f"data.eval_fraction={self.eval_fraction} is out of range: it must be in "
                    "(0, 1)")
        for key in ("files", "eval_files"):
            problem = _files_problem(key, getattr(self, key), optional=key == "eval_files")
            if problem:
                return problem
        if self.tokenizer is None or not Path(self.tokenizer).expanduser().is_dir():
            return (f"data.tokenizer={self.tokenizer} is not a folder: give a local tokenizer "
                    "folder (one that AutoTokenizer.from_pretrained reads, e.g. saved by "
                    "tokenizer.save_pretrained)")
        try:
            train, test = self.make(0)
        except Exception as error:  # noqa: BLE001 - a file or tokenizer that will not load
            return f"data=hf_text: {type(error).__name__}: {str(error).splitlines()[0]}"
        for split, data in (("train", train), ("eval", test)):
            if not len(data):
                return (f"data=hf_text: the {split} split holds fewer than data.seq_len="
                        f"{self.seq_len} tokens: give more text or a shorter data.seq_len")
        return None

    @property
    def vocab_size(self) -> int:
        return len(_tokenizer(str(Path(self.tokenizer).expanduser())))

    def make(self, seed: int) -> tuple[Packed, Packed]:
        tokens = _tokens(_paths(self.files), self.text_key, self.tokenizer)
        if self.eval_files is not None:
            test = _tokens(_paths(self.eval_files), self.text_key, self.tokenizer)
        else:
            cut = int(len(tokens) * (1 - self.eval_fraction))
            tokens, test = tokens[:cut], tokens[cut:]
        return Packed(_blocks(tokens, self.seq_len)), Packed(_blocks(test, self.seq_len))


def _paths(spec: Any) -> tuple[str, ...]:
    specs = [spec] if isinstance(spec, (str, Path)) else list(spec or [])
    found: list[str] = []
    for item in specs:
        item = str(Path(str(item)).expanduser())
        found += sorted(glob.glob(item)) if any(c in item for c in "*?[") else [item]
    return tuple(found)


def _files_problem(key: str, spec: Any, optional: bool) -> str | None:
    if spec is None:
        return None if optional else (f"data.{key} is not set: give the text files (a path, "
                                      "a glob or a list)")
    paths = _paths(spec)
    missing = [p for p in paths if not Path(p).is_file()]
    if not paths or missing:
        return f"data.{key}={spec}: no file {missing[0] if missing else 'matches'}"
    unknown = [p for p in paths if Path(p).suffix.lower() not in BUILDERS]
    if unknown:
        return (f"data.{key}: {unknown[0]} is not a file kind the datasets library reads here "
                f"({', '.join(sorted(BUILDERS))})")
    if len({BUILDERS[Path(p).suffix.lower()] for p in paths}) > 1:
        return f"data.{key}={spec}: its files are of several kinds: give files of one kind"
    return None


@lru_cache(maxsize=4)
def _tokenizer(folder: str):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(folder)


@lru_cache(maxsize=4)
def _tokens(paths: tuple[str, ...], text_key: str, tokenizer: str) -> torch.Tensor:
    """Every document of the files tokenized and joined, one long int64 tensor."""
    from datasets import load_dataset

    builder = BUILDERS[Path(paths[0]).suffix.lower()]
    options = {"sample_by": "document"} if builder == "text" else {}
    rows = load_dataset(builder, data_files=list(paths), split="train", **options)
    key = "text" if builder == "text" else text_key
    if key not in rows.column_names:
        raise KeyError(f"data.text_key={key} is no column of {paths[0]} (its columns: "
                       f"{', '.join(rows.column_names)})")
    tok = _tokenizer(str(Path(tokenizer).expanduser()))
    separator = [tok.eos_token_id] if tok.eos_token_id is not None else []
    ids: list[int] = []
    for encoded in tok(list(rows[key]), add_special_tokens=False)["input_ids"]:
        ids += encoded + separator
    return torch.tensor(ids, dtype=torch.long)


def _blocks(tokens: torch.Tensor, seq_len: int) -> torch.Tensor:
    n = len(tokens) // seq_len
    return tokens[: n * seq_len].view(n, seq_len)
