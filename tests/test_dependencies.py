"""Every distribution the code imports is declared in pyproject.toml.

A fresh install (``.ci/run``) finds a missing dependency only when nothing else happens to bring it
in: ``regex`` comes with ``tiktoken``, ``numpy`` with ``transformers``. This reads the imports
themselves, so an undeclared one fails here on any machine that has it installed.
"""

from __future__ import annotations

import ast
import fnmatch
import re
import sys
import tomllib
from importlib import metadata
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent  # the repository root is the llama_chat package
PACKAGE_FILES = [ROOT / "__init__.py", *(p for d in ("cmd", "inference", "model", "ml")
                                       for p in sorted((ROOT / d).rglob("*.py")))]
TEST_FILES = sorted((ROOT / "tests").glob("*.py"))
# First-party names: the package, the tests' helper modules, the default model's scripts.
LOCAL = {"llama_chat", "default_model", *(p.stem for p in TEST_FILES)}


def _name(requirement: str) -> tuple[str, set[str]]:
    """``"anyio[trio]>=4; python_version < '4'"`` -> ``("anyio", {"trio"})``, name normalized."""
    m = re.match(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)\s*(?:\[([^\]]*)\])?", requirement)
    assert m, requirement
    extras = {e.strip() for e in (m.group(2) or "").split(",") if e.strip()}
    return _normalize(m.group(1)), extras


def _normalize(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _provided(requirements: list[str]) -> set[str]:
    """The distributions a list of requirements brings in directly, with the extras they name."""
    out: set[str] = set()
    for req in requirements:
        name, extras = _name(req)
        out.add(name)
        for sub in (metadata.requires(name) or []) if extras else []:
            if any(re.search(rf"extra\s*==\s*['\"]{re.escape(e)}['\"]", sub) for e in extras):
                out.add(_name(sub)[0])
    return out


def _imports(files: list[Path]) -> dict[str, str]:
    """Top-level module name -> the first file that imports it (``import x``, ``from x import``,
    ``pytest.importorskip("x")``); relative imports and the standard library left out."""
    found: dict[str, str] = {}
    for path in files:
        tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
        for node in ast.walk(tree):
            names: list[str] = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                  and node.func.attr == "importorskip" and node.args
                  and isinstance(node.args[0], ast.Constant)):
                names = [node.args[0].value]
            for name in names:
                top = name.split(".")[0]
                if top not in sys.stdlib_module_names and top not in LOCAL and top != "__future__":
                    found.setdefault(top, str(path.relative_to(ROOT)))
    return found


def _undeclared(modules: dict[str, str], declared: set[str]) -> list[str]:
    """The imported modules that no declared distribution provides (or none installed does)."""
    by_module = metadata.packages_distributions()
    return [f"{module} (imported in {where}; provided by {by_module.get(module) or 'nothing installed'})"
            for module, where in sorted(modules.items())
            if not {_normalize(d) for d in by_module.get(module, [])} & declared]


def _project() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]


def test_every_package_import_is_a_declared_dependency():
    declared = _provided(_project()["dependencies"])
    missing = _undeclared(_imports(PACKAGE_FILES), declared)
    assert not missing, f"add to [project] dependencies in pyproject.toml: {missing}"


def test_every_test_import_is_declared_in_the_test_extra():
    project = _project()
    declared = _provided(project["dependencies"]) | _provided(project["optional-dependencies"]["test"])
    missing = _undeclared(_imports(TEST_FILES), declared)
    assert not missing, f"add to the test extra in pyproject.toml: {missing}"


def test_the_import_scan_sees_what_it_should():
    # Guards the scan itself: an empty or broken one would pass the two tests above.
    assert {"torch", "anyio", "typer", "rich"} <= set(_imports(PACKAGE_FILES))
    assert {"pytest", "hypothesis", "regex", "trio"} <= set(_imports(TEST_FILES))


def test_the_operators_sources_are_package_data():
    # The CPU operator is built from these files on first use: a wheel without one of them (a new
    # source file not added to the package data) could not build it on a fresh install.
    from llama_chat.ml.cpu import kernels as cpu_kernels

    patterns = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["tool"]["setuptools"][
        "package-data"]["llama_chat.ml.cpu"]
    for path in (*cpu_kernels.SOURCES, *cpu_kernels.HEADERS):
        assert any(fnmatch.fnmatch(path.name, p) for p in patterns), f"add {path.name} to the package data"
