"""How deep the constraint engine would recurse to compile a schema or grammar, measured before it
does.

llguidance compiles a chain of references (a rule that refers to the next, ``r0: "x0" | r1``; a
``$ref`` to a definition that holds the next ``$ref``) by recursion on the native stack of the
thread that calls it, one set of frames for each link, and a chain of a few thousand links
overflows it: the process dies of SIGSEGV, with no exception to catch. So a schema or grammar is
measured first, here, in Python and without recursion, and refused past ``MAX_GRAMMAR_DEPTH``
(ml/controls.py); what is left is compiled on a stack with room for several times that
(``ml/grammar_compile.py``).

The measure is an upper bound on any chain the engine can follow, whatever its order: the text
becomes a graph of nodes (a grammar's rules and terminals; a schema's objects and arrays, each
``$ref`` an edge to what it names), and its depth is the longest path through the graph's
strongly connected components, each counted at its size. A recursive rule (a JSON value that
holds values) is a small component; a chain of 3,000 rules is a path of 3,000.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from typing import Any
from urllib.parse import unquote

# A definition starts a line: ``name:``, ``?name:``, ``!name.2:`` (Lark) or ``name ::=`` (GBNF).
# Nothing else in either syntax starts a line with a name and a colon (JSON inside ``%json`` has
# quoted keys), so the bodies between definitions are exact.
_DEFINITION = re.compile(r"^[ \t]*[?!]?([A-Za-z_][A-Za-z0-9_-]*)(?:\.-?\d+)?[ \t]*(?:::=|:)", re.M)
# Any name in a body. Counting a name inside a string or a comment as a reference can only make
# the measure larger.
_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_-]*")
_EMBEDDED_SCHEMA = re.compile(r"%json\s*(?=\{)")


def longest_chain(edges: Sequence[Sequence[int]], weights: Sequence[int] | None = None) -> int:
    """The most nodes on a path of the graph ``edges`` (node ``i`` leads to each of
    ``edges[i]``), where a strongly connected component counts as all of its nodes: at least
    the longest simple path, so no depth-first walk of the graph goes deeper. ``weights``: what
    each node counts for (default 1). Iterative (Tarjan's components, then the longest path
    through them in the order they were found)."""
    count = len(edges)
    index = [-1] * count
    low = [0] * count
    on_stack = [False] * count
    component = [-1] * count
    sizes: list[int] = []
    stack: list[int] = []
    counter = 0
    for root in range(count):
        if index[root] >= 0:
            continue
        work = [(root, 0)]
        while work:
            node, child = work.pop()
            if child == 0:
                index[node] = low[node] = counter
                counter += 1
                stack.append(node)
                on_stack[node] = True
            if child < len(edges[node]):
                work.append((node, child + 1))
                nxt = edges[node][child]
                if index[nxt] < 0:
                    work.append((nxt, 0))
                elif on_stack[nxt]:
                    low[node] = min(low[node], index[nxt])
                continue
            if low[node] == index[node]:
                size = 0
                while True:
                    member = stack.pop()
                    on_stack[member] = False
                    component[member] = len(sizes)
                    size += 1 if weights is None else weights[member]
                    if member == node:
                        break
                sizes.append(size)
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[node])
    # Tarjan finds a component only after every component it leads to: in the order found, the
    # depth of each is known before the ones that lead to it.
    members: list[list[int]] = [[] for _ in sizes]
    for node in range(count):
        members[component[node]].append(node)
    depth = [0] * len(sizes)
    for c, nodes in enumerate(members):
        below = 0
        for node in nodes:
            for nxt in edges[node]:
                if component[nxt] != c:
                    below = max(below, depth[component[nxt]])
        depth[c] = sizes[c] + below
    return max(depth, default=0)


def grammar_depth(text: str) -> int:
    """The measure of a Lark or GBNF grammar: its rules and terminals, each leading to the names
    its body holds; a JSON schema embedded with ``%json`` adds its own depth."""
    found = list(_DEFINITION.finditer(text))
    names = {m.group(1): i for i, m in enumerate(found)}
    edges: list[list[int]] = []
    for i, m in enumerate(found):
        body = text[m.end():found[i + 1].start() if i + 1 < len(found) else len(text)]
        refs = set()
        for name in _NAME.findall(body):
            # GBNF names hold dashes, Lark's do not: ``a-b`` may be either one name or two.
            for part in (name, *name.split("-")):
                if part in names:
                    refs.add(names[part])
        edges.append(sorted(refs))
    return longest_chain(edges) + max(map(schema_depth, _embedded_schemas(text)), default=0)


def _embedded_schemas(text: str) -> list[Any]:
    decoder = json.JSONDecoder()
    schemas = []
    for m in _EMBEDDED_SCHEMA.finditer(text):
        try:
            schemas.append(decoder.raw_decode(text, m.end())[0])
        except (ValueError, RecursionError):
            pass  # not JSON: the engine refuses it before compiling anything
    return schemas


def schema_depth(schema: Any) -> int:
    """The measure of a parsed JSON schema: each object a node, leading to the objects it holds
    (arrays pass them on: the engine walks an ``anyOf``'s list in its object's frame), and a
    ``$ref`` to the node it names (a JSON pointer from the root or from a ``$id``, an
    ``$anchor``, or a ``$id`` itself)."""
    nodes: list[Any] = []
    at: dict[int, int] = {}  # id() of each object or array -> its node
    children: list[list[Any]] = []
    pending = [schema]
    while pending:
        value = pending.pop()
        if not isinstance(value, (dict, list)) or id(value) in at:
            continue
        at[id(value)] = len(nodes)
        nodes.append(value)
        inner = [v for v in (value.values() if isinstance(value, dict) else value) if isinstance(v, (dict, list))]
        children.append(inner)
        pending.extend(inner)
    bases = {v["$id"].rstrip("#"): v for v in nodes if isinstance(v, dict) and isinstance(v.get("$id"), str)}
    anchors = {v["$anchor"]: v for v in nodes if isinstance(v, dict) and isinstance(v.get("$anchor"), str)}
    edges = []
    for value, inner in zip(nodes, children):
        out = [at[id(v)] for v in inner]
        ref = value.get("$ref") if isinstance(value, dict) else None
        if isinstance(ref, str):
            target = _resolve(ref, schema, bases, anchors)
            if isinstance(target, (dict, list)) and id(target) in at:
                out.append(at[id(target)])
        edges.append(out)
    return longest_chain(edges, [int(isinstance(v, dict)) for v in nodes])


def _resolve(ref: str, root: Any, bases: dict[str, Any], anchors: dict[str, Any]) -> Any:
    base, _, fragment = ref.partition("#")
    start = bases.get(base, root if not base else None)
    if start is None:
        return None
    if not fragment.startswith("/"):
        return anchors.get(unquote(fragment)) if fragment else start
    value = start
    for token in fragment[1:].split("/"):
        token = unquote(token).replace("~1", "/").replace("~0", "~")
        if isinstance(value, dict):
            value = value.get(token)
        elif isinstance(value, list) and token.isdigit() and int(token) < len(value):
            value = value[int(token)]
        else:
            return None
    return value


__all__ = ["grammar_depth", "longest_chain", "schema_depth"]
