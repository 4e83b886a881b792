"""Token files read in place: a flat file of token ids (nanoGPT's train.bin, any dtype the
run names), a numpy .npy (its header states its dtype), or Megatron-LM's indexed pair, a
.bin beside a .idx that states the dtype and where each document starts.

Nothing here reads the tokens: a file is a numpy memmap, and the operating system brings
in the pages a window touches. A fingerprint (size and three 64 KiB slices) tells a file
changed since a checkpoint without reading it whole; a file's size against its size when
mapped tells one cut short under a running reader (TokenFile.check_size).
"""

from __future__ import annotations

import glob
import hashlib
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import numpy as np

from parallab.config.errors import OneLineError

DTYPES = {"uint16": np.uint16, "uint32": np.uint32}  # data.dtype of a flat .bin
IDX_HEADER = b"MMIDIDX\x00\x00"  # Megatron-LM's MMapIndexedDataset index
IDX_VERSION = 1
# Megatron-LM's DType codes; 9 (uint32) is what some of its forks write
IDX_CODES = {1: np.uint8, 2: np.int8, 3: np.int16, 4: np.int32, 5: np.int64, 8: np.uint16,
             9: np.uint32}
IDX_CODE_OF = {np.dtype(t): code for code, t in IDX_CODES.items()}
SLICE = 1 << 16  # bytes hashed at the start, middle and end of a file


class FileProblem(ValueError):
    """A token file that cannot be read as it is: one line naming the file and the fix."""


class FileCutShort(OneLineError):
    """A mapped token file whose size changed while the run read it: reading a page past
    its new end would have ended the rank by SIGBUS, no line said."""


@dataclass
class TokenFile:
    path: str
    tokens: np.ndarray  # 1-D memmap of token ids
    # byte offsets where its documents start (a .idx's sequence pointers, memory-mapped)
    pointers: Optional[np.ndarray] = None

    def __post_init__(self) -> None:
        # each mapping's mmap (which holds its file open: size() is an fstat, 0.5 us) and
        # the file's size when mapped
        named = ((self.path, self.tokens), (str(Path(self.path).with_suffix(".idx")),
                                            self.pointers))
        self.mapped = [(path, m, m.size()) for path, array in named
                       if (m := getattr(array, "_mmap", None)) is not None]

    @property
    def marks_documents(self) -> bool:
        return self.pointers is not None

    def __len__(self) -> int:
        return len(self.tokens)

    def check_size(self) -> None:
        """FileCutShort where a mapped file's size is not what it was when mapped. A file
        cut in the moment between this and the read still ends the rank by SIGBUS: the
        check narrows that to the read of one batch (docs/runs.md)."""
        for path, mapping, size in self.mapped:
            now = mapping.size()
            if now != size:
                raise FileCutShort(
                    f"{path} is {now} bytes, {size} when the run mapped it: it was changed "
                    "(cut short or written again) while the run read it; put the file back "
                    "as it was and resume (trainer.resume=auto), or start a new run on the "
                    "new file")


def paths(spec: Any) -> list[str]:
    """The files a glob, a path or a list of them names, each glob sorted (so the order
    of windows does not depend on the directory's listing order)."""
    # a number is a file's name too (a shard called 2024, which YAML reads as an int)
    specs = [spec] if isinstance(spec, (str, Path, int, float)) else list(spec or [])
    found: list[str] = []
    for item in specs:
        item = str(Path(str(item)).expanduser())
        found += sorted(glob.glob(item)) if any(c in item for c in "*?[") else [item]
    return [p for p in found if not p.endswith(".idx")]  # a pair is named by its .bin


def open_tokens(path: str, dtype: str) -> TokenFile:
    """The file's tokens, memory-mapped; FileProblem if they cannot be."""
    file = Path(path)
    if not file.is_file():
        raise FileProblem(f"{path} is not a file")
    if file.suffix == ".npy":
        try:
            tokens = np.load(path, mmap_mode="r")
        except (ValueError, OSError, EOFError) as error:  # no header, pickled, cut short
            raise FileProblem(f"{path} does not read as a .npy array ({error}): write it "
                              "again with numpy.save") from None
        if tokens.ndim != 1 or tokens.dtype.kind not in "ui":
            raise FileProblem(f"{path} holds a {tokens.ndim}-D {tokens.dtype} array: give a "
                              "1-D array of integer token ids")
        return TokenFile(path, tokens)
    index = file.with_suffix(".idx")
    if index.is_file():
        return _indexed(file, index)
    itemsize = np.dtype(DTYPES[dtype]).itemsize
    size = file.stat().st_size
    if size % itemsize:
        raise FileProblem(f"{path} is {size} bytes, not a whole number of {dtype} tokens: "
                          "give data.dtype as the file was written")
    if size == 0:  # numpy maps no empty file: no tokens, which the window checks refuse
        return TokenFile(path, np.zeros(0, dtype=DTYPES[dtype]))
    return TokenFile(path, np.memmap(path, dtype=DTYPES[dtype], mode="r"))


