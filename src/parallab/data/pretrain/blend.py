"""The run's one global order of training samples, over one source or a weighted mixture
(Megatron-LM's blend), a pure function of the sample's number g: what rank reads it, at
what world size or layout, and where the run was resumed play no part.

A mixture repeats a pattern of a period of samples (the shortest in which the weights are
whole counts, at most PERIOD) in which source s holds its weight's share (largest
remainders where they are not whole, each source with a weight at least one) in an even interleave: the
merged ticks (k + 1/2) / count_s, Sainte-Laguë's order. Sample g is slot g % PERIOD of
pass g // PERIOD, so which source it is and which of that source's samples (its k-th) are
two look-ups, and the tokens each source gave up to g a count: nothing is built or
replayed to start at sample 10^9. A source's k-th sample is its window order_s(k // N_s)
[k % N_s] (N_s windows, a new permutation each pass, so a small source repeats, as in
Megatron-LM's blend).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from fractions import Fraction

import numpy as np

from parallab.data.pretrain.windows import Windows

PERIOD = 1 << 16  # weights are honoured to 1 / PERIOD


def period_of(weights: list[float]) -> int:
    """The shortest period in which every share is a whole count (weights as written, 0.7
    or 3: their decimals), else PERIOD: weights such as token counts are then honoured to
    1 / PERIOD."""
    shares = [Fraction(repr(float(w))) for w in weights]
    total = sum(shares)
    period = math.lcm(*((share / total).denominator for share in shares))
    return period if period <= PERIOD else PERIOD


def counts(weights: list[float], period: int) -> np.ndarray:
    """Each source's samples per period: its share by largest remainders, at least one
    for every source (a weight of 0 excepted), summing to `period`."""
    w = np.asarray(weights, dtype=np.float64) / sum(weights)
    raw = w * period
    n = np.floor(raw).astype(np.int64)
    n[np.argsort(-(raw - n), kind="stable")[: period - n.sum()]] += 1
    for s in np.flatnonzero((n == 0) & (w > 0)):  # a tiny weight still gets its sample
        n[np.argmax(n)] -= 1
        n[s] += 1
    return n


def interleave(per_source: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(source, rank) of each slot of a period: sources ordered by their ticks
    (k + 1/2) / count, ties by source, and the k of each."""
    sources = np.repeat(np.arange(len(per_source)), per_source)
    ranks = np.concatenate([np.arange(c) for c in per_source])
    ticks = (ranks + 0.5) / per_source[sources]
    slot = np.lexsort((sources, ticks))
    return sources[slot].astype(np.int16), ranks[slot].astype(np.int64)


@dataclass
class Source:
    name: str
    windows: Windows
    weight: float = 1.0


class Stream:
    """Global sample g -> (source, window): see the module's docstring."""

    def __init__(self, sources: list[Source], seed: int, documents: bool = False):
        self.sources, self.seed = sources, seed
        self.marks = documents  # read where each token's document is (data.document_mask)
        live = [s.weight > 0 for s in sources]
        self.period = period_of([s.weight for s in sources])
        self.per_period = counts([s.weight for s in sources], self.period)
        self.slot_source, self.slot_rank = interleave(self.per_period)
        # prefix[s][r]: source s's samples among a period's first r slots
        self.prefix = np.stack([np.concatenate([[0], np.cumsum(self.slot_source == s)])
                                for s in range(len(sources))])
        self.live = live

    @property
    def seq_len(self) -> int:
        return self.sources[0].windows.seq_len

    def __len__(self) -> int:
        """Samples in a nominal epoch: every window of every source once."""
        return sum(len(s.windows) for s, live in zip(self.sources, self.live) if live)

    def locate(self, g: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(source, k): sample g is the k-th of its source."""
        passes, slot = np.divmod(np.asarray(g, dtype=np.int64), self.period)
        source = self.slot_source[slot]
        return source, passes * self.per_period[source] + self.slot_rank[slot]

    def samples_before(self, g: int) -> np.ndarray:
        """How many of the first g samples each source gave."""
        passes, slot = divmod(int(g), self.period)
        return passes * self.per_period + self.prefix[:, slot]

    def read(self, first: int, n: int) -> tuple[np.ndarray, np.ndarray | None, np.ndarray]:
        """Samples first .. first + n - 1: their (n, seq_len + 1) tokens, which document of
        its window each token is in (None where not asked), and each one's source."""
        if len(self.sources) == 1 and not self.marks:
            return self._read_one(first, n)
        source, k = self.locate(np.arange(first, first + n))
        tokens = np.empty((n, self.seq_len + 1), dtype=np.int64)
        documents = None
        for s in np.unique(source).tolist():
            rows = np.flatnonzero(source == s)
            windows = self.sources[s].windows
            rounds, at = np.divmod(k[rows], len(windows))
            index = np.empty(len(rows), dtype=np.int64)
            for r in np.unique(rounds).tolist():  # a batch spans at most two passes
                same = rounds == r
                index[same] = windows.order(self.seed, s, r)[at[same]]
            tokens[rows] = windows.read(index)
            if self.marks:
                found = windows.documents(index, tokens[rows])
                documents = np.zeros(tokens.shape, np.int32) if documents is None else documents
                documents[rows] = found
        return tokens, documents, source

    def _read_one(self, first: int, n: int) -> tuple[np.ndarray, None, np.ndarray]:
        """read() of one source: its k-th sample is the g-th, a slice of this pass's order
        where the batch lies in one pass (a batch's few look-ups are most of its cost)."""
        windows = self.sources[0].windows
        rounds, at = divmod(first, len(windows))
        if at + n <= len(windows):
            index = windows.order(self.seed, 0, rounds)[at:at + n]
        else:
            k = np.arange(first, first + n)
            index = np.array([windows.order(self.seed, 0, r)[a]
                              for r, a in zip(*(v.tolist() for v in np.divmod(k, len(windows))))])
        return windows.read(index), None, np.zeros(n, dtype=np.int16)
