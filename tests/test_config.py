"""Composition of every config group option, the key reference and help, the command line's
own refusals and what it leaves in place (each group's bad values: test_config_refusals.py)."""

from __future__ import annotations

import os
import re

import pytest
import torch
from conftest import REPO, checked, output, run_entry, typed
from omegaconf import OmegaConf

from parallab.checks import validate
from parallab.config.schema import DataConfig
from parallab.config.targets import model_name

GROUPS = ["model", "data", "parallel", "precision", "backend", "optim", "trainer", "logger"]
# what this machine lacks for an option, and the key the refusal names
NEEDS_MORE_THAN_THIS_MACHINE = {("backend", "nccl"): "backend=nccl",  # CUDA
                                ("backend", "mpi"): "backend=mpi",  # a PyTorch built with MPI
                                ("precision", "fp8"): "precision=fp8",  # an H100-class GPU
                                ("data", "cifar10"): "data.root",  # CIFAR-10 is not shipped
                                ("data", "imagefolder"): "data.path",  # nor is a default folder
                                ("data", "hf_text"): "data.files",  # nor a tokenizer
                                ("data", "token_files"): "data.files"}  # nor token files
# options train refuses by design, and the line that says where they belong
TRAIN_REFUSES = {("parallel", "auto"): "rank them with `parallab simulate parallel=auto"}
# models too large to build whole on this machine (the controller's trial would): composed,
# and checked as parallab simulate checks them, on meta
LARGE = {"llama3_8b", "llama3_70b", "llama3_405b", "deepseek_v3", "qwen3_moe_30b",
         "qwen3_moe_235b", "mixtral_8x7b", "nemotron4_340b"}


def options(group: str) -> list[str]:
    return sorted(p.stem for p in (REPO / "conf" / group).glob("*.yaml"))


# the class each model option builds (model._target_'s last part)
MODEL_CLASSES = {"gpt": "GPT", "lstm": "LSTMClassifier", "mlp": "MLP", "mnist_cnn": "MnistCNN",
                 "resnet18": "ResNet18", "convnet": "ConvNet",
                 **{name: "LlamaForCausalLM" for name in LARGE if name.startswith("llama")},
                 "deepseek_v3": "DeepseekV3ForCausalLM", "qwen3_moe_30b": "Qwen3MoeForCausalLM",
                 "qwen3_moe_235b": "Qwen3MoeForCausalLM", "mixtral_8x7b": "MixtralForCausalLM",
                 "nemotron4_340b": "NemotronForCausalLM"}

# options that only make sense with a partner from another group
PARTNERS = {("model", "gpt"): ["data=bytes"], ("data", "bytes"): ["model=gpt"],
            ("model", "lstm"): ["data=text"], ("data", "text"): ["model=lstm"],
            ("model", "resnet18"): ["data=synthetic", "data.shape=[3,32,32]"],
            ("data", "tokens"): ["model=gpt"],
            **{("model", name): ["data=tokens", "data.seq_len=64"] for name in LARGE},
            ("data", "cifar10"): ["model=resnet18"], ("data", "imagefolder"): ["model=resnet18"],
            # tensor parallel needs a model with a plan
            ("parallel", "tp"): ["model=mlp"], ("parallel", "fsdp_tp"): ["model=mlp"]}


