"""The shape DESIGN.md promises, read from the source with ``ast`` (nothing is imported).

Layers: ``protocol`` imports nothing of ours; ``gpu_workers`` and ``switch_nodes`` import only
``protocol``; ``luwu`` sits on top and nothing below imports it. Our code is always imported as
``luwu.protocol...``, ``luwu.switch_nodes...``, ``luwu.gpu_workers...``: a top-level ``protocol``
would load a second copy of the module under another name. Module-level imports form no cycle
(an import inside a function runs late, so it may close a loop, but it still follows the layers).
And the sizes: no module over 500 lines, no function over 80.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
#: folder -> the package name it is installed as (pyproject's package-dir)
FOLDERS = {
    "luwu": "luwu",
    "protocol": "luwu.protocol",
    "switch_nodes": "luwu.switch_nodes",
    "gpu_workers": "luwu.gpu_workers",
}
#: layer -> the layers it may import (its own always allowed)
ALLOWED = {
    "protocol": set(),
    "switch_nodes": {"protocol"},
    "gpu_workers": {"protocol"},
    "luwu": {"protocol", "switch_nodes", "gpu_workers"},
}
TOP_LEVEL_FORBIDDEN = {"protocol", "switch_nodes", "gpu_workers"}
MAX_MODULE_LINES = 500
MAX_FUNCTION_LINES = 80


@dataclass(frozen=True)
class Import:
    source: str  # importing module, e.g. luwu.switch_nodes.server
    target: str  # imported module as written and resolved, e.g. luwu.protocol.codecs
    line: int
    lazy: bool  # inside a function, or under `if TYPE_CHECKING:`: not run when the module loads
    path: Path

    def where(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line}"


def _module_files() -> dict[str, Path]:
    """Module name -> file, for every .py file under the four folders."""
    out = {}
    for folder, package in FOLDERS.items():
        for path in sorted((ROOT / folder).rglob("*.py")):
            parts = list(path.relative_to(ROOT / folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            out[".".join([package, *parts])] = path
    return out


MODULES = _module_files()


def layer(module: str) -> str | None:
    """Which layer a module name belongs to (None: not ours)."""
    for sub in ("protocol", "switch_nodes", "gpu_workers"):
        if module == f"luwu.{sub}" or module.startswith(f"luwu.{sub}."):
            return sub
    if module == "luwu" or module.startswith("luwu."):
        return "luwu"
    return None


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _resolve_relative(module: str, is_package: bool, level: int, name: str | None) -> str:
    base = module.split(".") if is_package else module.split(".")[:-1]
    if level > 1:
        base = base[: len(base) - (level - 1)]
    return ".".join(base + ([name] if name else []))


def _most_specific(name: str) -> str:
    """``luwu.protocol.codecs.get_codec`` -> ``luwu.protocol.codecs``: the longest prefix that is a module."""
    parts = name.split(".")
    for n in range(len(parts), 0, -1):
        if ".".join(parts[:n]) in MODULES:
            return ".".join(parts[:n])
    return name


def _walk(node: ast.AST, lazy: bool):
    """Every import node under ``node``, with whether it runs later than the module's own load."""
    for child in ast.iter_child_nodes(node):
        if isinstance(child, (ast.Import, ast.ImportFrom)):
            yield child, lazy
        elif isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            yield from _walk(child, True)
        elif isinstance(child, ast.If) and _is_type_checking(child.test):
            for stmt in child.body:
                yield from _walk(ast.Module(body=[stmt], type_ignores=[]), True)
            for stmt in child.orelse:
                yield from _walk(ast.Module(body=[stmt], type_ignores=[]), lazy)
        else:
            yield from _walk(child, lazy)


