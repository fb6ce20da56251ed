"""The import graph of src/rltrain: no circle, and no arrow up the layers.

The layers are the ones docs/architecture.md draws (top first). A module may
import from its own layer or any layer below it, never from one above. Every
import counts: module level, inside functions and under TYPE_CHECKING.
"""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src" / "rltrain"

# Top first; a module belongs to the layer of its longest matching prefix.
LAYERS: list[tuple[str, ...]] = [
    ("cli",),
    ("sweep",),
    ("runner",),
    ("loops",),  # the controllers: grpo, ppo, collect, evaluate
    ("envs",),  # multi-turn environments, trajectories, the turn driver (loops drive them)
    ("cluster",),  # Ray: actors, typed role handles, placement
    ("train",),  # the FSDP2 trainer and its workers
    ("rollout",),  # the engines
    ("refit",),
    ("algorithms",),  # pure math: advantages, GAE, losses, logprobs
    # the package: core, roles, batch, engine, gpus, process, objective, sizes, memory, parts, view
    ("plan",),
    ("data",),
    ("rewards",),
    (
        "config.validate",
        "config.inputs",
        "config.compose",
        "config.reference",
    ),  # read model folders
    ("logging", "models"),
    ("config", "env", ""),  # the schema, errors; the env registry; the package itself
]


def _modules() -> dict[str, Path]:
    out = {}
    for path in SRC.rglob("*.py"):
        parts = path.relative_to(SRC).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def _imports(path: Path, modules: dict[str, Path]) -> set[str]:
    """The rltrain modules ``path`` imports (relative to the package), each once."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        names: list[str] = []
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("rltrain"):
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        for name in names:
            if name == "rltrain" or name.startswith("rltrain."):
                short = name.removeprefix("rltrain").removeprefix(".")
                if short in modules:
                    found.add(short)
    return found


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    return {m: _imports(p, modules) - {m} for m, p in modules.items()}


def layer_of(module: str) -> int:
    """Index in LAYERS (0 = top) of ``module`` ("train.fsdp", "" = the package)."""
    best, best_len = None, -1
    for i, prefixes in enumerate(LAYERS):
        for prefix in prefixes:
            hit = module == prefix or module.startswith(prefix + ".") or prefix == ""
            if hit and len(prefix) > best_len:
                best, best_len = i, len(prefix)
    assert best is not None, module
    return best


def test_no_import_points_up_the_layers():
    upward = [
        f"{m} (layer {layer_of(m)}) imports {d} (layer {layer_of(d)})"
        for m, deps in _graph().items()
        for d in deps
        if layer_of(d) < layer_of(m)
    ]
    assert not upward, "\n".join(sorted(upward))


def test_no_import_circle():
    graph = _graph()
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    circles: list[list[str]] = []

    def visit(v: str) -> None:  # Tarjan's strongly connected components
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                circles.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    assert not circles, circles


def test_the_layer_check_sees_an_upward_import():
    """The check is not vacuous: the trainer sits below the controllers, math below both."""
    assert layer_of("loops.grpo") < layer_of("cluster.handles") < layer_of("train.fsdp")
    assert layer_of("train.fsdp") < layer_of("algorithms.losses")
    assert layer_of("rollout.torch_engine") < layer_of("algorithms.logprobs")
    graph = _graph()
    assert "algorithms.logprobs" in graph["rollout.torch_engine"]  # a real, downward arrow
    assert all(layer_of(d) >= layer_of("algorithms") for d in graph["algorithms.losses"])
