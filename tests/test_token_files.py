"""data=token_files: token files read in place (nanoGPT's .bin, .npy, Megatron-LM's
.bin/.idx), the global order of samples and a mixture's proportions, documents kept apart
in a packed window, a resume that holds across world sizes, `parallab prepare-data`, and
each bad input refused in one line before launch."""

from __future__ import annotations

import json
import re
import time

import numpy as np
import pytest
import torch
from conftest import TINY_LLAMA, checked, losses, output, run_entry

from parallab.config.errors import ConfigError
from parallab.data.pretrain import files as token_files
from parallab.data.pretrain.blend import PERIOD, Source, Stream
from parallab.data.pretrain.loader import Samples, TokenLoader
from parallab.data.pretrain.windows import Windows
from parallab.launching.distributed import Dist

SEQ = 16
GPT = ["model=gpt", "model.layers=1", "model.heads=2", "model.width=16",
       f"model.context={SEQ}", "model.vocab_size=256", "model.dropout=0", "data=token_files",
       "data.eval_samples=16", "data.batch_size=4", "trainer.log_every_n_steps=1",
       "trainer.checkpoint_every_n_steps=null", "device=cpu"]


def learnable(n: int, seed: int, dtype=np.uint16) -> np.ndarray:
    """Token ids below 256 that mostly follow a fixed map, so a model learns from them."""
    rng = np.random.default_rng(seed)
    follows, tokens = rng.permutation(256), np.empty(n, dtype=np.int64)
    tokens[0] = 0
    drawn, noisy = rng.integers(0, 256, n), rng.random(n) < 0.1
    for i in range(1, n):
        tokens[i] = drawn[i] if noisy[i] else follows[tokens[i - 1]]
    return tokens.astype(dtype)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """nanoGPT's train.bin (np.memmap uint16, as its prepare.py writes it), a .npy of
    uint32, and a Megatron-LM pair of documents ending in end-of-text (id 1)."""
    root = tmp_path_factory.mktemp("tokens")
    web = np.memmap(root / "web.bin", dtype=np.uint16, mode="w+", shape=(20_000,))
    web[:] = learnable(20_000, 0)
    web.flush()
    np.save(root / "code.npy", learnable(8_000, 1, np.uint32))
    rng = np.random.default_rng(2)
    docs = [np.append(rng.integers(2, 256, rng.integers(3, 40)), 1).astype(np.uint16)
            for _ in range(300)]
    token_files.write_indexed(root / "docs", docs)
    return root


def loader(stream: Stream, rank: int, world: int, batch: int) -> TokenLoader:
    dist = Dist(rank, rank, world, world, torch.device("cpu"), None)
    return TokenLoader(stream, Samples("pair", False, False), dist, batch, 0, [], None)


def test_windows_are_nanogpts_read_in_place_in_a_seeded_order(corpus):
    tokens = np.memmap(corpus / "web.bin", dtype=np.uint16, mode="r")
    windows = Windows([token_files.open_tokens(str(corpus / "web.bin"), "uint16")], SEQ)
    assert len(windows) == (len(tokens) - 1) // SEQ
    at = np.array([0, 7, len(windows) - 1])
    expected = [tokens[i * SEQ:i * SEQ + SEQ + 1] for i in at]  # x the first SEQ, y shifted
    assert np.array_equal(windows.read(at), np.stack(expected))
    order = windows.order(seed=0, source=0, rounds=0)
    assert sorted(order.tolist()) == list(range(len(windows)))
    assert not np.array_equal(order, windows.order(seed=0, source=0, rounds=1))


def test_each_source_keeps_its_pass_order_however_many_sources(corpus):
    """Nine sources: one cache of eight orders shared by all had permuted every source's
    windows again on every batch."""
    opened = token_files.open_tokens(str(corpus / "web.bin"), "uint16")
    sources = [Windows([opened], SEQ) for _ in range(9)]
    first = [w.order(0, s, 0) for s, w in enumerate(sources)]
    assert all(w.order(0, s, 0) is first[s] for s, w in enumerate(sources))


