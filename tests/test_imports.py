"""The package's structure, read from its source with ``ast`` (nothing is imported).

* No import cycle between modules inside ``rollstream``. Every import counts: at module
  level, inside a function (a lazy import is still a dependency; deferring it only hides a
  cycle until the first call) and under ``if TYPE_CHECKING:`` (a type-only import still ties
  the two modules' definitions together, and a checker resolves it). Where two modules need
  each other, a lower module or a registry breaks the cycle. A package's ``__init__`` is a
  module like any other: ``import rollstream.x.y`` runs ``rollstream.x`` first, but that
  implicit edge is not counted (else every package would be a cycle with its children).
* No ``print(`` outside the command line (``cli.py``, ``agent/proxy_cli.py``), the progress
  line (``monitor/progress.py``) and the benchmarks' tables (``bench/``): everything else a
  user should see goes through the package logger (``logging.getLogger("rollstream...")``),
  which the CLI configures (``--log-level``).
"""

from __future__ import annotations

import ast
from pathlib import Path

import rollstream

PACKAGE = Path(rollstream.__file__).resolve().parent
PRINT_ALLOWED = ("cli.py", "agent/proxy_cli.py", "monitor/progress.py", "bench/")


def _modules(package: Path) -> dict[str, tuple[Path, bool]]:
    """Dotted module name -> (file, is a package's ``__init__``)."""
    out = {}
    for path in sorted(package.rglob("*.py")):
        parts = list(path.relative_to(package.parent).with_suffix("").parts)
        is_init = parts[-1] == "__init__"
        out[".".join(parts[:-1] if is_init else parts)] = (path, is_init)
    return out


def import_graph(package: Path = PACKAGE) -> dict[str, set[str]]:
    """Module -> the package's modules it imports, wherever the import statement is."""
    mods = _modules(package)
    top = package.name

    def owner(name: str) -> str | None:  # the module that defines ``name``
        while name and name not in mods:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, set[str]] = {m: set() for m in mods}
    for mod, (path, is_init) in mods.items():
        package = mod if is_init else mod.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join([*up, *([node.module] if node.module else [])])
                # `from a import b` imports the module a.b when there is one, else a
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in mods else base
                           for a in node.names]
            for target in targets:
                found = owner(target) if target.split(".")[0] == top else None
                if found is not None and found != mod:
                    graph[mod].add(found)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
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
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def _check_the_checker(tmp_path: Path) -> None:
    """A lazy, a type-only and a relative import are all edges (on a package made here)."""
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    for name, text in {
        "__init__.py": "",
        "a.py": "from pkg import b\n",  # module level: a -> b
        "b.py": "def f():\n    from pkg.sub.c import g\n",  # lazy: b -> sub.c
        "sub/__init__.py": "from .c import g\n",  # relative: sub -> sub.c
        "sub/c.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                    "    from ..a import x\n",  # type-only and relative: sub.c -> a
        "d.py": "import pkg.a\nimport os\n",  # into the cycle, not part of it
    }.items():
        (pkg / name).write_text(text)
    graph = import_graph(pkg)
    assert graph["pkg.sub.c"] == {"pkg.a"} and graph["pkg.b"] == {"pkg.sub.c"}
    assert cycles(graph) == [["pkg.a", "pkg.b", "pkg.sub.c"]]
    (pkg / "b.py").write_text("")
    assert cycles(import_graph(pkg)) == []


def test_no_import_cycle_inside_the_package(tmp_path: Path):
    _check_the_checker(tmp_path)
    graph = import_graph()
    found = cycles(graph)
    detail = [" <-> ".join(c) + "  (" + "; ".join(
        f"{m} -> {', '.join(sorted(graph[m] & set(c)))}" for m in c) + ")" for c in found]
    assert not found, "import cycles:\n" + "\n".join(detail)


def _prints(path: Path) -> list[int]:
    """Lines of ``print(...)`` calls (the builtin; a method such as ``console.print`` is not)."""
    tree = ast.parse(path.read_text(), str(path))
    return sorted(node.lineno for node in ast.walk(tree)
                  if isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
                  and node.func.id == "print")


def test_no_print_outside_the_cli_the_progress_line_and_the_bench_tables():
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE).as_posix()
        if rel.startswith(PRINT_ALLOWED):
            continue
        found += [f"{rel}:{line}" for line in _prints(path)]
    assert not found, ("print( outside the CLI, the progress line and the bench tables (use "
                       "the package logger):\n" + "\n".join(found))


def _warns(path: Path) -> list[int]:
    """Lines of ``warnings.warn(...)`` calls."""
    tree = ast.parse(path.read_text(), str(path))
    return sorted(node.lineno for node in ast.walk(tree)
                  if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                  and node.func.attr == "warn" and isinstance(node.func.value, ast.Name)
                  and node.func.value.id == "warnings")


def test_every_warning_goes_through_the_package_logger():
    """A user sees every warning the same way (``warning: ...`` on standard error, filtered by
    ``--log-level``): ``warnings.warn`` would bypass that, and be shown once per place."""
    found = [f"{path.relative_to(PACKAGE).as_posix()}:{line}"
             for path in sorted(PACKAGE.rglob("*.py")) for line in _warns(path)]
    assert not found, "warnings.warn( (use the package logger):\n" + "\n".join(found)
