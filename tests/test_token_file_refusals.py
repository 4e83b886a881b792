"""data=token_files input refused in one line before any worker starts: a file two mixture
sources name, a mixture's malformed names and weights, a vocabulary left unset, and the
keys a user's own data set takes."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import checked

from parallab.config.errors import ConfigError

SEQ = 16
GPT = ["model=gpt", "model.layers=1", "model.heads=2", "model.width=16",
       f"model.context={SEQ}", "model.vocab_size=256", "model.dropout=0", "data=token_files",
       "data.eval_samples=16", "data.batch_size=4", "trainer.checkpoint_every_n_steps=null",
       "device=cpu"]


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    """Three shards and a file of one window, of ids below 256."""
    folder = tmp_path_factory.mktemp("tokens")
    (folder / "shards").mkdir()
    for i in range(3):
        ((np.arange(6000) * 7 + i) % 256).astype(np.uint16).tofile(folder / f"shards/s{i}.bin")
    np.arange(SEQ + 1, dtype=np.uint16).tofile(folder / "one.bin")
    return folder


def test_a_file_two_sources_name_is_refused(root):
    """One source's held-out windows had been the other's training windows, and the file
    drawn by both weights."""
    both = (f"data.sources=[{{name: a, files: {root}/shards/s0.bin, weight: 0.5}}, "
            f"{{name: b, files: '{root}/shards/*.bin', weight: 0.5}}]")
    with pytest.raises(ConfigError, match=r"^data.sources.b.files names \S+/shards/s0.bin, "
                       r"which data.sources.a.files names too: give each file to one "
                       r"source$"):
        checked(*GPT, both)
    apart = (f"data.sources=[{{name: a, files: {root}/shards/s0.bin}}, "
             f"{{name: b, files: '{root}/shards/s[12].bin'}}]")
    checked(*GPT, apart)
