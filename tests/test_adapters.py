"""adapter=lora through peft: only the adapters train (the base stays as it started, the
optimizer holds state for the adapters alone), every data-parallel layout gives one device's
losses, checkpoints resume under another layout, export writes what peft and transformers
read, and bad input ends in one line before any rank starts (what advise makes of
adapters: test_advise.py)."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
from conftest import GPT_RUN, REPO, checked, losses, read_metrics

from parallab.cli import train_in_process
from parallab.commands import _export
from parallab.config.errors import ConfigError
from parallab.training import checkpoint, weights

BIN = Path(sys.executable).parent
LLAMA = REPO / "examples" / "hf_llama"
# the gpt without dropout (ranks would draw different masks than one device), AdamW on
# the adapters alone
RUN = [*GPT_RUN, "model.dropout=0", "optim=adamw", "optim.lr=0.01", "trainer.max_steps=10",
       "data.batch_size=16"]
LORA = [*RUN, "adapter=lora", "adapter.r=4"]


@pytest.fixture(scope="module")
def one_device(tmp_path_factory):
    """The LoRA run on one device, checkpointed at step 5 (and its full fine-tuning twin)."""
    runs = {name: tmp_path_factory.mktemp(name) / "run" for name in ("lora", "full")}
    said, root = [], logging.getLogger()
    handler, level = logging.Handler(), root.level  # as caplog.at_level, for the module
    handler.emit = lambda record: said.append(record.getMessage())
    root.addHandler(handler)
    root.setLevel(logging.INFO)
    try:
        train_in_process([*LORA, "trainer.checkpoint_every_n_steps=5"], runs["lora"])
    finally:
        root.removeHandler(handler)
        root.setLevel(level)
    train_in_process(RUN, runs["full"])
    return {**runs, "said": said}


def saved_model(run_dir: Path) -> dict[str, torch.Tensor]:
    """The run's last weights (sharded or not), by name, with its adapters."""
    from conftest import typed

    from parallab.models import adapters, build_model

    cfg = typed(*LORA)
    model = adapters.apply(build_model(cfg.model), cfg.adapter)
    return weights.model_from(checkpoint.latest(run_dir / "checkpoints"), model).state_dict()


@pytest.mark.xdist_group("lora_one_device")
def test_only_the_adapters_train_and_hold_state(one_device):
    from conftest import typed

    from parallab.models import build_model

    torch.manual_seed(typed(*LORA).seed)
    start = build_model(typed(*LORA).model).state_dict()  # the base as the run built it
    trained = saved_model(one_device["lora"])
    base = {k.replace(".base_layer", ""): v for k, v in trained.items() if ".lora_" not in k}
    assert base.keys() == start.keys()
    for name, tensor in base.items():  # frozen: bit for bit as it started
        assert torch.equal(tensor, start[name]), name
    assert any(".lora_B." in k and v.abs().sum() > 0 for k, v in trained.items())  # trained
    state = checkpoint.load(one_device["lora"] / "checkpoints" / "last.pt")["optimizer"]
    moments = {k: v for k, v in state.items() if k.endswith((".exp_avg", ".exp_avg_sq"))}
    assert moments and all(".lora_" in k for k in moments)  # flat, by parameter name
    adapters = sum(v.numel() for k, v in trained.items() if ".lora_" in k)
    assert sum(v.numel() for v in moments.values()) == 2 * adapters  # of the adapters only
    log = "\n".join(one_device["said"])
    assert f"adapter=lora: {adapters:,} of {sum(v.numel() for v in trained.values()):,} " \
           "parameters train" in log
    lora, full = read_metrics(one_device["lora"]), read_metrics(one_device["full"])
    assert lora["state_memory_mb"] <= 0.3 * full["state_memory_mb"]


