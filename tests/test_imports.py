"""The package's modules import one way: no circle among them, counting imports inside functions
and those only for the type checker, and the folders in one order (``ml``, then ``model``, then
``inference``, then ``cmd``: each imports only the ones before it)."""

from __future__ import annotations

import ast
from pathlib import Path

import llama_chat

ROOT = Path(llama_chat.__file__).parent
PACKAGE = "llama_chat"
FOLDERS = ("ml", "model", "inference", "cmd")
OUTSIDE = {"tests", "benchmarks", "scripts"}


def modules() -> dict[str, Path]:
    found = {}
    for path in ROOT.rglob("*.py"):
        parts = path.relative_to(ROOT).with_suffix("").parts
        if parts[0] in OUTSIDE or any(part.endswith(".egg-info") for part in parts):
            continue
        if parts[-1] == "__init__":
            parts = parts[:-1]
        found[".".join((PACKAGE, *parts))] = path
    return found


def import_graph() -> dict[str, set[str]]:
    """Each module's imports of the package's own modules, wherever in it they are written."""
    found = modules()
    graph: dict[str, set[str]] = {name: set() for name in found}
    for name, path in found.items():
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                named = [node.module, *(f"{node.module}.{alias.name}" for alias in node.names)]
            elif isinstance(node, ast.Import):
                named = [alias.name for alias in node.names]
            else:
                continue
            graph[name] |= {other for other in named if other in found and other != name}
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected parts of more than one module (Tarjan's algorithm, iteratively)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, edges = work[-1]
            for other in edges:
                if other not in index:
                    index[other] = low[other] = len(index)
                    stack.append(other)
                    on_stack.add(other)
                    work.append((other, iter(sorted(graph[other]))))
                    break
                if other in on_stack:
                    low[node] = min(low[node], index[other])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    part = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        part.append(member)
                        if member == node:
                            break
                    if len(part) > 1:
                        found.append(sorted(part))
    return found


def folder(name: str) -> str | None:
    parts = name.split(".")
    return parts[1] if len(parts) > 2 and parts[1] in FOLDERS else None


def test_no_module_imports_itself_through_others():
    assert circles(import_graph()) == []


def test_the_finder_sees_a_circle_through_a_function_body():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert circles(graph) == [["a", "b", "c"]]
    assert circles({"a": {"b"}, "b": set()}) == []


def test_the_folders_import_one_way():
    backwards = sorted((name, other) for name, imported in import_graph().items() for other in imported
                       if folder(name) and folder(other)
                       and FOLDERS.index(folder(other)) > FOLDERS.index(folder(name)))
    assert backwards == []


def test_the_graph_holds_imports_inside_functions_and_for_the_type_checker():
    graph = import_graph()
    # serve_app names the registry only for the type checker; serve.py imports the routes in full.
    assert "llama_chat.cmd.models" in graph["llama_chat.cmd.serve_app"]
    assert "llama_chat.cmd.embeddings_api" in graph["llama_chat.cmd.serve"]
