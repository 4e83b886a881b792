"""Pretraining data read in place (data=token_files): flat token files (nanoGPT's .bin,
numpy's .npy) or Megatron-LM's .bin/.idx pairs, memory-mapped, never loaded whole; one
source (data.files) or a weighted mixture (data.sources). The pieces are in pretrain/.

    parallab train model=gpt data=token_files data.files='tokens/train_*.bin' \
        data.dtype=uint16 data.seq_len=1024 trainer.max_steps=100000
    data.sources='[{name: web, files: web/*.bin, weight: 0.7},
                   {name: code, files: code/*.bin, weight: 0.3}]'

A sample is a window of data.seq_len + 1 tokens: for parallab's gpt (x, y) as nanoGPT's
get_batch makes them, for a transformers causal LM {input_ids, labels} (data.sample=auto
picks by the model). The order of samples is global (pretrain/blend.py), and a checkpoint
keeps the next sample's number and the files' fingerprints (pretrain/loader.py), so a
resume starts at once, under any world size or layout, and refuses files that changed.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any, ClassVar, Optional

import numpy as np

from parallab.config.schema import DataConfig
from parallab.data.pretrain import files as token_files
from parallab.data.pretrain.blend import Source, Stream
from parallab.data.pretrain.files import TokenFile
from parallab.data.pretrain.loader import Samples, TokenEvalLoader, TokenLoader
from parallab.data.pretrain.windows import Joined, Windows


@dataclass
class TokenFiles(DataConfig):
    _target_: str = "parallab.data.token_files.TokenFiles"
    files: Any = None  # a glob, a path or a list of them (or data.sources)
    eval_files: Any = None  # null = the last eval_fraction of each source's windows
    eval_fraction: float = 0.01
    eval_samples: Optional[int] = None  # eval windows scored; null = all held out
    sources: Any = None  # [{name, files, weight}, ...]: a mixture, in place of data.files
    dtype: str = "uint16"  # of a flat .bin (a .npy's and an .idx's own dtype stand)
    seq_len: int = 1024  # tokens a sample predicts: windows of seq_len + 1
    vocab_size: Optional[int] = None  # the model's: every token id must be below it
    eos_id: Optional[int] = None  # the end-of-text id that ends each document, if any
    document_mask: bool = False  # attention stays within a document of a packed window
    skip_boundary_target: bool = False  # no loss on a document's first token
    sample: str = "auto"  # auto | pair (gpt's x, y) | causal_lm (input_ids, labels)
    prefetch: int = 2  # batches read ahead on a thread; 0 = in the step
    batch_size: int = 8
    eval_batch_size: int = 8

    name: ClassVar[str] = "token_files"
    # what resume_problem checks itself (the files by where they are and their fingerprints,
    # the windows held out, seq_len), and what decides no training window
    same_data: ClassVar[tuple[str, ...]] = ("files", "eval_files", "sources", "eval_fraction",
                                           "seq_len", "eval_samples", "prefetch", "vocab_size")
    tensors: ClassVar[bool] = False
    whole_steps: ClassVar[bool] = True  # TokenLoader.epoch_samples

    @property
    def next_token(self) -> bool:  # y is x shifted: gpt's targets
        return self.sample != "causal_lm"

    @property
    def input_shape(self) -> list[int]:
        return [self.seq_len]

    def named_sources(self) -> list[tuple[str, Any, float]]:
        if self.sources is None:
            return [("files", self.files, 1.0)]
        return [(s.get("name"), s.get("files"), s.get("weight", 1.0)) for s in self.sources]

    def problem(self) -> Optional[str]:
        from parallab.data.pretrain import checks

        return checks.problem(self)

    def fit_model(self, model: dict[str, Any]) -> None:
        """data.sample=auto: {input_ids, labels} for a transformers model, (x, y) else; and
        data.vocab_size=null: the model's, as conf/data/token_files.yaml interpolates it (a
        project's own TokenFiles YAML without the key had checked no token id)."""
        if self.sample == "auto":
            self.sample = "causal_lm" if _transformers(model) else "pair"
        if self.vocab_size is None:
            self.vocab_size = model_vocabulary(model)

    def layout_problem(self, layout) -> Optional[str]:
        if self.document_mask and layout.cuts_model:
            return ("data.document_mask=true under a layout that cuts the model into stages "
                    "(model, pipeline): the stages pass one tensor between them, not the "
                    "documents: use a layout that keeps the model whole (ddp, fsdp, tp), or "
                    "drop data.document_mask")
        return None

    def resume_problem(self, saved: Any, resume: str) -> Optional[str]:
        from parallab.data.pretrain import checks

        return checks.changed(self, saved, resume)

    def scored_problem(self, saved: Any, ckpt: str) -> Optional[str]:
        from parallab.data.pretrain import checks

        return checks.scored_changed(self, saved, ckpt)

    def sized(self) -> bool:
        return True

    def train_length(self) -> int:
        return len(self.stream(0))

    def marks(self) -> bool:
        return self.document_mask or self.skip_boundary_target

    def opened(self, spec: Any) -> list[TokenFile]:
        return _opened(tuple(token_files.paths(spec)), self.dtype)

    def split(self) -> tuple[list[Source], Windows | Joined]:
        """Each source's training windows, and the eval windows."""
        eos, vocab = self.eos_id, self.vocab_size
        train, held = [], []
        for name, spec, weight in self.named_sources():
            every = Windows(self.opened(spec), self.seq_len, eos_id=eos, vocab=vocab)
            cut = len(every) if self.eval_files is not None else \
                len(every) - max(1, int(len(every) * self.eval_fraction))
            train.append(Source(name, every.part(0, cut), float(weight)))
            held.append(every.part(cut, len(every)))
        if self.eval_files is not None:
            held = [Windows(self.opened(self.eval_files), self.seq_len, eos_id=eos,
                            vocab=vocab)]
        evaluated = held[0] if len(held) == 1 else Joined(held)
        if self.eval_samples is not None and self.eval_samples < len(evaluated):
            evaluated = evaluated.part(0, self.eval_samples) if isinstance(
                evaluated, Windows) else _first(evaluated, self.eval_samples)
        return train, evaluated

    def stream(self, seed: int) -> Stream:
        return Stream(self.split()[0], seed, documents=self.marks())

    def samples(self) -> Samples:
        kind = "pair" if self.sample == "auto" else self.sample
        return Samples(kind, self.document_mask, self.skip_boundary_target)

    def fingerprints(self) -> list[dict[str, Any]]:
        """The training files' (eval files decide no sample a resume trains on)."""
        found = [p for _, spec, _ in self.named_sources() for p in token_files.paths(spec)]
        return [token_files.fingerprint(p) for p in dict.fromkeys(found)]

    def loaders(self, dist, seed: int, batch: int, eval_batch: int, accumulate: int = 1):
        """(train, eval) loaders for this rank (data.build_data asks for them), the training
        one's epochs whole steps of `accumulate` batches."""
        sources, held = self.split()
        stream = Stream(sources, seed, documents=self.marks())
        names = [s.name for s in sources] if self.sources is not None else None
        train = TokenLoader(stream, self.samples(), dist, batch, self.prefetch,
                            self.fingerprints(), names, accumulate)
        return train, TokenEvalLoader(held, self.samples(), dist, eval_batch, seed)

    def make(self, seed: int) -> tuple[Any, Any]:
        """Map-style views of the windows, for a trial batch (checks/trial.py): a source
        the run draws from (the first, at a weight of 0, may hold no training window)."""
        from parallab.data.pretrain.loader import WindowSet

        sources, held = self.split()
        drawn = next(s for s in sources if s.weight > 0 and len(s.windows))
        return WindowSet(drawn.windows, self.samples()), WindowSet(held, self.samples())


