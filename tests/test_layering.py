"""The package's layers import only downward, and no module imports itself back through others.

    reference -> kernels -> ops -> measure -> models -> integrations -> bench -> course -> classroom

(each may import those to its left; a module's imports inside functions count as much as those at the top).
"""

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "mhc_lab"
LAYERS = ("reference", "kernels", "ops", "measure", "models", "integrations", "bench", "course", "classroom")


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path) -> set[str]:
    """The mhc_lab modules a file imports (``from mhc_lab.x import y`` counts mhc_lab.x.y where that is a module)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names if alias.name.startswith("mhc_lab"))
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("mhc_lab") and not node.level:
            found.add(node.module)
            for alias in node.names:
                candidate = f"{node.module}.{alias.name}"
                if candidate in MODULES:
                    found.add(candidate)
    return found


MODULES = {_module_name(p): p for p in PACKAGE.rglob("*.py")}


def _layer(module: str) -> int | None:
    parts = module.split(".")
    return LAYERS.index(parts[1]) if len(parts) > 1 and parts[1] in LAYERS else None


def test_every_package_has_a_layer():
    packages = {p.name for p in PACKAGE.iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    assert packages <= set(LAYERS), f"packages without a layer: {sorted(packages - set(LAYERS))}"


@pytest.mark.parametrize("module", sorted(MODULES))
def test_imports_only_downward(module):
    mine = _layer(module)
    if mine is None:
        return
    upward = sorted(m for m in _imports(MODULES[module]) if (_layer(m) or 0) > mine)
    assert not upward, f"{module} (layer {LAYERS[mine]}) imports a higher layer: {upward}"


def test_no_import_cycles():
    graph = {m: {i for i in _imports(p) if i in MODULES and i != m} for m, p in MODULES.items()}
    # a package's __init__ importing its own submodules is not a cycle worth naming: drop parent -> child edges
    graph = {m: {i for i in deps if not i.startswith(m + ".")} for m, deps in graph.items()}
    state, stack, cycles = {}, [], []

    def visit(node):
        state[node] = "open"
        stack.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == "open":
                cycles.append(stack[stack.index(nxt):] + [nxt])
            elif nxt not in state:
                visit(nxt)
        stack.pop()
        state[node] = "done"

    for node in sorted(graph):
        if node not in state:
            visit(node)
    assert not cycles, "import cycles: " + "; ".join(" -> ".join(c) for c in cycles)