def test_the_global_order_is_the_same_at_every_world_size_and_starts_anywhere_at_once(corpus):
    web = Windows([token_files.open_tokens(str(corpus / "web.bin"), "uint16")], SEQ)
    stream = Stream([Source("web", web)], seed=3)
    steps = {}
    for world, batch in ((1, 8), (2, 4), (4, 2)):  # a global batch of 8 each time
        ranks = [loader(stream, r, world, batch) for r in range(world)]
        for r in ranks:
            r.set_epoch(0)
        per_rank = [list(r) for r in ranks]
        steps[world] = [torch.cat([per_rank[r][i][0] for r in range(world)])
                        for i in range(5)]
    for world in (2, 4):
        assert all(torch.equal(a, b) for a, b in zip(steps[1], steps[world]))
    far = loader(stream, 0, 1, 8)
    far.load_state_dict({"next_sample": 10**12})  # a position no run replays to
    began = time.perf_counter()
    far.set_epoch(10**12 // far.epoch_samples)
    first = next(iter(far))
    assert time.perf_counter() - began < 0.5
    expected = stream.read(10**12, 8)[0]
    assert torch.equal(first[0], torch.from_numpy(expected[:, :-1]))


def test_epochs_hold_whole_steps_and_a_resume_at_another_global_batch_goes_on_from_its_sample(
        corpus):
    """Every step takes G: 5 samples x 2 accumulated and 10 at once take the same samples
    over two epochs (1,249 windows: the accumulated run's first epoch ended in a short step
    and its second began elsewhere); resumed after an epoch at another global batch, the
    next epoch begins at the sample the last one reached, its samples whole steps of 25."""
    web = Windows([token_files.open_tokens(str(corpus / "web.bin"), "uint16")], SEQ)
    stream = Stream([Source("web", web)], seed=3)
    dist = Dist(0, 0, 1, 1, torch.device("cpu"), None)
    split = TokenLoader(stream, Samples("pair", False, False), dist, 5, 0, [], None, 2)
    whole = loader(stream, 0, 1, 10)
    assert len(stream) == 1249 and len(split) == 2 * len(whole) == 248
    for epoch in (0, 1):
        split.set_epoch(epoch)
        whole.set_epoch(epoch)
        halves, steps = [b[0] for b in split], [b[0] for b in whole]
        assert all(torch.equal(torch.cat(halves[2 * i:2 * i + 2]), step)
                   for i, step in enumerate(steps))
    state = whole.state_dict()
    assert state["next_sample"] == state["epoch_start"] == 2480
    wider = loader(stream, 0, 1, 25)
    wider.load_state_dict(state)
    wider.set_epoch(2)
    read = [b[0] for b in wider]
    assert len(read) == 1249 // 25
    assert torch.equal(read[0], torch.from_numpy(stream.read(2480, 25)[0][:, :-1]))


def test_a_mixture_draws_deterministically_in_proportion_to_its_weights(corpus):
    opened = [token_files.open_tokens(str(corpus / name), "uint16")
              for name in ("web.bin", "code.npy", "docs.bin")]
    weights = [0.6, 0.3, 0.1]
    stream = Stream([Source(n, Windows([f], SEQ), w)
                     for n, f, w in zip(("web", "code", "docs"), opened, weights)], seed=0)
    source, k = stream.locate(np.arange(100_000))
    for g in (10, 997, 99_999):  # every prefix within a sample of its share
        seen = np.bincount(source[:g], minlength=3)
        assert np.abs(seen - g * np.array(weights)).max() < 1
        assert np.array_equal(seen, stream.samples_before(g))
    for s in range(3):  # each source's samples numbered 0, 1, 2, ... in order
        assert np.array_equal(k[source == s], np.arange((source == s).sum()))
    share = 0.123456789  # a share no short period holds: honoured to 1 / PERIOD
    odd = Stream([Source("a", stream.sources[0].windows, share),
                  Source("b", stream.sources[1].windows, 1 - share)], seed=0)
    assert odd.period == PERIOD
    assert abs(odd.samples_before(10**9)[0] / 10**9 - share) < 1 / PERIOD
    again = Stream(stream.sources, seed=0)
    assert np.array_equal(again.read(12345, 16)[0], stream.read(12345, 16)[0])


def test_a_capped_eval_of_a_mixture_scores_each_source_in_its_share(corpus):
    """data.eval_samples of a mixture: each source's share of the held-out windows, as
    uncapped (the first n of them all had been the first source's alone)."""
    from parallab.data.token_files import TokenFiles

    mix = [{"name": "web", "files": str(corpus / "web.bin"), "weight": 0.9},
           {"name": "code", "files": str(corpus / "code.npy"), "weight": 0.1}]
    every = TokenFiles(sources=mix, seq_len=SEQ, vocab_size=256).split()[1]
    capped = TokenFiles(sources=mix, seq_len=SEQ, vocab_size=256, eval_samples=9).split()[1]
    assert [len(p) for p in every.parts] == [12, 4]  # 1% of each source's windows
    assert [len(p) for p in capped.parts] == [7, 2]  # 6.75 and 2.25, by largest remainder
    assert np.array_equal(capped.read(np.arange(9)), every.read(np.array([*range(7), 12, 13])))


def test_a_packed_window_with_the_document_mask_is_each_document_alone():
    from parallab.models.gpt import GPT

    torch.manual_seed(0)
    for attention in ("sdpa", "manual"):
        model = GPT(vocab_size=64, context=16, layers=2, heads=2, width=16,
                    attention=attention).eval()
        lengths = [5, 8, 3]
        x = torch.randint(0, 64, (1, sum(lengths)))
        documents = torch.repeat_interleave(torch.arange(3), torch.tensor(lengths))[None]
        with torch.no_grad():
            packed = model(x, documents=documents)
            alone = torch.cat([model(part) for part in x.split(lengths, dim=1)], dim=1)
            plain = model(x)
        assert torch.allclose(packed, alone, atol=1e-5)
        assert not torch.allclose(plain, alone, atol=1e-3)  # without it, they attend across


def test_documents_from_an_idx_or_an_end_of_text_id_and_the_boundary_targets(corpus):
    pair = token_files.open_tokens(str(corpus / "docs.bin"), "uint16")
    flat = token_files.TokenFile(pair.path, pair.tokens)  # the same tokens, no .idx
    at = np.arange(5)
    by_index = Windows([pair], SEQ).documents(at, Windows([pair], SEQ).read(at))
    by_eos = Windows([flat], SEQ, eos_id=1).documents(at, Windows([flat], SEQ).read(at))
    assert np.array_equal(by_index, by_eos) and by_index.max() > 0
    tokens = Windows([pair], SEQ).read(at)
    (inputs, y) = Samples("pair", True, True)(tokens, by_index)
    starts = by_index[:, 1:] != by_index[:, :-1]  # y's token begins a new document
    assert torch.equal(y == -100, torch.from_numpy(starts))
    assert torch.equal(inputs["documents"], torch.from_numpy(by_index[:, :-1]))
    lm = Samples("causal_lm", True, True)(tokens, by_index)
    assert lm["position_ids"][starts[:, :-1].nonzero()[0][0], :].min() == 0


@pytest.fixture(scope="module")
def mixture_runs(corpus, tmp_path_factory):
    """A mixture trained 8 steps at one process, and cut at step 4 under ddp with two
    ranks (half the batch each), then resumed at one process: the same global batch."""
    from parallab.cli import train_in_process

    root = tmp_path_factory.mktemp("mixture")
    mix = [*GPT, f"data.sources=[{{name: web, files: {corpus}/web.bin, weight: 3}}, "
           f"{{name: code, files: {corpus}/code.npy, weight: 1}}]"]
    whole = train_in_process([*mix, "trainer.max_steps=8"], root / "whole")
    train_in_process([*mix, "trainer.max_steps=4", "parallel=ddp", "parallel.world_size=2",
                      "data.batch_size=2"], root / "cut")
    resumed = train_in_process([*mix, "trainer.max_steps=8", "trainer.resume=auto"],
                               root / "cut")
    return (whole, root / "whole"), (resumed, root / "cut")


@pytest.mark.slow
@pytest.mark.distributed
def test_a_mixture_resumed_at_another_world_size_continues_the_uninterrupted_losses(
        mixture_runs):
    (whole, whole_dir), (resumed, cut_dir) = mixture_runs
    expected, got = losses(whole_dir), losses(cut_dir)
    assert len(expected) == len(got) == 8
    assert got == pytest.approx(expected, rel=1e-5)
    assert resumed["source_tokens"] == whole["source_tokens"] == {"web": 6 * 4 * SEQ,
                                                                  "code": 2 * 4 * SEQ}


def test_a_transformers_causal_lm_trains_on_documents_kept_apart(corpus, train_here):
    metrics, _ = train_here(*TINY_LLAMA, "data=token_files", f"data.files={corpus}/docs.bin",
                            f"data.seq_len={SEQ}", "data.document_mask=true",
                            "data.skip_boundary_target=true", "data.eval_samples=8",
                            "trainer.max_steps=2", "trainer.checkpoint_every_n_steps=null",
                            "device=cpu")
    assert metrics["steps"] == 2 and np.isfinite(metrics["eval_loss"])


def test_a_resume_on_changed_files_is_refused_naming_the_file(corpus, train_here, tmp_path):
    data = tmp_path / "train.bin"
    data.write_bytes((corpus / "web.bin").read_bytes())
    train_here(*GPT, f"data.files={data}", "trainer.max_steps=2")
    with open(data, "r+b") as f:  # same size, other tokens
        f.seek(1000)
        f.write(b"\x07\x00" * 8)
    with pytest.raises(ConfigError, match=rf"{data} changed since the checkpoint"):
        train_here(*GPT, f"data.files={data}", "trainer.max_steps=4", "trainer.resume=auto")


def test_a_resume_tells_files_by_where_they_are_and_in_their_order(corpus, train_here,
                                                                     monkeypatch):
    """Files given in another order, or a mixture's sources, would draw other samples: it
    was taken; the same file written as another path is the same file: it was refused."""
    monkeypatch.chdir(corpus)
    two = [*GPT, "trainer.max_steps=2", "data.files=[web.bin,code.npy]"]
    train_here(*two)
    resume = ["trainer.max_steps=4", "trainer.resume=auto"]
    with pytest.raises(ConfigError, match=r"was saved reading its files in another order "
                       r"\(\S+/web.bin, \S+/code.npy\)"):
        train_here(*two, *resume, "data.files=[code.npy,web.bin]")
    metrics, _ = train_here(*two, *resume, f"data.files=[{corpus}/web.bin,./code.npy]")
    assert metrics["steps"] == 4
    mix = "data.sources=[{{name: {}, files: web.bin}}, {{name: {}, files: code.npy}}]"
    train_here(*GPT, "trainer.max_steps=2", mix.format("a", "b"), name="mix")
    with pytest.raises(ConfigError, match=r"was saved with data.sources \{'a': 1.0, 'b': 1.0\}"
                       r", here \{'b': 1.0, 'a': 1.0\}: give their names, order and weights"):
        train_here(*GPT, *resume, "data.sources=[{name: b, files: code.npy}, "
                   "{name: a, files: web.bin}]", name="mix")
    # the same shares written otherwise (2 and 2 for 1 and 1) draw the same samples: taken
    metrics, _ = train_here(*GPT, *resume, "data.sources=[{name: a, files: web.bin, weight: "
                            "2}, {name: b, files: code.npy, weight: 2}]", name="mix")
    assert metrics["steps"] == 4
    # from another dir: the checkpoint's paths, as given, were read against that dir
    monkeypatch.chdir(corpus.parent)
    metrics, _ = train_here(*two, "trainer.max_steps=6", "trainer.resume=auto",
                            f"data.files=[{corpus.name}/web.bin,{corpus}/code.npy]")
    assert metrics["steps"] == 6


def bad_inputs(root) -> list:
    short = root / "short.bin"
    np.arange(10, dtype=np.uint16).tofile(short)
    (root / "empty.bin").write_bytes(b"")  # numpy maps no empty file
    one = root / "one.bin"  # one window, which the held-out share takes
    np.arange(SEQ + 1, dtype=np.uint16).tofile(one)
    high = root / "high.bin"
    np.full(100, 300, dtype=np.uint16).tofile(high)
    (root / "cut.bin").write_bytes((root / "docs.bin").read_bytes()[:-2])
    (root / "cut.idx").write_bytes((root / "docs.idx").read_bytes())
    learnable(4000, 3, np.uint32).tofile(root / "wide.bin")  # read as uint16 by default
    (root / "garbage.npy").write_bytes(b"garbage" * 100)
    web = f"{root}/web.bin"
    two = "[{{name: a, files: {w}, weight: {a}}}, {{name: {n}, files: {w}, weight: {b}}}]"
    return [
        ([f"data.files={root}/nothing*.bin"], "matches no file"),
        ([f"data.files={web}", "model.vocab_size=100000"],
         "uint16 ids .below 65536., too few for a vocabulary of 100000 .data.vocab_size: "
         "the model's unless given.: write the files as uint32 and set data.dtype=uint32"),
        ([f"data.files={high}"], "holds token id 300 .at token 0., not in a vocabulary of "
         "256 .data.vocab_size: the model's unless given."),
        ([f"data.files={short}"], "holds 10 tokens, fewer than one window of data.seq_len "
         "\\+ 1 = 17"),
        ([f"data.files={root}/empty.bin"], "holds 0 tokens, fewer than one window"),
        ([f"data.files={one}"], "data.files: its 1 window.s. of data.seq_len \\+ 1 tokens "
         "are all held out for evaluation"),
        ([f"data.sources=[{{name: a, files: {web}}}, {{name: b, files: {one}}}]"],
         "data.sources.b.files: its 1 window.s. .* held out"),
        ([f"data.sources={two.format(w=web, a=1, n='b', b=-1)}"], "b's weight -1 is not a "
         "share"),
        ([f"data.sources={two.format(w=web, a=1, n='b', b='inf')}"], "b's weight inf is not "
         "a share"),
        ([f"data.sources={two.format(w=web, a=0, n='b', b=0)}"], "weights sum to 0"),
        ([f"data.sources={two.format(w=web, a=1, n='a', b=1)}"], "names a twice"),
        # a misspelt key: the source would have drawn at the default weight of 1
        ([f"data.sources=[{{name: a, files: {web}, wieght: 0.1}}]"], "a has wieght, which a "
         "source does not take"),
        ([f"data.sources=[{{name: a, files: {web}, weight: '0.7'}}]"], "a's weight '0.7' is "
         "not a share"),
        ([f"data.files={root}/cut.bin"], "cut.idx does not match .*cut.bin"),
        # each half of a uint32 id is a small uint16 one: no id check saw it
        ([f"data.files={root}/wide.bin"], "wide.bin reads as uint16 ids of which every "
         "second one is 0 or 1, as the high halves of uint32 ids are: set data.dtype=uint32"),
        ([f"data.files={root}/garbage.npy"], "garbage.npy does not read as a .npy array"),
        ([f"data.files={web}", "data.num_workers=2"], "data.num_workers=2: data=token_files "
         "reads its windows in place on a thread of its own, no DataLoader"),
        # the list's other files trained alone, the typo unsaid
        ([f"data.files=[{web},{root}/wbe*.bin]"], "data.files: .*wbe.*bin matches no file"),
        ([f"data.files=[{web},{root}/web*.bin]"], "data.files names .*web.bin twice"),
        ([f"data.files={web}", f"data.eval_files={web}"], "data.eval_files names .*web.bin, "
         "which the run trains on"),
        ([f"data.files={web}", "data.document_mask=true"], "needs document boundaries"),
        ([f"data.files={web}", "data.sample=causal_lm"], "data.sample=causal_lm gives a "
         "transformers model's {input_ids, labels}, and model=gpt takes .x, y. pairs: use "
         "data.sample=pair, or auto"),
        ([f"data.files={root}/docs.bin", "data.document_mask=true", "parallel=pipeline",
          "parallel.world_size=2"], "under a layout that cuts the model into stages"),
    ]


def test_each_bad_input_is_one_line_before_launch(corpus):
    for overrides, said in bad_inputs(corpus):
        with pytest.raises(ConfigError, match=said):
            checked(*GPT, *overrides)


def test_simulate_refuses_the_document_mask_under_a_pipeline_as_train_does(corpus, tmp_path):
    """simulate checks a layout by the check train's runs pass (the data's rule for it
    included): it refuses what train refuses, not print a command train then refuses."""
    from parallab.commands import simulate_in_process

    masked = [*GPT, f"data.files={corpus}/docs.bin",
              "data.document_mask=true", "parallel.world_size=2"]
    with pytest.raises(ConfigError, match="under a layout that cuts the model into stages"):
        simulate_in_process([*masked, "parallel=pipeline"], tmp_path / "pipeline")
    simulate_in_process([*masked, "parallel=fsdp"], tmp_path / "fsdp")  # a whole model: taken
    assert (tmp_path / "fsdp" / "simulate.json").exists()
    simulate_in_process([*masked, "model.layers=2", "parallel=auto", "simulate.plotted=0"],
                        tmp_path / "auto")
    ranked = json.loads((tmp_path / "auto" / "simulate.json").read_text())["layouts"]
    pipelines = [e for e in ranked if "parallel=pipeline" in e["command"]]
    assert pipelines and all("cuts the model into stages" in e["reason"] for e in pipelines)
    assert ranked[0]["fits"] and "parallel=pipeline" not in ranked[0]["command"]


def test_the_entrypoint_ends_a_bad_input_in_one_line_with_exit_status_2(corpus, tmp_path):
    result = run_entry("train.py", [*GPT, f"data.files={corpus}/none*.bin"], tmp_path / "run")
    assert result.returncode == 2, output(result)
    said = output(result).strip().splitlines()
    assert "Traceback" not in output(result)
    assert said[-1].endswith(f"data.files={corpus}/none*.bin matches no file: give token "
                             "files (a glob, a path or a list); `parallab prepare-data` "
                             "writes them from text")


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    """A byte-level BPE tokenizer of 300 tokens trained here (offline) on the shipped text."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    from parallab.data.bytetext import DEFAULT_TEXT

    text = DEFAULT_TEXT.read_text(encoding="utf-8")[:30_000]
    bpe = Tokenizer(models.BPE(unk_token="<unk>"))
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    bpe.train_from_iterator([text], trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<unk>", "<eos>"], show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    folder = tmp_path_factory.mktemp("tokenizer")
    PreTrainedTokenizerFast(tokenizer_object=bpe, unk_token="<unk>",
                            eos_token="<eos>").save_pretrained(folder)
    lines = [line for line in text.splitlines() if line.strip()]
    (folder / "docs.jsonl").write_text("".join(json.dumps({"text": line}) + "\n"
                                               for line in lines))
    return folder, lines


def test_prepare_data_writes_the_documents_token_files_read(tokenizer, tmp_path, train_here):
    from transformers import AutoTokenizer

    from parallab.data.pretrain.prepare import prepare

    folder, lines = tokenizer
    found = prepare([str(folder / "docs.jsonl")], str(folder), tmp_path, eval_fraction=0.1,
                    num_proc=2)
    assert found["train"]["documents"] + found["val"]["documents"] == len(lines)
    tok = AutoTokenizer.from_pretrained(folder)
    written = token_files.open_tokens(str(tmp_path / "train.bin"), "uint16")
    pointers = written.pointers.tolist() + [len(written) * 2]
    docs = [written.tokens[a // 2:b // 2].tolist() for a, b in zip(pointers, pointers[1:])]
    encoded = {tuple(tok(line, add_special_tokens=False)["input_ids"] + [tok.eos_token_id])
               for line in lines}
    assert all(tuple(d) in encoded for d in docs)
    metrics, _ = train_here(*GPT, f"data.files={tmp_path}/train.bin",
                            f"data.eval_files={tmp_path}/val.bin", "model.vocab_size=300",
                            "data.document_mask=true", "trainer.max_steps=2")
    assert metrics["steps"] == 2
    # written again into the same folder: refused before anything is tokenized, the run's
    # data as it was; with --force, replaced, the earlier val pair gone with it
    before = (tmp_path / "train.bin").read_bytes()
    with pytest.raises(ConfigError, match="already holds train.bin, train.idx, val.bin, "
                       "val.idx: give another folder, or --force"):
        prepare([str(folder / "docs.jsonl")], str(folder), tmp_path, eval_fraction=0.0)
    assert (tmp_path / "train.bin").read_bytes() == before
    again = prepare([str(folder / "docs.jsonl")], str(folder), tmp_path, eval_fraction=0.0,
                    force=True)
    assert again["train"]["documents"] == len(lines) and not (tmp_path / "val.bin").exists()


def test_prepare_datas_printed_command_trains_where_its_val_is_shorter_than_a_window(
        tokenizer, tmp_path, capsys):
    """The command prepare-data prints is one train takes: a held-out split shorter than
    one of gpt's windows (its context of 256, and the next token) is left out of it, said,
    where the command had been refused."""
    import argparse

    from parallab.data.pretrain import prepare

    folder, _ = tokenizer
    parser = argparse.ArgumentParser()
    prepare.arguments(parser)
    prepare.main(parser.parse_args([str(folder / "docs.jsonl"), "--tokenizer", str(folder),
                                    "--out", str(tmp_path), "--num-proc", "1"]))
    said = capsys.readouterr().out.strip().splitlines()
    # one document of a few held out: far more than the default 0.05% asks, said
    assert re.match(r"val.bin holds \d+% of the tokens, --eval-fraction 0.0005 asked for "
                    "less: a val split is whole documents", said[-3]), said
    assert said[-2].startswith("val.bin holds fewer tokens than one window of gpt's (257)")
    command = said[-1].removeprefix("train with: parallab train ").split()
    assert not any(o.startswith("data.eval_files=") for o in command)
    checked(*command, "model.layers=1", "model.width=32", "model.heads=2", "device=cpu")


def test_gpt_on_text_tokenized_as_a_transformers_model_takes_it_is_told_the_data_it_takes(
        tokenizer):
    """data=hf_text gives {input_ids, labels}: gpt's refusal had said it held no
    data.seq_len, which it sets."""
    folder, _ = tokenizer
    with pytest.raises(ConfigError, match=r"data=hf_text does not hold \(its samples are no "
                       r"\(x, y\) pairs of next-token targets\): use data=bytes, or "
                       "data=token_files"):
        checked("model=gpt", "data=hf_text", f"data.files={folder}/docs.jsonl",
                f"data.tokenizer={folder}", "device=cpu")


def test_prepare_data_refuses_a_record_without_text_in_one_line(tokenizer, tmp_path):
    """A record whose text is null, or under another key: its index named, nothing written
    (the tokenizer's own error was a worker's traceback)."""
    from parallab.data.pretrain.prepare import prepare

    folder, lines = tokenizer
    docs = tmp_path / "docs.jsonl"
    for bad in ({"text": None}, {"body": "a word"}):
        docs.write_text("".join(json.dumps(r) + "\n" for r in (
            *({"text": line} for line in lines[:40]), bad)))
        with pytest.raises(ConfigError, match=rf"^parallab prepare-data: record 40 of {docs} "
                           r"\(from 0, the files in order\) has None under --text-key text, "
                           "no text"):
            prepare([str(docs)], str(folder), tmp_path / "out", num_proc=2)
        assert not (tmp_path / "out").exists()
    # with --force over earlier token files: they stay as they were until the new ones are
    # all written (they were deleted before the record was read)
    good = tmp_path / "good.jsonl"
    good.write_text("".join(json.dumps({"text": line}) + "\n" for line in lines[:40]))
    kept = prepare([str(good)], str(folder), tmp_path / "kept", eval_fraction=0.0)
    before = (tmp_path / "kept" / "train.bin").read_bytes()
    with pytest.raises(ConfigError, match="no text"):
        prepare([str(docs)], str(folder), tmp_path / "kept", force=True)
    assert kept["train"]["documents"] == 40
    assert sorted(p.name for p in (tmp_path / "kept").iterdir()) == ["train.bin", "train.idx"]
    assert (tmp_path / "kept" / "train.bin").read_bytes() == before
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    with pytest.raises(ConfigError, match=rf"^parallab prepare-data {empty}: no records"):
        prepare([str(empty)], str(folder), tmp_path / "none")


def test_a_resume_that_would_train_other_samples_next_is_refused(corpus, train_here):
    """Another share held out (windows evaluated so far would be trained on) or another
    seed (another order): each named before launch; a cap on eval samples is taken."""
    data = [*GPT, f"data.files={corpus}/web.bin"]
    train_here(*data, "trainer.max_steps=2")
    resume = [*data, "trainer.max_steps=3", "trainer.resume=auto"]
    with pytest.raises(ConfigError, match=r"saved training on \d+ windows, here \d+: "
                       "data.eval_fraction=0.3 holds out another share"):
        train_here(*resume, "data.eval_fraction=0.3")
    with pytest.raises(ConfigError, match="data.eval_files takes the place of the share held "
                                          "out"):  # (it had been said as eval_fraction's)
        train_here(*resume, f"data.eval_files={corpus}/code.npy")
    with pytest.raises(ConfigError, match="saved at seed=42, which orders its data"):
        train_here(*resume, "seed=7")
    metrics, _ = train_here(*resume, "data.eval_samples=4")
    assert metrics["steps"] == 3
    # eval files decide no sample it trains on: other ones are taken (they were refused as
    # a change of the order of samples)
    # a file moved to another source, the files in their order: not a share held out
    mix = "data.sources=[{{name: a, files: [{}]}}, {{name: b, files: [{}]}}]"
    web, code, docs = (f"{corpus}/{name}" for name in ("web.bin", "code.npy", "docs.bin"))
    train_here(*GPT, "trainer.max_steps=2", mix.format(f"{web},{code}", docs), name="mix")
    with pytest.raises(ConfigError, match=r"saved training on \d+ \+ \d+ windows, here \d+ \+ "
                       r"\d+: its files lie in other sources"):
        train_here(*GPT, "trainer.max_steps=3", "trainer.resume=auto",
                   mix.format(web, f"{code},{docs}"), name="mix")
    held = [*data, f"data.eval_files={corpus}/code.npy"]
    train_here(*held, "trainer.max_steps=2", name="held")
    metrics, _ = train_here(*held[:-1], f"data.eval_files={corpus}/docs.bin", "trainer.max_steps=3",
                            "trainer.resume=auto", name="held")
    assert metrics["steps"] == 3


def test_a_reader_left_running_is_stopped_before_the_interpreter_ends():
    """A reader whose consumer never closed it (a loop that broke, the run's last epoch)
    was still in torch's code as the interpreter tore it down: the run that had ended
    aborted (exit 134) now and then. The exit handler stops it and waits."""
    from parallab.data.pretrain import loader as token_loader

    def forever():
        while True:
            yield torch.zeros(4)

    reader = token_loader._ahead(forever(), 2)
    next(reader)  # started, never closed
    running = [t for t in token_loader._READERS]
    assert running and all(t.is_alive() for t in running)
    token_loader.stop_readers()
    assert not any(t.is_alive() for t in running)
    reader.close()
    assert not token_loader._READERS
