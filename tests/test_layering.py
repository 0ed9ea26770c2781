"""The import graph, read from the source (ast), type-checking-only imports aside:

- no import cycle at run time among the project's modules (an import inside a function
  counts: it runs when the function does);
- in backend/, no two folders import each other, and the folders' order holds: a folder
  imports only folders below it (LAYERS), so shared data sits below the code that drives it.
"""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("backend", "openai_frontend", "launcher")

# backend's folders, bottom first: each may import only the folders listed before it.
LAYERS = (
    "contract",  # the wire: pure data, both processes
    "settings",  # EngineConfig (the environment) and MODEL.toml
    "types",  # Sequence, the step, SamplingRow, ModelConfig
    "kernels",  # the C++ kernels, their build, their wrappers
    "kv",  # the KV block pool and the prefix cache
    "vision",  # vision requests' state, the encoder cache, M-RoPE
    "lora",  # adapters: files, registry, lanes, the batched delta
    "sampling",  # the sampler, logprobs, grammars
    "guards",  # thinking, loops, tools, deadlines
    "beams",  # beam search
    "runner",  # the model forwards, attention, quantization, the loader
    "speculation",  # proposers and the speculator
    "core",  # the engine and the scheduler
    "serving",  # the threads that serve the engine to Triton
)


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _type_checking_nodes(tree: ast.AST) -> set[int]:
    inside: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            inside.update(id(n) for stmt in node.body for n in ast.walk(stmt))
    return inside


def _targets(node: ast.AST, module: str, is_package: bool, known: set[str]) -> list[str]:
    """The project modules an import statement loads: `from a import b` loads a.b when it
    is a module, else a."""
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    if not isinstance(node, ast.ImportFrom):
        return []
    if node.level:
        base = module.split(".") if is_package else module.split(".")[:-1]
        base = base[: len(base) - node.level + 1]
        source = ".".join(base + ([node.module] if node.module else []))
    else:
        source = node.module or ""
    out = []
    for alias in node.names:
        sub = f"{source}.{alias.name}"
        out.append(sub if sub in known else source)
    return out


def import_graph() -> dict[str, set[str]]:
    files = [p for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py")]
    known = {_module_name(p) for p in files}
    graph: dict[str, set[str]] = defaultdict(set)
    for path in files:
        module, tree = _module_name(path), ast.parse(path.read_text(), str(path))
        skip = _type_checking_nodes(tree)
        for node in ast.walk(tree):
            if id(node) in skip:
                continue
            for target in _targets(node, module, path.name == "__init__.py", known):
                if target in known and target != module:
                    graph[module].add(target)
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan's, iteratively)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is None:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
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
            elif child not in index:
                index[child] = low[child] = len(index)
                stack.append(child)
                on_stack.add(child)
                work.append((child, iter(sorted(graph.get(child, ())))))
            elif child in on_stack:
                low[node] = min(low[node], index[child])
    return found


def _folder(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if parts[0] == "backend" and len(parts) > 2 else None


def folder_edges(graph: dict[str, set[str]]) -> set[tuple[str, str]]:
    edges = set()
    for module, targets in graph.items():
        for target in targets:
            a, b = _folder(module), _folder(target)
            if a and b and a != b:
                edges.add((a, b))
    return edges


def test_no_import_cycle_at_run_time():
    assert _cycles(import_graph()) == []


def test_backend_folders_import_only_folders_below_them():
    edges = folder_edges(import_graph())
    folders = {p.name for p in (ROOT / "backend").iterdir() if (p / "__init__.py").exists()}
    assert folders == set(LAYERS), f"folders not placed in LAYERS: {folders ^ set(LAYERS)}"
    two_way = sorted((a, b) for a, b in edges if (b, a) in edges and a < b)
    assert two_way == [], f"folders importing each other: {two_way}"
    upward = sorted((a, b) for a, b in edges if LAYERS.index(b) > LAYERS.index(a))
    assert upward == [], f"imports of a folder above: {upward}"


def test_the_checks_see_a_cycle():
    """The detectors themselves: a planted cycle and a planted upward import are found."""
    graph = {"backend.a.x": {"backend.b.y"}, "backend.b.y": {"backend.a.z"}, "backend.a.z": {"backend.a.x"}}
    assert _cycles(graph) == [["backend.a.x", "backend.a.z", "backend.b.y"]]
    assert folder_edges(graph) == {("a", "b"), ("b", "a")}