@pytest.mark.parametrize("group,option", [(g, o) for g in GROUPS for o in options(g)])
def test_every_option_composes_and_validates(group, option):
    cfg = typed(f"{group}={option}", "device=cpu", *PARTNERS.get((group, option), []))
    if group == "trainer":  # one option, no name field
        assert type(cfg.trainer).__name__ == "TrainerConfig"
    elif group == "model":  # a _target_ spec: named by its class
        assert model_name(cfg.model) == MODEL_CLASSES[option]
    elif group == "data":  # typed by its data set's own class
        assert isinstance(cfg.data, DataConfig) and cfg.data.name == option
    elif group == "logger":  # name -> _target_ spec, one per chosen option
        assert list(cfg.logger) == [option]
    else:
        assert getattr(cfg, group).name == option
    if (group, option) in TRAIN_REFUSES:
        with pytest.raises(validate.ConfigError, match=TRAIN_REFUSES[(group, option)]):
            validate.prepare(cfg, in_place=None)
    elif group == "model" and option in LARGE:
        from parallab.commands import compose
        from parallab.config.hydra_app import typed_config
        from parallab.simulate import run

        overrides = [f"model={option}", "data.seq_len=64", "parallel=fsdp",
                     "parallel.world_size=8"]
        assert run.check(typed_config(compose(overrides, None, "simulate"), overrides))
    elif (group, option) in NEEDS_MORE_THAN_THIS_MACHINE:
        with pytest.raises(validate.ConfigError,
                           match=NEEDS_MORE_THAN_THIS_MACHINE[(group, option)]):
            validate.prepare(cfg, in_place=None)
    else:
        validate.prepare(cfg, in_place=None)


def test_the_key_reference_in_the_docs_is_the_dataclasses():
    from parallab.config import help

    assert help.keys_markdown() in (REPO / "docs" / "config.md").read_text(), (
        "docs/config.md's keys are stale: python -m parallab.config.help")
    # every key a user sets: a cluster's, which its option sets, and simulate's own had
    # been left out (--help alone listed them)
    assert "| `cluster.memory_gb` | the option's | a GPU's memory, GiB |" in help.keys_markdown()
    assert "| `simulate.routing` | `random` |" in help.keys_markdown()


@pytest.mark.parametrize("group", ["parallel", "adapter", "precision", "backend", "optim",
                                   "scheduler", "trainer"])
def test_an_option_sets_only_what_differs_from_its_schema(group):
    """The dataclasses are the defaults: an option's YAML repeating one would be a second
    place to change it."""
    import yaml

    from parallab.config.help import schema_of
    from parallab.config.schema import SCHEMAS

    for option in options(group):
        cls = schema_of(group, option)
        assert cls in SCHEMAS[group].values(), option
        defaults = OmegaConf.to_container(OmegaConf.structured(cls), enum_to_str=True)
        text = yaml.safe_load((REPO / "conf" / group / f"{option}.yaml").read_text())
        same = [k for k, v in text.items() if k != "defaults" and defaults.get(k, v) == v
                and k in defaults]
        assert not same, f"conf/{group}/{option}.yaml repeats its schema's {same}"


def test_defaults_are_the_seed_recipe():
    cfg, layout = validate.prepare(typed("device=cpu"), in_place=None)
    assert (model_name(cfg.model), cfg.data.name, cfg.parallel.name) == ("MnistCNN", "mnist",
                                                                          "none")
    assert cfg.model == {"_target_": "parallab.models.mnist_cnn.MnistCNN", "num_classes": 10,
                         "dropout": 0.5}
    assert (cfg.optim.name, cfg.optim.lr, cfg.optim.momentum) == ("sgd", 0.01, 0.5)
    assert (cfg.data.batch_size, cfg.trainer.epochs) == (64, 10)
    assert (cfg.backend.name, layout.world_size) == ("gloo", 1)


def test_auto_values_resolve_for_cpu():
    cfg, layout = validate.prepare(typed("parallel=ddp"), in_place=None)
    assert cfg.device.value == "cpu" and cfg.backend.name == "gloo"
    assert layout.world_size == 2  # null = one per GPU, or 2 on CPU


@pytest.fixture
def torch_loaded(tmp_path):
    """(env, loaded): run a command with `env` and `loaded()` says whether its process
    imported torch by the time it exited (a sitecustomize records it at exit)."""
    folder, record = tmp_path / "watch", tmp_path / "torch_loaded"
    folder.mkdir()
    (folder / "sitecustomize.py").write_text(
        "import atexit, sys\n"
        f"atexit.register(lambda: open({str(record)!r}, 'w').write(str('torch' in sys.modules)))\n")
    return {"PYTHONPATH": str(folder)}, lambda: record.read_text() == "True"


