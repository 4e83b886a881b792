"""The loaders of data=token_files: the training one reads the global order of samples
(blend.Stream) from a position, the eval one a fixed shard of the eval windows.

Training: global step k takes samples [k G, (k + 1) G) of the stream (G the global batch);
this rank's micro-batch m of it is the B samples at k G + (m W + r) B (W data-parallel
ranks, r this one's), so the samples of a step are the same for every world size, layout
and accumulation that give the same G, and the loss of the step with them. The position
kept in a checkpoint is the next global sample; resuming reads from it at once, nothing is
replayed or skipped through. Batches are read one or more ahead on a thread (memmap copies
release the GIL), so a step finds its batch waiting, the page cache warm or not.
"""

from __future__ import annotations

import atexit
import queue
import threading
from typing import Any, Iterator, Optional

import numpy as np
import torch

from parallab import batch as batches
from parallab.data.loaders import ShardLoader
from parallab.data.pretrain.blend import Stream
from parallab.data.pretrain.windows import Windows
from parallab.launching.distributed import Dist

IGNORE = batches.IGNORE_INDEX
SAMPLES = ("auto", "pair", "causal_lm")  # data.sample: auto picks by the model


class Samples:
    """How a window becomes the model's sample: `pair` (x, y) as nanoGPT's get_batch
    makes them, or `causal_lm` {input_ids, labels} as a transformers causal LM takes them
    (labels the inputs: the model shifts them). With document boundaries: gpt gets
    ({x, documents}, y), a transformers model position_ids that restart at each document
    (from which it masks attention to the document); `skip_boundary` leaves out of the loss
    each target that starts a document, predicted from the one before."""

    def __init__(self, kind: str, mask: bool, skip_boundary: bool):
        self.kind, self.mask, self.skip_boundary = kind, mask, skip_boundary

    def __call__(self, tokens: np.ndarray, documents: Optional[np.ndarray]) -> Any:
        """The batch of (n, seq_len + 1) windows, made with numpy alone: on the reading
        thread a torch op would start a second OpenMP team beside the step's (on a few
        cores the two then spin against each other: a step took 6x as long)."""
        x = tokens[:, :-1]
        cut = None if documents is None else documents[:, :-1]
        boundary = None if documents is None else documents[:, 1:] != documents[:, :-1]
        if self.kind == "pair":
            y = tokens[:, 1:]
            if self.skip_boundary:
                y = np.where(boundary, IGNORE, y)
            inputs = {"x": _tensor(x), "documents": _tensor(cut)} if self.mask else _tensor(x)
            return inputs, _tensor(y)
        labels = x
        if self.skip_boundary:  # the model shifts: label t + 1 is position t's target
            labels = x.copy()
            labels[:, 1:][boundary[:, :-1]] = IGNORE
        sample = {"input_ids": _tensor(x), "labels": _tensor(labels)}
        if self.mask:
            sample["position_ids"] = _tensor(positions(cut))
        return sample


