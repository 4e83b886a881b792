"""parallel=auto: every layout at once, which only a simulation can weigh (parallab simulate
ranks them for a cluster); a run trains one of them."""

from __future__ import annotations

from parallab.config.errors import ConfigError
from parallab.parallel.base import Options, Plan, bucket_problem
from parallab.parallel.layout import Layout


class AutoPlan(Plan):
    splits_experts = True  # some of its layouts do: what refuses parallel.ep is layout_of
    @classmethod
    def layout_of(cls, p, world_size: int) -> Layout:
        # the world size given, not the one a null resolved to here (1 on a CPU: none alone)
        raise ConfigError(f"parallel=auto stands for every layout, and a run trains one: rank "
                          f"them with `parallab simulate parallel=auto parallel.world_size="
                          f"{p.world_size or 'N'} cluster=NAME` and run the command it "
                          "prints, or give a layout (parallel=ddp, fsdp, ...)")

    @classmethod
    def problem(cls, p) -> str | None:
        """The keys auto passes on to the layouts it ranks, checked as their plans would;
        parallel.ep, which every plan's config has (no struct error names it), set by auto
        for each layout as the degrees are."""
        if p.ep != 1:
            return (f"parallel=auto sets parallel.ep itself, for each layout it ranks: drop "
                    f"parallel.ep={p.ep} (or give one layout)")
        return bucket_problem(p.bucket_cap_mb)

    @classmethod
    def options(cls, p) -> Options:
        """The mesh's keys, which auto carries to the layouts it ranks (each where its
        layout takes it: parallel/grid.py's WHERE)."""
        from parallab.parallel.mesh import MeshPlan

        return MeshPlan.options(p)