def imports_of(module: str, path: Path) -> list[Import]:
    """Every import in one module, resolved to absolute module names (relative ones too)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    is_package = path.name == "__init__.py"
    out = []
    for node, lazy in _walk(tree, False):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        else:
            base = (
                _resolve_relative(module, is_package, node.level, node.module)
                if node.level
                else node.module or ""
            )
            # `from pkg import sub` imports the submodule pkg.sub when there is one, else pkg itself
            targets = [
                base if alias.name == "*" else f"{base}.{alias.name}" for alias in node.names
            ]
        for target in dict.fromkeys(_most_specific(t) for t in targets):
            out.append(Import(module, target, node.lineno, lazy, path))
    return out


ALL_IMPORTS = [imp for module, path in MODULES.items() for imp in imports_of(module, path)]


def test_the_walk_sees_every_folder_and_kind_of_import():
    assert {layer(m) for m in MODULES} == set(ALLOWED)
    assert any(imp.lazy for imp in ALL_IMPORTS), (
        "no import inside a function found: the walk is broken"
    )
    assert any(
        layer(imp.target) == "protocol" and layer(imp.source) == "switch_nodes"
        for imp in ALL_IMPORTS
    )


def test_resolution_of_relative_and_from_imports():
    assert (
        _resolve_relative("luwu.switch_nodes.server", False, 1, "store")
        == "luwu.switch_nodes.store"
    )
    assert _resolve_relative("luwu.switch_nodes", True, 1, "store") == "luwu.switch_nodes.store"
    assert _resolve_relative("luwu.switch_nodes.server", False, 2, "protocol") == "luwu.protocol"
    assert (
        layer("luwu.protocol.codecs") == "protocol"
        and layer("luwu.cli") == "luwu"
        and layer("torch") is None
    )
    assert _most_specific("luwu.protocol.errors.LuwuError") == "luwu.protocol.errors"


def test_our_code_is_imported_only_as_luwu_dot_something():
    wrong = [
        f"{imp.where()}: {imp.target}"
        for imp in ALL_IMPORTS
        if imp.target.split(".")[0] in TOP_LEVEL_FORBIDDEN
    ]
    assert not wrong, "top-level imports of our folders (write luwu.<folder>...):\n" + "\n".join(
        wrong
    )


def test_imports_follow_the_layers():
    wrong = []
    for imp in ALL_IMPORTS:
        src, dst = layer(imp.source), layer(imp.target)
        if dst is None or dst == src:
            continue
        if dst not in ALLOWED[src]:
            wrong.append(
                f"{imp.where()}: {src} -> {dst} ({imp.source} imports {imp.target}"
                f"{', inside a function' if imp.lazy else ''})"
            )
    assert not wrong, "imports against DESIGN.md's direction:\n" + "\n".join(wrong)


def _cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index, low, on_stack, stack, out = {}, {}, set(), [], []
    counter = 0
    for root in sorted(edges):
        if root in index:
            continue
        work = [(root, iter(sorted(edges.get(root, ()))))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(edges.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                scc = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    scc.append(member)
                    if member == node:
                        break
                if len(scc) > 1:
                    out.append(sorted(scc))
    return out


def test_cycle_finder_finds_a_loop_and_only_loops():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_cycle_at_module_level():
    edges: dict[str, set[str]] = {m: set() for m in MODULES}
    for imp in ALL_IMPORTS:
        if not imp.lazy and imp.target in MODULES and imp.target != imp.source:
            edges[imp.source].add(imp.target)
    cycles = _cycles(edges)
    detail = []
    for scc in cycles:
        members = set(scc)
        arrows = [
            f"  {imp.where()}: {imp.source} -> {imp.target}"
            for imp in ALL_IMPORTS
            if not imp.lazy
            and imp.source in members
            and imp.target in members
            and imp.source != imp.target
        ]
        detail.append(" <-> ".join(scc) + "\n" + "\n".join(sorted(set(arrows))))
    assert not cycles, "module-level import cycles:\n" + "\n".join(detail)


def _long_functions(path: Path) -> list[tuple[str, int]]:
    tree = ast.parse(path.read_text(), filename=str(path))
    out = []

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                length = child.end_lineno - child.lineno + 1
                if length > MAX_FUNCTION_LINES:
                    out.append((f"{prefix}{child.name}", length))
                visit(child, f"{prefix}{child.name}.")
            elif isinstance(child, ast.ClassDef):
                visit(child, f"{prefix}{child.name}.")
            else:
                visit(child, prefix)

    visit(tree, "")
    return out


def test_the_sizes_are_measured_on_formatted_code():
    """Module and function sizes count lines as ``ruff format`` (pyproject's [tool.ruff], 100 columns)
    writes them: dense code that would grow past a limit once formatted fails here, not later."""
    files = [str(p) for p in MODULES.values()]
    done = subprocess.run(
        [sys.executable, "-m", "ruff", "format", "--check", *files],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, (
        "not formatted (run `ruff format .`, or `make lint` to see it as CI does):\n"
        + done.stdout[-3000:]
        + done.stderr[-2000:]
    )


def test_no_module_over_500_lines():
    long = sorted(
        ((len(p.read_text().splitlines()), p.relative_to(ROOT)) for p in MODULES.values()),
        reverse=True,
    )
    offenders = [f"{path}: {n} lines" for n, path in long if n > MAX_MODULE_LINES]
    assert not offenders, f"modules over {MAX_MODULE_LINES} lines:\n" + "\n".join(offenders)


def test_no_function_over_80_lines():
    offenders = [
        f"{path.relative_to(ROOT)}: {name} {n} lines"
        for path in MODULES.values()
        for name, n in _long_functions(path)
    ]
    assert not offenders, f"functions over {MAX_FUNCTION_LINES} lines:\n" + "\n".join(offenders)


#: the operations package (the node daemons' life on a host) and the modules that live in it
OPS = "luwu.ops"
OPS_MODULES = {"daemons", "supervisor", "rundir", "cluster_file", "monitor", "keyset"}


def _is_ops(module: str) -> bool:
    return module == OPS or module.startswith(OPS + ".")


def test_operations_live_under_luwu_ops_and_only_the_command_line_imports_them():
    """``luwu/`` holds what a training script imports; run dirs, supervisor, keys and status
    queries are ``luwu.ops``, loaded by the command line (``luwu.cli``) and by themselves only."""
    missing = sorted({f"{OPS}.{m}" for m in OPS_MODULES} - set(MODULES))
    assert not missing, f"operations modules missing from luwu/ops/: {missing}"
    stray = sorted(f"luwu.{m}" for m in OPS_MODULES if f"luwu.{m}" in MODULES)
    assert not stray, f"operations modules outside luwu/ops/: {stray}"
    cli = [imp for imp in ALL_IMPORTS if _is_ops(imp.target) and imp.source.startswith("luwu.cli")]
    assert cli, "no import of luwu.ops by luwu.cli found: the rule below would see nothing"
    wrong = [
        f"{imp.where()}: {imp.source} imports {imp.target}"
        for imp in ALL_IMPORTS
        if _is_ops(imp.target)
        and not _is_ops(imp.source)
        and not imp.source.startswith("luwu.cli.")
    ]
    assert not wrong, "luwu.ops imported outside the command line:\n" + "\n".join(wrong)


def test_every_package_folder_is_in_pyproject_packages():
    """setuptools ships only the listed packages: a folder left out installs without its modules."""
    import tomllib

    tool = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    packages = {m for m, path in MODULES.items() if path.name == "__init__.py"}
    missing = sorted(packages - set(tool["packages"]))
    assert not missing, f"package folders missing from pyproject's packages: {missing}"
