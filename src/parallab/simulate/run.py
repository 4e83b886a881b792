"""One `parallab simulate`: the config checked before anything is traced, the layouts
simulated and ranked, the answer written (report.py) and printed."""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

from parallab.config.errors import ConfigError, NothingFits, refuse
from parallab.parallel.grid import Candidate, Judge
from parallab.simulate import (Facts, Predict, Traces, clusters, experts, float8, rank,
                               rates_of, refuse_no_sequences, refuse_one_process, report,
                               search, trace_key)

log = logging.getLogger("parallab")


def check(cfg) -> Any:
    """The config as a simulation reads it, checked in train's order as train's checks would
    check it on the cluster: every run's keys, the data, the model, then the cluster's GPUs
    where train checks this machine's device, and the layout; the resolved layout, None for
    auto. ConfigError naming the key at fault."""
    from parallab.checks import validate
    from parallab.config.schema import Device
    from parallab.parallel import PLANS

    validate.check_values(cfg)
    validate.check_fixed_batch(cfg)  # auto's commands too: train refuses them otherwise
    refuse(_own_problem(cfg.simulate) or _advise_given(cfg.advise))
    cfg.data.fit_model(cfg.model)  # as train does: the model's vocabulary, its samples
    _check_data(cfg.data)
    _check_model(cfg)
    _check_cluster(cfg)
    cfg.device = Device.cuda  # the cluster's: its compute dtypes, not this machine's
    p = cfg.parallel
    if p.name == "auto":
        refuse(PLANS[p.name].problem(p) or _spanned(cfg.trainer))
        return None
    layout = PLANS[p.name].resolve(p, "cuda", p.world_size)
    from parallab.checks.trial import stages_on_meta

    validate.check_resolved(cfg, layout,
                            lambda: stages_on_meta(cfg) if layout.cuts_model else None)
    return layout


def _spanned(t) -> str | None:
    """trainer.accumulate_grad_batches, which parallel=auto spans for each layout: it had
    been dropped without a word, the command printed set otherwise. (A checkpointing mode
    is said in the notes instead: it is how trainer.activation_checkpointing_every is given
    to the layouts that checkpoint.)"""
    if t.accumulate_grad_batches != 1:
        return (f"trainer.accumulate_grad_batches={t.accumulate_grad_batches} with "
                "parallel=auto: auto spans trainer.accumulate_grad_batches itself, for each "
                "layout it ranks: drop it (or give one layout)")
    return None


def _check_model(cfg) -> None:
    """The model checked against the data as train checks it; a model of other data (its
    refusal names the data group, data=, and no key of its own) said so. A sequence model's
    own limits (model.context against data.seq_len, model.vocab_size) are said as train
    says them."""
    from parallab import models

    if cfg.adapter.name != "none":
        raise ConfigError(f"adapter={cfg.adapter.name}: parallab simulate trains every weight "
                          "(its gradient and optimizer states), not an adapter beside frozen "
                          "ones: simulate without adapter= for the whole model's figures")
    try:
        cfg.model = models.check(cfg.model, cfg.data)
    except ConfigError as error:
        said = str(error)
        if "data=" not in said or "model." in said:
            raise
        name = cfg.model["_target_"].rpartition(".")[2]
        raise ConfigError(f"parallab simulate traces a language model's block on token "
                          f"sequences, which {name} does not take: simulate gpt, a "
                          "transformers causal LM (model=llama3_8b, qwen3_moe_30b, ...) or "
                          "your own sequence model") from None


def _check_cluster(cfg) -> None:
    """The cluster and its GPU count, in the place of train's check of this machine."""
    refuse(clusters.problem(cfg.cluster))
    if cfg.precision.name == "fp8" and cfg.cluster.gpu == clusters.THIS:  # before measuring
        raise ConfigError("precision=fp8 with cluster=this: this machine's rates are measured "
                          "in float32 and bf16, and train runs float8 on CUDA GPUs alone: use "
                          "precision=bf16 here, or a cluster of GPUs with float8 (cluster=h100)")
    p = cfg.parallel
    if p.world_size is None:
        raise ConfigError("parallel.world_size is not set: give the GPU count to simulate, "
                          "e.g. parallel.world_size=64")
    if p.name == "auto" and p.world_size < 2:
        raise ConfigError(f"parallel=auto with parallel.world_size={p.world_size}: one GPU has "
                          "one layout; give the cluster's GPU count (2 or more)")
    refuse_one_process(p.name)