def _indexed(data: Path, index: Path) -> TokenFile:
    """A Megatron-LM pair: the .idx's header, sequence lengths and byte pointers, checked
    against the .bin's size (each sequence is one document, as its GPTDataset reads it)."""
    with open(index, "rb") as f:
        head = f.read(34)
    if len(head) < 34 or head[:9] != IDX_HEADER:
        raise FileProblem(f"{index} is not a Megatron-LM index (no MMIDIDX header): remove it "
                          f"to read {data} as a flat file, or write it again")
    version, code, sequences, documents = struct.unpack("<QBQQ", head[9:34])
    if version != IDX_VERSION or code not in IDX_CODES:
        raise FileProblem(f"{index}: index version {version}, dtype code {code}, which this "
                          "reader does not know: write it with Megatron-LM's tools")
    dtype = np.dtype(IDX_CODES[code])
    need = 34 + 12 * sequences + 8 * documents
    if index.stat().st_size < need:
        raise FileProblem(f"{index} is cut short ({index.stat().st_size} bytes, its header "
                          f"says {need}): write it again")
    if sequences == 0:
        raise FileProblem(f"{index} indexes no document: write the pair again with text in it")
    lengths = np.memmap(index, dtype=np.int32, mode="r", offset=34, shape=(sequences,))
    pointers = np.memmap(index, dtype=np.int64, mode="r", offset=34 + 4 * sequences,
                         shape=(sequences,))
    # O(1), not a pass over every document: where the index says its last one ends
    size, end = data.stat().st_size, int(pointers[-1]) + int(lengths[-1]) * dtype.itemsize
    if pointers[0] != 0 or end != size:
        raise FileProblem(f"{index} does not match {data}: its documents end at byte {end} "
                          f"({dtype} tokens), the .bin holds {size} bytes: write the pair "
                          "again together")
    return TokenFile(str(data), np.memmap(data, dtype=dtype, mode="r"), pointers)


def fingerprint(path: str) -> dict[str, Any]:
    """The file's size and a hash of three slices of it (start, middle, end), and its
    index's where it has one: a changed file is told without reading it whole."""
    # where it is, not the path as given: a resume from another dir names it otherwise
    found = {"path": os.path.realpath(path), "bytes": Path(path).stat().st_size,
             "hash": _hash(path)}
    index = Path(path).with_suffix(".idx")
    if Path(path).suffix == ".bin" and index.is_file():
        found["idx_hash"] = _hash(str(index))
    return found


def _hash(path: str) -> str:
    size = Path(path).stat().st_size
    digest = hashlib.blake2b(str(size).encode(), digest_size=16)
    with open(path, "rb") as f:
        for at in sorted({0, max(0, size // 2 - SLICE // 2), max(0, size - SLICE)}):
            f.seek(at)
            digest.update(f.read(SLICE))
    return digest.hexdigest()


def write_index(path: Path, lengths: np.ndarray, dtype: np.dtype) -> None:
    """Megatron-LM's index: header, version, dtype code, counts, each document's length
    (int32) and byte pointer (int64), and the document index (one sequence each)."""
    lengths = np.asarray(lengths, dtype=np.int64)
    pointers = np.zeros(len(lengths), dtype=np.int64)
    pointers[1:] = np.cumsum(lengths)[:-1] * np.dtype(dtype).itemsize
    with open(path, "wb") as f:
        f.write(IDX_HEADER + struct.pack("<QBQQ", IDX_VERSION, IDX_CODE_OF[np.dtype(dtype)],
                                         len(lengths), len(lengths) + 1))
        f.write(lengths.astype(np.int32).tobytes())
        f.write(pointers.tobytes())
        f.write(np.arange(len(lengths) + 1, dtype=np.int64).tobytes())


def write_indexed(prefix: str | Path, documents: list[np.ndarray]) -> Path:
    """A Megatron-LM pair PREFIX.bin/.idx of `documents` (arrays of one dtype); the .bin."""
    prefix = Path(prefix)
    tokens = np.concatenate(documents)
    tokens.tofile(prefix.with_suffix(".bin"))
    write_index(prefix.with_suffix(".idx"), np.array([len(d) for d in documents]),
                tokens.dtype)
    return prefix.with_suffix(".bin")
