"""`parallab advise`: which layout trains this model fastest, measured, with the memory of
each predicted before anything runs and a correctness verdict for each.

The controller enumerates the candidates (candidates.py), checks each as train.py would,
predicts its memory per rank on fake tensors (memory.py) and prunes what cannot run or is
not needed; then measures the rest a few steps each, one launched job per world size
(measure.py), judges their losses against the single-device reference, predicts their
step time at a target world size as parallab simulate does (advise.target_world_size on
the cluster group) and here from the parts each job measured (scaling.py's replay), and
writes the answer (report.py).
"""

from __future__ import annotations

import logging
import math
import statistics
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Callable

import torch

from parallab.advise import candidates as grid
from parallab.advise import report, scaling
from parallab.parallel.grid import Candidate, kept_for
from parallab.config import targets
from parallab.config.errors import ConfigError, NothingFits, first_line, refuse

log = logging.getLogger("parallab")


def problem(options) -> str | None:
    """None if the advise keys can be used, else one line naming the key."""
    from parallab import precision
    from parallab.config.schema import PrecisionConfig
    from parallab.parallel import PLANS, activations

    for key, low in (("steps", 1), ("warmup_steps", 0), ("max_accumulation", 1)):
        if getattr(options, key) < low:
            return f"advise.{key}={getattr(options, key)} is out of range: it must be >= {low}"
    if not options.rtol > 0:
        return f"advise.rtol={options.rtol} is out of range: it must be > 0"
    if options.budget_mb is not None and not options.budget_mb > 0:
        return (f"advise.budget_mb={options.budget_mb} is out of range: it must be > 0 (or "
                "null for the device's memory)")
    if options.world_sizes is not None and not options.world_sizes:
        return ("advise.world_sizes=[] holds no world size: give some, or leave it out (null: "
                "1 and each divisor of parallel.world_size)")
    bad = [n for n in options.world_sizes or [] if n < 1]
    if bad:
        return (f"advise.world_sizes={list(options.world_sizes)} holds {bad[0]}: give world "
                "sizes >= 1 (or null for 1 and each divisor of parallel.world_size)")
    for key in ("layouts", "precisions"):  # an empty list read as null: every one measured
        if getattr(options, key) is not None and not getattr(options, key):
            return (f"advise.{key}=[] names none: give some, or leave it out (null: all)")
    layouts = [name for name in PLANS if name != "auto"]  # auto chooses; it is no layout
    unknown = [n for n in options.layouts or [] if n not in layouts]
    if unknown:
        return (f"advise.layouts names {', '.join(unknown)}: use parallel options "
                f"({', '.join(layouts)}), or leave it out (null: every one)")
    for name in options.precisions or []:
        found = precision.problem(PrecisionConfig(name=name))
        if found:
            return f"advise.precisions: {found}"
    for mode in options.activation_checkpointing:
        found = activations.problem(mode)
        if found:
            return f"advise.activation_checkpointing: {found}"
    if options.target_world_size is not None and options.target_world_size < 1:
        return f"advise.target_world_size={options.target_world_size}: it must be >= 1"
    return _pipeline_problem(options)


def _pipeline_problem(options) -> str | None:
    """The pipeline candidates' keys: schedules parallab has, micro-batch counts >= 1 (a
    typo would only leave the pipelines out, unsaid)."""
    from parallab.parallel.schedules import SCHEDULES

    unknown = [n for n in options.schedules or [] if n not in SCHEDULES]
    if unknown or options.schedules == []:
        said = f" names {', '.join(unknown)}" if unknown else "=[] names none"
        return (f"advise.schedules{said}: use schedules parallab has "
                f"({', '.join(SCHEDULES)}), or null for every one")
    if not options.microbatches or any(m < 1 for m in options.microbatches):
        return (f"advise.microbatches={list(options.microbatches)}: give the pipeline "
                "candidates' micro-batch counts, each >= 1 (e.g. [2, 4])")
    return None


