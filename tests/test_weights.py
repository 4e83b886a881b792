"""Weights in and out: a checkpoint exported as a torch file, one safetensors file or a folder
(a transformers model's from_pretrained folder) and each read back; runs started from weights
(trainer.init_from) under any layout, strict about what fits; a transformers model built by
from_pretrained from a local folder."""

from __future__ import annotations

import re

import pytest
import torch
from conftest import FAST, REPO, losses, read_metrics

from parallab.cli import train_in_process
from parallab.commands import _export, evaluate_in_process
from parallab.config.errors import ConfigError
from parallab.training import checkpoint, formats, weights

MLP = [*FAST, "model=mlp", "model.hidden=[64,32]", "data.shape=[1,8,8]", "optim.lr=0.05",
       "trainer.log_every_n_steps=1", "trainer.checkpoint_every_n_steps=null",
       "trainer.save_best=false"]
LLAMA = REPO / "examples" / "hf_llama"
HF_RUN = ["experiment=llama", "device=cpu", "trainer.log_every_n_steps=1",
          "data.train.size=160", "data.eval.size=64", "trainer.save_best=false"]


def same_weights(model: torch.nn.Module, state: dict[str, torch.Tensor]) -> None:
    for name, tensor in model.state_dict().items():
        torch.testing.assert_close(tensor, state[name], rtol=0, atol=0)


@pytest.fixture(scope="module")
def fsdp_run(tmp_path_factory):
    """An mlp trained 4 steps under fsdp on 2 ranks: a sharded .dcp checkpoint."""
    run_dir = tmp_path_factory.mktemp("weights") / "fsdp"
    train_in_process([*MLP, "trainer.max_steps=4", "parallel=fsdp", "parallel.world_size=2",
                      "data.batch_size=32"], run_dir)
    return run_dir


@pytest.mark.distributed
def test_export_writes_each_format_and_each_reads_back(fsdp_run, tmp_path):
    """From the sharded checkpoint, in this one process: .pt, .safetensors and a folder,
    each holding the checkpoint's weights and its run's config; OUT is never replaced
    without --force."""
    from parallab.models import build_model

    ckpt = fsdp_run / "checkpoints" / "last.dcp"
    spec = checkpoint.saved_model(checkpoint.load_meta(ckpt), ckpt)
    whole = weights.model_from(ckpt, build_model(spec)).state_dict()
    for out in (tmp_path / "m.pt", tmp_path / "m.safetensors", tmp_path / "folder"):
        _export(ckpt, out)
        same_weights(weights.model_from(out, build_model(spec)), whole)
        assert weights.record(out)["config"]["model"] == spec
        assert weights.record(out)["step"] == 4  # the step it was exported at
        with pytest.raises(ConfigError, match="exists: give a new name, or --force"):
            _export(ckpt, out)
    (tmp_path / "m.safetensors").write_bytes(b"mine")
    _export(ckpt, tmp_path / "m.safetensors", force=True)
    same_weights(weights.model_from(tmp_path / "m.safetensors", build_model(spec)), whole)
    with pytest.raises(ConfigError, match="export writes .pt"):
        _export(ckpt, tmp_path / "m.bin")
    # as a user reads it back: evaluate.py scores the folder as the run scored its weights
    evaluate_in_process([f"ckpt={tmp_path / 'folder'}"], tmp_path / "eval")
    assert read_metrics(tmp_path / "eval")["eval_loss"] == pytest.approx(
        read_metrics(fsdp_run)["eval_loss"], rel=1e-5)
    assert read_metrics(tmp_path / "eval")["step"] == 4
    # its record damaged: one line naming it, as any damaged checkpoint's (a traceback)
    for text, says in (("{", r"is not JSON \(JSONDecodeError\)"),
                       ("[4]", "holds a JSON list, not an object"),
                       ('{"step": "4"}', "records step '4', not a whole number")):
        (tmp_path / "folder" / formats.RECORD).write_text(text)
        with pytest.raises(checkpoint.CheckpointError, match=rf"^ckpt={tmp_path / 'folder'}: "
                           rf"its {formats.RECORD} {says}: the export is damaged"):
            evaluate_in_process([f"ckpt={tmp_path / 'folder'}"], tmp_path / "eval2")


