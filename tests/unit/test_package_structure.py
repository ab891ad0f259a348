"""The package's shape: no import cycles among finetune's modules, counting the
imports inside functions (a cycle there is one edit away from an import-time
failure, and says that two modules each need the other), and the light modules
the command line reads before any heavy library stay light."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def module_name(path: Path, root: Path) -> str:
    parts = path.relative_to(root.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported(node: ast.AST, importer: str, is_package: bool) -> list[str]:
    """The modules an import statement names (and `from M import N`'s N, which may be a module)."""
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    if node.level:  # relative: from the importer's package
        package = importer.split(".")[: None if is_package else -1]
        base = ".".join(package[: len(package) - node.level + 1] + ([node.module] if node.module else []))
    else:
        base = node.module
    return [base, *(f"{base}.{alias.name}" for alias in node.names)]


def import_graph(root: Path) -> dict[str, set[str]]:
    """Each module of the package under `root` -> the package's modules it imports
    anywhere (with the packages above each, whose __init__ runs first), but
    under `if TYPE_CHECKING:`."""
    paths = {module_name(path, root): path for path in root.rglob("*.py")}
    graph = {}
    for name, path in paths.items():
        tree = ast.parse(path.read_text(encoding="utf-8"))
        checking_only = {id(n) for node in ast.walk(tree) if isinstance(node, ast.If)
                         and "TYPE_CHECKING" in ast.unparse(node.test) for n in ast.walk(node)}
        targets = set()
        for node in ast.walk(tree):
            if isinstance(node, (ast.Import, ast.ImportFrom)) and id(node) not in checking_only:
                for target in imported(node, name, path.name == "__init__.py"):
                    parts = target.split(".")
                    targets |= {".".join(parts[:i]) for i in range(2, len(parts) + 1)}
        graph[name] = {t for t in targets if t in paths and t != name and not name.startswith(t + ".")}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for other in sorted(graph[node]):
            if other not in index:
                visit(other)
                low[node] = min(low[node], low[other])
            elif other in stack:
                low[node] = min(low[node], index[other])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_finetune_has_no_import_cycles():
    graph = import_graph(REPO / "finetune")
    assert len(graph) > 50 and "finetune.config" in graph["finetune.cli"]  # the graph is read, not empty
    assert cycles(graph) == []


def test_a_cycle_through_a_function_local_import_is_found(tmp_path):
    package = tmp_path / "pkg"
    (package / "sub").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "sub" / "__init__.py").write_text("")
    (package / "a.py").write_text("from pkg.sub import b\n")
    (package / "sub" / "b.py").write_text("def f():\n    from .. import c\n")
    (package / "c.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg import d\n"
                                  "import pkg.a\n")
    (package / "d.py").write_text("import pkg.c\n")  # c -> d only for type checkers: no cycle
    assert cycles(import_graph(package)) == [["pkg.a", "pkg.c", "pkg.sub.b"]]


def test_the_command_line_and_the_registries_import_no_heavy_library():
    light = ("finetune.cli", "finetune.config", "finetune.objectives", "finetune.peft", "finetune.tasks",
             "finetune.models.attention")
    code = (f"import sys\nfor name in {light!r}:\n    __import__(name)\n"
            "print(sorted(m for m in ('torch', 'transformers', 'datasets', 'accelerate', 'numpy') if m in sys.modules))")
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip() == "[]"
