"""The import layering of the product packages, checked over their real imports.

Every module under the packages named in pyproject's ``[tool.setuptools.package-dir]`` is parsed with ``ast``
(nothing is imported). Each ``import`` is classed as eager (module level), lazy (inside a function) or typing
(under ``if TYPE_CHECKING:``); relative imports are resolved. The rules hold for all three kinds:

- ``proto`` and ``runtime`` import nothing of primerl outside themselves;
- ``client`` imports only ``proto`` and ``runtime``; ``configs`` only ``proto``, ``runtime`` and itself;
- no role (broker, trainer, inference, orchestrator) imports another role, ``configs`` excepted;
- ``cli`` and ``supervisor`` may import anything;
- the eager imports between modules form no cycle.
"""

from __future__ import annotations

import ast
import functools
import tomllib
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
ROLES = ("broker", "trainer", "inference", "orchestrator")
FOUNDATION = ("proto", "runtime")

# package (the first name after "primerl.") -> the packages it may import besides itself.
ALLOWED: dict[str, tuple[str, ...]] = {
    "proto": (),
    "runtime": (),
    "client": FOUNDATION,
    "configs": FOUNDATION,
    **{role: (*FOUNDATION, "client", "configs") for role in ROLES},
    "dashboard": (*FOUNDATION, "client"),  # a read-only client of a run: its files and the broker's gRPC
    "slurm": (*FOUNDATION, "client", "configs", "supervisor"),  # a launcher beside `primerl rl`'s: its run files
}
UNRESTRICTED = ("cli", "supervisor", "")  # "" is the top package, primerl itself (its __main__ runs the CLI)


@dataclass(frozen=True)
class Import:
    importer: str  # dotted module name
    path: Path
    line: int
    imported: str  # dotted module name (or a name inside one; see resolve)
    kind: str  # "eager" | "lazy" | "typing"


@functools.cache
def package_dirs() -> dict[str, Path]:
    """Dotted package -> its folder, from pyproject (a package the test does not know fails the rules check)."""
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    return {name: ROOT / folder for name, folder in pyproject["tool"]["setuptools"]["package-dir"].items()}


