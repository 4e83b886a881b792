"""data=token_files' checks before launch, each a line that names the key and the fix:
its keys, a mixture's names and weights, the files (there, readable, an .idx matching its
.bin, at least one window long), a dtype that holds the model's vocabulary and token ids
below it (a sampled check), document boundaries where asked for; and, resuming, files that
changed since the checkpoint."""

from __future__ import annotations

import math
import os
from typing import Any, Optional

import numpy as np

from parallab.data.pretrain import blend
from parallab.data.pretrain import files as token_files
from parallab.data.pretrain.files import DTYPES, FileProblem, TokenFile
from parallab.data.pretrain.loader import SAMPLES

SAMPLED_SLICES, SLICE_TOKENS = 16, 4096  # ids read per file: 64 Ki tokens, spread out
SOURCE_KEYS = {"name", "files", "weight"}


def problem(cfg) -> Optional[str]:
    return _keys(cfg) or _sources(cfg) or _files(cfg) or _left_to_train(cfg)


def _keys(cfg) -> Optional[str]:
    # its reader is its own (a thread, data.prefetch): DataLoader workers had been dropped
    if cfg.num_workers:
        return (f"data.num_workers={cfg.num_workers}: data=token_files reads its windows in "
                "place on a thread of its own, no DataLoader: drop it (data.prefetch sets the "
                "batches read ahead)")
    if cfg.dtype not in DTYPES:
        return f"data.dtype={cfg.dtype} is unknown: use uint16 or uint32"
    if cfg.sample not in SAMPLES:
        return f"data.sample={cfg.sample} is unknown: use {', '.join(SAMPLES)}"
    for key, low in (("seq_len", 1), ("prefetch", 0), ("eval_samples", 1)):
        value = getattr(cfg, key)
        if value is not None and value < low:
            return f"data.{key}={value} is out of range: it must be >= {low}"
    if cfg.eval_files is None and not 0 < cfg.eval_fraction < 1:
        return (f"data.eval_fraction={cfg.eval_fraction} is out of range: it must be in (0, 1)"
                " (or give data.eval_files)")
    if (cfg.files is None) == (cfg.sources is None):
        return ("data.files and data.sources are both set: give one (data.sources is a mixture "
                "of several)" if cfg.files is not None else "data.files is not set: give "
                "token files (a glob, a path or a list), or data.sources")
    vocab = cfg.vocab_size
    if cfg.eos_id is not None and (cfg.eos_id < 0 or (vocab is not None and cfg.eos_id >= vocab)):
        return (f"data.eos_id={cfg.eos_id} is no token id of the vocabulary of {vocab}: give "
                "the tokenizer's end-of-text id")
    return None


def _sources(cfg) -> Optional[str]:
    if cfg.sources is None:
        return None
    if not isinstance(cfg.sources, (list, tuple)) or not cfg.sources or not all(
            isinstance(s, dict) and {"name", "files"} <= set(s) for s in cfg.sources):
        return ("data.sources is not a list of {name, files, weight}: give e.g. "
                "data.sources='[{name: web, files: web/*.bin, weight: 0.7}, ...]'")
    unnamed = next((i for i, s in enumerate(cfg.sources)
                    if s["name"] is None or not str(s["name"]).strip()), None)
    if unnamed is not None:  # its tokens had been reported under 'None'
        return (f"data.sources: source {unnamed + 1} of {len(cfg.sources)} has no name (name:"
                f" {cfg.sources[unnamed]['name']!r}): give each source a name (web, code, ...)")
    for s in cfg.sources:  # a misspelt weight would otherwise leave the source at 1
        extra = sorted(set(s) - SOURCE_KEYS)
        if extra:
            return (f"data.sources: {s['name']} has {', '.join(map(str, extra))}, which a "
                    "source does not take: give each source name, files and weight alone")
    names = [str(s["name"]) for s in cfg.sources]
    twice = next((n for n in names if names.count(n) > 1), None)
    if twice is not None:
        return f"data.sources names {twice} twice: give each source a name of its own"
    for name, _, weight in cfg.named_sources():
        if isinstance(weight, bool) or not isinstance(weight, (int, float)) or \
                not math.isfinite(weight) or weight < 0:  # true had been taken as 1
            return (f"data.sources: {name}'s weight {weight!r} is not a share: give a number "
                    ">= 0 (they need not sum to 1)")
    if sum(w for _, _, w in cfg.named_sources()) <= 0:
        return "data.sources' weights sum to 0: give at least one source a weight > 0"
    return None