# what advise decides for each candidate, and the advise key that says which to compare
CHOSEN_BY = {"parallel": "advise.layouts=[...]", "parallel.schedule": "advise.schedules=[...]",
             "parallel.microbatches": "advise.microbatches=[...]",
             "precision": "advise.precisions=[...]",
             "trainer.activation_checkpointing": "advise.activation_checkpointing=[...]"}
# what advise spans up to a bound of its own: given, it had been dropped without a word
BOUNDED_BY = {"trainer.accumulate_grad_batches": "advise.max_accumulation"}


def decided_problem(overrides: list[str]) -> str | None:
    """A layout, precision or memory saver given on the command line, which advise decides
    for each candidate: it had been dropped without a word (a bad value too)."""
    from parallab.config.schema import AutoConfig

    decided = {*CHOSEN_BY, *BOUNDED_BY, *(f"parallel.{key}" for key in AutoConfig.decides)}
    for override in overrides:
        key, _, value = override.lstrip("+~").partition("=")
        if key.startswith("simulate."):  # carried into the printed command, read by none
            return (f"{override}: {key} is parallab simulate's, and advise reads none of its "
                    "keys (its prediction at a target size: advise.target_world_size on the "
                    "cluster group): drop it")
        if key in decided and not (key == "parallel" and value == "none"):
            way = f", or give {CHOSEN_BY[key]} to compare those alone" if key in CHOSEN_BY \
                else f", or give {BOUNDED_BY[key]}={value} as its bound" if key in BOUNDED_BY \
                else ""
            return (f"{override}: parallab advise decides {key} for each candidate it "
                    f"measures: drop it{way}")
    return None


def _world_size(cfg, overrides: list[str], device_type: str) -> int:
    """parallel.world_size where the command line gives it, else the GPUs, else 2 (CPU)."""
    given = any(o.startswith("parallel.world_size=") for o in overrides)
    if given and cfg.parallel.world_size is not None and cfg.parallel.world_size < 1:
        raise ConfigError(f"parallel.world_size={cfg.parallel.world_size} is out of range: it "
                          "must be >= 1 (advise measures 1 and each of its divisors)")
    if given and cfg.parallel.world_size:
        return cfg.parallel.world_size
    return torch.cuda.device_count() if device_type == "cuda" else 2


def _budget(options, cfg, device_type: str) -> Callable[[int], float]:
    """Memory per rank at world size n: advise.budget_mb, trainer.max_memory_mb, 90% of a
    GPU, or the available RAM shared by the n ranks."""
    fixed = options.budget_mb or cfg.trainer.max_memory_mb
    if fixed:
        return lambda n: fixed
    if device_type == "cuda":
        total = torch.cuda.get_device_properties(0).total_memory / 2**20
        return lambda n: 0.9 * total
    available = next(int(line.split()[1]) for line in Path("/proc/meminfo").read_text()
                     .splitlines() if line.startswith("MemAvailable:")) / 1024
    return lambda n: available / n


def measuring(options, global_batch: int) -> list[str]:
    """What every candidate's run adds: its length, a loss logged each step, nothing saved."""
    return [f"data.global_batch_size={global_batch}", "advise.run=false",
            f"trainer.max_steps={options.warmup_steps + options.steps}",
            f"trainer.timing_skip_steps={options.warmup_steps}", "trainer.epochs=1000000",
            "trainer.log_every_n_steps=1", "trainer.checkpoint_every_n_steps=null",
            "trainer.save_best=false", "trainer.early_stop_patience=null",
            "trainer.eval_every_n_steps=null",
            "trainer.auto_batch_size=false", "trainer.progress_bar=false",
            "trainer.profile=false", "trainer.resume=null", "trainer.quantize=null",
            # the counted step's dispatch modes (comm, saved activations) skip compiled runs
            "trainer.compile=false"]


