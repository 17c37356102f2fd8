"""The package's spine, read from its source with ast: layers import only downwards, export/
and runtimes/ never import each other, and no cycle exists between modules or between the
package's top-level parts. Imports inside functions count: a lazy import is still a dependency."""

import ast
from pathlib import Path

import pytest

import infmoe_export

PACKAGE = Path(infmoe_export.__file__).parent
# Bottom to top; a part may import its own layer and those below (docs/design/design.md, "Layout").
# options: the commands' parsing and export choice, checked against the runtimes (the commands' layer).
LAYERS = [
    {"errors", "files", "limits", "model", "quant"},
    {"contract", "checkpoint", "data"},
    {"evaluate", "train", "export", "runtimes"},
    {"verify"},
    {"report"},
    {"serving"},
    {"commands", "cli", "options"},
]
RANK = {part: rank for rank, parts in enumerate(LAYERS) for part in parts}


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(p): p for p in PACKAGE.rglob("*.py")}


def imports_of(name: str, path: Path) -> set:
    """Every infmoe_export module that `name` imports (`from x import y` counts x.y when y is a module)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[:len(base) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module
            for alias in node.names:
                found.add(f"{target}.{alias.name}" if f"{target}.{alias.name}" in MODULES else target)
    return {m for m in found if m in MODULES and m != name}


GRAPH = {name: imports_of(name, path) for name, path in MODULES.items()}


def part(module: str) -> str:
    """The top-level part of the package a module belongs to ('' for the package itself)."""
    return module.split(".")[1] if "." in module else ""


def find_cycle(graph: dict):
    """One cycle as a list of nodes, or None (iterative depth-first search)."""
    state, parent = {}, {}
    for root in graph:
        if root in state:
            continue
        stack = [(root, iter(sorted(graph[root])))]
        state[root] = "open"
        while stack:
            node, children = stack[-1]
            child = next(children, None)
            if child is None:
                state[node] = "done"
                stack.pop()
            elif state.get(child) == "open":
                cycle = [child, node]
                while cycle[-1] != child:
                    cycle.append(parent[cycle[-1]])
                return cycle[::-1]
            elif child not in state:
                state[child], parent[child] = "open", node
                stack.append((child, iter(sorted(graph.get(child, ())))))
    return None


def test_the_graph_was_read():
    # Guards the checks below against an empty or broken reading.
    assert {"infmoe_export.export.exporter", "infmoe_export.runtimes.ort", "infmoe_export.contract"} <= set(GRAPH)
    assert "infmoe_export.contract" in GRAPH["infmoe_export.export.exporter"]
    assert "infmoe_export.verify.validate" in GRAPH["infmoe_export.commands.onnx"]


def test_every_part_has_a_layer():
    unplaced = {part(m) for m in MODULES} - set(RANK) - {""}
    assert not unplaced, f"add {sorted(unplaced)} to LAYERS"


@pytest.mark.parametrize("a, b", [("export", "runtimes"), ("runtimes", "export")])
def test_export_and_runtimes_do_not_import_each_other(a, b):
    edges = [(m, t) for m, targets in GRAPH.items() for t in targets if part(m) == a and part(t) == b]
    assert not edges, f"{a}/ must not import {b}/: {edges}"


def test_layers_import_only_downwards():
    upward = [(m, t) for m, targets in GRAPH.items() for t in targets
              if part(m) and part(t) and RANK[part(t)] > RANK[part(m)]]
    assert not upward, f"imports that go up the layers: {upward}"


def test_no_cycle_between_modules():
    cycle = find_cycle(GRAPH)
    assert cycle is None, " -> ".join(cycle or [])


def test_no_cycle_between_parts():
    parts = {}
    for module, targets in GRAPH.items():
        parts.setdefault(part(module), set()).update(part(t) for t in targets if part(t) != part(module))
    cycle = find_cycle(parts)
    assert cycle is None, " -> ".join(cycle or [])


def test_find_cycle_finds_one():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None
