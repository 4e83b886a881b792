"""The commands beside training: `python evaluate.py` (a Hydra app: a checkpoint scored
on one device), `parallab export` and `parallab summary`, and the `parallab` command that
dispatches to them and to the training apps (cli.py)."""

from __future__ import annotations

import json
import logging
import os
import sys
from pathlib import Path
from typing import Any

from parallab.launching.preemption import ended_by_interrupt

# the `parallab` command's own imports (this module is its entry): Ctrl-C while they run
# ends it in one line, as train.py's does, where Python printed the import's traceback
with ended_by_interrupt():
    from hydra.core.hydra_config import HydraConfig
    from omegaconf import DictConfig, OmegaConf

    from parallab.cli import Invocation, _fail, _register_configs, advise, compose, train
    from parallab.config import help
    from parallab.config.chosen_data import composed_in_app, with_data
    from parallab.config.errors import ConfigError, OneLineError
    from parallab.config.hydra_app import config_flags, hydra_app, run_app, typed_config
    from parallab.config.schema import register_configs
    from parallab.checks.evaluating import (
        checked,
        onto_trained_data,
        refuse_ignored_overrides,
        trained_model_config,
    )
    from parallab.launching import launch
    from parallab.observe import summary

log = logging.getLogger("parallab")


def _evaluate_task(dict_cfg: DictConfig, call: Invocation) -> float:
    from parallab.training import rundir
    from parallab.training.checkpoint import CheckpointError

    usage = "python evaluate.py ckpt=outputs/DATE/TIME/checkpoints/last.pt"
    # --config-name gave a config to train with (keys(): `in` is false for ckpt=??? too)
    if "ckpt" not in dict_cfg.keys():
        name = HydraConfig.get().job.config_name
        _fail(f"evaluate.py --config-name={name}: {name} is a config to train with, which "
              "takes no ckpt; evaluate.py composes its own and takes the checkpoint (its "
              f"model and data come from it): {usage} [overrides], no --config-name", 2)
    if OmegaConf.is_missing(dict_cfg, "ckpt"):
        _fail(f"ckpt is not set: give the checkpoint to evaluate, {usage}", 2)
    overrides = list(HydraConfig.get().overrides.task)
    run_dir = Path(HydraConfig.get().runtime.output_dir)
    try:
        rundir.check_unused(run_dir, "evaluate.py", call.held_before())
        cfg, state = checked(dict_cfg, overrides)
    except (ConfigError, CheckpointError) as error:
        call.restore()
        _fail(str(error), 2)
    try:
        figures, objective = _scored(cfg, state, run_dir)
    except ConfigError as error:
        _fail(str(error), 2)
    return figures[objective]


def evaluate_in_process(overrides: list[str], run_dir: str | Path) -> dict[str, float]:
    """What `python evaluate.py OVERRIDES hydra.run.dir=RUN_DIR` does, in this process
    (tests, notebooks): the figures it writes to RUN_DIR/metrics.json; raises ConfigError
    or CheckpointError where evaluate.py would end in one line."""
    refuse_ignored_overrides(list(overrides))
    overrides = onto_trained_data(list(overrides))
    cfg, state = checked(compose(overrides, config_name="evaluate"), overrides)
    Path(run_dir).mkdir(parents=True, exist_ok=True)
    return _scored(cfg, state, Path(run_dir))[0]


def _scored(cfg, state: dict, run_dir: Path) -> tuple[dict[str, float], str]:
    """The checkpoint's model scored on the eval set, written to run_dir/metrics.json; its
    figures and the objective's name. ConfigError where the weights do not fit the model."""
    from parallab import metrics
    from parallab.data import build_data
    from parallab.launching import distributed
    from parallab.loss import build_loss
    from parallab.metrics import evaluate
    from parallab.models import adapters, build_model
    import torch

    from parallab.precision import Precision
    from parallab.training import weights

    dist = distributed.setup(cfg.device.value, None, cfg.backend.timeout_s,
                             cfg.parallel.threads_per_worker)
    try:
        base = weights.base_of_adapters(cfg.ckpt, state, cfg.model, cfg.seed) \
            if adapters.is_folder(cfg.ckpt) else build_model(cfg.model)
        model = weights.model_from(cfg.ckpt, adapters.apply(base, cfg.adapter))
    except ConfigError as error:
        raise ConfigError(f"ckpt={cfg.ckpt} does not fit model "
                          f"{cfg.model['_target_']}: {error}") from None
    precision = Precision(cfg.precision, dist.device)
    if precision.state_dtype != torch.float32:  # scored as a run keeps its weights
        from parallab.precision import kept_in

        model = kept_in(model, precision.state_dtype)
    data = build_data(cfg.data, dist, cfg.seed)
    loss = build_loss(cfg.loss).bind(model)
    figures = evaluate(model.to(dist.device), data.eval, dist, precision, loss, cfg.metrics)
    result = {"ckpt": str(Path(cfg.ckpt).resolve()), "model": cfg.model["_target_"],
              "data": cfg.data.name, "step": state.get("step"), **figures}
    out = run_dir / "metrics.json"
    out.write_text(json.dumps(result, indent=2) + "\n")
    log.info("%s (%s)", ", ".join(f"{k} {v:.4f}" for k, v in figures.items()), out)
    return figures, metrics.objective(cfg, loss)


