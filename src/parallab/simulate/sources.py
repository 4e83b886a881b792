"""What a compiled step keeps that its trace does not see saved: the collectives' outputs
a recomputed chain is made from.

torch.compile's partitioner makes again in backward what a chain of memory-bound ops made
(a norm's input, a sequence's gathered chunks put together, autocast's copy of them),
from what it saves; it never runs a collective again (partitioners.force_save_collectives:
MUST_SAVE). So where such a chain starts from a collective's output (the all-gather of a
sequence-parallel input, a row-split layer's reduce-scatter), the partitioner keeps the
cheaper of that output and what backward reads of the chain (a float32 gather's bf16
copy, say), once, unless the output is saved as it is. The eager step saves the chain's
tensors instead, which the trace counts as they are."""

from __future__ import annotations

import itertools
import weakref

import torch

# a collective's output: (serial, bytes as it moves, made inside the traced block)
Source = tuple[int, int, bool]


class Sources:
    """Storage -> the collective outputs a memory-bound chain that made it started from,
    and storage -> the collective output it is (its wait's too); each entry while its
    storage lives (a freed storage's address is the next one's)."""

    def __init__(self):
        self.found: dict[int, frozenset[Source]] = {}
        self.itself: dict[int, int] = {}
        self._alive: dict[int, weakref.ref] = {}
        self._serials = itertools.count()

    def collective(self, out: torch.Tensor, nbytes: int, in_block: bool) -> int:
        """A collective's output (local), `nbytes` as it moves (float8's one byte): its
        serial."""
        serial = next(self._serials)
        self._keep(out, frozenset({(serial, nbytes, in_block)}), serial)
        return serial

    def waited(self, source: torch.Tensor, out: torch.Tensor) -> None:
        """A collective's wait: `out` is `source`."""
        key = source.untyped_storage()._cdata
        if key in self.found:
            self._keep(out, self.found[key], self.itself.get(key))

    def passed(self, sources: list[torch.Tensor], outputs: list[torch.Tensor],
               in_block: bool) -> None:
        """A memory-bound op made `outputs` from `sources`, inside the traced block or
        not. A chain is followed inside the block, or outside it, not across: a compiled
        step makes again what a block made from what the block holds (the next block's
        input is this block's output, saved where it is read; the trace's first block's
        input is the embedding's collective, which no other block's is)."""
        found = frozenset(source for t in sources
                          for source in self.found.get(t.untyped_storage()._cdata, ())
                          if source[2] == in_block)
        for out in outputs if found else ():
            self._keep(out, found, None)

    def of(self, tensor: torch.Tensor) -> frozenset[Source]:
        return self.found.get(tensor.untyped_storage()._cdata, frozenset())

    def serial_of(self, tensor: torch.Tensor) -> int | None:
        """The collective output `tensor` is (or a view of it), if it is one."""
        return self.itself.get(tensor.untyped_storage()._cdata)

    def _keep(self, tensor: torch.Tensor, found: frozenset[Source], serial: int | None
              ) -> None:
        key = tensor.untyped_storage()._cdata
        self.found[key] = found
        if serial is None:
            self.itself.pop(key, None)
        else:
            self.itself[key] = serial
        while_alive(tensor.untyped_storage(), (self.found, self.itself), self._alive)


class Needed:
    """The collective outputs a traced step's recomputed chains need, by region: each
    one's bytes, and those of the saved tensors backward reads of its chains."""

    def __init__(self):
        self.needs: dict[int, tuple[str, int, int]] = {}  # serial -> (region, bytes, read)
        self.saved: set[int] = set()  # serials saved as they are (counted with the rest)

    def add(self, sources: Sources, tensor: torch.Tensor, nbytes: int, region: str,
            recomputed: bool) -> None:
        """`tensor` saved, as `nbytes` (a float8 copy's one byte a value)."""
        if not recomputed:
            serial = sources.serial_of(tensor)
            if serial is not None:
                self.saved.add(serial)
            return
        for serial, size, in_block in sources.of(tensor):
            if in_block == (region == "block"):
                _, _, read = self.needs.get(serial, (region, size, 0))
                self.needs[serial] = (region, size, read + nbytes)

    def kept(self, region: str) -> float:
        """Bytes a compiled step keeps in `region` for them: the cheaper cut of each."""
        return float(sum(min(nbytes, read) for serial, (where, nbytes, read)
                         in self.needs.items() if where == region and serial not in self.saved))


class Lifetimes:
    """A key for each storage of its own, for as long as it lives: a freed storage's
    address is the next one's, which its `_cdata` alone would take for the same storage."""

    def __init__(self):
        self.keys: dict[int, int] = {}
        self._alive: dict[int, weakref.ref] = {}
        self._serials = itertools.count()

    def of(self, storage: torch.UntypedStorage) -> int:
        if storage._cdata not in self.keys:
            self.keys[storage._cdata] = next(self._serials)
            while_alive(storage, self.keys, self._alive)
        return self.keys[storage._cdata]


def while_alive(storage: torch.UntypedStorage, found: tuple[dict, ...] | dict, alive: dict
                ) -> None:
    """`storage`'s entries in `found` dropped as it is freed (`alive` holds the
    reference)."""
    key = storage._cdata
    each = found if isinstance(found, tuple) else (found,)
    alive[key] = weakref.ref(storage, lambda _: ([d.pop(key, None) for d in each],
                                                 alive.pop(key, None)))
