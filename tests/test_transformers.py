"""Transformers models as they are written, tiny and built from their config (nothing is
downloaded): the example project's Llama (4 heads, 2 key-value heads) and GPT-2 (tied
embeddings) on dict samples with padded labels, under the layouts against one device (a
pipeline too, of their own chain of stages); their own plans read (blocks, tensor-parallel
plan, FLOPs); text files through the datasets
library with a tokenizer trained here. The example from the installed wheel: test_install."""

from __future__ import annotations

import re
import sys

import pytest
import torch
from conftest import REPO, TINY_LLAMA, losses

from parallab.cli import train_in_process
from parallab.training import checkpoint
from parallab.config.errors import ConfigError

LLAMA = REPO / "examples" / "hf_llama"
CONF = LLAMA / "conf"
BASE = ["experiment=llama", "device=cpu", "trainer.max_steps=10", "trainer.log_every_n_steps=1"]
RUN = [*BASE, "data.train.size=320", "data.eval.size=64"]


@pytest.fixture(autouse=True)
def project_on_path(monkeypatch):
    monkeypatch.syspath_prepend(str(LLAMA))


def train(run_dir, *overrides: str, base: list[str] = RUN) -> dict:
    return train_in_process([*base, *overrides], run_dir, CONF)


def built(name: str):
    """The example's model `name` (my_llama, my_gpt2), built as a run builds it."""
    return hf_model([*RUN, f"model={name}"], config_dir=CONF)


def hf_model(overrides: list[str], **where):
    """The model `overrides` compose, built as a run builds it (`where`: conftest.typed's
    config_dir)."""
    from conftest import typed

    from parallab import models

    cfg = typed(*overrides, **where)
    return models.build_model(models.check(cfg.model, cfg.data))


LAYOUTS = {
    # ranks read padded verses of different lengths: the mean over the step's valid labels
    "llama-ddp2": ["parallel=ddp", "parallel.world_size=2", "data.batch_size=8"],
    # its own plan (base_model_tp_plan) inside FSDP2, its decoder layers recomputed
    "llama-fsdp_tp2x2-ac_full": ["parallel=fsdp_tp", "parallel.world_size=4", "parallel.tp=2",
                                 "data.batch_size=8", "trainer.activation_checkpointing=full"],
    # the stream between its blocks cut along the sequence (its plan made sequence
    # parallel: sequence_plan), padded verses and its own loss over the gathered logits
    "llama-tp2-sp": ["parallel=tp", "parallel.world_size=2", "data.batch_size=16",
                     "parallel.sequence_parallel=true"],
    # its head tied to its embedding, both cut by vocabulary (one parameter) on the V's
    # first rank, whose last part holds no block its plan names; the sequence cut between
    # the split layers, each part handing on its slice (its stream is a DTensor)
    "llama-tied-zbv-tp2-sp": ["parallel=pipeline", "parallel.world_size=4", "parallel.tp=2",
                              "parallel.schedule=zbv", "data.batch_size=16",
                              "parallel.sequence_parallel=true",
                              "++model.config.tie_word_embeddings=true"],
    # GPT2Block units; the tied embedding and head stay in the root's unit
    "gpt2-fsdp2-ac_selective": ["model=my_gpt2", "parallel=fsdp", "parallel.world_size=2",
                                "data.batch_size=8",
                                "trainer.activation_checkpointing=selective"],
    # its own chain of stages (hf.pipeline_stages), its blocks recomputed: the attention mask
    # given to every block, its loss computed from the last part's logits, the tied
    # embedding and head on the V's first rank, where both parts' gradients add up
    "gpt2-pipeline-zbv-ac_full": ["model=my_gpt2", "parallel=pipeline", "parallel.world_size=2",
                                  "data.batch_size=16", "parallel.schedule=zbv",
                                  "trainer.activation_checkpointing=full"],
}


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize("case", LAYOUTS)
def test_a_transformers_model_trains_under_a_layout_as_on_one_device(case, tmp_path):
    layout = LAYOUTS[case]
    model = [o for o in layout if o.lstrip("+").startswith("model")]
    one = train(tmp_path / "one", *model, "data.batch_size=16")
    many = train(tmp_path / "many", *layout)
    assert losses(tmp_path / "many") == pytest.approx(losses(tmp_path / "one"), abs=1e-3)
    assert len(losses(tmp_path / "one")) == 10
    assert many["eval_loss"] == pytest.approx(one["eval_loss"], abs=1e-3)
    assert many["tokens_per_sec"] > 0 and "eval_accuracy" not in many


QWEN3 = [*TINY_LLAMA, "model._target_=transformers.Qwen3ForCausalLM",
         "model.config._target_=transformers.Qwen3Config", "data=tokens", "data.seq_len=32",
         "data.batch_size=8", "device=cpu", "trainer.max_steps=3", "trainer.log_every_n_steps=1"]