LAYOUTS = {
    "ddp2-ac_full": ["parallel=ddp", "parallel.world_size=2", "data.batch_size=8",
                     "trainer.activation_checkpointing=full"],
    # the embedding and head stages frozen whole: units of their own all the same; the
    # blocks compiled before FSDP2 shards them (torchtitan's order), their weights saved
    # under the plain model's names (saved_model loads them strictly). Dynamo's tracing and
    # autograd's graphs are what meet FSDP2 and the adapters; inductor's code (30 s to
    # build here) is checked in test_activations
    "fsdp2-compile": ["parallel=fsdp", "parallel.world_size=2", "data.batch_size=8",
                      "trainer.compile=true", "trainer.compile_backend=aot_eager"],
    "hsdp2x2": ["parallel=hsdp", "parallel.world_size=4", "parallel.dp_shard=2",
                "data.batch_size=4"],
}


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.xdist_group("lora_one_device")
@pytest.mark.parametrize("layout", LAYOUTS)
def test_every_data_parallel_layout_trains_the_adapters_as_one_device(one_device, tmp_path,
                                                                     layout):
    metrics = train_in_process([*LORA, *LAYOUTS[layout]], tmp_path / "run")
    reference = one_device["lora"]
    assert losses(tmp_path / "run") == pytest.approx(losses(reference), rel=1e-4, abs=1e-5)
    assert metrics["eval_loss"] == pytest.approx(read_metrics(reference)["eval_loss"],
                                                 rel=1e-5)
    expected, got = saved_model(reference), saved_model(tmp_path / "run")
    for name in (k for k in expected if ".lora_" in k):
        torch.testing.assert_close(got[name], expected[name], rtol=1e-4, atol=1e-5)


@pytest.mark.distributed
@pytest.mark.xdist_group("lora_one_device")  # beside the other LoRA launches: their server
def test_the_ranks_find_peft_imported_by_their_fork_server(tmp_path):
    """peft (2 s of CPU a process here) is imported once, by the fork server the ranks are
    forked from (forking.job_imports), not by each rank as it builds its model."""
    noted = tmp_path / "built_by"
    train_in_process([*LORA, "model._target_=own_parts.gpt_noting_peft", f"+model.noted={noted}",
                      "adapter.target_modules=[qkv]", "parallel=ddp", "parallel.world_size=2",
                      "trainer.max_steps=2"], tmp_path / "run")
    ranks = [line.split() for line in noted.read_text().splitlines()
             if line.split()[0] != str(os.getpid())]  # the controller tries the model too
    assert [imported for _, imported in ranks] == ["True", "True"]


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.xdist_group("lora_one_device")
def test_a_lora_checkpoint_resumes_exactly_under_another_layout(one_device, tmp_path):
    step5 = next(p for p in (one_device["lora"] / "checkpoints").iterdir()
                 if checkpoint.load_meta(p)["step"] == 5)
    train_in_process([*LORA, f"trainer.resume={step5}", "parallel=fsdp",
                      "parallel.world_size=2", "data.batch_size=8"], tmp_path / "resumed")
    expected = losses(one_device["lora"])
    assert losses(tmp_path / "resumed") == pytest.approx(expected[5:], rel=1e-4, abs=1e-5)
    assert read_metrics(tmp_path / "resumed")["eval_loss"] == pytest.approx(
        read_metrics(one_device["lora"])["eval_loss"], rel=1e-5)