def _tensor(array: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(array)  # a view as it is (x, y: strided views of the windows)


def positions(documents: np.ndarray) -> np.ndarray:
    """Each token's position in its document (from the window's start for the first)."""
    index = np.broadcast_to(np.arange(documents.shape[1]), documents.shape)
    starts = np.ones(documents.shape, dtype=bool)
    starts[:, 1:] = documents[:, 1:] != documents[:, :-1]
    return index - np.maximum.accumulate(np.where(starts, index, 0), axis=1)


class TokenLoader:
    """The training loader over the stream (the module's docstring); the trainer's loader
    interface (set_epoch, len, iteration, resized) and the data's place in a checkpoint."""

    drop_last = True  # every batch full: a step's samples are G whatever the layout
    num_valid = float("inf")

    def __init__(self, stream: Stream, samples: Samples, dist: Dist, batch_size: int,
                 prefetch: int, fingerprints: list[dict[str, Any]], names: list[str] | None,
                 accumulate: int = 1):
        self.stream, self.samples, self.dist = stream, samples, dist
        self.batch_size, self.prefetch, self.device = batch_size, prefetch, dist.device
        self.fingerprints, self.names = fingerprints, names
        self.accumulate = accumulate  # micro-batches a step: an epoch holds whole steps
        self.all_valid = not samples.skip_boundary  # labels counted from shapes alone
        self.per_rank = len(stream) // dist.world_size
        self.position = 0  # the next global sample to train on
        # (the start of the epoch it was in, the next sample) from a checkpoint
        self.restored: Optional[tuple[Optional[int], int]] = None
        self.epoch, self.epoch_start, self.start, self.end = -1, 0, 0, 0

    @property
    def epoch_samples(self) -> int:
        """Global samples in one of the trainer's epochs: whole steps' worth, so that every
        step takes G, whatever the split of G into ranks, batches and accumulation."""
        per_step = self.batch_size * self.dist.world_size * self.accumulate
        return len(self.stream) // per_step * per_step

    def __len__(self) -> int:
        return self.epoch_samples // (self.batch_size * self.dist.world_size)

    def set_epoch(self, epoch: int, skip_batches: int = 0) -> None:
        """Read epoch `epoch`'s samples, from a checkpoint's position where one was
        restored, else after this rank's first `skip_batches` batches of it. An epoch
        begins where the one before ended, which a resume at another global batch (whose
        epochs hold another count of samples) keeps."""
        if self.restored is not None:
            (begun, self.start), self.restored = self.restored, None
            self.epoch_start = epoch * self.epoch_samples if begun is None else begun
        else:
            if epoch == self.epoch + 1 and self.end:
                self.epoch_start = self.end
            elif epoch != self.epoch:
                self.epoch_start = epoch * self.epoch_samples
            self.start = self.epoch_start + skip_batches * self.batch_size * \
                self.dist.world_size
        self.epoch, self.end = epoch, self.epoch_start + self.epoch_samples

    def batch_at(self, first: int) -> tuple[Any, np.ndarray]:
        """The batch of this rank in the global batch starting at sample `first`."""
        tokens, documents, sources = self.stream.read(
            first + self.dist.rank * self.batch_size, self.batch_size)
        batch = self.samples(tokens, documents)
        if self.device.type == "cuda":
            batch = batches.apply(batch, lambda t: t.pin_memory())
        return batch, sources

    def _batches(self) -> Iterator[tuple[Any, int]]:
        step = self.batch_size * self.dist.world_size
        for first in range(self.start, self.end - step + 1, step):
            yield self.batch_at(first)[0], first + step

    def __iter__(self) -> Iterator[Any]:
        reader = self._batches() if self.prefetch == 0 else _ahead(self._batches(),
                                                                     self.prefetch)
        for batch, after in reader:
            self.position = after  # trained once the caller asks for the next one
            yield batches.to_device(batch, self.device)

    def resized(self, batch_size: int) -> TokenLoader:
        return TokenLoader(self.stream, self.samples, self.dist, batch_size, self.prefetch,
                           self.fingerprints, self.names, self.accumulate)

    def state_dict(self) -> dict[str, Any]:
        # an epoch trained to its end: the trainer's next one begins here
        begun = self.end if self.end and self.position >= self.end else self.epoch_start
        return {"next_sample": self.position, "epoch_start": begun,
                "seq_len": self.stream.seq_len,
                "files": self.fingerprints, "sources": self.names and {
                    name: s.weight for name, s in zip(self.names, self.stream.sources)},
                "windows": [len(s.windows) for s in self.stream.sources]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.position = int(state["next_sample"])
        begun = state.get("epoch_start")  # (an earlier parallab's records none)
        self.restored = (None if begun is None else int(begun), self.position)

    def tokens_by_source(self) -> dict[str, int]:
        """Tokens each named source gave the run so far (targets: seq_len a sample): a
        count from the global position, the same on every rank."""
        if not self.names:
            return {}
        seen = self.stream.samples_before(self.position) * self.stream.seq_len
        return {name: int(n) for name, n in zip(self.names, seen)}


def _ahead(source: Iterator[Any], depth: int) -> Iterator[Any]:
    """`source`'s items, made up to `depth` ahead on a thread; the thread ends when the
    consumer stops asking (an epoch cut short by max_steps or a stop)."""
    items: queue.Queue = queue.Queue(maxsize=depth)
    stop = threading.Event()
    done = object()

    def fill() -> None:
        try:
            for item in source:
                while not stop.is_set():
                    try:
                        items.put(item, timeout=0.1)
                        break
                    except queue.Full:
                        continue
                if stop.is_set():
                    return
            items.put(done)
        except BaseException as error:  # noqa: BLE001 - raised again in the consumer
            items.put(error)

    thread = threading.Thread(target=fill, name="token-files-reader", daemon=True)
    thread.start()
    _READERS[thread] = stop
    try:
        while True:
            item = items.get()
            if item is done:
                return
            if isinstance(item, BaseException):
                raise item
            yield item
    finally:
        stop.set()
        _READERS.pop(thread, None)


# the reader threads running, each with its stop: ended at exit, where a reader still in
# torch's code as the interpreter tore it down aborted the ended run (SIGABRT, exit 134:
# "terminate called without an active exception") once in a score of runs
_READERS: dict[threading.Thread, threading.Event] = {}


@atexit.register
def stop_readers(patience_s: float = 5.0) -> None:
    """Each reader thread told to stop, and waited for: it ends after the item it makes."""
    for thread, stop in list(_READERS.items()):
        stop.set()
        thread.join(patience_s)


class TokenEvalLoader(ShardLoader):
    """The eval windows in file order, each rank a DistributedSampler-style shard of them
    (padded; num_valid says how much is real), read a batch at a time."""

    all_valid = True

    def __init__(self, windows: Windows, samples: Samples, dist: Dist, batch_size: int,
                 seed: int):
        super().__init__(range(len(windows)), dist, batch_size, False, seed)
        self.windows, self.samples = windows, samples
        self.all_valid = not samples.skip_boundary

    def __iter__(self) -> Iterator[Any]:
        for index in self.batches(self.sampler.indices()):
            index = index.numpy()
            tokens = self.windows.read(index)
            documents = (self.windows.documents(index, tokens)
                         if self.samples.mask or self.samples.skip_boundary else None)
            yield batches.to_device(self.samples(tokens, documents), self.device)

    def resized(self, batch_size: int) -> TokenEvalLoader:
        return TokenEvalLoader(self.windows, self.samples, self.dist, batch_size, self.seed)


class WindowSet(torch.utils.data.Dataset):
    """Windows as a map-style Dataset of samples (a trial batch before launch)."""

    def __init__(self, windows: Windows, samples: Samples):
        self.windows, self.samples = windows, samples

    def __len__(self) -> int:
        return len(self.windows)

    def __getitem__(self, index: int) -> Any:
        at = np.array([index])
        tokens = self.windows.read(at)
        documents = (self.windows.documents(at, tokens)
                     if self.samples.mask or self.samples.skip_boundary else None)
        return batches.apply(self.samples(tokens, documents), lambda t: t[0])