def dropout_off(node: Any, path: str = "model") -> list[str]:
    """Overrides setting each dropout probability of a model's config to 0: keys named
    *dropout or *pdrop, nested ones too, and those a `_target_`'s signature defaults that the
    config leaves out (GPT2Config's 0.1s). Dropout's masks are drawn per rank and per
    micro-batch, so with it on no layout's losses would match one device's: advise times
    and compares its candidates without it, and recommends the user's own setting."""
    if not isinstance(node, Mapping):
        return []
    found = []
    if isinstance(node.get(targets.TARGET), str):
        try:
            given = targets.defaults(targets.locate(node[targets.TARGET], path))
        except ConfigError:  # the checks say why, before any of this is used
            given = {}
        found += [f"+{path}.{key}=0.0" for key, value in given.items()
                  if key not in node and _is_dropout(key, value)]
    for key, value in node.items():
        if isinstance(value, Mapping):
            found += dropout_off(value, f"{path}.{key}")
        elif _is_dropout(key, value):
            found.append(f"{path}.{key}=0.0")
    return found


def _is_dropout(key: Any, value: Any) -> bool:
    return (str(key).endswith(("dropout", "pdrop")) and isinstance(value, (int, float))
            and not isinstance(value, bool) and value > 0)


def _device_type(cfg) -> str:
    return "cuda" if cfg.device.value == "cuda" or (
        cfg.device.value == "auto" and torch.cuda.is_available()) else "cpu"


def default_precisions(device_type: str) -> list[str]:
    """The precisions advise tries unless told: fp32 and bf16; on CUDA amp too, and fp8 where
    the GPU has float8 tensor cores and torchao is installed (only there does it pay)."""
    from parallab import precision
    from parallab.config.schema import PrecisionConfig

    if device_type != "cuda":
        return ["fp32", "bf16"]
    fp8 = precision.device_problem(PrecisionConfig(name="fp8"), "cuda") is None
    return ["fp32", "bf16", "amp", *(["fp8"] * fp8)]


def request_problem(cfg, overrides: list[str]) -> str | None:
    """What advise refuses in `cfg` before it plans anything (a sweep's launcher checks each
    advise job by it too): its own keys, a key it decides given, the cluster it predicts for."""
    found = problem(cfg.advise) or decided_problem(overrides) or _state_problem(cfg)
    if not found and cfg.advise.target_world_size is not None:
        from parallab.simulate import cluster

        found = cluster.problem(cfg.cluster)
    return found


def _state_problem(cfg) -> str | None:
    """precision.state_dtype=bfloat16 given: precision=bf16 alone computes with it, and the
    other precisions' candidates had each been refused (precision's own fix, use
    precision=bf16, one advise refuses in turn)."""
    others = [p for p in cfg.advise.precisions or ["fp32"] if p != "bf16"]
    if cfg.precision.state_dtype != "float32" and others:
        held = "advise.precisions holds" if cfg.advise.precisions else \
            "advise's default precisions hold"
        return (f"precision.state_dtype={cfg.precision.state_dtype} keeps the state in a dtype "
                f"precision=bf16 alone computes with, and {held} {others[0]}: give "
                "advise.precisions=[bf16] to compare layouts with it")
    return None


def full_grid(cfg, overrides: list[str]) -> tuple[list[Candidate], list[int]]:
    """Every candidate advise considers for `cfg` (its advise.* keys filled in), none yet
    checked or pruned, and the world sizes they use. ConfigError for a bad advise key."""
    options, device_type = cfg.advise, _device_type(cfg)
    refuse(request_problem(cfg, overrides))  # before the defaults fill in
    options.precisions = options.precisions or default_precisions(device_type)
    world = _world_size(cfg, overrides, device_type)
    sizes = options.world_sizes or [d for d in range(1, world + 1) if world % d == 0]
    batch = cfg.data.global_batch_size or cfg.data.batch_size
    return grid.enumerate_grid(options, sizes, device_type, _experts(cfg), batch), sizes


def _experts(cfg) -> int | None:
    """The experts of each MoE layer of the model (None: dense), on meta."""
    from parallab.models import build_on_meta, experts

    try:
        return experts.count(build_on_meta(cfg.model))
    except Exception:  # noqa: BLE001 - a model that does not build is the checks' to say
        return None


