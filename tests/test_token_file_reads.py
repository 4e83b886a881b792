"""data=token_files where a batch is read: a token id outside the model's vocabulary that
the start's sampled check missed, and a file cut short under the running reader, each end
the rank with one line naming the file, not a traceback from the embedding or SIGBUS."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import numpy as np
import pytest
from conftest import output, run_entry

from parallab.data.pretrain import checks
from parallab.data.pretrain import files as token_files
from parallab.data.pretrain.windows import TokenIdOutOfRange, Windows

SEQ = 16
GPT = ["model=gpt", "model.layers=1", "model.heads=2", "model.width=16",
       f"model.context={SEQ}", "model.vocab_size=256", "model.dropout=0", "data=token_files",
       "data.eval_samples=16", "data.batch_size=8", "trainer.checkpoint_every_n_steps=null",
       "device=cpu"]
BAD_AT = 100_007  # between two of the start's sampled slices


@pytest.fixture(scope="module")
def one_bad_id(tmp_path_factory):
    """200,000 uint16 ids below 256 but one, 300, where the start's slices do not look."""
    path = tmp_path_factory.mktemp("tokens") / "train.bin"
    tokens = np.random.default_rng(0).integers(0, 256, 200_000).astype(np.uint16)
    tokens[BAD_AT] = 300
    tokens.tofile(path)
    sampled = checks._sampled(np.memmap(path, dtype=np.uint16, mode="r"))
    assert checks.sampled_max(sampled)[0] < 256  # the start's check passes it
    return path


def test_a_read_of_an_id_outside_the_vocabulary_names_the_file_its_place_and_the_fix(
        one_bad_id):
    opened = token_files.open_tokens(str(one_bad_id), "uint16")
    windows = Windows([opened, opened], SEQ, vocab=256).part(10, 2 * (200_000 // SEQ))
    inside = (BAD_AT - 3) // SEQ - 10  # the window holding it, numbered from the part's start
    assert windows.read(np.array([0, inside - 1])).max() < 256
    with pytest.raises(TokenIdOutOfRange) as raised:
        windows.read(np.array([0, inside, 5]))
    assert str(raised.value) == (
        f"{one_bad_id} holds token id 300 at token {BAD_AT}, not in the model's vocabulary "
        "of 256 (data.vocab_size): set the model's vocabulary to the tokenizer's "
        "(model.vocab_size; model.config.vocab_size for a transformers model), or tokenize "
        "the file again with the model's tokenizer")
    assert raised.value.status == 2
    # a file whose dtype holds no id outside the vocabulary reads unchecked
    assert not Windows([opened], SEQ, vocab=1 << 16).checked


def test_a_signed_file_s_negative_id_is_refused_where_it_is_read(tmp_path):
    path = tmp_path / "ids.npy"
    tokens = np.arange(4 * SEQ, dtype=np.int32) % 200
    tokens[SEQ + 3] = -1
    np.save(path, tokens)
    windows = Windows([token_files.open_tokens(str(path), "uint16")], SEQ, vocab=256)
    with pytest.raises(TokenIdOutOfRange, match=rf"{path} holds token id -1 at token "
                                                 rf"{SEQ + 3},"):
        windows.read(np.array([0, 1]))


def test_training_on_an_id_outside_the_vocabulary_ends_in_one_line_with_exit_status_2(
        one_bad_id, tmp_path):
    """The batch is read on the reader thread; the run ends with its line, no IndexError
    from the embedding's traceback."""
    result = run_entry("train.py", [*GPT, f"data.files={one_bad_id}", "data.batch_size=64",
                                    "trainer.max_steps=400"], tmp_path / "run")
    said = output(result)
    assert result.returncode == 2, said[-3000:]
    assert "Traceback" not in said and "IndexError" not in said
    assert said.strip().splitlines()[-1].endswith(
        f"{one_bad_id} holds token id 300 at token {BAD_AT}, not in the model's vocabulary "
        "of 256 (data.vocab_size): set the model's vocabulary to the tokenizer's "
        "(model.vocab_size; model.config.vocab_size for a transformers model), or tokenize "
        "the file again with the model's tokenizer")


@pytest.mark.parametrize("pair", [False, True], ids=["flat", "idx"])
def test_a_file_cut_short_under_the_reader_is_one_line_not_sigbus(tmp_path, pair):
    """A read past a flat file's new end had ended the process by SIGBUS (a memmap of a
    file that shrank), an .idx cut within its last page read zeros as document starts:
    the read is refused naming the file, in a process of its own since SIGBUS would end
    this one."""
    documents = [np.arange(1, 2_000, dtype=np.uint16) % 256 for _ in range(64)]
    bin_ = tmp_path / "train.bin"
    if pair:
        token_files.write_indexed(tmp_path / "train", documents)
    else:
        np.concatenate(documents).tofile(bin_)
    cut = tmp_path / "train.idx" if pair else bin_
    size = cut.stat().st_size
    script = textwrap.dedent(f"""
        import os, numpy as np
        from parallab.data.pretrain.files import FileCutShort, open_tokens
        from parallab.data.pretrain.windows import Windows
        windows = Windows([open_tokens({str(bin_)!r}, "uint16")], {SEQ})
        last = np.array([len(windows) - 1])
        windows.read(last)
        os.truncate({str(cut)!r}, os.path.getsize({str(cut)!r}) // 4)
        try:
            tokens = windows.read(last)
            if windows.files[0].marks_documents:
                windows.documents(last, tokens)
        except FileCutShort as error:
            print(error)
    """)
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0, f"exit {result.returncode}: {output(result)[-2000:]}"
    assert result.stdout.strip() == (
        f"{cut} is {cut.stat().st_size} bytes, {size} when the run mapped it: it was changed "
        "(cut short or written again) while the run read it; put the file back as it was "
        "and resume (trainer.resume=auto), or start a new run on the new file")
