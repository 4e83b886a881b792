"""The Hydra apps behind train.py and evaluate.py.

The Hydra process is the controller: it composes, checks and resolves the config once, then
either trains in this process (one device, or in place under torchrun/SLURM/mpirun) or
starts the workers with torch's elastic launcher. Workers never re-enter Hydra.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import sys
from pathlib import Path
from typing import Any, Iterator, NoReturn

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf, open_dict

from parallab import help, launch, metrics, run, summary, validate
from parallab.checkpoint import CheckpointError
from parallab.config import register_configs

log = logging.getLogger("parallab")
# conf/ ships inside the package; Hydra finds it as pkg://parallab/conf (a user project adds
# its own groups with --config-dir or hydra.searchpath)
CONF_DIR = str(Path(__file__).resolve().parent / "conf")


def _fail(message: str, status: int) -> NoReturn:
    log.error(message)
    sys.exit(status)


def _train_and_report(spec: run.RunSpec, in_place: launch.InPlace | None) -> dict[str, Any]:
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    from parallab.parallel import STRATEGIES

    from parallab.trainer import Diverged

    p = spec.cfg.parallel
    if in_place is not None or not STRATEGIES[p.name].launches_workers:
        try:
            return run.train(spec)
        except (Diverged, CheckpointError) as error:  # the whole story in one line
            raise JobFailed(str(error), 1) from None
        except validate.ConfigError as error:  # a value found wrong only once data is built
            raise JobFailed(str(error), 2) from None
    log.info("launching %d workers (parallel=%s, backend=%s) in %s", p.world_size, p.name,
             spec.cfg.backend.name, spec.run_dir)
    try:
        return launch.elastic(run.worker_main, (spec,), p.world_size, p.max_restarts,
                              launch.worker_env(spec.cfg))
    except ChildFailedError as error:
        rank, failure = error.get_first_failure()
        reason = failure.message  # the error file's record, or a line about a signal
        reason = reason.get("message", "") if isinstance(reason, dict) else str(reason)
        reason = reason.strip().splitlines()[-1] if reason.strip() else (
            f"exit code {failure.exitcode}")
        for known, status in ((Diverged, 1), (CheckpointError, 1), (validate.ConfigError, 2)):
            if reason.startswith(f"{known.__name__}: "):  # the error record: "Type: message"
                raise JobFailed(f"rank {rank}: {reason.split(': ', 1)[1]}", status) from None
        raise JobFailed(f"a worker failed, so the job was stopped:\n{error}", 1,
                        f"rank {rank}: {reason}")


class JobFailed(Exception):
    """A job that cannot go on: its message, exit status, and a one-line summary."""

    def __init__(self, message: str, status: int, line: str | None = None):
        super().__init__(message)
        self.status = status
        self.line = line or message


def typed_config(dict_cfg: DictConfig, overrides: list[str]):
    """The composed config as the typed Config; a key added with `+` that the schema does not
    know is refused (Hydra adds it, and the typed config would drop it without a word)."""
    import dataclasses

    for override in overrides:
        key = override.lstrip("+~").partition("=")[0]
        if not override.startswith("+"):
            continue
        node, parts = dict_cfg, key.split(".")
        for depth, part in enumerate(parts):
            schema = OmegaConf.get_type(node)
            if dataclasses.is_dataclass(schema):
                known = [f.name for f in dataclasses.fields(schema)]
                if part not in known:
                    import difflib

                    where = ".".join(parts[:depth]) or "the config"
                    close = difflib.get_close_matches(part, known, n=1)
                    hint = f"did you mean {'.'.join([*parts[:depth], close[0]])}?" if close \
                        else f"its keys: {', '.join(known)}"
                    raise validate.ConfigError(f"{override}: {where} has no key {part!r} ({hint})"
                                               ": a + override adds a key only where the config "
                                               "takes any (model, data, loss, metrics)")
            if not isinstance(node, DictConfig) or node._is_none() or part not in node:
                break
            node = node[part]
    return OmegaConf.to_object(dict_cfg)


def _train_job(dict_cfg: DictConfig) -> float | None:
    hydra_cfg = HydraConfig.get()
    if dict_cfg.advise.run:
        from hydra import compose as hydra_compose

        overrides = list(hydra_cfg.overrides.task)
        _advise(dict_cfg, overrides, hydra_cfg.runtime.output_dir,
                lambda extra: hydra_compose(hydra_cfg.job.config_name, overrides=extra))
        return None
    in_place = launch.prepare_in_place()  # again for launchers that call the app (submitit)
    launch.warm_up(dict_cfg.parallel.name, in_place)
    try:
        cfg = validate.prepare(typed_config(dict_cfg, list(hydra_cfg.overrides.task)),
                               in_place, hydra_cfg.runtime.output_dir)
    except validate.ConfigError as error:
        _restore_earlier_run()
        raise JobFailed(str(error), 2) from None
    from hydra.types import RunMode

    sweep = hydra_cfg.sweep.dir if hydra_cfg.mode == RunMode.MULTIRUN else None
    spec = run.RunSpec(cfg, hydra_cfg.runtime.output_dir, list(hydra_cfg.overrides.task),
                       command=entry_command(sys.argv), sweep=sweep)
    with _claimed(spec.run_dir, cfg, in_place):
        return _train_and_report(spec, in_place).get(objective(cfg))


# Hydra's flags that say where the config comes from: a recommended command keeps them
CONFIG_FLAGS = ("--config-dir", "-cd", "--config-path", "-cp", "--config-name", "-cn")


def entry_command(argv: list[str]) -> list[str]:
    """How this command was started, less its overrides: `parallab train` or `python
    train.py`, and the Hydra config flags (a project's --config-dir)."""
    entry = ["parallab", "train"] if Path(argv[0]).name == "parallab" else ["python",
                                                                            "train.py"]
    return [*entry, *config_flags(argv[1:])]


def config_flags(argv: list[str]) -> list[str]:
    """The Hydra config flags in `argv` (a command line less its program), with their
    values: `--config-dir conf` and `--config-dir=conf` alike."""
    return [arg for i, arg in enumerate(argv) if arg in CONFIG_FLAGS or (
        i and argv[i - 1] in CONFIG_FLAGS) or arg.startswith(tuple(f"{f}=" for f in CONFIG_FLAGS))]


def _advise(dict_cfg: DictConfig, overrides: list[str], run_dir: str, compose_with
            ) -> dict[str, Any]:
    """advise.run=true: parallab advise (advise/) in `run_dir`; `compose_with(overrides)`
    composes a candidate's config as this command composed its own."""
    from parallab import advise

    def configure(extra: list[str]):
        return validate.prepare(typed_config(compose_with(extra), extra), None)

    entry = " ".join(entry_command(sys.argv)[:2])
    try:
        cfg = typed_config(dict_cfg, overrides)
        with _claimed(run_dir, cfg, None, command="parallab advise"):
            return advise.advise(cfg, overrides, run_dir, configure,
                                 [entry, *config_flags(sys.argv[1:])])
    except validate.ConfigError as error:
        _restore_earlier_run()
        raise JobFailed(str(error), 2) from None
    except advise.NothingFits as error:
        raise JobFailed(str(error), 1) from None


@contextlib.contextmanager
def _claimed(run_dir: str, cfg, in_place: launch.InPlace | None,
             command: str | None = None) -> Iterator[None]:
    """The run dir for this run alone: a fresh run does not start over an earlier one's
    checkpoints or metrics (trainer.resume=auto continues it), and a second run started in
    the same dir while this one runs is refused at once (a lock file). `command`: one that
    is not training (advise, evaluate) starts only in a dir holding no run at all."""
    from parallab import rundir

    from parallab.distributed import restart_count

    main = in_place is None or in_place.rank == 0
    # a launcher's restart of this job continues it (run.resume_path), deleting nothing
    resume = "auto" if restart_count() > 0 else cfg.trainer.resume
    try:
        lock = rundir.lock(Path(run_dir)) if main else contextlib.nullcontext()
        with lock:  # taken first: a refused run touches nothing of a running one
            if command is not None:
                rundir.check_unused(Path(run_dir), command, _held_before())
            else:
                rundir.check_fresh(Path(run_dir), resume, cfg.trainer.overwrite, delete=main)
            yield
    except validate.ConfigError as error:
        _restore_earlier_run()
        raise JobFailed(str(error), 2) from None


def objective(cfg) -> str:
    from parallab.loss import build_loss

    return metrics.objective(cfg, build_loss(cfg.loss))


_stopped_sweep: list[str] = []  # the command that continues a multirun a signal stopped


def _sweep_job(dict_cfg: DictConfig, run_dir: Path) -> float | None:
    """One job of a multirun: a failure is recorded for the summary and ends no other job;
    with sweep.skip_completed, a job whose dir holds complete metrics is not run again. A job
    stopped by a signal (saved, as a single run is) stops the sweep: the node is going."""
    status_file = run_dir / summary.STATUS_FILE
    status_file.unlink(missing_ok=True)
    if _stopped_sweep:
        status_file.write_text(json.dumps({"status": "stopped"}) + "\n")
        log.info("not run: the sweep was stopped; continue it with: %s", _stopped_sweep[0])
        return None
    done = summary.read_metrics(run_dir) if dict_cfg.sweep.skip_completed else None
    if done is not None:
        status_file.write_text(json.dumps({"status": "skipped"}) + "\n")
        log.info("skipped: %s already holds complete metrics", run_dir)
        return metrics.objective_of(done, dict_cfg.objective)
    if dict_cfg.sweep.skip_completed and dict_cfg.trainer.resume is None:
        dict_cfg.trainer.resume = "auto"  # a job that did not finish continues (or starts)
    try:
        result = _train_job(dict_cfg)
    except Exception as error:  # noqa: BLE001 - any failure of one job is that job's result
        line = error.line if isinstance(error, JobFailed) else (
            f"{type(error).__name__}: {error}".splitlines()[0])
        log.error("job failed: %s", error if isinstance(error, JobFailed) else line,
                  exc_info=not isinstance(error, JobFailed))
        status_file.write_text(json.dumps({"status": "failed", "error": line}) + "\n")
        return None
    if result is None and not (run_dir / "metrics.json").exists():  # stopped, and saved
        _stopped_sweep.append(_continue_sweep(run_dir.parent))
        log.warning("the sweep stops here, its later jobs not run; continue it with: %s",
                    _stopped_sweep[0])
    return result


def _continue_sweep(sweep_dir: Path) -> str:
    """The multirun command as the user ran it, in its dir, finished jobs kept."""
    import shlex

    args = [a for a in sys.argv[1:] if not a.startswith(("hydra.sweep.dir=",
                                                         "sweep.skip_completed="))]
    return shlex.join([*entry_command(sys.argv)[:2], *args,
                       f"hydra.sweep.dir={run.hydra_value(str(sweep_dir))}",
                       "sweep.skip_completed=true"])


@hydra.main(version_base=None, config_path="conf", config_name="config")
def _train_app(dict_cfg: DictConfig) -> float | None:
    hydra_cfg = HydraConfig.get()
    if hydra_cfg.mode == RunMode.MULTIRUN:
        return _sweep_job(dict_cfg, Path(hydra_cfg.runtime.output_dir))
    try:
        return _train_job(dict_cfg)
    except JobFailed as error:
        _fail(str(error), error.status)


_earlier_run: dict[Path, bytes] = {}  # .hydra files of the run dir named on the command line


def _remember_earlier_run(argv: list[str]) -> None:
    """Hydra writes .hydra/ into the run dir before the config can be checked; when
    hydra.run.dir names an earlier run (to resume it), keep its files to put back."""
    _earlier_run.clear()
    for arg in argv:
        if arg.startswith("hydra.run.dir="):  # the value may be quoted (a path with spaces)
            hydra_dir = Path(arg.partition("=")[2].strip("'\"")) / ".hydra"
            if hydra_dir.is_dir():
                _earlier_run.update({p: p.read_bytes() for p in hydra_dir.iterdir()
                                     if p.is_file()})


def _held_before() -> list[str]:
    """The earlier run's record in the dir named on the command line, if it held one."""
    return [".hydra/"] if _earlier_run else []


def _restore_earlier_run() -> None:
    """A refused command leaves an earlier run's record as it was."""
    for path, content in _earlier_run.items():
        path.write_bytes(content)


def hydra_line(error: Exception) -> str:
    """Hydra's refusal (an unknown key or option, a value of the wrong type), which Hydra
    prints over several lines, as one: its sentences, and a group's options on one line."""
    text = str(error)
    if error.__cause__ is not None and "full_key" in str(error.__cause__):  # OmegaConf's why
        text += "\n" + str(error.__cause__)
    text, _, options = text.partition("Available options in")
    said = [line.strip().rstrip(".") for line in text.splitlines() if line.strip() and not
            line.strip().startswith(("full_key:", "object_type=", "reference_type="))]
    override = getattr(error, "override", None)  # a parse error names the text, not the key
    line = "; ".join([*([override] if override else []), *said])
    if options:
        group, _, names = options.partition(":")
        names = [n.strip() for n in names.splitlines() if n.startswith("\t")
                 and not n.strip().startswith("provider=")]
        line += f" (options in{group}: {', '.join(names)})"
    return line


def _run_app(app) -> None:
    """A Hydra app whose own refusals end as parallab's do: one line, exit status 2 (Hydra
    prints them itself, over several lines, and exits 1, unless HYDRA_FULL_ERROR asks it to
    raise them)."""
    from hydra.errors import CompactHydraException

    if os.environ.get("HYDRA_FULL_ERROR"):  # the user asked for Hydra's whole story
        app()
        return
    os.environ["HYDRA_FULL_ERROR"] = "1"
    try:
        app()
    except CompactHydraException as error:
        _restore_earlier_run()
        print(hydra_line(error), file=sys.stderr)
        raise SystemExit(2) from None
    finally:
        os.environ.pop("HYDRA_FULL_ERROR", None)


def train() -> None:
    """`python train.py [overrides]`."""
    _remember_earlier_run(sys.argv[1:])
    launch.prepare_in_place()
    launch.register_resolvers()
    help.register_resolver()
    register_configs()
    _run_app(_train_app)


@hydra.main(version_base=None, config_path="conf", config_name="evaluate")
def _evaluate_app(dict_cfg: DictConfig) -> float:
    from parallab import checkpoint, distributed, weights
    from parallab.data import build_data
    from parallab.loss import build_loss
    from parallab.models import build_model
    from parallab.precision import Precision
    from parallab.metrics import evaluate

    if OmegaConf.is_missing(dict_cfg, "ckpt"):
        _fail("ckpt is not set: give the checkpoint to evaluate, python evaluate.py "
              "ckpt=outputs/DATE/TIME/checkpoints/last.pt", 2)
    overrides = list(HydraConfig.get().overrides.task)
    run_dir = Path(HydraConfig.get().runtime.output_dir)
    try:
        from parallab import rundir

        rundir.check_unused(run_dir, "evaluate.py", _held_before())
        state = weights.record(dict_cfg.ckpt)
        _refuse_model_overrides(overrides, dict_cfg.ckpt)
        # the checkpoint's model and data, before anything resolves: data keys that follow
        # the model (data=bytes: seq_len from model.context) follow the trained one
        with open_dict(dict_cfg):
            dict_cfg.model = _trained_model_config(state, dict_cfg.ckpt)
            dict_cfg.data = _trained_data_config(state, dict_cfg, overrides)
            # generated data (data=synthetic) is drawn from the run's seed
            saved_seed = checkpoint.saved_config(state).get("seed")
            if saved_seed is not None and not any(o.startswith("seed=") for o in overrides):
                dict_cfg.seed = saved_seed
        cfg = typed_config(dict_cfg, overrides)
        validate.prepare(cfg, in_place=None)
    except (validate.ConfigError, checkpoint.CheckpointError) as error:
        _restore_earlier_run()
        _fail(str(error), 2)
    dist = distributed.setup(cfg.device.value, None, cfg.backend.timeout_s,
                             cfg.parallel.threads_per_worker)
    try:
        model = weights.model_from(cfg.ckpt, build_model(cfg.model))
    except validate.ConfigError as error:
        _fail(f"ckpt={cfg.ckpt} does not fit model {cfg.model['_target_']}: {error}", 2)
    data = build_data(cfg.data, dist, cfg.seed)
    loss = build_loss(cfg.loss).bind(model)
    figures = evaluate(model.to(dist.device), data.eval, dist,
                       Precision(cfg.precision, dist.device), loss, cfg.metrics)
    result = {"ckpt": str(Path(cfg.ckpt).resolve()), "model": cfg.model["_target_"],
              "data": cfg.data.name, "step": state.get("step"), **figures}
    out = run_dir / "metrics.json"
    out.write_text(json.dumps(result, indent=2) + "\n")
    log.info("%s (%s)", ", ".join(f"{k} {v:.4f}" for k, v in figures.items()), out)
    return figures[metrics.objective(cfg, loss)]


def _refuse_model_overrides(overrides: list[str], ckpt: str) -> None:
    """evaluate.py builds the model the checkpoint records: a model override would be
    ignored, so it is refused rather than dropped without a word."""
    for override in overrides:
        key = override.lstrip("+~").split("=")[0]
        if key.startswith("model."):
            raise validate.ConfigError(
                f"{override}: evaluate.py builds the model ckpt={ckpt} was trained with (its "
                "_target_ and arguments come from the checkpoint): drop the model override")
        if key == "model":  # a group choice, harmless: said, not silently dropped
            log.info("%s: evaluate.py uses the model ckpt=%s records", override, ckpt)


def _trained_data_config(meta: dict[str, Any], dict_cfg: DictConfig, overrides: list[str]):
    """The data evaluate.py scores: the checkpoint's, with the command line's data.KEY
    values; a data= choice that differs from it is used, and said."""
    from parallab import checkpoint

    saved = checkpoint.saved_config(meta).get("data")
    chosen = any(o.lstrip("+~").partition("=")[0] == "data" for o in overrides)
    if not isinstance(saved, dict) or targets_of(saved) is None:
        return dict_cfg.data  # a checkpoint that records no data: as composed
    if chosen:
        if targets_of(saved) != dict_cfg.data.get("_target_"):
            log.info("evaluate.py scores ckpt=%s, trained on data %s, on data %s, as asked",
                     dict_cfg.ckpt, targets_of(saved), dict_cfg.data.get("_target_"))
        return dict_cfg.data
    data = OmegaConf.create(saved)
    for override in overrides:  # the command line's data.KEY=VALUE, as Hydra parsed them
        key = override.lstrip("+~").partition("=")[0]
        if key.startswith("data."):
            OmegaConf.update(data, key[5:], OmegaConf.select(dict_cfg, key), force_add=True)
    return data


def targets_of(spec: dict[str, Any]) -> str | None:
    return spec.get("_target_") if isinstance(spec, dict) else None


def _trained_model_config(meta: dict[str, Any], path) -> dict[str, Any]:
    """The model spec a checkpoint was trained with; a pretrained-weights file it named is
    not needed again (the checkpoint holds the weights)."""
    from parallab import checkpoint

    spec = checkpoint.saved_model(meta, path)
    if spec.get("weights"):
        spec["weights"] = None
    return spec


def evaluate() -> None:
    """`python evaluate.py ckpt=PATH [overrides]`."""
    _remember_earlier_run(sys.argv[1:])
    launch.register_resolvers()
    help.register_resolver()
    register_configs()
    _run_app(_evaluate_app)


def _export(ckpt: Path, out: Path, force: bool = False) -> None:
    """A checkpoint's model (a .pt file, or a sharded .dcp read by this one process) as
    weights.FORMATS; ConfigError or CheckpointError, one line, where it cannot."""
    from parallab import checkpoint, targets, weights
    from parallab.models import build_model

    if not out.parent.is_dir():
        raise validate.ConfigError(f"{out.parent} is not a directory: create it, or give a "
                                   "path in an existing one")
    meta = weights.record(ckpt)
    spec = _trained_model_config(meta, ckpt)
    targets.locate(spec.get("_target_"), "model._target_")  # the project must import
    try:
        model = weights.model_from(ckpt, build_model(spec))
    except validate.ConfigError as error:
        raise checkpoint.CheckpointError(f"ckpt={ckpt} does not fit model {spec['_target_']}: "
                                         f"{error}") from None
    what = weights.export(model, {"step": meta["step"], "config": meta["config"]}, out, force)
    print(f"{out}: {what}, of {ckpt} (step {meta['step']})")


def advise() -> None:
    """`parallab advise [overrides]` = `parallab train advise.run=true [overrides]`."""
    sys.argv.append("advise.run=true")  # last: Hydra's flags (--config-dir) may come first
    train()


APPS = {"train": train, "evaluate": evaluate, "advise": advise}  # Hydra apps: argv is theirs


def parallab() -> None:
    """`parallab train [overrides]` = python train.py; `parallab evaluate ckpt=PATH` =
    python evaluate.py; `parallab summary DIR`: rebuild a finished multirun's summary;
    `parallab export CKPT OUT`: a checkpoint's full model state as one file."""
    import argparse

    if len(sys.argv) > 1 and sys.argv[1] in APPS:
        app = APPS[sys.argv.pop(1)]
        # as `python -m` does: a project's own modules (its model, its data) import from where
        # it is run; launched workers inherit the path
        sys.path.insert(0, os.getcwd())
        app()
        return
    parser = argparse.ArgumentParser(prog="parallab")
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser("train", help="train: [group=option ...] [key=value ...] (Hydra's "
                        "overrides and flags, as python train.py takes them)")
    commands.add_parser("evaluate", help="evaluate a checkpoint: ckpt=PATH [overrides]")
    commands.add_parser("advise", help="which layout trains this model fastest: [overrides] "
                        "(advise.md/.csv/.png in the run dir)")
    summarize = commands.add_parser("summary", help="summary.csv/.md/.png of a multirun dir")
    summarize.add_argument("sweep_dir", type=Path)
    export = commands.add_parser("export", help="a checkpoint's model (.pt or sharded .dcp) "
                                 "as OUT.pt, OUT.safetensors, or a folder OUT (a transformers "
                                 "model's save_pretrained folder)")
    export.add_argument("ckpt", type=Path)
    export.add_argument("out", type=Path)
    export.add_argument("--force", action="store_true", help="replace OUT if it exists")
    args = parser.parse_args()
    if args.command == "export":
        try:
            _export(args.ckpt, args.out, args.force)
        except (CheckpointError, validate.ConfigError, KeyError) as error:
            print(f"parallab export: {error}", file=sys.stderr)  # one line, as every refusal
            raise SystemExit(2) from None
        return
    if not any(args.sweep_dir.glob("*/.hydra/overrides.yaml")):
        parser.error(f"{args.sweep_dir} holds no multirun jobs (no */.hydra/overrides.yaml)")
    print(summary.markdown(summary.write(args.sweep_dir)))


def compose(overrides: list[str], config_dir: str | Path | None = None,
            config_name: str = "config") -> DictConfig:
    """conf/ composed with `overrides` as train.py composes it, a project's config dir's
    groups added (as --config-dir adds them)."""
    from hydra import compose as hydra_compose, initialize_config_dir

    launch.register_resolvers()
    register_configs()
    extra = [f"hydra.searchpath=[file://{Path(config_dir).resolve()}]"] if config_dir else []
    with initialize_config_dir(config_dir=CONF_DIR, version_base=None):
        return hydra_compose(config_name, overrides=[*overrides, *extra])


def advise_in_process(overrides: list[str], run_dir: str | Path,
                      config_dir: str | Path | None = None) -> dict[str, Any]:
    """What `parallab advise OVERRIDES hydra.run.dir=RUN_DIR` does, in this process."""
    overrides = ["advise.run=true", *overrides]
    Path(run_dir).mkdir(parents=True, exist_ok=True)
    return _advise(compose(overrides, config_dir), overrides, str(run_dir),
                   lambda extra: compose(extra, config_dir))


def train_in_process(overrides: list[str], run_dir: str | Path,
                     config_dir: str | Path | None = None) -> dict[str, Any]:
    """What `python train.py OVERRIDES hydra.run.dir=RUN_DIR` does, in this process and
    without Hydra's logging set-up (tests, notebooks): check, then train here or launch the
    workers. Returns the run's metrics; raises ConfigError or JobFailed."""
    in_place = launch.prepare_in_place()
    cfg = validate.prepare(typed_config(compose(overrides, config_dir), overrides), in_place,
                           str(run_dir))
    Path(run_dir).mkdir(parents=True, exist_ok=True)
    command = ["python", "train.py", *(["--config-dir", str(config_dir)] if config_dir else [])]
    with _claimed(str(run_dir), cfg, in_place):
        return _train_and_report(run.RunSpec(cfg, str(run_dir), list(overrides),
                                             command=command), in_place)