@pytest.mark.xdist_group("lora_one_device")
def test_export_writes_an_adapter_folder_and_a_merged_model(one_device, tmp_path):
    from peft import PeftModel

    from parallab.commands import evaluate_in_process
    from parallab.models import build_model

    ckpt = one_device["lora"] / "checkpoints" / "last.pt"
    eval_loss = read_metrics(one_device["lora"])["eval_loss"]
    _export(ckpt, tmp_path / "adapter")
    assert {"adapter_config.json", "adapter_model.safetensors"} <= {
        p.name for p in (tmp_path / "adapter").iterdir()}
    from conftest import typed

    torch.manual_seed(typed(*LORA).seed)
    base = build_model(typed(*LORA).model)  # the base the run started from
    peft_model = PeftModel.from_pretrained(base, tmp_path / "adapter").eval()
    inner = peft_model.base_model.model
    for name, tensor in saved_model(one_device["lora"]).items():
        torch.testing.assert_close(inner.state_dict()[name], tensor)
    for merged in ("merged.pt", "merged.safetensors", "merged"):
        _export(ckpt, tmp_path / merged, merged=True)
        evaluate_in_process([f"ckpt={tmp_path / merged}"], tmp_path / f"eval_{merged}")
        assert read_metrics(tmp_path / f"eval_{merged}")["eval_loss"] == pytest.approx(
            eval_loss, rel=1e-5)
    assert not any(".lora_" in k for k in weights.shapes(tmp_path / "merged.pt"))
    evaluate_in_process([f"ckpt={ckpt}"], tmp_path / "eval_ckpt")  # with its adapters on
    assert read_metrics(tmp_path / "eval_ckpt")["eval_loss"] == pytest.approx(eval_loss)
    # the adapter folder alone, on the base its run built (its seed; no trainer.init_from):
    # it scored the adapters on a base built afresh, unseeded, without a word
    evaluate_in_process([f"ckpt={tmp_path / 'adapter'}"], tmp_path / "eval_adapter")
    assert read_metrics(tmp_path / "eval_adapter")["eval_loss"] == pytest.approx(eval_loss,
                                                                                 rel=1e-5)
    # the folder merged: onto that base too (it folded them into one built afresh, unseeded)
    _export(tmp_path / "adapter", tmp_path / "folded.pt", merged=True)
    evaluate_in_process([f"ckpt={tmp_path / 'folded.pt'}"], tmp_path / "eval_folded")
    assert read_metrics(tmp_path / "eval_folded")["eval_loss"] == pytest.approx(eval_loss,
                                                                                rel=1e-5)

    # the adapter folder as the start of a new run: its first loss continues the last one
    train_in_process([*LORA, f"trainer.init_from={tmp_path / 'adapter'}", "adapter.dropout=0",
                      "trainer.max_steps=1", "optim.lr=1e-9"], tmp_path / "again")
    assert losses(tmp_path / "again")[0] < losses(one_device["lora"])[0] - 0.05


def test_an_adapter_folder_trained_on_given_weights_starts_a_run_on_them(one_device,
                                                                       tmp_path):
    """A run's adapters trained on the weights trainer.init_from gave (its folder records
    them), given as a new run's trainer.init_from: they had gone on a base built afresh
    from the seed, without a word, and trained on noise. Its base is read first; the run
    scores as the adapters do on it. Those weights changed since: one line."""
    from parallab.commands import evaluate_in_process

    base = one_device["full"] / "checkpoints" / "last.pt"  # trained: not the seed's base
    train_in_process([*LORA, f"trainer.init_from={base}", "trainer.max_steps=2"],
                     tmp_path / "tuned")
    _export(tmp_path / "tuned" / "checkpoints" / "last.pt", tmp_path / "adapter")
    evaluate_in_process([f"ckpt={tmp_path / 'adapter'}"], tmp_path / "scored")
    again = train_in_process([*LORA, f"trainer.init_from={tmp_path / 'adapter'}",
                              "trainer.max_steps=1", "optim.lr=1e-12"], tmp_path / "again")
    assert again["eval_loss"] == pytest.approx(read_metrics(tmp_path / "scored")["eval_loss"],
                                               rel=1e-4)
    # its base is loaded whole whatever trainer.init_strict says: no fix names it
    with pytest.raises(ConfigError, match=rf"^the base of trainer.init_from={base} does not "
                       r"fit GPT: .*: give weights of this model$"):
        checked(*LORA, "model.layers=3", f"trainer.init_from={tmp_path / 'adapter'}")
    moved = tmp_path / "moved.pt"
    base.rename(moved)
    try:
        with pytest.raises(ConfigError, match="holds LoRA adapters alone, trained on the "
                           f"weights at trainer.init_from={base}, which is gone"):
            checked(*LORA, f"trainer.init_from={tmp_path / 'adapter'}")
    finally:
        moved.rename(base)