@pytest.mark.distributed
def test_export_replaces_only_what_it_writes_and_never_the_checkpoint(fsdp_run, tmp_path):
    """--force: everything checked before anything is written; a folder's other files
    kept; the checkpoint itself, inside it or around it refused; a symlink to a folder is
    the folder."""
    ckpt = fsdp_run / "checkpoints" / "last.dcp"
    before = {p: p.stat().st_size for p in ckpt.iterdir()}
    notes = tmp_path / "notes.txt"
    notes.write_text("mine")
    with pytest.raises(ConfigError, match="no other suffix"):
        _export(ckpt, notes, force=True)
    assert notes.read_text() == "mine"
    plain = tmp_path / "NOTES"  # a file with no suffix: a folder's name (a traceback)
    plain.write_text("mine")
    with pytest.raises(ConfigError, match="NOTES is a file: export writes a folder there "
                       "only in place of one"):
        _export(ckpt, plain, force=True)
    assert plain.read_text() == "mine"
    version = tmp_path / "v1.0"  # a folder, whatever its name
    version.mkdir()
    (version / "README").write_text("mine")
    (tmp_path / "link").symlink_to(version)
    _export(ckpt, version, force=True)
    _export(ckpt, tmp_path / "link", force=True)
    assert (version / "README").read_text() == "mine"
    assert sorted(p.name for p in version.iterdir()) == sorted(
        ["README", formats.RUN_CONFIG, formats.RECORD, formats.WEIGHTS])
    for out, said in ((ckpt, "is the checkpoint"), (ckpt / "x.pt", "inside the checkpoint"),
                      (fsdp_run / "checkpoints", "a folder holding the checkpoint")):
        with pytest.raises(ConfigError, match=said):
            _export(ckpt, out, force=True)
    assert {p: p.stat().st_size for p in ckpt.iterdir()} == before
    _export(ckpt, tmp_path / "m.pt")
    kept = (tmp_path / "m.pt").read_bytes()
    with pytest.raises(ConfigError, match="is the checkpoint"):  # a .pt onto itself
        _export(tmp_path / "m.pt", tmp_path / "m.pt", force=True)
    assert (tmp_path / "m.pt").read_bytes() == kept
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no scratch left


@pytest.mark.distributed
def test_init_from_starts_every_layout_from_the_same_weights(fsdp_run, tmp_path):
    """The fsdp run's .dcp under none (the whole model given them), under fsdp from each
    format and under tp (laid out on meta first, each rank reading its part), and its
    folder under ddp:
    the same losses, from trained weights (below the fresh start's first loss)."""
    ckpt = fsdp_run / "checkpoints" / "last.dcp"
    for out in ("w.pt", "w.safetensors", "folder"):
        _export(ckpt, tmp_path / out)
    run = [*MLP, "trainer.max_steps=6"]
    train_in_process([*run, f"trainer.init_from={ckpt}"], tmp_path / "none")
    reference = losses(tmp_path / "none")
    assert reference[0] < losses(fsdp_run)[0] - 0.01  # the same first batch, trained weights
    starts = {"fsdp_dcp": (ckpt, "fsdp"), "fsdp_pt": (tmp_path / "w.pt", "fsdp"),
              "fsdp_safetensors": (tmp_path / "w.safetensors", "fsdp"),
              "tp_safetensors": (tmp_path / "w.safetensors", "tp"),
              "ddp_folder": (tmp_path / "folder", "ddp")}
    for name, (weights_at, layout) in starts.items():
        batch = 64 if layout == "tp" else 32  # a tp group is one data-parallel rank
        train_in_process([*run, f"trainer.init_from={weights_at}", f"parallel={layout}",
                          "parallel.world_size=2", f"data.batch_size={batch}"], tmp_path / name)
        assert losses(tmp_path / name) == pytest.approx(reference, rel=1e-4, abs=1e-5), name
    assert "each rank reading its part" in (tmp_path / "fsdp_pt" / "train.log").read_text()
    assert "started from the weights in" in (tmp_path / "ddp_folder" / "train.log").read_text()