def _check_data(data) -> None:
    """The data's keys a simulation reads (its batch, its sequences), and the data's own
    check, its files named as train's, which a simulation never reads."""
    for key in ("batch_size", "global_batch_size"):
        value = getattr(data, key)
        if value is not None and value < 1:
            raise ConfigError(f"data.{key}={value} is out of range: it must be >= 1 (sequences "
                              "per data-parallel rank, or per step)")
    refuse_no_sequences(data)
    said = data.problem()
    if said and any(f"data.{key}" in said for key in ("path", "files", "root")):
        said += ("; or leave data= out: parallab simulate reads no data, its own takes "
                 f"data.seq_len={data.seq_len} data.batch_size={data.batch_size}")
    refuse(said)


def _own_problem(s) -> str | None:
    """simulate's own keys: None, or one line naming the key at fault."""
    if s.rows < 1 or s.plotted < 0:
        key, value = ("rows", s.rows) if s.rows < 1 else ("plotted", s.plotted)
        return f"simulate.{key}={value} is out of range: it must be >= {int(key == 'rows')}"
    if any(n < 1 for n in s.world_sizes or ()):
        return f"simulate.world_sizes={list(s.world_sizes)}: each must be a GPU count >= 1"
    if s.routing not in experts.ROUTINGS:
        return (f"simulate.routing={s.routing} is not a routing parallab simulate prices: "
                f"pick one of {', '.join(experts.ROUTINGS)}")
    if s.measured and not Path(s.measured).is_dir():
        return (f"simulate.measured={s.measured} is not a directory: give a dir of runs "
                "measured here (an advise run dir, a sweep's dir), or leave it null")
    return None


def _advise_given(options) -> str | None:
    """An advise key given to a simulation, which reads none: it had been taken without a
    word (advise.schedules=[foo] too), the grid spanning every schedule regardless."""
    import dataclasses

    from parallab.config.planning import AdviseConfig

    default = AdviseConfig()
    given = next((f.name for f in dataclasses.fields(options)
                  if getattr(options, f.name) != getattr(default, f.name)), None)
    return None if given is None else (
        f"advise.{given} is parallab advise's: parallab simulate spans every schedule, "
        "micro-batch count and memory saver (parallel=auto) at the precision given, or "
        "prices the one layout given: drop it")


def candidates_of(cfg, layout, facts: Facts, rates) -> tuple[list[Candidate], list[str]]:
    """The given layout alone, or parallel=auto's grid; notes on what the grid leaves out
    and what the simulation assumed."""
    notes = []
    if facts.mix is not None:
        notes.append(f"Routing: each of the {facts.mix.experts} experts takes an even share "
                     "of the tokens (uniform, as vendor benchmarks force it); a real router's "
                     "busiest expert makes its rank, and every rank of its all-to-all, "
                     "wait. Each token is sent once to each rank holding any of its experts, "
                     f"which it picks as simulate.routing={cfg.simulate.routing} says. The "
                     "all-to-all is NCCL's (no node-level deduplication, as DeepEP's).")
    if cfg.trainer.auto_batch_size:  # a search on the GPUs themselves, as train starts
        notes.append("trainer.auto_batch_size=true: train searches the largest batch each "
                     "GPU holds as it starts; each layout is priced at the batch it is given "
                     "here (its data.batch_size).")
    if layout is not None:
        refuse(facts.split_problem())
        mode = cfg.trainer.activation_checkpointing
        if mode != "none" and facts.checkpoint_problem:  # train refuses it before launch
            raise ConfigError(f"trainer.activation_checkpointing={mode}: "
                              f"{facts.checkpoint_problem}")
        return [search.given(cfg, layout)], notes
    found = search.grid(cfg, facts, rates.gpus_per_node)
    if cfg.trainer.activation_checkpointing != "none":  # it had been dropped without a word
        notes.append(f"trainer.activation_checkpointing={cfg.trainer.activation_checkpointing}"
                     ": parallel=auto weighs every mode for each layout (none, the "
                     "selective ones, full); trainer.activation_checkpointing_every goes to "
                     "those that checkpoint.")
    why = facts.pipeline_problem(2)
    if why:
        notes.append(f"No pipeline layouts: {why}.")
    if facts.checkpoint_problem:  # the grid's first mode past none named, as train says it
        notes.append("No activation checkpointing: trainer.activation_checkpointing=full: "
                     f"{facts.checkpoint_problem}.")
    if not found:
        raise ConfigError(f"no layout of parallel.world_size={cfg.parallel.world_size} GPUs "
                          "takes this model and batch: use a power-of-two GPU count")
    if all(c.reason for c in found):  # refused before anything is traced
        raise ConfigError(f"no layout of parallel.world_size={cfg.parallel.world_size} GPUs "
                          f"takes this model and batch: {found[0].reason}")
    return found, notes


def given(cfg) -> tuple[Candidate, Facts]:
    """The layout a checked config gives, predicted on its cluster; nothing written (the
    benchmark against published runs)."""
    layout = check(cfg)
    if layout is None:
        raise ConfigError("parallel=auto: give one layout to predict")
    ranked, _, _, traces, _ = _simulated(cfg, layout)
    return ranked[0], traces.facts