def evaluate(argv: list[str] | None = None) -> None:
    """`python evaluate.py ckpt=PATH [overrides]`; `argv`: the command line (sys.argv)."""
    argv = argv or sys.argv
    call = Invocation.read([argv[0], *onto_trained_data(argv[1:])])
    try:
        refuse_ignored_overrides([a for a in call.argv[1:] if not a.startswith("-")])
    except ConfigError as error:
        print(error, file=sys.stderr)
        raise SystemExit(2) from None
    launch.register_resolvers()
    help.register_resolver("evaluate")
    register_configs()
    run_app(hydra_app("evaluate", _evaluate_task, call), call)


def _export(ckpt: Path, out: Path, force: bool = False, merged: bool = False) -> None:
    """A checkpoint's model (a .pt file, or a sharded .dcp read by this one process) as
    formats.FORMATS writes; one with adapters as a peft adapter folder, or with `merged` as its
    base with the adapters folded in. ConfigError or CheckpointError, one line, where it
    cannot."""
    from parallab.config import targets
    from parallab.models import adapters, build_model
    from parallab.training import checkpoint, weights

    kind = weights.export_kind(ckpt, out, force)  # before anything is read or written
    meta = weights.record(ckpt)
    spec = trained_model_config(meta, ckpt)
    adapter = checkpoint.saved_config(meta).get("adapter") if weights.holds_adapters(ckpt) \
        else None
    weights.require_adapters(ckpt, out, kind, adapter, merged)
    targets.locate(spec.get("_target_"), "model._target_")  # the project must import
    try:  # an adapter folder's base as its run built it (the folder holds adapters alone)
        built = weights.base_of_adapters(ckpt, meta, spec, 0) if adapters.is_folder(ckpt) \
            else build_model(spec)
    except ConfigError:
        raise
    except Exception as error:  # noqa: BLE001 - a user's or a library's constructor
        raise ConfigError(weights.unbuildable(ckpt, spec, error)) from None
    peft_model = adapters.with_adapters(built, adapter) if adapter else None
    if merged and (tied := adapters.merge_problem(peft_model)) is not None:
        raise ConfigError(tied)
    try:  # a PeftModel's inner model has the names the run's model had
        weights.load_into(peft_model.base_model.model if adapter else built, ckpt)
    except ConfigError as error:
        raise checkpoint.CheckpointError(f"ckpt={ckpt} does not fit model {spec['_target_']}: "
                                         f"{error}") from None
    record = {"step": meta["step"], "config": meta["config"],
              **({"base": meta["base"]} if meta.get("base") else {})}
    if merged:  # what is written is a plain model again
        record["config"] = {**meta["config"], "adapter": {"name": "none"}}
    model = peft_model.merge_and_unload() if merged else peft_model or built
    kept = (checkpoint.saved_config(meta).get("precision") or {}).get("state_dtype")
    if kept and kept != "float32":  # written as the run kept them (half float32's bytes)
        import torch

        from parallab.precision import kept_in

        model = kept_in(model, getattr(torch, kept))
    what = weights.export(model, record, out, kind)
    print(f"{out}: {what}, of {ckpt} (step {meta['step']})")


def _simulate_task(dict_cfg: DictConfig, call: Invocation) -> None:
    from hydra.types import RunMode

    from parallab import sweep_job
    from parallab.simulate import run
    from parallab.training import rundir

    overrides = list(HydraConfig.get().overrides.task)
    run_dir = HydraConfig.get().runtime.output_dir
    try:
        rundir.check_unused(Path(run_dir), "parallab simulate", call.held_before())
        dict_cfg, overrides = with_data(dict_cfg, overrides, composed_in_app)
        run.run(typed_config(dict_cfg, overrides), overrides, run_dir,
                ["parallab", "train", *config_flags(call.argv[1:])])
    except OneLineError as error:  # a refusal puts the dir back; a full disk keeps its log
        if HydraConfig.get().mode == RunMode.MULTIRUN:  # one job's: the others run
            return sweep_job.failed(Path(run_dir), str(error))
        if isinstance(error, ConfigError):
            call.restore()
        _fail(str(error), error.status)


def simulate_in_process(overrides: list[str], run_dir: str | Path,
                        config_dir: str | Path | None = None) -> dict[str, Any]:
    """What `parallab simulate OVERRIDES hydra.run.dir=RUN_DIR` does, in this process: its
    summary; ConfigError where the command would end in one line."""
    from parallab.simulate import run

    dict_cfg, overrides = with_data(
        compose(list(overrides), config_dir, "simulate"), list(overrides),
        lambda name, given, hydra=True: compose(given, config_dir, name, hydra))
    cfg = typed_config(dict_cfg, overrides)
    flags = ["--config-dir", str(config_dir)] if config_dir else []  # as its commands need it
    return run.run(cfg, list(overrides), str(run_dir), ["parallab", "train", *flags])