@pytest.mark.distributed
def test_a_sharded_checkpoint_not_strict_loads_what_matches(fsdp_run):
    """As a file does: a weight of another shape is left at its initial value, and said
    (DCP's size mismatch was a traceback)."""
    from parallab.models.mlp import MLP as Net

    small = Net(input_dim=64, hidden=[64], num_classes=10)
    dcp = fsdp_run / "checkpoints" / "last.dcp"
    assert weights.load_into(small, dcp, strict=False) == ["head.1.weight"]
    whole = weights.model_from(dcp, Net(input_dim=64, hidden=[64, 32], num_classes=10))
    torch.testing.assert_close(small.state_dict()["layers.0.1.weight"],
                               whole.state_dict()["layers.0.1.weight"])


def test_init_from_is_strict_in_one_line_and_loads_what_matches_when_told(tmp_path):
    from conftest import checked

    from parallab.models.mlp import MLP as Net

    source = tmp_path / "wide.pt"  # by a wrapped model: the prefixes never matter
    torch.manual_seed(0)
    net = Net(input_dim=64, hidden=[64, 32], num_classes=10)
    checkpoint.save(source, {"model": {f"module._orig_mod.{k}": v
                                       for k, v in net.state_dict().items()}})
    base = [*MLP, f"trainer.init_from={source}"]
    checked(*base)  # fits
    with pytest.raises(ConfigError) as error:
        checked(*base, "model.hidden=[64]")
    assert str(error.value).startswith(
        f"trainer.init_from={source} does not fit MLP: 2 unexpected (layers.1.1.weight, "
        "layers.1.1.bias); 1 mis-shaped (head.1.weight [10, 32] vs [10, 64])")
    assert "trainer.init_strict=false loads those that match" in str(error.value)
    assert "\n" not in str(error.value)
    checked(*base, "model.hidden=[64]", "trainer.init_strict=false")
    other = tmp_path / "other.pt"  # nothing of it matches: init_strict=false would not help
    checkpoint.save(other, {"model": {"encoder.weight": torch.zeros(3, 3)}})
    with pytest.raises(ConfigError, match=r"1 unexpected \(encoder.weight\): give weights of "
                       "this model$"):
        checked(*MLP, f"trainer.init_from={other}")
    small = Net(input_dim=64, hidden=[64], num_classes=10)
    assert weights.load_into(small, source, strict=False) == ["head.1.weight"]
    torch.testing.assert_close(small.state_dict()["layers.0.1.weight"],
                               net.state_dict()["layers.0.1.weight"])
    bad = {"trainer.init_from=/nope.pt": "trainer.init_from=/nope.pt does not exist",
           "trainer.resume=auto": "and trainer.resume=auto continues one from its checkpoint"}
    truncated = tmp_path / "cut.safetensors"
    import safetensors.torch

    safetensors.torch.save_model(net, str(truncated))
    truncated.write_bytes(truncated.read_bytes()[:100])
    bad[f"trainer.init_from={truncated}"] = f"{truncated} cannot be read as weights"
    for override, says in bad.items():
        with pytest.raises(ConfigError) as error:
            checked(*base, override)
        assert says in str(error.value) and "\n" not in str(error.value)


def test_a_resume_of_another_model_names_the_key_that_differs(train_here):
    """The refusal names the first model key whose value differs, saved and here."""
    from conftest import checked

    _, run_dir = train_here(*MLP, "trainer.max_steps=1")
    ckpt = checkpoint.latest(run_dir / "checkpoints")
    with pytest.raises(ConfigError, match=r"was saved from another model config than model "
                       r"MLP here \(model.hidden=\[64\] here, \[64, 32\] in the checkpoint\): "
                       "resume with the same model config"):
        checked(*MLP, "model.hidden=[64]", f"trainer.resume={ckpt}")


