"""The one grid of layouts: every way a count of ranks splits into replicas, FSDP2 shards,
tensor-parallel slices and pipeline parts (a pipeline's by schedule, stages per rank and
micro-batches too), each a parallel.Layout that its preset's plan trains (Layout.preset,
Layout.overrides). `parallab advise` measures the presets' shapes of it on this machine;
`parallab simulate` prices every product on a cluster. What differs between them is the
span (a Space), never the layouts or how they are enumerated, nor the Candidate each
holds a layout in, nor what judges it (a Judge: advise's measurement, simulate's
prediction)."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any, Callable, Protocol

from parallab.parallel.layout import SET_KEYS, Layout


def overrides_kept(overrides: list[str], decided: tuple[str, ...],
                   kept: tuple[str, ...] = ()) -> list[str]:
    """The user's overrides a candidate's command keeps: all but those of the keys its
    layout sets (layout.SET_KEYS), the planners' own (advise., hydra.) and what the planner
    deciding also decides (`decided`), bar `kept`."""
    gone = (*SET_KEYS, "advise.", "hydra.", *decided)
    return [o for o in overrides if o.startswith(kept) or not o.lstrip("+~").startswith(gone)]


# the user's keys a candidate's command carries only where its layout takes them: a
# tensor-parallel plan where it splits (train refuses one at tp 1), FSDP's resharding where
# no pipeline holds the parts (its parts stay gathered to the flush; no such key), which
# blocks are checkpointed where some are
WHERE = (("parallel.tp_plan=", lambda layout: layout.tp > 1),
         ("parallel.reshard_after_forward=", lambda layout: layout.pp == 1),
         ("trainer.activation_checkpointing_every=",
          lambda layout: layout.checkpointing != "none"))


def kept_for(user: list[str], layout: Layout) -> list[str]:
    """The user's overrides as the command of a candidate of `layout` keeps them (WHERE)."""
    return [o for o in user if all(takes(layout) for key, takes in WHERE
                                   if o.lstrip("+~").startswith(key))]


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def powers_of_two(limit: int) -> list[int]:
    return [2**k for k in range(int(math.log2(limit)) + 1)] if limit >= 1 else []


def powers_of_two_dividing(n: int) -> list[int]:
    return [d for d in powers_of_two(n) if n % d == 0]



def expert_degrees(experts: int | None, tp: int, shards: int) -> list[int]:
    """The ep a layout of `tp` and `shards` (FSDP2's) may take for a model of `experts`
    experts a layer (None: no mixture, [1]): 1, and tp x each power of two of the shards,
    where it divides the experts (train's rule: parallel/expert_parallel.py)."""
    if not experts:
        return [1]
    carved = [tp * s for s in powers_of_two_dividing(shards) if tp * s > 1]
    return [1, *(ep for ep in carved if experts % ep == 0)]

@dataclass(frozen=True)
class Space:
    """What a grid spans: the degrees a count of ranks splits into (`splits`: each divides
    it; the shards may also take every data-parallel rank), tp within `max_tp`, every
    product of the degrees (`mixed`) or only the presets' own shapes (ddp, fsdp, hsdp, tp,
    fsdp_tp: replicas and tp not both; a pipeline of replicas alone), the ways a rank's
    batch is taken for pp parts over dp data-parallel ranks (`ways(pp, dp)`: the Layout
    fields each fixes, such as the schedule, micro-batches and batch; none: left out), and
    whether one process may drive several GPUs (dp's replicas, model's parts)."""

    splits: Callable[[int], list[int]] = divisors
    max_tp: int | None = None
    mixed: bool = False
    ways: Callable[[int, int], list[dict[str, Any]]] = lambda pp, dp: [{}]
    devices: bool = False


