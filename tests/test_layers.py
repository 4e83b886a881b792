"""The package's layers: each module imports only its own layer and those below it, and no
two modules import each other however indirectly (docs/architecture.md draws the picture)."""

from __future__ import annotations

import ast
from pathlib import Path

import parallab.cli

SRC = Path(parallab.cli.__file__).resolve().parent
# bottom first; a module's layer is its longest matching prefix
LAYERS = [
    ("config",),                                            # the config and its words
    ("launching.distributed", "models", "data", "batch", "loss", "precision", "schedule",
     "optim", "quantize", "metrics", "parallel"),  # the pieces a rank runs
    ("observe",),                                           # what a run reports
    ("launching",),                                         # processes and signals
    ("training",),                                          # a rank's run
    ("checks", "advise", "simulate"),                       # the controller's checks
    ("cli", "commands", "invocation", "sweep_job", "testing"),  # the commands
]


def layer_of(module: str) -> int:
    found = [(len(prefix), level) for level, prefixes in enumerate(LAYERS)
             for prefix in prefixes if module == prefix or module.startswith(prefix + ".")]
    assert found, f"parallab.{module} is in no layer: add it to LAYERS"
    return max(found)[1]


def modules() -> dict[str, Path]:
    found = {}
    for path in SRC.rglob("*.py"):
        parts = path.relative_to(SRC).with_suffix("").parts
        if parts[0] == "conf" or "files" in parts:
            continue
        found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def imports(found: dict[str, Path]) -> dict[str, set[str]]:
    """Each module's parallab imports (those inside functions too), as module names."""
    def resolve(name: str) -> str:
        while name and name not in found:
            name = name.rpartition(".")[0]
        return name

    edges: dict[str, set[str]] = {}
    for module, path in found.items():
        targets = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("parallab."):
                base = node.module.removeprefix("parallab.")
                for alias in node.names:
                    targets.add(resolve(f"{base}.{alias.name}"))
            elif isinstance(node, ast.Import):
                targets |= {resolve(a.name.removeprefix("parallab."))
                            for a in node.names if a.name.startswith("parallab.")}
        edges[module] = targets - {module, ""}
    return edges


def test_no_module_imports_a_layer_above_its_own():
    found = modules()
    upward = [f"parallab.{m} (layer {layer_of(m)}) imports parallab.{t} (layer {layer_of(t)})"
              for m, targets in imports(found).items() for t in targets
              if layer_of(t) > layer_of(m)]
    assert not upward, "\n".join(sorted(upward))


def test_no_import_cycle():
    edges = imports(modules())
    # a package's __init__ importing its own modules is how it names them, not a cycle
    edges = {m: {t for t in ts if not t.startswith(m + ".")} for m, ts in edges.items()}
    state: dict[str, int] = {}

    def visit(module: str, path: list[str]) -> list[str] | None:
        state[module] = 1
        for target in sorted(edges.get(module, ())):
            if state.get(target) == 1:
                return path + [module, target]
            if target not in state:
                cycle = visit(target, path + [module])
                if cycle:
                    return cycle
        state[module] = 2
        return None

    for module in sorted(edges):
        if module not in state:
            cycle = visit(module, [])
            assert cycle is None, " -> ".join(cycle)


def test_at_most_twelve_modules_at_the_top():
    top = sorted(p.stem for p in SRC.glob("*.py") if p.stem != "__init__")
    assert len(top) <= 12, f"{len(top)} modules at the top of parallab/: {', '.join(top)}"
