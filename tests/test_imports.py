"""No import cycles among the package's modules: fuser/, passes/ (fuser.passes), runtime/
(fuser.runtime) and models/ (fuser.models).

The graph is built from the source with ast: an edge for every import statement, at module level,
inside a function (a deferred import still ties the two modules together) or under
`if TYPE_CHECKING:` (an import for types only is a dependency too; a Protocol breaks it). A
package's own __init__ is a node like any module; importing a submodule is not counted as
importing its parent package.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# source directory -> the package it installs as (pyproject.toml's package-dir mapping)
PACKAGES = {"fuser": "fuser", "passes": "fuser.passes", "runtime": "fuser.runtime",
            "models": "fuser.models"}


def module_names() -> dict[str, Path]:
    """Dotted module name -> source file, for every .py file of the packages."""
    names: dict[str, Path] = {}
    for directory, package in PACKAGES.items():
        for path in sorted((ROOT / directory).rglob("*.py")):
            parts = list(path.relative_to(ROOT / directory).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            names[".".join([package, *parts])] = path
    return names


def import_graph() -> dict[str, set[str]]:
    """Module -> the package modules it imports."""
    names = module_names()
    graph: dict[str, set[str]] = {name: set() for name in names}
    for name, path in names.items():
        tree = ast.parse(path.read_text(), str(path))
        is_package = path.name == "__init__.py"
        for node in ast.walk(tree):
            if not isinstance(node, (ast.Import, ast.ImportFrom)):
                continue
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            else:
                base = node.module or ""
                if node.level:
                    anchor = name.split(".")
                    anchor = anchor if is_package else anchor[:-1]
                    anchor = anchor[:len(anchor) - node.level + 1]
                    base = ".".join(anchor + ([base] if base else []))
                for alias in node.names:
                    full = f"{base}.{alias.name}"
                    targets.append(full if full in names else base)
            for target in targets:
                while target and target not in names:  # `import fuser.ops.linear as x`
                    target = target.rpartition(".")[0]
                if target and target != name:
                    graph[name].add(target)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The graph's strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for succ in sorted(graph[node]):
            if succ not in index:
                visit(succ)
                low[node] = min(low[node], low[succ])
            elif succ in on_stack:
                low[node] = min(low[node], index[succ])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_the_graph_sees_the_imports() -> None:
    graph = import_graph()
    assert "fuser.ops.gemv_tables" in graph["fuser.ops.linear"]
    assert "fuser.engine" in graph["fuser.runtime.scheduler"]  # under TYPE_CHECKING
    assert "fuser.ops.linear" in graph["fuser.ops.fp8_linear"]
    assert "fuser.ops.gemv_tables" in graph["fuser.passes.linear"]


def test_a_cycle_is_found() -> None:
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_cycles() -> None:
    found = cycles(import_graph())
    assert not found, "import cycles: " + "; ".join(" <-> ".join(c) for c in found)


# What `fuser serve ENGINE_DIR` imports before it loads: the `fuser` command, the serve entry
# point, the HTTP app and its runner, and the load path (fuser.load and what it reads with).
SERVE_MODULES = ["fuser.cli", "fuser.server.cli", "fuser.server.app", "fuser.server.runner",
                 "fuser.launch", "fuser.pipeline", "fuser.engine_io", "fuser.engine_file",
                 "fuser.kernel_store"]
# What serving a loaded engine does not need at import: sympy (through torch.fx's
# symbolic_shapes: seconds), Dynamo and Inductor (a load imports Inductor's artifact loading on
# a thread, only where a step was compiled), and transformers (the engine directory's
# tokenizer loads on the load's thread).
NOT_IMPORTED = ["sympy", "torch.fx.experimental.symbolic_shapes", "torch._dynamo",
                "torch._inductor", "transformers"]
IMPORTED = """
import importlib, json, sys
for name in sys.argv[1:]:
    importlib.import_module(name)
print(json.dumps(sorted(sys.modules)))
"""


def test_serving_imports_no_compiler() -> None:
    """Importing what `fuser serve ENGINE_DIR` runs before its load imports none of
    NOT_IMPORTED, in a fresh interpreter (an import of this process's tests may have)."""
    import json
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", IMPORTED, *SERVE_MODULES],
                          capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    modules = set(json.loads(done.stdout.strip().splitlines()[-1]))
    assert set(SERVE_MODULES) <= modules  # the check sees the imports
    assert "torch" in modules and "fastapi" in modules
    found = sorted(name for name in NOT_IMPORTED if name in modules)
    assert not found, f"importing {SERVE_MODULES} imports {found}"
