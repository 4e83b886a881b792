"""data=token_files where a batch is read: a token id outside the model's vocabulary that
the start's sampled check missed ends the rank with one line naming the file, not a
traceback from the embedding."""

from __future__ import annotations

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
        "of 256 (data.vocab_size): set model.vocab_size to the tokenizer's vocabulary, or "
        "tokenize the file again with the model's tokenizer")
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
        "of 256 (data.vocab_size): set model.vocab_size to the tokenizer's vocabulary, or "
        "tokenize the file again with the model's tokenizer")
