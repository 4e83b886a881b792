"""`parallab prepare-data`: text, jsonl or parquet files tokenized once, with the `datasets`
library's own worker processes and progress bars and a tokenizer folder (as data=hf_text
reads them), into Megatron-LM .bin/.idx pairs that data=token_files reads in place:
OUT/train.bin, OUT/train.idx and OUT/val.bin, OUT/val.idx. Each document's tokens are
followed by the tokenizer's end-of-text id (nanoGPT's and Megatron-LM's --append-eod), and
the .idx keeps where each document starts, so data.document_mask works on them.

    parallab prepare-data corpus/*.jsonl --tokenizer my_tokenizer --out tokens --num-proc 8
    parallab train model=gpt data=token_files data.files=tokens/train.bin \
        data.eval_files=tokens/val.bin
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import Any

import numpy as np

from parallab.config.errors import ConfigError
from parallab.data.pretrain.files import write_index

BATCH = 1000  # documents tokenized per call, and written per write


def arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("files", nargs="+", help="text (.txt, .md: a document a file), "
                        ".json/.jsonl, .parquet or .csv files, or globs of them")
    parser.add_argument("--tokenizer", required=True, help="a local tokenizer folder "
                        "(AutoTokenizer.from_pretrained reads it)")
    parser.add_argument("--out", required=True, type=Path, help="the folder to write "
                        "train.bin/.idx and val.bin/.idx into")
    parser.add_argument("--text-key", default="text", help="the column that holds the text "
                        "(json, parquet, csv)")
    parser.add_argument("--eval-fraction", type=float, default=0.0005, help="the share of "
                        "documents held out as val (nanoGPT's 0.0005); 0: none")
    parser.add_argument("--num-proc", type=int, default=max(1, (os.cpu_count() or 2) // 2),
                        help="tokenizing processes (datasets' num_proc)")
    parser.add_argument("--seed", type=int, default=2357, help="the seed of the val split")
    parser.add_argument("--no-eos", action="store_true", help="write no end-of-text id "
                        "after each document")
    parser.add_argument("--force", action="store_true", help="replace the token files an "
                        "earlier prepare-data wrote at OUT (its other files are kept)")


def prepare(files: list[str], tokenizer: str, out: Path, text_key: str = "text",
            eval_fraction: float = 0.0005, num_proc: int = 1, seed: int = 2357,
            eos: bool = True, force: bool = False) -> dict[str, Any]:
    """Tokenize and write; returns what was written (paths, documents and tokens per
    split, the dtype). ConfigError, one line, for bad input; for token files already at
    `out` unless `force` (a run's data, which its checkpoints fingerprint)."""
    from parallab.data import hf_text

    paths = _checked(files, tokenizer, eval_fraction)
    earlier = _held(out, force)
    tok = hf_text._tokenizer(str(Path(tokenizer).expanduser()))
    end = [tok.eos_token_id] if eos and tok.eos_token_id is not None else []
    dtype = np.dtype(np.uint16 if len(tok) <= 1 << 16 else np.int32)  # Megatron-LM's rule
    rows = _documents(paths, text_key)

    def tokenize(batch: dict[str, list], indices: list[int]) -> dict[str, list]:
        texts = batch[text_key]
        for index, text in zip(indices, texts):
            if not isinstance(text, str):  # the tokenizer's own error: a worker's traceback
                raise NoText(index, text)
        ids = tok(texts, add_special_tokens=False)["input_ids"]
        return {"ids": [i + end for i in ids], "length": [len(i) + len(end) for i in ids]}

    try:
        tokens = rows.map(tokenize, batched=True, batch_size=BATCH, num_proc=num_proc,
                          with_indices=True, remove_columns=rows.column_names,
                          desc="tokenizing")
    except NoText as error:
        index, text = error.args
        raise ConfigError(f"parallab prepare-data: record {index} of {', '.join(files)} (from "
                          f"0, the files in order) has {text!r} under --text-key {text_key}, "
                          "no text: drop such records, or give the key every record's text is "
                          "under") from None
    held = max(1, int(len(tokens) * eval_fraction)) if eval_fraction and len(tokens) > 1 else 0
    splits = {"train": tokens}
    if held:
        parts = tokens.train_test_split(test_size=held, seed=seed, shuffle=True)
        splits = {"train": parts["train"], "val": parts["test"]}
    out.mkdir(parents=True, exist_ok=True)
    # beside the earlier files until every split is written: a refusal or a failure leaves
    # them as they were (a run's data, which its checkpoints fingerprint)
    written = {name: write_split(split, out / f".{name}-partial", dtype)
               for name, split in splits.items()}
    for path in earlier:
        path.unlink()
    for name, figures in written.items():
        for kind in ("bin", "idx"):
            (out / f".{name}-partial.{kind}").replace(out / f"{name}.{kind}")
        figures["path"] = str(out / f"{name}.bin")
    return {"dtype": str(dtype), "vocab_size": len(tok), "eos_id": end[0] if end else None,
            **written}


class NoText(ValueError):
    """A record without text under the key (its index, its value): raised in a worker."""


def _checked(files: list[str], tokenizer: str, eval_fraction: float) -> list:
    """The input files' paths, once the command's arguments are checked: ConfigError, one
    line, for what it cannot take."""
    from parallab.data import hf_text

    try:
        import datasets  # noqa: F401
        import transformers  # noqa: F401
    except ImportError as error:
        raise ConfigError(f"parallab prepare-data needs {error.name}, which is not installed: "
                          f"{hf_text.INSTALL}") from None
    paths = list(hf_text._paths(files))
    problem = hf_text._files_problem("files", files, optional=False)
    if problem:  # its words name the data key; here they are the command's arguments
        said = problem.split(": ", 1)[1] if ": " in problem else problem
        fix = "" if "give " in said else ": give text, json/jsonl, parquet or csv files (or " \
            "globs of them)"
        raise ConfigError(f"parallab prepare-data {' '.join(map(str, files))}: {said}{fix}")
    if not Path(tokenizer).expanduser().is_dir():
        raise ConfigError(f"parallab prepare-data: --tokenizer {tokenizer} is not a folder: give "
                          "a local tokenizer folder (saved by tokenizer.save_pretrained)")
    if not 0 <= eval_fraction < 1:
        raise ConfigError(f"parallab prepare-data: --eval-fraction {eval_fraction} is out of "
                          "range: it must be in [0, 1)")
    return paths

def _held(out: Path, force: bool) -> list[Path]:
    """The token files already at `out`, checked before anything is tokenized: refused
    where `out` is a file, or holds them (unless `force`: then they are replaced once the
    new ones are written, a val pair this run may not write included, so no earlier split
    is left beside the new one)."""
    if out.exists() and not out.is_dir():
        raise ConfigError(f"parallab prepare-data: --out {out} is a file: give a folder")
    held = [out / f"{split}.{kind}" for split in ("train", "val") for kind in ("bin", "idx")
            if (out / f"{split}.{kind}").exists()]
    if held and not force:
        raise ConfigError(f"parallab prepare-data: --out {out} already holds "
                          f"{', '.join(p.name for p in held)}: give another folder, or "
                          "--force to replace them")
    return held


def _documents(paths: list[str], text_key: str):
    from datasets import load_dataset

    from parallab.data.hf_text import BUILDERS

    builder = BUILDERS[Path(paths[0]).suffix.lower()]
    options = {"sample_by": "document"} if builder == "text" else {}
    try:
        rows = load_dataset(builder, data_files=paths, split="train", **options)
    except StopIteration:  # datasets' json builder, on files without a record
        rows = None
    if rows is None or len(rows) == 0:
        raise ConfigError(f"parallab prepare-data {' '.join(paths)}: no records in them: "
                          "give files that hold text")
    if text_key not in rows.column_names:
        raise ConfigError(f"parallab prepare-data: --text-key {text_key} is no column of "
                          f"{paths[0]} (its columns: {', '.join(rows.column_names)})")
    return rows.select_columns([text_key])


def write_split(split, prefix: Path, dtype: np.dtype) -> dict[str, Any]:
    """One split as PREFIX.bin/.idx, written a batch of documents at a time (never held
    whole), with a progress bar."""
    from tqdm.auto import tqdm

    lengths = np.asarray(split["length"], dtype=np.int64)
    with open(prefix.with_suffix(".bin"), "wb") as data, \
            tqdm(total=int(lengths.sum()), unit="tok", unit_scale=True,
                 desc=f"writing {prefix.name}.bin") as bar:
        for batch in split.iter(batch_size=BATCH):
            ids = np.fromiter((t for doc in batch["ids"] for t in doc), dtype=dtype)
            ids.tofile(data)
            bar.update(len(ids))
    write_index(prefix.with_suffix(".idx"), lengths, dtype)
    return {"path": str(prefix.with_suffix(".bin")), "documents": len(lengths),
            "tokens": int(lengths.sum())}


def main(args: argparse.Namespace) -> None:
    found = prepare(args.files, args.tokenizer, args.out, args.text_key, args.eval_fraction,
                    args.num_proc, args.seed, not args.no_eos, args.force)
    for name in ("train", "val"):
        if name in found:
            split = found[name]
            print(f"{split['path']}: {split['documents']:,} documents, {split['tokens']:,} "
                  f"tokens ({found['dtype']})")
    if "val" in found:  # at least one document held out: of a few, far more than asked
        share = found["val"]["tokens"] / (found["val"]["tokens"] + found["train"]["tokens"])
        if share > 2 * args.eval_fraction:
            print(f"val.bin holds {share:.0%} of the tokens, --eval-fraction "
                  f"{args.eval_fraction} asked for less: a val split is whole documents (a "
                  "text file is one), and at least one; give more documents, or "
                  "--eval-fraction 0 and data.eval_fraction to hold out windows instead")
    # a held-out split shorter than one of gpt's windows (its context of 256, and the next
    # token) would refuse the printed command: the training split's last windows instead
    window = _gpt_context() + 1
    short = "val" in found and found["val"]["tokens"] < window
    val = f" data.eval_files={args.out / 'val.bin'}" if "val" in found and not short else ""
    if short:
        print(f"val.bin holds fewer tokens than one window of gpt's ({window}): left out "
              "below, data.eval_fraction holds out train.bin's last windows instead")
    # the .idx marks the documents: no data.eos_id needed; gpt's vocabulary the tokenizer's
    print(f"train with: parallab train model=gpt model.vocab_size={found['vocab_size']} "
          f"data=token_files data.files={args.out / 'train.bin'}{val}")


def _gpt_context() -> int:
    """model=gpt's context (its YAML's), which the printed command's data.seq_len follows."""
    import yaml

    from parallab.config.hydra_app import CONF_DIR

    return int(yaml.safe_load((Path(CONF_DIR) / "model" / "gpt.yaml").read_text())["context"])