@pytest.mark.slow
@pytest.mark.distributed
def test_qwen3s_norms_over_its_heads_train_under_tensor_and_sequence_parallel(tmp_path):
    """Qwen 3's own plan keeps its q and k norms replicated, their gradient summed over the
    tp ranks (replicated_with_grad_allreduce): each rank norms its own heads, so a
    gradient left as it is would be half of it. The same weights as one device (to float
    rounding) under tp with the sequence cut too."""
    from parallab.training import weights

    def final(run_dir):
        model = hf_model(QWEN3)
        return weights.model_from(checkpoint.latest(run_dir / "checkpoints"), model).state_dict()

    train_in_process(QWEN3, tmp_path / "one")
    train_in_process([*QWEN3, "parallel=tp", "parallel.world_size=2",
                      "parallel.sequence_parallel=true"], tmp_path / "tp")
    expected, got = final(tmp_path / "one"), final(tmp_path / "tp")
    moved = [n for n in expected if "q_norm" in n and not torch.all(expected[n] == 1)]
    assert moved  # the norms trained
    for name in expected:
        torch.testing.assert_close(got[name], expected[name], rtol=1e-5, atol=1e-7)


def test_its_own_plans_are_read():
    from parallab.models import hf
    from parallab.parallel import tp_plans

    llama, gpt2 = built("my_llama"), built("my_gpt2")
    assert [type(b).__name__ for b in hf.blocks(llama)] == ["LlamaDecoderLayer"] * 2
    assert hf.shifts_labels(llama) and hf.shifts_labels(gpt2)
    assert not llama.config.use_cache  # built for training
    plan = tp_plans.plan_of(llama, None)
    assert {n for n in plan if n.startswith("model.layers.1.")} == {
        f"model.layers.1.{m}" for m in ("self_attn.q_proj", "self_attn.k_proj",
                                        "self_attn.v_proj", "self_attn.o_proj",
                                        "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")}
    assert "lm_head" in plan and "model.embed_tokens" in plan
    given = tp_plans.plan_of(llama, {"model.layers.*.mlp.up_proj": "colwise",
                                  "model.layers.*.mlp.down_proj": "rowwise"})
    assert sorted(given) == ["model.layers.0.mlp.down_proj", "model.layers.0.mlp.up_proj",
                             "model.layers.1.mlp.down_proj", "model.layers.1.mlp.up_proj"]
    with pytest.raises(tp_plans.PlanError, match="names layers.*.mlp.nope, which matches no"):
        tp_plans.plan_of(llama, {"layers.*.mlp.nope": "colwise"})
    with pytest.raises(tp_plans.PlanError, match="is not a style parallab splits by"):
        tp_plans.plan_of(llama, {"lm_head": "diagonal"})
    assert tp_plans.source(gpt2, None) is None


@pytest.mark.parametrize("name", ["my_llama", "my_gpt2"])
def test_its_chain_of_stages_gives_its_logits(name):
    """A pipeline runs it as its embeddings, each decoder block (given the masks and
    positions its forward would give it, from the activation and the batch's attention
    mask) and its head, one after the other: the model's forward."""
    from parallab.models import hf
    from parallab.parallel.stages import Part

    model = built(name).eval()
    stages = hf.pipeline_stages(model)
    assert len(stages) == model.config.num_hidden_layers + 2
    ids = torch.randint(1, 256, (3, 16))
    padded = torch.ones_like(ids)
    padded[0, 9:] = 0
    chain = Part(stages, first=True)
    with torch.no_grad():
        assert torch.equal(chain(ids), model(ids).logits)
        masked = chain(input_ids=ids, attention_mask=padded)
        assert torch.equal(masked, model(ids, attention_mask=padded).logits)
        assert not torch.equal(masked, chain(ids))


@pytest.mark.parametrize("name", ["my_llama", "my_gpt2"])
def test_compiled_it_calls_attention_causal_without_a_mask_as_eagerly(name):
    """Traced, transformers builds a full causal mask that keeps SDPA off its flash kernels;
    a run's model builds its masks outside the graph, so compiled SDPA gets is_causal=True
    where eagerly it does, and a padded batch's mask still reaches it."""
    model = built(name)
    from parallab.models import hf

    module = sys.modules[type(model).__module__]
    mask = module.create_causal_mask
    hf.for_training(model)  # a second model of the class (advise builds many): wrapped once
    assert module.create_causal_mask is mask
    calls: list[tuple[bool, bool]] = []

    def recording(graph, inputs):  # the graphs dynamo hands a backend, run as they are
        calls.extend((n.kwargs.get("attn_mask") is None, n.kwargs.get("is_causal"))
                     for n in graph.graph.nodes if "scaled_dot_product" in str(n.target))
        return graph.forward

    compiled = torch.compile(model, backend=recording)
    ids = torch.randint(0, 256, (2, 16))
    compiled(ids)
    assert calls == [(True, True)] * model.config.num_hidden_layers
    calls.clear()
    padded = torch.ones_like(ids)
    padded[0, :3] = 0
    compiled(ids, attention_mask=padded)
    assert calls == [(False, False)] * model.config.num_hidden_layers
    torch._dynamo.reset()