def _simulated(cfg, layout):
    """The checked config's candidates simulated on its cluster: (ranked, the seconds it
    took, notes, the traces, the rates)."""
    rates = rates_of(cfg.cluster, cfg.parallel.world_size)
    refuse(float8.problem(cfg.precision.name, rates))
    facts = Facts.of(cfg)
    if cfg.simulate.routing != "random" and facts.mix is None:
        raise ConfigError(f"simulate.routing={cfg.simulate.routing} prices how tokens pick "
                          "experts, and this model has none: leave it out")
    candidates, notes = candidates_of(cfg, layout, facts, rates)
    if cfg.precision.name == "fp8":
        notes.append(float8.NOTE)
    facts.cut()
    traces = Traces(cfg, facts)
    start = time.perf_counter()
    # the given layout alone is traced whatever its state
    judge: Judge = Predict(cfg.cluster, {trace_key(cfg): traces},
                           {cfg.parallel.world_size: rates}, skim=len(candidates) > 1)
    judge.judge(candidates)
    seconds = time.perf_counter() - start
    log.info("simulate: %d layouts from %d traces in %.1f s", len(candidates),
             len(traces.found), seconds)
    return rank(candidates, rates), seconds, notes, traces, rates


def run(cfg, overrides: list[str], run_dir: str, entry: list[str]) -> dict[str, Any]:
    """The whole simulation of the composed, typed `cfg`; its summary."""
    layout = check(cfg)
    taken = _defaults_taken(cfg, overrides)
    ranked, seconds, notes, traces, rates = _simulated(cfg, layout)
    for line in taken:  # once the input is known good: a refusal is its one line alone
        log.warning(line)
    notes = [*taken, *([""] if taken else []), *notes]
    user = search.user_overrides(overrides)
    fits = [c for c in ranked if c.fits(rates.memory_bytes)]
    if layout is None and not fits:
        raise NothingFits(_nothing_fits(cfg, ranked, rates))
    entries = [report.entry(c, c.fits(rates.memory_bytes), report.command_of(entry, user, c))
               for c in ranked]
    head = _head(cfg, traces.facts, seconds)
    best = fits[0] if fits else ranked[0]
    command = report.command_of(entry, user, best)
    lines = report.sbatch(best, rates.gpus_per_node, command)
    notes += _notes(lines)
    out = Path(run_dir)
    out.mkdir(parents=True, exist_ok=True)
    curves, left_out = _curves(cfg, fits[:cfg.simulate.plotted], traces, rates)
    notes += left_out
    report.write(out, head, entries, cfg.simulate.rows, notes, curves,
                 _measured(cfg.simulate.measured))
    _say(best, command, lines, rates, out)
    return {"best": best.label, "command": command, "sbatch": lines, "layouts": entries}


def _defaults_taken(cfg, overrides: list[str]) -> list[str]:
    """What a first simulation of a cluster takes from train's defaults unasked and rarely
    means: a sequence as long as the model's whole context, float32 matmuls."""
    given = {o.lstrip("+~").partition("=")[0] for o in overrides}
    said = []
    if "data.seq_len" not in given and cfg.data.seq_len > 8192:
        said.append(f"data.seq_len={cfg.data.seq_len} is the model's whole context, taken as "
                    "every sequence's length: give the length you train (torchtitan's Llama 3 "
                    "runs 8192), e.g. data.seq_len=8192")
    if "precision" not in given and cfg.precision.name == "fp32" and \
            cfg.cluster.gpu != clusters.THIS:
        said.append("precision=fp32 (train's default) prices float32 matmuls: runs on such "
                    "GPUs train in bf16 or fp8: give precision=bf16")
    return said


def _nothing_fits(cfg, ranked: list[Candidate], rates) -> str:
    sized = [c for c in ranked if c.memory_gb is not None]
    if not sized:
        return (f"no layout of {cfg.parallel.world_size} GPUs can run this model: "
                f"{ranked[0].reason}")
    least = min(sized, key=lambda c: c.memory_gb)
    need = least.memory_gb
    return (f"no layout of parallel.world_size={cfg.parallel.world_size} GPUs fits "
            f"{cfg.model['_target_'].rpartition('.')[2]} on cluster={cfg.cluster.name}: the "
            f"smallest needs {report.gib(need)} GiB per GPU ({least.label}) and a GPU has "
            f"{report.gib(rates.memory_bytes / 2**30)} GiB; use more GPUs, a shorter "
            "data.seq_len or a smaller data.batch_size")