def plan(cfg, overrides: list[str], configure: Callable[[list[str]], Any],
         dropout: list[str]) -> tuple[list[Candidate], int, list[str]]:
    """The candidates, checked, predicted and pruned, each with `dropout` (dropout_off) on
    top of the user's overrides; the global batch; the user's overrides advise keeps.
    ConfigError / NothingFits where nothing can be compared."""
    options = cfg.advise
    candidates, sizes = full_grid(cfg, overrides)
    global_batch = cfg.data.global_batch_size or cfg.data.batch_size
    user = grid.user_overrides(overrides)
    base = measuring(options, global_batch) + dropout
    grid.settle(candidates, lambda c: configure(kept_for(user, c.layout) + base + c.overrides),
                _budget(options, cfg, _device_type(cfg)), options.only_needed)
    checked = [c for c in candidates if c.cfg is not None]
    if not checked:
        splits = [c for c in candidates if "does not split" in (c.reason or "")]
        if splits and len(splits) == len(candidates):
            raise ConfigError(f"data.global_batch_size={global_batch} does not split over any "
                              f"layout at world sizes {sizes}: use a multiple of "
                              f"{math.lcm(*sizes) * options.max_accumulation}")
        raise ConfigError(candidates[0].reason if candidates else
                          f"no layout uses world sizes {sizes}: set parallel.world_size")
    if not checked[0].cfg.data.sized() and cfg.trainer.max_steps is None:
        raise ConfigError(f"data={checked[0].cfg.data.name} streams samples with no known "
                          "length, so the command advise recommends needs a run length: set "
                          "trainer.max_steps (advise measures advise.steps either way)")
    kept = [c for c in candidates if c.reason is None]
    if len(kept) == 1 and all(c.reason is None or "not needed" in c.reason for c in candidates):
        others = "; the others are savers it does not need (advise.only_needed=false " \
                 "measures them)" if len(candidates) > 1 else ""
        sizes_key = ("parallel.world_size > 1" if sizes == [1] else
                     "more advise.world_sizes" if options.world_sizes else None)
        raise ConfigError(f"only one candidate ({kept[0].label}) at world sizes {sizes}"
                          f"{others}: nothing to compare; give "
                          f"{f'{sizes_key}, or ' if sizes_key else ''}more advise.precisions "
                          "or advise.layouts")
    if not any(c.reason is None for c in candidates):
        least = min((c for c in candidates if c.predicted_mb), key=lambda c: c.predicted_mb)
        table = "\n".join(f"  {c.label}: {c.reason}" for c in candidates)
        raise NothingFits(f"no candidate fits the memory budget; the smallest predicted need "
                          f"is {least.predicted_mb:,.1f} MB per rank ({least.label}):\n{table}",
                          status=1)
    return candidates, global_batch, user


def _links_here(here, n: int) -> list[str]:
    """This machine's all-reduce at world size n as simulate measured it for this run's
    predictions (cluster=this: one measurement of its collectives, kept between runs); none
    where no candidate of that size was simulated (nothing is measured for a note)."""
    rates = here.rates.get(n)
    if rates is None or "all_reduce" not in (rates.links or {}):
        return []
    fixed, bus = rates.links["all_reduce"]
    return [f"At world size {n}: all-reduce {bus * 8 / 1e9:.2f} Gbit/s of bus bandwidth, "
            f"{fixed * 1e6:.0f} us a call amid compute (this machine as cluster=this "
            "measured it)."]