@pytest.mark.parametrize("args,key,before_torch", [
    (["data.batch_size=abc"], "data.batch_size", False),  # wrong type: the data set's class
    (["data.batch_sze=3"], "batch_sze", True),  # unknown key
    # a typed group's: the key meant, not Hydra's "+trainer.max_step=3", refused after
    (["trainer.max_step=3"], "Could not override 'trainer.max_step'; did you mean "
                             "trainer.max_steps?", True),
    (["data.batchsize=3"], "did you mean data.batch_size?", True),  # untyped until checked
    # a key auto's layouts each set, given to auto
    (["parallel=auto", "parallel.regather_in_backward=true"],
     "parallel=auto sets parallel.regather_in_backward itself, for each layout it ranks: drop "
     "it (or give one layout)", True),
    (["logger.csv.filename=x.csv"], "logger.csv is set only for a logger chosen: choose it, "
                                    "e.g. logger=[tensorboard,csv]", True),
    # a chosen logger's key mistyped: the key meant, not advice to choose it
    (["logger=csv", "logger.csv.filenme=x.csv"], "did you mean logger.csv.filename?", True),
    (["parallel=fsdp_typo"], "parallel", True),  # unknown group option
    # one of a list's options unknown: Hydra lists where it looked, parallab what is there
    (["logger=[tensorboard,nope]"], "'logger/nope' (options in 'logger': csv, mlflow, "
                                    "tensorboard, wandb)", True),
    (["device=gpu"], "device", True),  # not one of the enum's values
    (["data.batch_size=[1"], "data.batch_size=[1", True),  # Hydra cannot parse it
    # nor a run dir with an unquoted '=' (read for its earlier record before Hydra runs)
    (["hydra.run.dir=/tmp/a=b"], "hydra.run.dir=/tmp/a=b; mismatched input '='", True),
    (["precision=null"], "precision=null: the precision group takes one of its options", True),
])
def test_bad_input_exits_with_one_line_naming_the_key(args, key, before_torch, tmp_path,
                                                      torch_loaded):
    """Hydra's own refusals (type, key, option, value, grammar), as parallab's: one line,
    exit status 2, those of the schema before torch is loaded (a second, not four)
    (parallab's own checks: test_bad_values_fail_naming_the_key, in-process, and from the
    command line the test after this one)."""
    env, loaded = torch_loaded
    result = run_entry("train.py", args, tmp_path / "run", timeout=120, env=env)
    text = output(result)
    assert result.returncode == 2, text
    assert key in text and len(text.strip().splitlines()) == 1, text
    assert not (tmp_path / "run" / "metrics.json").exists()
    if before_torch:
        assert not loaded()


@pytest.mark.parametrize("name,naming", [
    ("earlier", "hydra.run.dir={}"),
    # the dir as Hydra reads it, not as typed: a comma escaped, the key forced
    ("an,earlier", "++hydra.run.dir={}"),
])
def test_bad_input_aimed_at_an_earlier_run_leaves_its_record_as_it_was(tmp_path, name, naming):
    """Resuming with a typo: Hydra writes .hydra/ before the check, so the app puts it back."""
    earlier = tmp_path / name
    record = {name: f"# the earlier run's {name}\n".encode()
              for name in ("config.yaml", "hydra.yaml", "overrides.yaml")}
    (earlier / ".hydra").mkdir(parents=True)
    for name, content in record.items():
        (earlier / ".hydra" / name).write_bytes(content)
    (earlier / "checkpoints").mkdir()
    (earlier / "checkpoints" / "last.pt").write_bytes(b"weights")
    named = naming.format(str(earlier).replace(",", "\\,"))
    result = run_entry("train.py", ["trainer.resume=auto", "data.batch_size=0", named],
                       timeout=120)
    assert result.returncode == 2 and "data.batch_size=0" in output(result)
    for name, content in record.items():
        assert (earlier / ".hydra" / name).read_bytes() == content, name
    assert (earlier / "checkpoints" / "last.pt").read_bytes() == b"weights"