def test_flops_per_token_follow_the_config():
    from parallab.observe import mfu

    llama = built("my_llama")
    c = llama.config
    embedding = c.vocab_size * c.hidden_size  # looked up, not multiplied (untied head)
    weights = sum(p.numel() for p in llama.parameters()) - embedding
    expected = 6 * weights + 12 * c.num_hidden_layers * 64 * c.hidden_size
    assert mfu.flops_per_token(llama, 64) == expected
    gpt2 = built("my_gpt2")  # tied: the shared matrix is multiplied by the head
    positions = gpt2.config.n_positions * gpt2.config.n_embd
    assert mfu.flops_per_token(gpt2, 64) == 6 * (sum(
        p.numel() for p in gpt2.parameters()) - positions) + 12 * 2 * 64 * 64


BAD = [
    (["parallel=tp", "parallel.world_size=2", "model=my_gpt2"],
     "parallel.tp=2: GPT2LMHeadModel declares no tensor-parallel plan"),
    (["parallel=tp", "parallel.world_size=3"],
     "parallel.tp=3 does not divide the model's num_attention_heads=4"),
    (["parallel=tp", "parallel.world_size=2", "parallel.tp_plan={model.layers.*.nope: colwise}"],
     "parallel.tp_plan names model.layers.*.nope, which matches no module"),
    (["parallel=tp", "parallel.world_size=2", "model=my_gpt2",
      "parallel.tp_plan={transformer.h.*.mlp.c_fc: colwise}"],
     "the tensor-parallel plan splits transformer.h.0.mlp.c_fc, a Conv1D"),
    (["parallel=tp", "parallel.world_size=2", "parallel.tp_plan={model.layers.*.mlp.gate_proj: "
      "colwise, model.layers.*.mlp.up_proj: colwise, model.layers.*.mlp.down_proj: colwise}"],
     "the tensor-parallel plan does not compose at parallel.tp=2: split as planned, the forward "
     "fails in model.layers.0.mlp.down_proj (RuntimeError: mat1 and mat2 shapes"),
    # split otherwise than alike, a tied pair would be two parameters, parting ways
    (["parallel=tp", "parallel.world_size=2", "++model.config.tie_word_embeddings=true",
      "parallel.tp_plan={lm_head: rowwise}"],
     "parallel.tp=2 splits lm_head and model.embed_tokens, which share one weight (tied "
     "embeddings), differently"),
    (["parallel=tp", "parallel.world_size=2", "parallel.sequence_parallel=true",
      "parallel.tp_plan={model.layers.*.mlp.up_proj: colwise, model.layers.*.mlp.down_proj: "
      "rowwise}"], "the plan of LlamaForCausalLM (parallel.tp_plan) takes no sequence_parallel"),
    # the dict data's own sequence length (its train set's), not only data.seq_len
    (["parallel=tp", "parallel.world_size=2", "parallel.sequence_parallel=true",
      "data.train.seq_len=63"], "which data.train.seq_len=63 does not divide by"),
    # learned positions (the example's GPT-2: 64 of them) shorter than the sequences: its
    # embedding would index past its table (an IndexError in a worker)
    (["model=my_gpt2", "data.train.seq_len=128"], "data.train.seq_len=128 is longer than "
     "the model's 64 learned positions (model.config.n_positions): set data.train.seq_len<=64"),
    (["model.config.vocab_size=100"], "model.config.vocab_size=100 is smaller than the 256 "
                                      "tokens of data=datasets's vocabulary"),
    (["model.config.vocab_size=100", "~data.vocab_size"],  # nothing says: the forward tells
     "model: its forward fails on a batch of the data"),
]


@pytest.mark.parametrize("overrides,message", BAD, ids=[" ".join(o) for o, _ in BAD])
def test_bad_input_for_a_transformers_model_is_one_line(overrides, message, tmp_path):
    with pytest.raises(ConfigError) as error:
        train(tmp_path, *overrides)
    assert message in str(error.value) and "\n" not in str(error.value)