def _predict_times(candidates: list[Candidate], cfg, links: dict[int, Any]) -> list[str]:
    """Each measured candidate's step: simulated at advise.target_world_size on the cluster
    group's GPUs, and here (cluster=this) at its own world size, as parallab simulate
    predicts it; and here from the parts its job measured (the replay's check). Notes for
    advise.md."""
    from parallab.config.planning import ClusterConfig
    from parallab.simulate import Predict, search
    from parallab.simulate import cluster as clusters

    options = cfg.advise
    ran = [c for c in candidates if c.measured]
    devices = torch.cuda.device_count() or 1 if ran and ran[0].cfg.device.value == "cuda" else 1
    notes, errors, simulated, unsimulated = [], [], [], set()
    # simulate's judge here (cluster=this: this machine, every rate measured) and on the
    # cluster group's GPUs (checked with the advise keys), sharing the model's traces
    here = Predict(ClusterConfig(name=clusters.THIS, gpu=clusters.THIS,
                                 **dict.fromkeys(clusters.RATES)))
    there = Predict(cfg.cluster, here.traces) if options.target_world_size else None
    for c in ran:
        one = report.reference_of(candidates, c.precision)
        alone = one.figures["step_time_ms"] / 1e3 if one and one.world_size == 1 else None
        replayed = c.world_size in links and scaling.validate(
            c.figures, c.cfg, c.resolved, links[c.world_size], alone, devices)
        if replayed:
            c.figures["predicted_step_ms_here"] = 1e3 * replayed
            errors.append(abs(1e3 * replayed / c.figures["step_time_ms"] - 1))
        try:  # the layout the checks resolved from its command, as it ran
            ran_as = search.given(c.cfg, c.resolved)
            step = here.of(ran_as)
            c.figures["simulated_step_ms_here"] = 1e3 * step.step_time_s
            simulated.append(abs(1e3 * step.step_time_s / c.figures["step_time_ms"] - 1))
            if there is not None:
                step = there.of(ran_as, options.target_world_size)
                c.figures["predicted_step_ms"] = 1e3 * step.step_time_s
        except Exception as error:  # noqa: BLE001 - advise's answer stands without it
            unsimulated.add(str(error) if isinstance(error, ConfigError) else first_line(error))
    if options.target_world_size and ran:
        notes.append(f"predicted_step_ms: each layout simulated on {options.target_world_size} "
                     f"x {cfg.cluster.gpu} (cluster={cfg.cluster.name}), as parallab simulate "
                     "predicts it (docs/parallel.md: planning for a cluster).")
    for n in links:
        notes += _links_here(here, n)
    if errors:
        notes.append(f"Step time here predicted from its measured parts: median error "
                     f"{statistics.median(errors):.0%} over {len(errors)} layouts.")
    if simulated:
        notes.append(f"Step time here simulated (cluster=this: this machine's rates, measured "
                     f"once): median error {statistics.median(simulated):.0%} over "
                     f"{len(simulated)} layouts.")
    notes += [f"Not simulated: {reason}." for reason in sorted(unsimulated)]
    return notes


def advise(cfg, overrides: list[str], run_dir: str, configure: Callable[[list[str]], Any],
           entry: list[str] | None = None) -> dict[str, Any]:
    """The whole advice for the composed `cfg` (advise.run=true); returns its summary.
    `entry`: how the recommended command starts (python train.py, and any --config-dir)."""
    from parallab.advise.measure import Measure

    out = Path(run_dir)
    out.mkdir(parents=True, exist_ok=True)
    off = dropout_off(cfg.model)
    candidates, global_batch, user = plan(cfg, overrides, configure, off)
    measure = Measure(out)
    measure.judge(candidates)
    links = measure.links
    report.judge(candidates, cfg.advise.rtol)
    notes = _predict_times(candidates, cfg, links)
    if off:  # what the verdicts rest on, and what the command keeps
        notes.append(f"Measured with dropout off ({', '.join(off)}), so that each layout's "
                     "losses can match one device's; the command keeps yours.")
    top = report.best(candidates)
    command = report.command(entry or ["python train.py"], user, top,
                             global_batch) if top else None
    table = report.write(candidates, out, command, notes)
    log.info("advise: %d candidates, %d measured; advise.md, advise.csv, advise.png in %s",
             len(candidates), sum(c.measured for c in candidates), out)
    if command:
        print(f"parallab advise recommends {top.label} "
              f"({top.figures['samples_per_sec']:,.1f} samples/s):\n{command}", flush=True)
    return {"recommended": top.label if top else None, "command": command, "rows": table}