def product_modules() -> dict[str, Path]:
    """Dotted module name -> source file, for every module of the product (generated protobuf code included)."""
    modules: dict[str, Path] = {}
    for package, folder in package_dirs().items():
        for path in sorted(folder.rglob("*.py")):
            relative = path.relative_to(folder).with_suffix("")
            parts = [part for part in relative.parts if part != "__init__"]
            name = ".".join([package, *parts])
            modules.setdefault(name, path)  # a nested package (proto.v1) is listed under its own dir too
    return modules


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def module_imports(name: str, path: Path) -> list[Import]:
    """The primerl imports of one module, with their kind and line; relative imports resolved."""
    tree = ast.parse(path.read_text(), filename=str(path))
    is_package = path.name == "__init__.py"
    found: list[Import] = []

    def visit(node: ast.AST, kind: str) -> None:
        for child in ast.iter_child_nodes(node):
            child_kind = kind
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)) and kind == "eager":
                child_kind = "lazy"
            if isinstance(child, ast.If) and _is_type_checking(child.test):
                for inner in child.body:
                    visit_statement(inner, "typing")
                for inner in child.orelse:
                    visit_statement(inner, kind)
                continue
            visit_statement(child, child_kind)

    def visit_statement(node: ast.AST, kind: str) -> None:
        if isinstance(node, ast.Import):
            for alias in node.names:
                found.append(Import(name, path, node.lineno, alias.name, kind))
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = name.split(".") if is_package else name.split(".")[:-1]
                anchor = anchor[: len(anchor) - (node.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
            for alias in node.names:
                found.append(Import(name, path, node.lineno, f"{base}.{alias.name}" if base else alias.name, kind))
        visit(node, kind)

    visit(tree, "eager")
    return [item for item in found if item.imported == "primerl" or item.imported.startswith("primerl.")]


def resolve(imported: str, modules: dict[str, Path]) -> str:
    """The module an import names: `from primerl.x import y` is module primerl.x.y when that exists, else primerl.x."""
    while imported not in modules and "." in imported:
        imported = imported.rsplit(".", 1)[0]
    return imported


def package_of(module: str) -> str:
    """primerl.broker.spool -> "broker"; a module of the top package (primerl, primerl.__main__) -> ""."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and f"primerl.{parts[1]}" in package_dirs() else ""


def violation(item: Import, target: str) -> str | None:
    """Why this import breaks the layering, or None."""
    source, dest = package_of(item.importer), package_of(target)
    if source == dest or source in UNRESTRICTED:
        return None
    if source not in ALLOWED:
        return f"package {source!r} has no layering rule: add it to ALLOWED in tests/test_layering.py"
    if dest in ALLOWED[source]:
        return None
    if source in ROLES and dest in ROLES:
        return f"a role imports another role ({source} -> {dest})"
    if not ALLOWED[source]:
        return f"{source} imports nothing of primerl outside itself"
    return f"{source} may import only {', '.join(ALLOWED[source])} and itself"


def all_imports() -> tuple[dict[str, Path], list[Import]]:
    modules = product_modules()
    imports = [item for name, path in modules.items() for item in module_imports(name, path)]
    return modules, imports


def where(item: Import) -> str:
    path = item.path.relative_to(ROOT) if item.path.is_relative_to(ROOT) else item.path
    return f"{path}:{item.line}"


def layering_violations(modules: dict[str, Path], imports: list[Import]) -> list[str]:
    messages = []
    for item in imports:
        target = resolve(item.imported, modules)
        reason = violation(item, target)
        if reason:
            messages.append(f"{item.importer} ({where(item)}, {item.kind}) imports {target}: {reason}")
    return messages


def eager_cycles(modules: dict[str, Path], imports: list[Import]) -> list[list[str]]:
    """The strongly connected components (of more than one module) of the eager import graph (Tarjan)."""
    graph: dict[str, set[str]] = {name: set() for name in modules}
    for item in imports:
        target = resolve(item.imported, modules)
        if item.kind == "eager" and target != item.importer and target in graph:
            graph[item.importer].add(target)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []

    def connect(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for successor in sorted(graph[node]):
            if successor not in index:
                connect(successor)
                low[node] = min(low[node], low[successor])
            elif successor in on_stack:
                low[node] = min(low[node], index[successor])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                components.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            connect(node)
    return components


def cycle_message(component: list[str], imports: list[Import], modules: dict[str, Path]) -> str:
    members = set(component)
    edges = sorted(
        {
            f"  {item.importer} ({where(item)}) imports {resolve(item.imported, modules)}"
            for item in imports
            if item.kind == "eager" and item.importer in members and resolve(item.imported, modules) in members
        }
    )
    return "eager import cycle among " + ", ".join(component) + ":\n" + "\n".join(edges)


@pytest.fixture(scope="module")
def tree() -> tuple[dict[str, Path], list[Import]]:
    return all_imports()


def test_every_module_is_found(tree):
    modules, imports = tree
    assert len(modules) > 150, f"only {len(modules)} product modules found: is pyproject's package-dir read?"
    assert {"eager", "lazy", "typing"} <= {item.kind for item in imports}


def test_packages_import_only_their_layers(tree):
    messages = layering_violations(*tree)
    assert not messages, f"{len(messages)} imports break the layering:\n" + "\n".join(messages)


def test_no_cycle_among_eager_imports(tree):
    modules, imports = tree
    cycles = eager_cycles(modules, imports)
    assert not cycles, "\n".join(cycle_message(component, imports, modules) for component in cycles)


def test_a_planted_violation_is_reported(tmp_path):
    """The checker itself: a role importing another role, lazily and under TYPE_CHECKING, and an eager cycle."""
    role = tmp_path / "trainer_mod.py"
    role.write_text(
        "from typing import TYPE_CHECKING\n"
        "from . import sibling\n"
        "if TYPE_CHECKING:\n"
        "    from primerl.broker.spool import Spool\n"
        "def load():\n"
        "    from ..orchestrator import packing\n"
    )
    sibling = tmp_path / "sibling.py"
    sibling.write_text("import primerl.trainer.trainer_mod\n")
    modules = {
        "primerl.trainer.trainer_mod": role,
        "primerl.trainer.sibling": sibling,
        "primerl.broker.spool": role,
        "primerl.orchestrator.packing": role,
    }
    imports = module_imports("primerl.trainer.trainer_mod", role) + module_imports("primerl.trainer.sibling", sibling)
    kinds = {(item.imported, item.kind) for item in imports}
    assert ("primerl.broker.spool.Spool", "typing") in kinds
    assert ("primerl.orchestrator.packing", "lazy") in kinds
    assert ("primerl.trainer.sibling", "eager") in kinds
    messages = layering_violations(modules, imports)
    cycles = eager_cycles(modules, imports)
    assert len(messages) == 2 and all("a role imports another role" in message for message in messages), messages
    assert "trainer_mod.py:4" in messages[0] and "primerl.broker.spool" in messages[0]
    assert cycles == [["primerl.trainer.sibling", "primerl.trainer.trainer_mod"]]