def _first(joined: Joined, n: int) -> Joined:
    """`n` of a mixture's held-out windows, each source's share of them as in all of them
    (the first of each, by largest remainder): the first n of them all had been the first
    source's alone, the others never scored."""
    sizes = np.array([len(p) for p in joined.parts], dtype=np.float64)
    exact = n * sizes / sizes.sum()
    counts = np.floor(exact).astype(np.int64)
    for i in np.argsort(counts - exact)[:n - int(counts.sum())].tolist():
        counts[i] += 1
    return Joined([p.part(0, int(c)) for p, c in zip(joined.parts, counts) if c])


@lru_cache(maxsize=32)
def _opened_at(paths: tuple[str, ...], dtype: str, stamps: tuple) -> list[TokenFile]:
    return [token_files.open_tokens(p, dtype) for p in paths]


def _opened(paths: tuple[str, ...], dtype: str) -> list[TokenFile]:
    """The files memory-mapped, once per version of them (size and mtime)."""
    stamps = tuple((Path(p).stat().st_size, Path(p).stat().st_mtime_ns)
                   if Path(p).is_file() else None for p in paths)
    return _opened_at(paths, dtype, stamps)


def model_vocabulary(model: dict[str, Any]) -> Optional[int]:
    """The vocabulary a model spec states (model.vocab_size, or its config's), else None."""
    config = model.get("config")
    for vocab in (model.get("vocab_size"),
                  config.get("vocab_size") if isinstance(config, dict) else None):
        if isinstance(vocab, int) and not isinstance(vocab, bool):
            return vocab
    return None


def _transformers(model: dict[str, Any]) -> bool:
    """The model spec builds a transformers model (its class, or its config's)."""
    target = str(model.get("_target_", ""))
    config = model.get("config")
    config_target = str(config.get("_target_", "")) if isinstance(config, dict) else ""
    if target.startswith("transformers.") or config_target.startswith("transformers."):
        return True
    if "transformers" not in sys.modules:
        return False
    from parallab.config import targets
    from transformers import PreTrainedModel

    try:
        found = targets.locate(target, "model._target_")
    except Exception:  # noqa: BLE001 - models.check names it
        return False
    return isinstance(found, type) and issubclass(found, PreTrainedModel)