def test_export_refuses_what_it_cannot_write_in_one_line(one_device, tmp_path):
    for ckpt, args, says in [
            (one_device["full"], ["--merged"], "holds no adapters"),
            (one_device["lora"], [], "export as a peft adapter folder")]:
        done = subprocess.run([str(BIN / "parallab"), "export",
                               str(ckpt / "checkpoints" / "last.pt"), str(tmp_path / "x.pt"),
                               *args], capture_output=True, text=True)
        assert done.returncode == 2 and says in done.stderr
        assert len(done.stderr.strip().splitlines()) == 1 and not (tmp_path / "x.pt").exists()


@pytest.mark.parametrize("overrides, says", [
    (["adapter.target_modules=[nope]"], "matches no layer of model GPT: name some of its "
     "layers, such as tokens, positions, qkv, proj"),
    (["NO_GPT", "model=mlp", "data=synthetic"], "model MLP names no layers for adapters"),
    (["adapter.target_modules=[ln1]"], "matches blocks.0.ln1 (LayerNorm), blocks.1.ln1 "
     "(LayerNorm), which peft's LoRA "
     "cannot wrap"),
    (["parallel=tp", "parallel.world_size=2"], "adapter=lora with parallel=tp"),
    (["parallel=pipeline", "parallel.world_size=2", "data.batch_size=16"],
     "adapter=lora with parallel=pipeline"),
    (["adapter.r=0"], "adapter.r=0 is out of range"),
    # no parameter would move (alpha / r = 0), where 2,048 were said to train
    (["adapter.alpha=0"], "adapter.alpha=0.0 is out of range: the adapters' output is "
     "scaled by alpha / r, and at 0 no parameter would move"),
    # read as the model's own, without a word
    (["adapter.target_modules=[]"], "adapter.target_modules=[] names no layer (an empty "
     "list was read as the model's own)"),
    (["adapter.target_modules=qkv"], "adapter.target_modules=qkv matches no layer"),
    (["adapter.target_modules={a:1}"], "give a list of layer names"),
    (["NO_ADAPTER", "trainer.init_from=LORA_CKPT"], "holds a model with LoRA adapters: add "
     "adapter=lora"),
])
def test_bad_adapter_input_is_one_line(one_device, overrides, says):
    overrides = [o.replace("LORA_CKPT", str(one_device["lora"] / "checkpoints" / "last.pt"))
                 for o in overrides]
    base = ["device=cpu", "adapter=lora"] if "NO_GPT" in overrides else \
        RUN if "NO_ADAPTER" in overrides else LORA
    with pytest.raises(ConfigError) as error:
        checked(*base, *(o for o in overrides if not o.startswith("NO_")))
    assert says in str(error.value) and "\n" not in str(error.value)


@pytest.mark.parametrize("chosen,adapted", [
    # as peft reads them: a string is a regular expression a whole name matches, a list's
    # items are names (or their last parts)
    ("'.*\\.qkv'", ["blocks.0.attn.qkv", "blocks.1.attn.qkv"]),
    ("all-linear", ["blocks.0.attn.proj", "blocks.0.attn.qkv", "blocks.0.mlp.0",
                    "blocks.0.mlp.2", "blocks.1.attn.proj", "blocks.1.attn.qkv",
                    "blocks.1.mlp.0", "blocks.1.mlp.2", "head.out"]),
    ("[proj,mlp.2]", ["blocks.0.attn.proj", "blocks.0.mlp.2", "blocks.1.attn.proj",
                      "blocks.1.mlp.2"]),
])
def test_target_modules_take_the_forms_peft_reads(chosen, adapted):
    """The docs promise a name's last parts or a regular expression: a string was refused
    by the config's type, and a list item was read as a name only."""
    from parallab.models import adapters, build_on_meta

    cfg, _ = checked(*LORA, f"adapter.target_modules={chosen}")
    model = adapters.apply(build_on_meta(cfg.model), cfg.adapter)
    assert sorted({name.partition(".lora_A")[0] for name, _ in model.named_parameters()
                   if ".lora_A" in name}) == adapted


def test_adapter_lora_without_peft_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "peft", None)  # import peft raises ImportError
    with pytest.raises(ConfigError, match=r'pip install "parallab\[hf\]"'):
        checked(*LORA)