@pytest.mark.distributed
def test_a_new_weight_format_is_one_class_and_one_registry_line(fsdp_run, tmp_path,
                                                                 monkeypatch):
    """A format registered in formats.FORMATS is chosen from the path for reading, export
    writes it by its suffix, and the messages that list formats name it."""
    class Pth(formats.TorchFile):
        said, suffix = ".pth (torch's other suffix)", ".pth"

        @staticmethod
        def holds(path):
            return path.suffix == ".pth"

    monkeypatch.setattr(formats, "FORMATS", [Pth, *formats.FORMATS])
    ckpt = fsdp_run / "checkpoints" / "last.dcp"
    _export(ckpt, tmp_path / "m.pth")
    assert isinstance(formats.format_of(tmp_path / "m.pth"), Pth)
    assert weights.shapes(tmp_path / "m.pth") == weights.shapes(ckpt)
    with pytest.raises(ConfigError, match=r"\.pth \(torch's other suffix\) \(no other"):
        _export(ckpt, tmp_path / "m.bin")


@pytest.fixture
def llama_on_path(monkeypatch):
    monkeypatch.syspath_prepend(str(LLAMA))


def test_a_transformers_export_is_what_from_pretrained_reads(llama_on_path, tmp_path):
    """GPT-2, whose head is its token embedding: written once, tied again on load; the
    folder from_pretrained loads scores the eval set as the run's own evaluation did."""
    from hf_llama.data import Verses
    from transformers import AutoModelForCausalLM

    from parallab.models import build_model

    run_dir = tmp_path / "gpt2"
    metrics = train_in_process([*HF_RUN, "model=my_gpt2", "trainer.max_steps=4"], run_dir,
                               LLAMA / "conf")
    ckpt = run_dir / "checkpoints" / "last.pt"
    _export(ckpt, tmp_path / "gpt2.safetensors")
    _export(ckpt, tmp_path / "folder")
    assert {"config.json", "model.safetensors", "parallab.yaml"} <= {
        p.name for p in (tmp_path / "folder").iterdir()}
    saved = weights.shapes(tmp_path / "gpt2.safetensors")
    assert ("lm_head.weight" in saved) != ("transformer.wte.weight" in saved)  # once
    spec = checkpoint.saved_model(checkpoint.load_meta(ckpt), ckpt)
    model = weights.model_from(tmp_path / "gpt2.safetensors", build_model(spec))
    assert model.lm_head.weight is model.transformer.wte.weight
    same_weights(model, checkpoint.load(ckpt)["model"])

    pretrained = AutoModelForCausalLM.from_pretrained(tmp_path / "folder").eval()
    verses = Verses(seq_len=64, size=64, offset=30000)
    with torch.no_grad():
        loss = pretrained(input_ids=verses.input_ids, attention_mask=verses.attention_mask,
                          labels=verses.labels).loss  # one batch: the mean over every token
    assert loss.item() == pytest.approx(metrics["eval_loss"], rel=1e-5)


@pytest.mark.distributed
def test_a_from_pretrained_folder_trains_and_starts_any_layout(llama_on_path, tmp_path):
    """A Llama folder (save_pretrained) as the model (_target_ from_pretrained, under tp: its
    plan read from the loaded model, which from_pretrained will not build on meta) and as
    the start of the example's own Llama (trainer.init_from, under fsdp): the same losses,
    from those weights."""
    from conftest import typed

    from parallab import models

    cfg = typed(*HF_RUN, config_dir=LLAMA / "conf")
    torch.manual_seed(123)  # not the run's seed: the runs start from these weights
    models.build_model(models.check(cfg.model, cfg.data)).save_pretrained(tmp_path / "llama")
    run = [*HF_RUN, "trainer.max_steps=6"]
    pretrained = train_in_process([*run, "~model.config", "model._target_=transformers."
                                   "AutoModelForCausalLM.from_pretrained",
                                   f"+model.pretrained_model_name_or_path={tmp_path / 'llama'}",
                                   "parallel=tp", "parallel.world_size=2"],
                                  tmp_path / "pretrained", LLAMA / "conf")
    started = train_in_process([*run, f"trainer.init_from={tmp_path / 'llama'}",
                                "parallel=fsdp", "parallel.world_size=2", "data.batch_size=8"],
                               tmp_path / "started", LLAMA / "conf")
    assert losses(tmp_path / "started") == pytest.approx(losses(tmp_path / "pretrained"),
                                                         rel=1e-4, abs=1e-4)
    assert started["eval_loss"] == pytest.approx(pretrained["eval_loss"], rel=1e-4)
    # its parameters built on meta, its rotary table for real: no rank held the whole model
    assert "each rank reading its part" in (tmp_path / "started" / "train.log").read_text()