def test_a_transformers_model_without_transformers_names_the_extra(monkeypatch, tmp_path):
    for name in [m for m in sys.modules if m == "transformers" or m.startswith("transformers.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "transformers", None)  # as if not installed
    with pytest.raises(ConfigError, match=r'needs transformers, which is not installed: pip '
                                          r'install "parallab\[hf\]"'):
        train(tmp_path)


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    """A byte-level BPE tokenizer of 512 tokens trained here on the shipped text (offline),
    saved as a folder AutoTokenizer reads."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    from parallab.data.bytetext import DEFAULT_TEXT

    text = DEFAULT_TEXT.read_text(encoding="utf-8")[:200_000]
    bpe = Tokenizer(models.BPE(unk_token="<unk>"))
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    bpe.train_from_iterator([text], trainers.BpeTrainer(
        vocab_size=512, special_tokens=["<unk>", "<eos>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    folder = tmp_path_factory.mktemp("tokenizer")
    PreTrainedTokenizerFast(tokenizer_object=bpe, unk_token="<unk>",
                            eos_token="<eos>").save_pretrained(folder)
    corpus = folder / "corpus"
    corpus.mkdir()
    (corpus / "a.txt").write_text(text[:60_000], encoding="utf-8")
    (corpus / "b.txt").write_text(text[60_000:120_000], encoding="utf-8")
    return folder


def test_text_files_are_tokenized_and_packed(tokenizer, tmp_path):
    from parallab.data.hf_text import HFText

    data = HFText(files=str(tokenizer / "corpus" / "*.txt"), tokenizer=str(tokenizer),
                  seq_len=64)
    assert data.problem() is None and data.vocab_size == 512
    train_set, eval_set = data.make(0)
    sample = train_set[0]
    assert set(sample) == {"input_ids", "labels"} and sample["input_ids"].shape == (64,)
    assert torch.equal(sample["labels"], sample["input_ids"])
    assert 0.03 < len(eval_set) / (len(train_set) + len(eval_set)) < 0.07  # eval_fraction
    text = ["data=hf_text", f"data.files={tokenizer}/corpus/*.txt", f"data.tokenizer={tokenizer}",
            "data.seq_len=64"]
    # the example's model leaves its vocabulary to the data: the tokenizer's 512 tokens
    metrics = train(tmp_path, *text, "trainer.max_steps=8", base=BASE)
    assert metrics["steps"] == 8 and metrics["tokens_per_sec"] > 0
    ckpt = tmp_path / "checkpoints" / "last.pt"
    assert checkpoint.saved_model(checkpoint.load_meta(ckpt), ckpt)["config"]["vocab_size"] == 512
    for overrides, message in (
            ([f"data.tokenizer={tokenizer}/nope"], "is not a folder"),
            (["data.files=/nowhere/*.txt"], "data.files=/nowhere/*.txt: no file matches"),
            (["model.config.vocab_size=256"], "model.config.vocab_size=256 is smaller than "
                                              "the 512 tokens of data=hf_text's vocabulary")):
        with pytest.raises(ConfigError, match=re.escape(message)):
            train(tmp_path / "bad", *text, *overrides, base=BASE)
    with pytest.raises(ConfigError, match=re.escape(  # own data that states no vocabulary
            "model.config.vocab_size=null takes the data's vocabulary, which data=datasets "
            "does not state")):
        train(tmp_path / "unstated", "~data.vocab_size", base=BASE)


@pytest.mark.slow
@pytest.mark.distributed
def test_advise_ranks_a_transformers_models_layouts_tp_by_its_plan(tmp_path):
    import csv

    from parallab.cli import advise_in_process

    answer = advise_in_process([*RUN, "parallel.world_size=2", "advise.layouts=[ddp,tp]",
                                "advise.precisions=[fp32]", "advise.steps=3",
                                "advise.warmup_steps=1", "advise.activation_checkpointing=[none]",
                                "advise.max_accumulation=1", "data.global_batch_size=8"],
                               tmp_path / "advise", CONF)
    rows = {r["layout"]: r for r in csv.DictReader(open(tmp_path / "advise" / "advise.csv"))}
    assert set(rows) == {"ddp(R2) b4 ac=none fp32", "tp(T2) b8 ac=none fp32"}
    for row in rows.values():  # each trained, matched one device, memory as predicted
        assert row["verdict"] in ("reference", "matches"), row
        assert abs(float(row["memory_error"])) <= 0.05, row
    assert answer["recommended"] in rows


def test_a_transformers_target_imports_without_torchaos_warnings():
    """transformers imports torchao where it is installed, whose enums' registration this
    torch warns of twice at import: nothing a user can act on, so not shown when parallab
    imports a `_target_` (a fresh process: this one has imported transformers already)."""
    import subprocess

    said = subprocess.run(
        [sys.executable, "-c", "from parallab.config.targets import locate; "
         "locate('transformers.LlamaForCausalLM', 'model._target_')"],
        capture_output=True, text=True, timeout=120)
    assert said.returncode == 0 and "register_constant" not in said.stderr, said.stderr