@pytest.fixture
def llama_on_path(monkeypatch):
    monkeypatch.syspath_prepend(str(LLAMA))


@pytest.mark.slow
@pytest.mark.distributed
def test_a_pretrained_llama_fine_tunes_under_fsdp_and_exports_as_peft_and_transformers_read(
        llama_on_path, tmp_path):
    """The example's LoRA experiment on its Llama, started from a pretrained folder (the
    base's weights load before the adapters go on; peft's default targets for Llama,
    q_proj and v_proj) under fsdp: the adapter folder on that base in PeftModel, and the
    merged folder in from_pretrained, score the run's eval loss."""
    from conftest import typed
    from hf_llama.data import Verses
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from parallab import models

    cfg = typed("experiment=llama", config_dir=LLAMA / "conf")
    torch.manual_seed(123)  # not the run's seed: the run starts from these weights
    models.build_model(models.check(cfg.model, cfg.data)).save_pretrained(tmp_path / "llama")
    metrics = train_in_process([
        "experiment=llama_lora", f"trainer.init_from={tmp_path / 'llama'}", "device=cpu",
        "trainer.max_steps=6", "data.train.size=192", "data.eval.size=64", "parallel=fsdp",
        "parallel.world_size=2", "data.batch_size=8"], tmp_path / "run", LLAMA / "conf")
    ckpt = checkpoint.latest(tmp_path / "run" / "checkpoints")
    with warnings.catch_warnings(record=True) as said:  # nothing the user can act on
        warnings.simplefilter("always")
        _export(ckpt, tmp_path / "adapter")
        _export(ckpt, tmp_path / "merged", merged=True)
    assert not [w for w in said if issubclass(w.category, FutureWarning)], \
        [str(w.message) for w in said]
    verses = Verses(seq_len=64, size=64, offset=30000)

    def scored(model) -> float:
        with torch.no_grad():
            return model.eval()(input_ids=verses.input_ids, labels=verses.labels,
                                attention_mask=verses.attention_mask).loss.item()

    base = AutoModelForCausalLM.from_pretrained(tmp_path / "llama")
    assert scored(base) > metrics["eval_loss"] + 1e-3  # the adapters changed something
    tuned = PeftModel.from_pretrained(base, tmp_path / "adapter")
    assert scored(tuned) == pytest.approx(metrics["eval_loss"], rel=1e-5)
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged")
    assert scored(merged) == pytest.approx(metrics["eval_loss"], rel=1e-5)
    assert_base_held_to_its_fingerprint(tmp_path, lambda: models.build_model(
        models.check(cfg.model, cfg.data)).save_pretrained(tmp_path / "llama"))


def assert_base_held_to_its_fingerprint(tmp_path, save_other_base) -> None:
    """The adapter folder names its base by where it is (absolute, read from any dir) and
    its fingerprint: other weights saved over it are refused in one line, not scored."""
    from parallab.commands import evaluate_in_process
    from parallab.training.formats.safetensors_weights import BASE

    recorded = json.loads((tmp_path / "adapter" / BASE).read_text())
    assert recorded["path"] == str((tmp_path / "llama").absolute())
    torch.manual_seed(7)
    save_other_base()
    with pytest.raises(ConfigError, match="holds other weights now than those they were "
                                          "trained on"):
        evaluate_in_process([f"ckpt={tmp_path / 'adapter'}"], tmp_path / "eval_other_base")


TIED_HEAD = [*LORA, "model.tie_embeddings=true", "adapter.target_modules=[out]",
             "trainer.max_steps=2"]


def test_a_merge_into_a_weight_tied_to_another_is_refused_in_one_line(tmp_path):
    """The head's delta folded into the token embedding it shares: the merged model scored
    5.5408 where the run scored 5.5441, without a word."""
    train_in_process(TIED_HEAD, tmp_path / "run")
    ckpt = tmp_path / "run" / "checkpoints" / "last.pt"
    with pytest.raises(ConfigError, match=r"^--merged: the adapters on head.out would be "
                       r"folded into its weight, which is tied to embed.tokens.weight"):
        _export(ckpt, tmp_path / "merged.safetensors", merged=True)
    assert not (tmp_path / "merged.safetensors").exists()
    _export(ckpt, tmp_path / "adapter")  # the adapters alone stay apart from the base
    assert (tmp_path / "adapter" / "adapter_model.safetensors").is_file()