def _files(cfg) -> Optional[str]:
    specs = [(f"data.sources.{n}.files" if cfg.sources is not None else "data.files", s,
              token_files.paths(s)) for n, s, _ in cfg.named_sources()]
    if cfg.eval_files is not None:
        trained = {os.path.realpath(p) for *_, paths in specs for p in paths}
        evaluated = token_files.paths(cfg.eval_files)
        scored = next((p for p in evaluated if os.path.realpath(p) in trained), None)
        if scored is not None:
            return (f"data.eval_files names {scored}, which the run trains on: give held-out "
                    "files, or leave data.eval_files out (data.eval_fraction holds out the "
                    "end of each file)")
        specs.append(("data.eval_files", cfg.eval_files, evaluated))
    window = cfg.seq_len + 1
    owner: dict[str, str] = {}  # each trained file's source: one file in two had been
    # drawn by both weights, and one source's held-out windows the other's training ones
    for key, spec, paths in specs:
        if not paths:
            return (f"{key}={spec} matches no file: give token files (a glob, a path or a "
                    "list); `parallab prepare-data` writes them from text")
        # each glob of a list: one matching nothing (a typo) had dropped its files unsaid
        missing = next((i for i in spec if not token_files.paths(i)), None) \
            if isinstance(spec, (list, tuple)) else None
        if missing is not None:
            return f"{key}: {missing} matches no file: correct it, or drop it from the list"
        where = [os.path.realpath(p) for p in paths]
        twice = next((p for p, w in zip(paths, where) if where.count(w) > 1), None)
        if twice is not None:  # its windows drawn twice as often, unsaid
            return f"{key} names {twice} twice: name each file once"
        shared = next((p for p, w in zip(paths, where) if owner.get(w, key) != key), None)
        if shared is not None:
            return (f"{key} names {shared}, which {owner[os.path.realpath(shared)]} names "
                    "too: give each file to one source")
        if key != "data.eval_files":
            owner.update(dict.fromkeys(where, key))
        try:
            opened = cfg.opened(spec)
        except FileProblem as error:
            return f"{key}: {error}"
        for file in opened:
            found = _file_problem(cfg, file, window)
            if found:
                return f"{key}: {found}"
    return None


def _left_to_train(cfg) -> Optional[str]:
    """Each source that is drawn keeps a window to train on once data.eval_fraction holds
    out the last of its windows (TokenFiles.split, the files opened once)."""
    if cfg.eval_files is not None:
        return None
    for source in cfg.split()[0]:
        if source.weight and not len(source.windows):
            key = f"data.sources.{source.name}.files" if cfg.sources is not None else \
                "data.files"
            return (f"{key}: its {source.windows.total} window(s) of data.seq_len + 1 tokens "
                    f"are all held out for evaluation (data.eval_fraction="
                    f"{cfg.eval_fraction}, at least one): give more tokens, a shorter "
                    "data.seq_len, or data.eval_files")
    return None


def _file_problem(cfg, file: TokenFile, window: int) -> Optional[str]:
    if len(file) < window:
        return (f"{file.path} holds {len(file)} tokens, fewer than one window of "
                f"data.seq_len + 1 = {window}: give a longer file, or a shorter data.seq_len")
    vocab = cfg.vocab_size
    dtype = file.tokens.dtype
    if vocab is not None and vocab - 1 > np.iinfo(dtype).max:
        return (f"{file.path} holds {dtype} ids (below {np.iinfo(dtype).max + 1}), too few for "
                f"a vocabulary of {vocab} (data.vocab_size: the model's unless given): write "
                "the files as uint32 and set "
                "data.dtype=uint32")
    sampled = _sampled(file.tokens)  # read once for both checks
    if file.tokens.dtype == np.uint16 and not file.marks_documents and \
            not file.path.endswith(".npy") and _halves_of_uint32(sampled):
        return (f"{file.path} reads as uint16 ids of which every second one is 0 or 1, as "
                "the high halves of uint32 ids are: set data.dtype=uint32 (as it was written)")
    if vocab is not None:
        high, at = sampled_max(sampled)
        if high >= vocab or high < 0:
            return (f"{file.path} holds token id {high} (at token {at}), not in a vocabulary "
                    f"of {vocab} (data.vocab_size: the model's unless given): give data.dtype "
                    "as the file was written, or a vocabulary that holds the tokenizer's")
    if cfg.marks() and not file.marks_documents and cfg.eos_id is None:
        key = "document_mask" if cfg.document_mask else "skip_boundary_target"
        return (f"data.{key}=true needs document boundaries, which {file.path} does not mark: "
                "set data.eos_id (the end-of-text id between documents) or give Megatron-LM "
                ".bin/.idx pairs")
    return None


def _sampled(tokens: np.ndarray) -> list[tuple[int, np.ndarray]]:
    """SAMPLED_SLICES slices of SLICE_TOKENS ids spread over the file, read: (start, ids)."""
    starts = np.linspace(0, max(0, len(tokens) - SLICE_TOKENS), SAMPLED_SLICES)
    return [(start, np.asarray(tokens[start:start + SLICE_TOKENS]))
            for start in np.unique(starts.astype(np.int64)).tolist()]


def _halves_of_uint32(sampled: list[tuple[int, np.ndarray]]) -> bool:
    """Every second id of the sampled slices (by place in the file) 0 or 1 and the others
    not all so: uint32 ids below 131072 read as uint16, a mistake no id check sees (each
    half is a small id)."""
    odd = np.concatenate([chunk[1 - start % 2::2] for start, chunk in sampled])
    even = np.concatenate([chunk[start % 2::2] for start, chunk in sampled])
    return len(odd) >= 64 and int(odd.max()) <= 1 and int(even.max()) > 1