def test_cfg_job_prints_the_composed_config(torch_loaded):
    env, loaded = torch_loaded
    result = run_entry("train.py", ["--cfg", "job", "parallel=ddp", "optim=adam"], timeout=120,
                       env=env)
    assert result.returncode == 0, output(result)
    assert not loaded()  # composing needs no torch
    printed = OmegaConf.create(result.stdout)
    assert printed.parallel.name == "ddp" and printed.optim.name == "adam"
    assert printed.optim.lr == 0.001 and printed.data.batch_size == 64


def test_help_lists_the_groups_and_says_what_each_key_does():
    result = run_entry("train.py", ["--help", "model=gpt", "data=bytes"], timeout=120)
    assert result.returncode == 0, output(result)
    for group in GROUPS:
        assert f"{group}: " in result.stdout
    assert "mnist_cnn" in result.stdout and "ddp" in result.stdout
    assert "schema/" not in result.stdout  # the typed bases of options are not choices
    for line in ["  clip_grad_norm: null  # max global gradient norm",  # a schema's comment
                 "  context: 256  # longest sequence",  # the option YAML's
                 "  loader: auto  # auto | memory",  # config.yaml's, for every data set
                 "  path: null  # a text file"]:  # the data set class's
        assert line in result.stdout, line
    assert "--multirun,-m" in result.stdout  # Hydra's flags still listed
    assert result.stdout.startswith("python train.py [group=option ...]")
    said = run_entry("evaluate.py", ["--help"], timeout=120).stdout  # the same, its own usage
    assert said.startswith("python evaluate.py ckpt=PATH") and "mnist_cnn" in said
    said = run_entry("parallab", ["advise", "--help"], timeout=120).stdout
    assert said.startswith("parallab advise [group=option ...]") and "target_world_size" in said


def test_shell_completion_offers_group_options(torch_loaded):
    env, loaded = torch_loaded
    result = run_entry("train.py", ["-sc", "query=bash"], timeout=120,
                       env={"COMP_LINE": "python train.py parallel=", "COMP_POINT": "99", **env})
    assert result.returncode == 0, output(result)
    assert not loaded()  # a completion at every Tab: no torch
    assert "parallel=ddp" in result.stdout and "parallel=none" in result.stdout


def test_amp_is_fp16_on_cuda_and_every_mesh_layout_takes_it():
    """float16's scaled loss: the trainer's backward, or a pipeline's schedule's (its
    _loss scales it); the sharded layouts' ranks agree on an overflow (ShardedGradScaler)."""
    from parallab.config.schema import Device
    from parallab.parallel import PLANS
    from parallab.precision import compute_dtype

    assert compute_dtype("amp", "cuda") == torch.float16
    assert compute_dtype("amp", "cpu") == torch.bfloat16
    for name in ("pipeline", "fsdp"):
        cfg = typed(f"parallel={name}", "precision=amp", "parallel.world_size=2")
        cfg.device = Device.cuda  # resolved, as on a GPU machine
        plan = PLANS[name]
        plan.refuse_sharded(cfg, plan.layout_of(cfg.parallel, cfg.parallel.world_size))


@pytest.mark.parametrize("layout,devices,found,expected", [
    ("dp", [0, 0], 1, 2), ("model", [1, 0], 2, 2), ("ddp", [0, 1], 2, 2),
    ("dp", [0, 5], 1, "names 2 GPUs, but 1 of them are visible"),
    ("ddp", [0, 0], 1, "names a GPU twice, and parallel=ddp runs a process per GPU"),
])
def test_parallel_devices_are_gpus_this_machine_has(monkeypatch, layout, devices, found,
                                                    expected):
    """The GPU count stood in for (this machine has none): a one-process layout may name
    one GPU twice; an id CUDA does not have, or a repeat under a process per GPU, is
    refused before launch."""
    import torch

    from parallab.config.schema import Device
    from parallab.parallel import PLANS

    cfg = typed(f"parallel={layout}", f"parallel.devices=[{','.join(map(str, devices))}]")
    cfg.device = Device.cuda
    monkeypatch.setattr(torch.cuda, "device_count", lambda: found)
    if isinstance(expected, int):
        assert validate.visible_gpus(cfg, PLANS[layout]) == expected
    else:
        with pytest.raises(validate.ConfigError, match=expected):
            validate.visible_gpus(cfg, PLANS[layout])