def _head(cfg, facts: Facts, seconds: float) -> dict[str, Any]:
    head = {"model": cfg.model["_target_"].rpartition(".")[2], "cluster": cfg.cluster.name,
            "gpu": cfg.cluster.gpu, "world_size": cfg.parallel.world_size,
            "seq_len": cfg.data.seq_len, "precision": cfg.precision.name,
            "compile": cfg.trainer.compile, "blocks": facts.blocks,
            "flops_per_token": facts.flops_per_token, "seconds": seconds}
    if cfg.cluster.gpu == clusters.THIS:  # a figure of its hour: when, and under what load
        from parallab.simulate import this_machine

        head["measured"] = this_machine.when(cfg.cluster, cfg.parallel.world_size)
    return head


def _notes(lines: list[str]) -> list[str]:
    return ["Parts: seconds of a step on the busiest GPU: compute (forward, backward and "
            "any recompute), the collectives each layout leaves exposed by kind (tp_: inside "
            "the blocks), the pipeline's idle slots (bubble), its schedule's own time where "
            "the cores that compute pay it (schedule: cluster=this) and the optimizer.", "",
            "The best layout's allocation:", "", "```bash", *lines, "```"]


def _curves(cfg, best: list[Candidate], traces, rates) -> tuple[dict[str, list], list[str]]:
    """Each of the best layouts at other GPU counts, as search.grown grows it (the same
    tp, pp and batch per data-parallel rank; fsdp's shards, hsdp's and ddp's replicas
    grown), on the cluster's rates at each count (simulate.world_sizes, else powers of 2
    from 8); and a note on each count given that a layout cannot take (it had been left
    out of the plot without a word)."""
    from parallab.parallel import grid

    n = cfg.parallel.world_size
    sizes = cfg.simulate.world_sizes or [s for s in grid.powers_of_two(max(n, 8)) if s >= 8]
    judge = Predict(cfg.cluster, {trace_key(cfg): traces}, {n: rates})
    curves: dict[str, list] = {}
    left_out = []
    for c in best:
        points = []
        for size in sorted(set(sizes)):
            try:
                other = search.grown(c, size)
            except ConfigError as error:  # the count does not split so
                if cfg.simulate.world_sizes:
                    left_out.append(f"simulate.world_sizes: {size} GPUs left out of "
                                    f"{c.label}'s curve: {error}")
                continue
            points.append((size, judge.of(other).tokens_per_sec_per_gpu))
        curves[c.label] = points
    return curves, left_out


def _measured(where: str | None) -> list[tuple[int, float, str]]:
    """(world size, tokens/s per GPU, label) of each run measured under `where`: each
    metrics.json with tokens per second (a sweep's jobs, advise's candidates)."""
    import json

    if not where:
        return []
    found = []
    for path in sorted(Path(where).rglob("metrics.json")):
        try:
            figures = json.loads(path.read_text())
        except (OSError, ValueError):  # a run still writing it, or cut short: not a point
            log.warning("simulate.measured: %s cannot be read as JSON; left out", path)
            continue
        point = _measured_point(figures)
        if point is None:  # a run of parallab's timed none of its steps, or another file
            why = ("is a run that timed no step (each within trainer.timing_skip_steps)"
                   if isinstance(figures, dict) and "step_time_ms" in figures and
                   figures["step_time_ms"] is None else
                   "holds no run's tokens/s and world size (a metrics.json parallab wrote "
                   "has them)")
            log.warning("simulate.measured: %s %s; left out", path, why)
            continue
        found.append((*point, f"{path.parent.name} (measured)"))
    return found


def _measured_point(figures) -> tuple[int, float] | None:
    """(world size, tokens/s per GPU) of a run's metrics.json, or None where it holds no
    such pair (another file of that name, a run without tokens, a figure not finite)."""
    import math

    if not isinstance(figures, dict):
        return None
    tokens, world = figures.get("tokens_per_sec"), figures.get("world_size")
    if not isinstance(world, int) or isinstance(world, bool) or world < 1 or \
            not isinstance(tokens, (int, float)) or not math.isfinite(tokens) or tokens <= 0:
        return None
    return world, tokens / world


def _say(best: Candidate, command: str, lines: list[str], rates, out: Path) -> None:
    p = best.prediction
    if p is None:
        print(f"parallab simulate: {best.label} cannot run: {best.reason}", flush=True)
        return
    over = "" if best.fits(rates.memory_bytes) else " (does not fit)"
    print(f"parallab simulate: {best.label}: {p.tokens_per_sec_per_gpu:,.0f} tokens/s per GPU, "
          f"{p.step_time_s:.3f} s a step, MFU {p.mfu:.1%}, {report.gib(p.memory_per_gpu_gb)} "
          f"GiB per GPU{over} (simulate.md, .json, .png in {out})", flush=True)
    print(command, flush=True)