def test_export_of_a_model_whose_pretrained_folder_is_gone_says_so_in_one_line(tmp_path):
    ckpt = tmp_path / "last.pt"
    checkpoint.save(ckpt, {"model": {}, "step": 3, "config": {"model": {
        "_target_": "transformers.AutoModelForCausalLM.from_pretrained",
        "pretrained_model_name_or_path": str(tmp_path / "llama")}}})
    with pytest.raises(ConfigError, match=r"its model transformers.AutoModelForCausalLM."
                                          r"from_pretrained cannot be built \(.*\): it reads "
                                          r"pretrained_model_name_or_path=.*llama, which is gone"):
        _export(ckpt, tmp_path / "out.pt")
    assert not (tmp_path / "out.pt").exists()


def test_an_untied_models_weights_given_to_a_tied_one_are_refused(tmp_path):
    """An embedding and a head saved apart (an untied gpt's export) for a gpt that ties them:
    one of the two had won without a word (eval loss 5.41 where the untied model scores
    5.36). Saved equal, as a tied state_dict saved whole holds them, they are one."""
    import safetensors.torch
    from conftest import checked

    from parallab.models import build_model

    gpt = ["model=gpt", "model.layers=1", "model.width=32", "model.heads=2",
           "model.context=32", "data=bytes", "device=cpu", "model.tie_embeddings=true"]
    untied = build_model(checked(*gpt, "model.tie_embeddings=false")[0].model)
    apart = tmp_path / "untied.safetensors"
    safetensors.torch.save_file({k: v.contiguous() for k, v in untied.state_dict().items()},
                                str(apart))
    with pytest.raises(ConfigError, match=re.escape(
            f"trainer.init_from={apart} holds embed.tokens.weight and head.out.weight apart")):
        checked(*gpt, f"trainer.init_from={apart}")
    tied = build_model(checked(*gpt)[0].model)
    whole = tmp_path / "tied.pt"
    torch.save(tied.state_dict(), whole)  # both names, one tensor
    checked(*gpt, f"trainer.init_from={whole}")
    # a sharded checkpoint holds a tied run's two names apart too (a pipeline's stages each
    # save theirs): told by their values; an untied run's had been taken without a word
    for model, name in ((untied, "untied.dcp"), (tied, "tied.dcp")):
        _sharded(model, tmp_path / name)
    with pytest.raises(ConfigError, match=re.escape(
            f"trainer.init_from={tmp_path / 'untied.dcp'} holds embed.tokens.weight and "
            "head.out.weight apart")):
        checked(*gpt, f"trainer.init_from={tmp_path / 'untied.dcp'}")
    checked(*gpt, f"trainer.init_from={tmp_path / 'tied.dcp'}")


def _sharded(model: torch.nn.Module, path) -> None:
    """`model`'s weights as one process writes a run's .dcp: each name its own tensor."""
    import warnings

    import torch.distributed.checkpoint as dcp

    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    with warnings.catch_warnings():  # ("assuming ... a single process")
        warnings.simplefilter("ignore")
        dcp.save({"model": state}, checkpoint_id=str(path))
    checkpoint.save(path / formats.SHARDED_META, {"step": 1})


def test_an_export_the_disk_cannot_take_is_one_line_and_leaves_out_as_it_was(tmp_path,
                                                                            monkeypatch):
    """A full disk under the writer had ended `parallab export` in torch's or safetensors'
    traceback ("unexpected pos 5248 vs 5142", "os error 28"); OUT, replaced with --force, is
    left as it was, and no temporary beside it."""
    import errno

    from parallab.config.errors import OneLineError

    out = tmp_path / "m.safetensors"
    out.write_text("mine")

    def full(*_):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(formats.SafetensorsFile, "write", staticmethod(full))
    with pytest.raises(OneLineError, match=re.escape(
            f"could not write {out} (No space left on device); it is as it was")):
        weights.export(torch.nn.Linear(2, 2), {}, out, formats.SafetensorsFile)
    assert out.read_text() == "mine" and [p.name for p in tmp_path.iterdir()] == [out.name]