@pytest.mark.parametrize("before", [None, "3"])
def test_a_refused_gpu_choice_leaves_the_callers_environment_as_it_was(monkeypatch, before):
    """parallel.devices makes its GPUs the process's (CUDA_VISIBLE_DEVICES, before the first
    CUDA call); refused (on the CPU), the variable is as the caller had it: a notebook's
    next run sees the GPUs it saw, and its launches keep their fork server."""
    if before is None:
        monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    else:
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", before)
    with pytest.raises(validate.ConfigError, match="parallel.devices"):
        checked("parallel=ddp", "parallel.devices=[0,1]", "device=cpu")
    assert os.environ.get("CUDA_VISIBLE_DEVICES") == before


def test_the_hydra_internals_parallab_uses_are_in_the_installed_hydra_and_nowhere_else():
    """One module holds every private Hydra name parallab calls: importing it fails where
    the installed Hydra lacks one, and no other module reaches into Hydra's internals."""
    from parallab.config import hydra_internals  # noqa: F401 - fails without one of them

    src = REPO / "src" / "parallab"
    reaching = [p.relative_to(src) for p in src.rglob("*.py") if p.name != "hydra_internals.py"
                and re.search(r"hydra\._internal|from hydra\.\S+ import _|hydra\.main import",
                              p.read_text())]
    assert not reaching


def test_a_config_dir_given_a_file_says_so(tmp_path, train):
    """Hydra said the dir was not found, of a file that is there."""
    own = tmp_path / "mine.yaml"
    own.write_text("a: 1\n")
    result, _ = train("--config-dir", str(own), "device=cpu")
    text = output(result)
    assert result.returncode == 2 and len(text.strip().splitlines()) == 1, text
    assert "it is a file; give --config-dir the folder that holds your config groups" in text


def test_two_loggers_chosen_that_set_one_key_are_refused(tmp_path, train):
    """A user's copy of csv.yaml as mycsv.yaml, its key still csv: logger=[csv,mycsv] made
    one logger of the two, the other dropped without a word; one line now, exit 2."""
    conf = tmp_path / "conf"
    (conf / "logger").mkdir(parents=True)
    (conf / "logger" / "mycsv.yaml").write_text(
        "csv:\n  _target_: parallab.observe.loggers.csv_file.CSVLogger\n"
        "  filename: user_metrics.csv\n")
    result, run_dir = train("--config-dir", str(conf), "logger=[csv,mycsv]", "device=cpu")
    text = output(result)
    assert result.returncode == 2 and len(text.strip().splitlines()) == 1, text
    assert "logger/mycsv.yaml sets another's, so one was dropped: give it a key of its own" \
        in text


def test_composing_shares_hydras_config_store_only_while_it_composes():
    """Hydra copies its config repository for each compose; parallab's copies share the one
    ConfigStore instead (one_store), and leave it copied as before after, nested too."""
    import copy

    from hydra.core.config_store import ConfigStore

    from parallab.config.hydra_internals import one_store

    store = ConfigStore.instance()
    with one_store():
        with one_store():
            assert copy.deepcopy(store) is store
        assert copy.deepcopy(store) is store  # the inner one leaves it to the outer
    assert typed("device=cpu").device.value == "cpu"
    assert copy.deepcopy(store) is not store


