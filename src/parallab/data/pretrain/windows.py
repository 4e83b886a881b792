"""A source's samples: windows of seq_len + 1 tokens, as nanoGPT's get_batch cuts them (x the
first seq_len, y the last seq_len), at a stride of seq_len, so that a window's last token
is the next one's first and every token is a target once (Megatron-LM's GPTDataset
samples overlap the same way). A window never spans two files.

Windows are numbered in file order; the training split is a range of them and the eval
split another, so holding eval out costs nothing. Each pass over a source visits its
windows in a seeded permutation of their numbers (seed, source, pass), made from the
count alone: the tokens are not touched until a window is read.
"""

from __future__ import annotations

from typing import Optional

import numpy as np

from parallab.config.errors import OneLineError
from parallab.data.pretrain.files import TokenFile


class TokenIdOutOfRange(OneLineError):
    """A token id read at or above the vocabulary (or below 0): bad input, as the start's
    sampled check refuses it, found where a batch reads it."""

    status = 2


class Windows:
    """Windows [lo, hi) of the files' windows, in file order."""

    def __init__(self, files: list[TokenFile], seq_len: int, lo: int = 0,
                 hi: Optional[int] = None, eos_id: Optional[int] = None,
                 vocab: Optional[int] = None):
        self.files, self.seq_len, self.eos_id, self.vocab = files, seq_len, eos_id, vocab
        # ids are checked where a file's dtype can hold one outside the vocabulary (a
        # signed one, or one wider than it): uint16 files under a vocabulary of 65,536 not
        self.signed = any(np.iinfo(f.tokens.dtype).min < 0 for f in files)
        self.checked = vocab is not None and (self.signed or any(
            np.iinfo(f.tokens.dtype).max >= vocab for f in files))
        counts = [max(0, (len(f) - 1) // seq_len) for f in files]
        self.first = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)  # per file
        self.lo = lo
        self.hi = int(self.first[-1]) if hi is None else hi
        self.arrays = [f.tokens.view(np.ndarray) for f in files]  # the same mapped pages
        self._orders: dict[tuple[int, int, int], np.ndarray] = {}  # the last two passes'

    def __len__(self) -> int:
        return self.hi - self.lo

    @property
    def total(self) -> int:
        """Windows in all the files, whichever range this is."""
        return int(self.first[-1])

    def part(self, lo: int, hi: int) -> Windows:
        return Windows(self.files, self.seq_len, self.lo + lo, self.lo + hi, self.eos_id,
                       self.vocab)

    def where(self, index: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(file, first token) of each window (numbers within this range)."""
        number = np.asarray(index, dtype=np.int64) + self.lo
        file = np.searchsorted(self.first, number, side="right") - 1
        return file, (number - self.first[file]) * self.seq_len

    def read(self, index: np.ndarray) -> np.ndarray:
        """(n, seq_len + 1) int64 tokens of the windows `index`: one slice of a memmap each,
        the loop a hand-written loader runs (a gather of n x (T + 1) indices cost more),
        on the memmaps' plain ndarray views (a memmap's own slicing costs a Python call)."""
        width = self.seq_len + 1
        out = np.empty((len(index), width), dtype=np.int64)
        if len(self.files) == 1:  # one file: a window's first token by a multiply
            self.files[0].check_size()
            tokens = self.arrays[0]
            for row, start in enumerate(((np.asarray(index) + self.lo) * self.seq_len).tolist()):
                out[row] = tokens[start:start + width]
        else:
            files, starts = self.where(index)
            for f in set(files.tolist()):
                self.files[f].check_size()
            for row, (f, start) in enumerate(zip(files.tolist(), starts.tolist())):
                out[row] = self.arrays[f][start:start + width]
        if self.checked:
            self._check_ids(index, out)
        return out

    def _check_ids(self, index: np.ndarray, tokens: np.ndarray) -> None:
        """TokenIdOutOfRange for the first id of `tokens` outside the vocabulary: the start's
        check reads 16 slices of a file, and an id elsewhere had reached the embedding as a
        bare IndexError deep in torch. A max (and a min for a signed file) over the batch:
        a few us against the read's tens (docs/runs.md)."""
        if int(tokens.max()) < self.vocab and (not self.signed or int(tokens.min()) >= 0):
            return
        row, column = (int(i) for i in np.argwhere((tokens >= self.vocab) | (tokens < 0))[0])
        files, starts = self.where(np.asarray(index)[row:row + 1])
        raise TokenIdOutOfRange(
            f"{self.files[int(files[0])].path} holds token id {int(tokens[row, column])} at "
            f"token {int(starts[0]) + column}, not in the model's vocabulary of {self.vocab} "
            "(data.vocab_size): set the model's vocabulary to the tokenizer's "
            "(model.vocab_size; model.config.vocab_size for a transformers model), or "
            "tokenize the file again with the model's tokenizer")

    def documents(self, index: np.ndarray, tokens: np.ndarray) -> Optional[np.ndarray]:
        """(n, seq_len + 1) int32: which document of its window each token is in (0 for the
        first), from the file's .idx where it has one, else from data.eos_id (an
        end-of-text token belongs to the document it ends); None where neither marks them."""
        files, starts = self.where(index)
        out = np.zeros(tokens.shape, dtype=np.int32)
        offsets = np.arange(tokens.shape[1], dtype=np.int64)
        for row, (f, start) in enumerate(zip(files.tolist(), starts.tolist())):
            file = self.files[f]
            if file.marks_documents:
                at = (start + offsets) * file.tokens.dtype.itemsize
                doc = np.searchsorted(file.pointers, at, side="right")
                out[row] = doc - doc[0]
            elif self.eos_id is not None:
                ends = tokens[row, :-1] == self.eos_id
                out[row, 1:] = np.cumsum(ends)
            else:
                return None
        return out

    def order(self, seed: int, source: int, rounds: int) -> np.ndarray:
        """The permutation of this range's windows for pass `rounds` over it, kept for the
        pass read now and the one a batch may run on into: each source's own (one cache of
        8 shared by all had made a mixture of 9 sources permute every source every batch,
        O(windows) each)."""
        key = (seed, source, rounds)
        order = self._orders.get(key)
        if order is None:
            order = _permutation(len(self), *key)
            self._orders = dict(list(self._orders.items())[-1:]) | {key: order}
        return order


def _permutation(size: int, seed: int, source: int, rounds: int) -> np.ndarray:
    generator = np.random.Generator(np.random.PCG64([seed, source, rounds]))
    order = generator.permutation(size)
    return order.astype(np.int32 if size < 2**31 else np.int64)


class Joined:
    """Several ranges of windows read as one (a mixture's eval windows, source after
    source)."""

    def __init__(self, parts: list[Windows]):
        self.parts = [p for p in parts if len(p)]
        self.first = np.concatenate([[0], np.cumsum([len(p) for p in self.parts])])
        self.seq_len = parts[0].seq_len

    def __len__(self) -> int:
        return int(self.first[-1])

    def _each(self, index: np.ndarray):
        part = np.searchsorted(self.first, index, side="right") - 1
        for p in np.unique(part).tolist():
            rows = np.flatnonzero(part == p)
            yield rows, self.parts[p], index[rows] - self.first[p]

    def read(self, index: np.ndarray) -> np.ndarray:
        out = np.empty((len(index), self.seq_len + 1), dtype=np.int64)
        for rows, part, local in self._each(np.asarray(index, dtype=np.int64)):
            out[rows] = part.read(local)
        return out

    def documents(self, index: np.ndarray, tokens: np.ndarray) -> Optional[np.ndarray]:
        out = np.zeros(tokens.shape, dtype=np.int32)
        for rows, part, local in self._each(np.asarray(index, dtype=np.int64)):
            found = part.documents(local, tokens[rows])
            if found is None:
                return None
            out[rows] = found
        return out