def simulate(argv: list[str] | None = None) -> None:
    """`parallab simulate [overrides]`: a step on a cluster predicted (simulate/)."""
    import signal

    call = Invocation.read(argv or sys.argv)
    launch.register_resolvers()
    help.register_resolver("simulate")
    _register_configs()  # with the launchers that check a sweep's every job first
    try:
        run_app(hydra_app("simulate", _simulate_task, call), call)
    except KeyboardInterrupt:  # nothing is written before the answer: nothing to keep
        call.restore()
        print("parallab simulate: stopped by SIGINT, no answer written", file=sys.stderr)
        raise SystemExit(128 + signal.SIGINT) from None


APPS = {"train": train, "evaluate": evaluate, "advise": advise,  # Hydra apps: argv is theirs
        "simulate": simulate}


def parallab() -> None:
    """`parallab train|evaluate [overrides]` = python train.py|evaluate.py; `summary DIR`: a
    finished multirun's summary again; `export CKPT OUT`: a checkpoint's model as one file;
    `prepare-data FILES --tokenizer DIR --out DIR`: token files from text."""
    # as `python -m` does: a project's own modules import from where it is run, for every
    # command (export rebuilds its model); launched workers inherit the path
    sys.path.insert(0, os.getcwd())
    if len(sys.argv) > 1 and sys.argv[1] in APPS:
        APPS[sys.argv[1]]([sys.argv[0], *sys.argv[2:]])  # the app's command line: no `train`
        return
    parser = _parser()
    args = parser.parse_args()
    if args.command == "prepare-data":
        from parallab.data.pretrain import prepare

        try:
            prepare.main(args)
        except ConfigError as error:
            print(error, file=sys.stderr)  # one line, as every refusal
            raise SystemExit(2) from None
        return
    if args.command == "export":
        from parallab.training.checkpoint import CheckpointError

        try:
            _export(args.ckpt, args.out, args.force, args.merged)
        except (CheckpointError, ConfigError, KeyError, OneLineError) as error:
            print(f"parallab export: {error}", file=sys.stderr)  # one line, as every refusal
            raise SystemExit(1 if type(error) is OneLineError else 2) from None
        return
    if not any(args.sweep_dir.glob("*/.hydra/overrides.yaml")):
        parser.error(f"{args.sweep_dir} holds no multirun jobs (no */.hydra/overrides.yaml)")
    print(summary.markdown(summary.write(args.sweep_dir)))


def _parser():
    """The `parallab` command's subcommands and their arguments (an app's own command line,
    Hydra's, is not parsed here)."""
    import argparse

    from parallab.data.pretrain import prepare

    parser = argparse.ArgumentParser(prog="parallab")
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser("train", help="train: [group=option ...] [key=value ...] (Hydra's "
                        "overrides and flags, as python train.py takes them)")
    commands.add_parser("evaluate", help="evaluate a checkpoint: ckpt=PATH [overrides]")
    commands.add_parser("advise", help="which layout trains this model fastest: [overrides] "
                        "(advise.md/.csv/.png in the run dir)")
    commands.add_parser("simulate", help="memory and tokens/s per GPU of a layout (or of every "
                        "one: parallel=auto) on a cluster: cluster=NAME parallel.world_size=N "
                        "[overrides] (simulate.md/.json/.png in the run dir)")
    said = "summary.csv/.md/.png of a multirun dir"  # `parallab --help` and its own --help
    summarize = commands.add_parser("summary", help=said, description=said)
    summarize.add_argument("sweep_dir", type=Path, help="a sweep's dir (its hydra.sweep.dir), "
                           "or any dir of run dirs")
    said = ("a checkpoint's model (.pt or sharded .dcp) as OUT.pt, OUT.safetensors, or a "
            "folder OUT (a transformers model's save_pretrained folder)")
    export = commands.add_parser("export", help=said, description=said)
    export.add_argument("ckpt", type=Path, help="a run's checkpoint, e.g. "
                        "outputs/DATE/TIME/checkpoints/last.pt (or last.dcp)")
    export.add_argument("out", type=Path, help="where to write: a .pt or .safetensors file, or "
                        "a folder")
    export.add_argument("--force", action="store_true", help="replace what export writes at "
                        "OUT if it exists (a folder's other files are kept)")
    export.add_argument("--merged", action="store_true", help="a checkpoint with LoRA adapters: "
                        "the base with the adapters folded in, in any format (without: a peft "
                        "adapter folder PeftModel.from_pretrained reads)")
    said = ("token files from text: Megatron-LM .bin/.idx pairs that data=token_files reads "
            "(OUT/train.bin, OUT/val.bin)")
    prepare.arguments(commands.add_parser("prepare-data", help=said, description=said))
    return parser