def test_a_users_option_wins_over_a_built_in_of_its_name(tmp_path, train):
    """A project's own conf/data/tokens.yaml is the one composed for data=tokens, not
    parallab's built-in of that name (Hydra's search path put parallab's conf/ first), as
    a test composes it and as a user runs it, with one line naming the built-in passed
    over; the built-ins the project has no file for stay parallab's."""
    conf = tmp_path / "conf"
    (conf / "data").mkdir(parents=True)
    (conf / "data" / "tokens.yaml").write_text(
        "# the project's own tokens: its bytes\n_target_: parallab.data.bytetext.Bytes\n"
        "seq_len: 32\nbatch_size: 4\neval_fraction: 0.002\n")
    gpt = ["model=gpt", "model.context=32", "model.layers=1", "model.width=32",
           "model.heads=2", "device=cpu"]
    cfg = typed("data=tokens", *gpt, config_dir=conf)
    assert cfg.data._target_ == "parallab.data.bytetext.Bytes" and cfg.data.batch_size == 4
    assert typed("data=synthetic", config_dir=conf).data.name == "synthetic"  # not shadowed
    result, _ = train("--config-dir", str(conf), "data=tokens", *gpt, "trainer.max_steps=1",
                      "trainer.checkpoint_every_n_steps=null")
    assert result.returncode == 0, output(result)[-2000:]
    said = [line for line in output(result).splitlines() if "built-ins" in line]
    assert len(said) == 1 and said[0].endswith(f"data=tokens from {conf}")
    # a Hydra project's own config.yaml beside its groups: parallab's stays the app's whole
    # config (the project's replaced every key: a traceback), and the file not read is said
    (conf / "config.yaml").write_text("db:\n  host: localhost\n")
    assert typed("data=tokens", *gpt, config_dir=conf).data.batch_size == 4
    result, _ = train("--config-dir", str(conf), "data=tokens", *gpt, "trainer.max_steps=1",
                      "trainer.checkpoint_every_n_steps=null", "trainer.overwrite=true")
    assert result.returncode == 0, output(result)[-2000:]
    assert f"{conf} holds config.yaml, the name of parallab's own config, which is not " \
        "read" in output(result)


def refusal(capsys, *argv: str) -> str:
    """The one line train.py refuses `argv` with (exit status 2), run in this process."""
    from parallab import cli

    with pytest.raises(SystemExit) as ended:
        cli.train(["train.py", *argv])
    said = capsys.readouterr().err.strip()
    assert ended.value.code == 2 and "\n" not in said, said
    return said


def test_a_project_option_extending_the_built_in_of_its_name_is_refused(tmp_path, capsys):
    """Hydra's way to extend a config names it in the defaults list; a project's option of
    a built-in's name names itself that way, the project's coming first, and Hydra recursed
    to Python's limit (2,500 lines of RecursionError). Under a name of its own it extends
    the built-in, and the project's other options are not held up by it."""
    conf = tmp_path / "conf"
    (conf / "model").mkdir(parents=True)
    (conf / "model" / "mnist_cnn.yaml").write_text(
        "defaults:\n  - /model/mnist_cnn@_here_\n  - _self_\ndropout: 0.1\n")
    said = refusal(capsys, "--config-dir", str(conf), "--cfg", "job")
    assert said.startswith(f"{conf}/model/mnist_cnn.yaml extends /model/mnist_cnn, which is "
                           "itself") and "(model/my_mnist_cnn.yaml)" in said
    assert typed("model=gpt", config_dir=conf).model["_target_"].endswith(".GPT")
    (conf / "model" / "mnist_cnn.yaml").rename(conf / "model" / "my_mnist_cnn.yaml")
    assert typed("model=my_mnist_cnn", config_dir=conf).model["dropout"] == 0.1


@pytest.mark.parametrize("given,said", [
    # Hydra warned, and composed parallab's built-ins in place of the project's options
    (["hydra.searchpath=[file://no_such_conf]"],
     "hydra.searchpath: file://no_such_conf is not found (no such folder"),
    (["hydra.searchpath=[pkg://no_such_package.conf]"],
     "hydra.searchpath: pkg://no_such_package.conf is not found (no such package dir"),
    # Hydra's flag for a primary config: it replaced parallab's, every built-in gone
    (["--config-path", "/tmp"], "--config-path /tmp: it would replace parallab's own config"),
    # Hydra's ValueError, in a traceback
    (["-m"], "Only one of --run, --multirun, --cfg, --info and --shell_completion"),
], ids=["file", "pkg", "config-path", "multirun-cfg"])
def test_a_project_config_that_would_drop_out_is_refused(capsys, given, said):
    assert refusal(capsys, *given, "model=gpt", "--cfg", "job").startswith(said)