def sampled_max(sampled: list[tuple[int, np.ndarray]]) -> tuple[int, int]:
    """The largest id (or a negative one) among the sampled slices (_sampled), and where it
    is: a wrong dtype shows in any slice, so a sample finds it."""
    worst, where = -1, 0
    for start, chunk in sampled:
        low, high = int(chunk.min()), int(chunk.max())
        if low < 0:
            return low, start + int(chunk.argmin())
        if high > worst:
            worst, where = high, start + int(chunk.argmax())
    return worst, where


def changed(cfg, saved: Any, resume: str) -> Optional[str]:
    """A checkpoint's data (its files' fingerprints and their order, seq_len, the windows
    held out, a mixture's sources, their order and weights) that differs here: one line
    naming what changed. A run must not go on on other data. Files are told by where they
    are, however the path is written."""
    if not isinstance(saved, dict) or "files" not in saved:
        return None
    scored = {_where(p) for p in token_files.paths(cfg.eval_files)}  # (an earlier record's)
    before = {_where(f["path"]): f for f in saved["files"] if _where(f["path"]) not in scored}
    now = {_where(f["path"]): f for f in cfg.fingerprints()}
    for where, print_ in before.items():
        path = print_["path"]
        if where not in now:
            return (f"trainer.resume={resume} was saved reading {path}, which this run's "
                    "data does not name (or no longer exists): give the files it was saved "
                    "with, or start a new run")
        if not _same_file(print_, now[where]):
            return (f"trainer.resume={resume}: {path} changed since the checkpoint (its size or "
                    "contents): the next samples would be others; put the file back as it was, "
                    "or start a new run")
    added = next((now[w]["path"] for w in now if w not in before), None)
    if added is not None:
        return (f"trainer.resume={resume} was saved without {added}, which this run's data "
                "adds: the order of samples would change; drop it, or start a new run")
    weights = {n: float(w) for n, _, w in cfg.named_sources()} if cfg.sources else None
    was = saved.get("sources") or None
    if not _same_shares(was, weights):
        return (f"trainer.resume={resume} was saved with data.sources {was}, here {weights}: "
                "give their names, order and weights as saved, or start a new run")
    if list(before) != list(now):
        return (f"trainer.resume={resume} was saved reading its files in another order ("
                f"{', '.join(f['path'] for f in before.values())}): the order of samples "
                "would change; give them in that order, or start a new run")
    if saved.get("seq_len") != cfg.seq_len:
        return (f"trainer.resume={resume} was saved at data.seq_len={saved.get('seq_len')}: "
                "give it again, or start a new run")
    # the files, their order and seq_len as saved, a source's count of training windows
    # moves only with the share held out: windows it evaluated would be trained on
    windows = [len(s.windows) for s in cfg.split()[0]]
    if saved.get("windows", windows) != windows:
        counts = [" + ".join(map(str, w)) for w in (saved["windows"], windows)]
        why = "its files lie in other sources" if sum(saved["windows"]) == sum(windows) else \
            "data.eval_files takes the place of the share held out" if cfg.eval_files else \
            f"data.eval_fraction={cfg.eval_fraction} holds out another share"
        return (f"trainer.resume={resume} was saved training on {counts[0]} windows, here "
                f"{counts[1]}: {why}; give it as saved, or start a new run")
    return None


def _same_shares(was: dict | None, now: dict | None) -> bool:
    """The same sources in the same order, drawn as the blend draws them: the same period
    and counts in it (weights 7 and 3 are 0.7 and 0.3 there)."""
    if not was or not now:
        return was == now
    if list(was) != list(now):
        return False
    periods = [blend.period_of(list(w.values())) for w in (was, now)]
    return periods[0] == periods[1] and (blend.counts(list(was.values()), periods[0]) ==
                                         blend.counts(list(now.values()), periods[1])).all()


def scored_changed(cfg, saved: Any, ckpt: str) -> Optional[str]:
    """A file the run at `ckpt` held windows out of, changed since: its held-out windows
    would be others here, some of them trained on (evaluate.py had scored them without a
    word). None where data.eval_files gives the windows to score."""
    if cfg.eval_files is not None or not isinstance(saved, dict) or "files" not in saved:
        return None
    now = {_where(f["path"]): f for f in cfg.fingerprints()}
    for print_ in saved["files"]:
        found = now.get(_where(print_["path"]))
        if found is not None and not _same_file(print_, found):
            return (f"ckpt={ckpt}: {print_['path']} changed since the run trained on it (its "
                    "size or contents): the windows held out of it would be others, some of "
                    "them trained on; put the file back as it was, or score other windows "
                    "with data.eval_files=FILE")
    return None


def _same_file(saved: dict, now: dict) -> bool:
    """Two fingerprints of one file (its size and sampled contents), however its path is
    written."""
    return {**saved, "path": None} == {**now, "path": None}


def _where(path: str) -> str:
    return os.path.realpath(path)
