"""Size guardrails of the product code: no module over 600 lines, no function over 120, unless
``tests/oversized.toml`` lists it with its reason; a listed one that is back under its bound must leave the list.

Modules and functions are read with ``ast`` (nothing is imported); generated protobuf code is left out. Lines
count as ``tools``' shape counts them: newlines in the file; a function's lines run from its ``def`` to its end.
"""

from __future__ import annotations

import ast
import re
import tomllib
from pathlib import Path

import pytest
from test_layering import package_dirs

ROOT = Path(__file__).resolve().parent.parent
MAX_MODULE_LINES = 600
MAX_FUNCTION_LINES = 120
LISTED = Path(__file__).with_name("oversized.toml")


def product_files() -> list[Path]:
    files: set[Path] = set()
    for folder in package_dirs().values():
        files.update(path for path in folder.rglob("*.py") if "_pb2" not in path.name)
    return sorted(files)


def oversized(files: list[Path], root: Path) -> tuple[dict[str, int], dict[str, int]]:
    """(module -> lines, "module:function" -> lines) of ``files`` over the bounds; names relative to ``root``."""
    modules: dict[str, int] = {}
    functions: dict[str, int] = {}
    for path in files:
        source = path.read_text(encoding="utf-8")
        name = path.relative_to(root).as_posix()
        if source.count("\n") > MAX_MODULE_LINES:
            modules[name] = source.count("\n")
        for node in ast.walk(ast.parse(source, str(path))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = (node.end_lineno or node.lineno) - node.lineno + 1
                if lines > MAX_FUNCTION_LINES:
                    functions[f"{name}:{node.name}"] = lines
    return modules, functions


def problems(found: tuple[dict[str, int], dict[str, int]], listed: dict[str, dict[str, str]]) -> list[str]:
    lines = []
    for kind, sizes, bound in (("modules", found[0], MAX_MODULE_LINES), ("functions", found[1], MAX_FUNCTION_LINES)):
        reasons = listed.get(kind, {})
        for name, size in sorted(sizes.items()):
            if not str(reasons.get(name, "")).strip():
                lines.append(f"{name}: {size} lines (bound {bound}); split it, or list it in {LISTED.name} with why")
        for name in sorted(set(reasons) - set(sizes)):
            lines.append(f"{name} is listed in {LISTED.name} [{kind}] but is within {bound} lines now: drop it")
    return lines


def test_product_code_within_its_size_bounds() -> None:
    listed = tomllib.loads(LISTED.read_text(encoding="utf-8"))
    found = oversized(product_files(), ROOT)
    assert not problems(found, listed), "\n".join(problems(found, listed))


def test_the_check_can_fail(tmp_path: Path) -> None:
    big = tmp_path / "big.py"
    body = "".join(f"    x{i} = {i}\n" for i in range(MAX_FUNCTION_LINES))
    big.write_text("def long():\n" + body + "\n" * MAX_MODULE_LINES, encoding="utf-8")
    found = oversized([big], tmp_path)
    assert found == ({"big.py": MAX_FUNCTION_LINES + MAX_MODULE_LINES + 1}, {"big.py:long": MAX_FUNCTION_LINES + 1})
    assert len(problems(found, {})) == 2
    assert problems(found, {"modules": {"big.py": "why"}, "functions": {"big.py:long": "why"}}) == []
    stale = problems(({}, {}), {"modules": {"gone.py": "why"}})
    assert stale and "drop it" in stale[0]


@pytest.mark.parametrize("kind", ["modules", "functions"])
def test_every_listed_entry_has_a_reason(kind: str) -> None:
    listed = tomllib.loads(LISTED.read_text(encoding="utf-8"))
    assert all(str(reason).strip() for reason in listed.get(kind, {}).values())


def unnamed_modules(package: Path) -> list[str]:
    """The modules of ``package`` that its ``__init__.py`` docstring (the package's map) does not name."""
    doc = ast.get_docstring(ast.parse((package / "__init__.py").read_text(encoding="utf-8"))) or ""
    modules = sorted(
        path.stem for path in package.glob("*.py") if not path.stem.startswith("__") and "_pb2" not in path.stem
    )
    return [name for name in modules if not re.search(rf"\b{re.escape(name)}\b", doc)]


def test_every_package_map_names_its_modules() -> None:
    """A newcomer reads a package's ``__init__.py`` first: each module is named there with what it holds."""
    packages = sorted({path.parent for path in product_files() if (path.parent / "__init__.py").exists()})
    missing = {str(p.relative_to(ROOT)): unnamed_modules(p) for p in packages if unnamed_modules(p)}
    assert not missing, f"modules their package's __init__.py docstring does not name: {missing}"


def test_the_package_map_check_can_fail(tmp_path: Path) -> None:
    (tmp_path / "__init__.py").write_text('"""- ``known``: a module."""\n', encoding="utf-8")
    for name in ("known", "new_one"):
        (tmp_path / f"{name}.py").write_text("", encoding="utf-8")
    assert unnamed_modules(tmp_path) == ["new_one"]
