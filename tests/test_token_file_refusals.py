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


def own_yaml(tmp_path, root, name: str = "high.bin"):
    """A project's own TokenFiles option that leaves vocab_size out, over a file holding
    id 300 (ids 0..299: the sampled check reads it)."""
    (tmp_path / "data").mkdir()
    np.arange(300, dtype=np.uint16).repeat(4).tofile(root / name)
    (tmp_path / "data" / "mytok.yaml").write_text(
        f"_target_: parallab.data.token_files.TokenFiles\nfiles: {root}/{name}\n"
        f"seq_len: {SEQ}\nbatch_size: 4\neval_batch_size: 4\n")
    return tmp_path


def test_an_own_token_files_option_without_a_vocabulary_checks_ids_by_the_models(
        root, tmp_path):
    """Its vocab_size null had skipped every id check (the run ended in the embedding's
    IndexError), and model=gpt was refused as if the files held no sequences."""
    project = own_yaml(tmp_path, root)
    model = [o for o in GPT if o.startswith("model.")]
    with pytest.raises(ConfigError, match=r"high.bin holds token id 299 .at token \d+., not "
                       r"in a vocabulary of 256"):
        checked("model=gpt", *model, "data=mytok", "device=cpu", config_dir=project)
    cfg, _ = checked("model=gpt", *model, "model.vocab_size=512", "data=mytok", "device=cpu",
                     config_dir=project)
    assert cfg.data.vocab_size == 512


def test_a_key_an_own_data_option_leaves_out_is_said_as_plus_the_key(root, tmp_path):
    """data.vocab_size=256 had been answered "did you mean data.eval_batch_size?"."""
    from parallab.config.hydra_app import hydra_line

    project = own_yaml(tmp_path, root)
    for given, said in (("data.vocab_size=256", "data=mytok leaves out vocab_size, a key of "
                         "data set TokenFiles: add it with +data.vocab_size=256"),
                        ("data.vocab_sz=256", "did you mean data.vocab_size?")):
        argv = ["--config-dir", str(project), "model=gpt", "data=mytok", given]
        with pytest.raises(Exception) as refused:
            checked("model=gpt", "data=mytok", given, config_dir=project)
        assert said in hydra_line(refused.value, argv)
    cfg, _ = checked("model=gpt", "model.vocab_size=512", "data=mytok", "+data.vocab_size=300",
                     "device=cpu", config_dir=project)
    assert cfg.data.vocab_size == 300


def test_a_first_source_at_weight_0_without_a_training_window_is_taken(root):
    """The trial batch had been read from the first source, whatever its weight: one whose
    one window is held out ended the check in an IndexError."""
    mix = (f"data.sources=[{{name: a, files: {root}/one.bin, weight: 0}}, "
           f"{{name: b, files: {root}/shards/s0.bin, weight: 1}}]")
    cfg, _ = checked(*GPT, mix)
    trial, _ = cfg.data.make(cfg.seed)
    assert len(trial) == len(cfg.data.split()[0][1].windows) > 0


def test_a_sources_weight_of_true_and_a_null_name_are_refused(root):
    """weight: true had drawn at 1 (a bool is an int) and name: null reported its tokens
    under 'None'."""
    shard = f"{root}/shards/s0.bin"
    for source, said in (
            (f"{{name: a, files: {shard}, weight: true}}", r"^data.sources: a's weight True is "
             r"not a share: give a number >= 0"),
            (f"{{name: null, files: {shard}, weight: 1}}", r"^data.sources: source 2 of 2 has "
             r"no name \(name: None\): give each source a name"),
            (f"{{name: '', files: {shard}, weight: 1}}", r"source 2 of 2 has no name \(name: "
             r"''\)")):
        with pytest.raises(ConfigError, match=said):
            checked(*GPT, f"data.sources=[{{name: b, files: {root}/shards/s1.bin}}, {source}]")


def test_a_run_its_loader_finds_no_full_batch_or_step_for_is_refused_before_launch(root):
    """The check before launch rounded each rank's share up to a batch, where the loader
    drops what is short of one: the workers started, then rank 0 refused the run. s0.bin's
    374 windows of 17 tokens, 3 held out: 371 to train on, 185 full batches at 2 ranks."""
    ddp = [*GPT, f"data.files={root}/shards/s0.bin", "parallel=ddp", "parallel.world_size=2",
           "trainer.max_steps=2"]
    with pytest.raises(ConfigError, match=r"^an epoch of the data gives each rank no full "
                       r"batch of data.batch_size=186: lower data.batch_size"):
        checked(*ddp, "data.batch_size=186")
    with pytest.raises(ConfigError, match=r"^trainer.accumulate_grad_batches=4 is more than "
                       r"the 3 batches an epoch of the data gives each rank"):
        checked(*ddp, "data.batch_size=60", "trainer.accumulate_grad_batches=4")
    checked(*ddp, "data.batch_size=185")


def test_a_key_the_data_set_lacks_added_with_plus_names_the_key_meant(root):
    """+data.flies=x had said "data.flies: Key 'flies' not (data set TokenFiles)"."""
    files = f"data.files={root}/shards/s0.bin"
    with pytest.raises(ConfigError, match=r"^data.flies is not a key of data set TokenFiles: "
                       r"did you mean data.files\?$"):
        checked(*GPT, files, "+data.flies=x")
    with pytest.raises(ConfigError, match=r"^data.zzzqqq is not a key of data set TokenFiles: "
                       r"drop it$"):
        checked(*GPT, files, "+data.zzzqqq=x")


def test_a_checkpoint_whose_token_file_changed_is_not_scored_on_other_windows(tmp_path, root):
    """evaluate.py of a run's checkpoint scores the windows the run held out of its files:
    a file cut since gave others, some trained on, without a word. data.eval_files scores
    windows of its own."""
    import shutil

    from parallab.cli import train_in_process
    from parallab.commands import evaluate_in_process

    data = tmp_path / "a.bin"
    shutil.copy(root / "shards" / "s0.bin", data)
    train_in_process([*GPT, f"data.files={data}", "trainer.max_steps=2"], tmp_path / "run")
    ckpt = tmp_path / "run" / "checkpoints" / "last.pt"
    evaluate_in_process([f"ckpt={ckpt}", "device=cpu"], tmp_path / "scored")
    np.fromfile(data, np.uint16)[:3000].tofile(data)  # cut since
    with pytest.raises(ConfigError, match=rf"^ckpt={ckpt}: {data} changed since the run "
                                          r"trained on it \(its size or contents\)"):
        evaluate_in_process([f"ckpt={ckpt}", "device=cpu"], tmp_path / "again")
    evaluate_in_process([f"ckpt={ckpt}", "device=cpu", f"data.eval_files={root}/shards/s1.bin"],
                        tmp_path / "other")
