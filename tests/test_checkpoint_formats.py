"""Each checkpoint file format is one class in formats.FORMATS that writes and reads a run's
training state: the Checkpointer writes in the layout's, and `latest`, pruning and resume
find and read checkpoints by the registry alone."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from parallab.training import checkpoint, formats
from parallab.training.checkpoint import Checkpointer

ONE = SimpleNamespace(backend=None, world_size=1, rank=0, is_main=True,
                      device=torch.device("cpu"))


def _state(step: int) -> dict:
    return {"model": {"fc.weight": torch.full((2, 2), float(step))},
            "optimizer": {"state.fc.weight.step": torch.tensor(float(step))},
            "step": step, "epoch_step": step}


def test_the_layout_picks_the_checkpoint_format(tmp_path):
    assert Checkpointer(tmp_path, ONE, {}, 3).format is formats.TorchFile
    assert Checkpointer(tmp_path, ONE, {}, 3, sharded=True).format is formats.Sharded


def test_a_new_checkpoint_format_is_one_class_and_one_registry_line(tmp_path, monkeypatch):
    """Registered first, a format is what the Checkpointer writes; latest, pruning, the
    resume checks and resume itself find and read it by its suffix, and the .pt files
    written before it was are pruned with its own, by step (keep_last_k in all)."""
    class Pth(formats.TorchFile):
        said, checkpoint_suffix = ".pth (torch's other suffix)", ".pth"

        @staticmethod
        def holds(path):
            return path.suffix == ".pth" and not path.is_dir()

    Checkpointer(tmp_path, ONE, {"model": {}}, keep_last_k=2).save(_state(1), "step_00000001")
    monkeypatch.setattr(formats, "FORMATS", [Pth, *formats.FORMATS])
    checkpointer = Checkpointer(tmp_path, ONE, {"model": {}}, keep_last_k=2)
    for step in (2, 3, 4):
        assert checkpointer.save(_state(step), checkpoint.periodic_name(step)).suffix == ".pth"
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "step_00000003.pth", "step_00000004.pth"]
    newest = checkpoint.latest(tmp_path)
    assert newest.name == "step_00000004.pth"
    meta = checkpoint.load_meta(newest)
    assert meta["step"] == 4 and meta["config"] == {"model": {}}
    assert checkpoint.resumable(newest, meta) and checkpoint.by_name(newest, meta)
    template = {"model": {"fc.weight": torch.zeros(2, 2)},
                "optimizer": {"state.fc.weight.step": torch.tensor(0.0)}}
    state = checkpoint.read_state(newest, template)
    assert torch.equal(state["model"]["fc.weight"], torch.full((2, 2), 4.0))
    assert len(state["rng"]) == 1


def test_a_sharded_checkpoint_is_written_and_read_by_its_format(tmp_path):
    """One process in a gloo group: the .dcp directory, its trainer.pt beside the shards,
    read back into a template, and found by latest."""
    import torch.distributed as dist

    if dist.is_initialized():
        pytest.skip("a process group is already up in this process")
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1),
                            rank=0, world_size=1)
    try:
        ranks = SimpleNamespace(**{**vars(ONE), "backend": "gloo"})
        path = Checkpointer(tmp_path / "c", ranks, {"model": {}}, 3, sharded=True).save(
            _state(5), "last")
    finally:
        dist.destroy_process_group()
    assert path.name == "last.dcp" and (path / checkpoint.SHARDED_META).is_file()
    assert checkpoint.latest(tmp_path / "c") == path
    assert set(checkpoint.load_meta(path)) == {"step", "epoch_step", "rng", "config"}
    template = {"model": {"fc.weight": torch.zeros(2, 2)},
                "optimizer": {"state.fc.weight.step": torch.tensor(0.0)}}
    state = checkpoint.read_state(path, template)
    assert torch.equal(state["model"]["fc.weight"], torch.full((2, 2), 5.0))
    assert state["optimizer"]["state.fc.weight.step"].item() == 5.0


def test_a_run_resumed_in_another_format_keeps_its_newest_and_no_stale_best(tmp_path):
    """Resumed under a layout of the other format: the periodic checkpoints are pruned by
    step whatever their format (each format kept its own keep_last_k), and best.dcp goes
    once best.pt is saved (the earlier layout's stood beside it, naming another step)."""
    folder = tmp_path / "c"
    folder.mkdir()
    for name in ("step_00000002.dcp", "step_00000004.dcp", "best.dcp", "last.dcp"):
        (folder / name).mkdir()  # the earlier layout's (their contents are not read)
    saver = Checkpointer(folder, ONE, {"model": {}}, 2)
    saver.save(_state(6), "step_00000006")
    saver.save(_state(6), "best")
    assert sorted(p.name for p in folder.iterdir()) == [
        "best.pt", "last.dcp", "step_00000004.dcp", "step_00000006.pt"]


def test_a_sharded_index_read_for_weights_goes_through_the_allow_list(tmp_path):
    """Reading a .dcp's shapes (trainer.init_from, evaluate, export) unpickled its index with
    torch's own reader, which runs whatever class the index names."""
    import fractions
    import pickle

    from parallab.training.checkpoint import CheckpointError

    index = tmp_path / "evil.dcp"
    index.mkdir()
    (index / ".metadata").write_bytes(pickle.dumps(fractions.Fraction(1, 3)))
    with pytest.raises(CheckpointError, match="refusing to load"):
        formats.Sharded(index).shapes()