def test_a_project_option_without_its_schema_is_told_the_schemas_name(tmp_path):
    """The fix the line gives works as written: the group's one schema named (a scheduler's
    is `default`, which no built-in option is called), or the group's list of them."""
    from parallab.config.hydra_app import untyped

    conf = tmp_path / "conf"
    (conf / "scheduler").mkdir(parents=True)
    (conf / "scheduler" / "cosine.yaml").write_text("min_lr_ratio: 0.5\n")
    with pytest.raises(validate.ConfigError, match=r"`defaults: \[/schema/scheduler/default"
                                                   r"@_here_, _self_\]`, as"):
        checked("scheduler=cosine", "device=cpu", config_dir=conf)
    fixed = "defaults:\n  - /schema/scheduler/default@_here_\n  - _self_\n"
    (conf / "scheduler" / "cosine.yaml").write_text(fixed + "name: cosine\nmin_lr_ratio: 0.5\n")
    assert typed("scheduler=cosine", config_dir=conf).scheduler.min_lr_ratio == 0.5
    assert "/schema/parallel/SCHEMA@_here_, _self_]`, SCHEMA one of none, dp, mesh, model, " \
        "pipeline, auto" in untyped("parallel")


def test_a_users_option_in_a_list_is_said_over_the_built_in(tmp_path):
    """logger=[tensorboard,csv] with a project's csv.yaml: the line naming the built-ins
    passed over read Hydra's choices, which hold no list, and left it out."""
    from parallab import cli

    conf = tmp_path / "conf"
    (conf / "logger").mkdir(parents=True)
    (conf / "logger" / "csv.yaml").write_text(
        "csv:\n  _target_: parallab.observe.loggers.csv_file.CSVLogger\n  filename: mine.csv\n")
    run_dir = tmp_path / "run"
    cli.train(["train.py", "--config-dir", str(conf), "logger=[tensorboard,csv]",
               "data=synthetic", "data.train_size=64", "data.eval_size=32", "device=cpu",
               "trainer.max_steps=1", f"hydra.run.dir={run_dir}"])
    assert (run_dir / "mine.csv").is_file()
    assert f"built-ins of the same name: logger=csv from {conf}" in \
        (run_dir / "train.log").read_text()


def test_a_projects_options_are_the_ones_hints_name(tmp_path, capsys):
    """A mistyped key of the project's own csv logger is matched against its keys, not
    parallab's csv's; `optim=null` lists the project's optim options too."""
    conf = tmp_path / "conf"
    for group in ("logger", "optim"):
        (conf / group).mkdir(parents=True)
    (conf / "logger" / "csv.yaml").write_text(
        "csv:\n  _target_: parallab.observe.loggers.csv_file.CSVLogger\n  path: mine.csv\n")
    (conf / "optim" / "fast.yaml").write_text(
        "defaults:\n  - /schema/optim/sgd@_here_\n  - _self_\nname: sgd\nlr: 0.1\n")
    said = refusal(capsys, "--config-dir", str(conf), "logger=csv", "logger.csv.pth=x")
    assert "did you mean logger.csv.path?" in said
    said = refusal(capsys, f"hydra.searchpath=[file://{conf}]", "optim=null")
    assert "the optim group takes one of its options (adam, adamw, fast, sgd)" in said


def test_help_describes_a_projects_option_by_its_own_words(tmp_path, capsys):
    """--help read each option's comments from parallab's file of that name: a project's
    model/gpt.yaml was shown with parallab's GPT's description."""
    from parallab import cli

    conf = tmp_path / "conf"
    (conf / "model").mkdir(parents=True)
    (conf / "model" / "gpt.yaml").write_text(
        "_target_: torch.nn.Linear  # the project's own\nin_features: 784  # pixels in\n"
        "out_features: 10\n")
    with pytest.raises(SystemExit) as ended:
        cli.train(["train.py", "--config-dir", str(conf), "model=gpt", "--help"])
    assert ended.value.code == 0
    shown = capsys.readouterr().out
    assert "  _target_: torch.nn.Linear  # the project's own\n  in_features: 784  # pixels in" \
        in shown
    assert "decoder-only" not in shown