def layouts(world_size: int, space: Space) -> list[Layout]:
    """The grid at `world_size` ranks, by tp, then pp, then shards (ascending), then the
    ways; each Layout with its preset's plan set."""
    from parallab.parallel import PLANS

    n = world_size
    found = []
    limit = n if space.max_tp is None else min(n, space.max_tp)
    for tp in [t for t in space.splits(n) if t <= limit]:
        for pp in space.splits(n // tp):
            dp = n // (tp * pp)
            for shard in sorted({*space.splits(dp), dp}):
                if space.mixed or _a_presets_shape(dp // shard, shard, tp, pp):
                    found += [_planned(n, dp // shard, shard, tp, pp, way)
                              for way in space.ways(pp, dp)]
    if space.devices and n > 1:  # one process's GPUs: dp's replicas, model's parts
        found += [Layout(n, ("dp_replicate",), dp_replicate=n, plan=PLANS["dp"]),
                  Layout(n, ("pp",), pp=n, plan=PLANS["model"])]
    return found


def _a_presets_shape(replicas: int, shards: int, tp: int, pp: int) -> bool:
    """A shape a preset's config takes with its own degrees: no replicas beside tp (fsdp_tp
    keeps one replica), and a pipeline of replicas alone."""
    return not (replicas > 1 and tp > 1) if pp == 1 else shards == tp == 1


def _planned(n: int, r: int, f: int, t: int, p: int, way: dict[str, Any]) -> Layout:
    from parallab.parallel import PLANS

    layout = Layout.planned(n, dp_replicate=r, dp_shard=f, tp=t, pp=p, **way)
    return dataclasses.replace(layout, plan=PLANS[layout.preset])


@dataclass(eq=False)
class Candidate:
    """A layout of the grid as a command trains it, and what became of it: why it cannot
    run (the checks, the memory), and what a judge found of it: advise measures it here
    (`figures`, `verdict`), simulate predicts it on a cluster (`prediction`)."""

    layout: Layout  # the grid's: its degrees and all it fixes, its preset's plan set
    precision: str | None = None  # its precision=NAME (advise crosses them); None: the config's
    global_batch: bool = False  # data.global_batch_size given: it sets the batch, not the layout
    reason: str | None = None  # why it cannot run, or why its run failed
    cfg: Any = None  # the config train's checks made of its command, and
    resolved: Layout | None = None  # the layout they resolved from it (what a run launches)
    # a rank's training state and activations in MB, predicted before anything runs (the
    # activations None where only the state was: it alone is over the memory)
    memory_mb: tuple[float, float | None] | None = None
    prediction: Any = None  # simulate's: its step (simulate/step.Prediction)
    figures: dict[str, Any] = field(default_factory=dict)  # advise's: what its run measured
    verdict: str | None = None  # advise's: its losses against one device's

    @property
    def label(self) -> str:
        return f"{self.layout.label}{f' {self.precision}' if self.precision else ''}"

    @property
    def overrides(self) -> list[str]:
        """What `parallab train` needs beyond the user's overrides to train this way."""
        precision = [f"precision={self.precision}"] if self.precision else []
        return [*self.layout.overrides(self.global_batch), *precision]

    @property
    def world_size(self) -> int:
        return self.layout.world_size

    @property
    def predicted_mb(self) -> float | None:
        """MB a rank holds as predicted before anything runs, where all of it was."""
        if self.memory_mb is None or self.memory_mb[1] is None:
            return None
        return sum(self.memory_mb)

    @property
    def memory_gb(self) -> float | None:
        """GiB a GPU holds: the prediction's, else the training state's alone, if known."""
        if self.prediction is not None:
            return self.prediction.memory_per_gpu_gb
        return self.memory_mb[0] / 1024 if self.memory_mb else None

    def fits(self, memory_bytes: float) -> bool:
        """Predicted, and within a GPU's memory."""
        return self.prediction is not None and \
            self.prediction.memory_per_gpu_gb * 2**30 <= memory_bytes

    @property
    def measured(self) -> bool:
        return bool(self.figures) and "error" not in self.figures


class Judge(Protocol):
    """What a candidate comes to, a layout in and figures out, written into each candidate
    it is given that can run (no reason yet): advise measures them on this machine
    (advise/measure.py Measure: Candidate.figures, a failed run's reason); simulate
    predicts them on a cluster, cluster=this included (simulate.Predict:
    Candidate.prediction, or the training state alone where it is over a GPU)."""

    def judge(self, candidates: list[Candidate]) -> None: ...