@pytest.mark.xdist_group("lora_one_device")
def test_an_adapter_folder_that_does_not_fit_is_held_to_init_strict(one_device, tmp_path,
                                                                    caplog):
    """As a .pt of another model is: a folder of a 2-block model on a 3-block one started
    the third block's adapters fresh without a word, on a wider one ended in a size-mismatch
    traceback; strict, both are one line; not strict, what fits loads and the rest is said."""
    folder = tmp_path / "adapter"
    _export(one_device["lora"] / "checkpoints" / "last.pt", folder)
    # (every adapter of the wider model mis-shaped: init_strict=false would load none)
    for other, says, fix in (
            (["model.layers=3"], r"2 missing \(blocks.2.attn.qkv.lora_A",
             "trainer.init_strict=false loads those that match"),
            (["model.width=64"], r"mis-shaped \(blocks.0.attn.qkv.lora_A.default.weight "
                                 r"\[4, 32\] vs \[4, 64\]", "give weights of this model")):
        with pytest.raises(ConfigError, match=rf"^trainer.init_from={folder} does not fit "
                           rf"GPT: .*{says}.*: {fix}$"):
            checked(*LORA, *other, f"trainer.init_from={folder}")
    # another scale: refused from the folder, and from the run's checkpoint too (it
    # scaled the adapters otherwise without a word)
    ckpt = one_device["lora"] / "checkpoints" / "last.pt"
    for given in (folder, ckpt):
        with pytest.raises(ConfigError, match=rf"^trainer.init_from={given} holds adapters of "
                           r"alpha=\d+(\.0)?, and adapter.alpha=64.0 here: set adapter.alpha="):
            checked(*LORA, "adapter.alpha=64", f"trainer.init_from={given}")
    with caplog.at_level(logging.INFO):
        train_in_process([*LORA, "model.layers=3", f"trainer.init_from={folder}",
                          "trainer.init_strict=false", "trainer.max_steps=1"], tmp_path / "run")
    [line] = [m for m in caplog.messages if m.startswith("started from the weights")]
    assert "left at their initial values: blocks.2.attn.qkv.lora_A.default.weight" in line
    assert "blocks.1." not in line


@pytest.mark.xdist_group("lora_one_device")
def test_export_force_replaces_what_it_owns_and_nothing_else(one_device, tmp_path):
    """--merged --force onto an adapter export left its adapter files beside the new model
    (evaluate then refused the folder); --force onto a folder holding the user's README
    replaced it with peft's model card."""
    from parallab.commands import evaluate_in_process
    from parallab.training import formats

    ckpt = one_device["lora"] / "checkpoints" / "last.pt"
    out = tmp_path / "out"
    out.mkdir()
    (out / "README.md").write_text("the user's own\n")
    (out / "notes.txt").write_text("theirs too\n")
    _export(ckpt, out, force=True)
    assert (out / "README.md").read_text() == "the user's own\n"
    _export(ckpt, out, force=True, merged=True)
    assert sorted(p.name for p in out.iterdir()) == ["README.md", "model.safetensors",
                                                       "notes.txt", "parallab.yaml",
                                                       "parallab_record.json"]
    assert isinstance(formats.format_of(out), formats.WeightsFolder)
    evaluate_in_process([f"ckpt={out}"], tmp_path / "eval")
    assert read_metrics(tmp_path / "eval")["eval_loss"] == pytest.approx(
        read_metrics(one_device["lora"])["eval_loss"], rel=1e-5)
    _export(ckpt, out, force=True)  # and back: the merged model's file goes
    assert sorted(p.name for p in out.iterdir()) == [
        "README.md", "adapter_config.json", "adapter_model.safetensors", "notes.txt",
        "parallab.yaml", "parallab_record.json"]
