"""The planes' dependency rule, read from the source: data flows env_servers -> actors -> stream -> learner ->
weights -> actors, so no plane imports one downstream of it, and inside common/ the stream and the weight sync
know nothing of each other. Any import counts, also one inside a function: a lazy import is still a
dependency a reader must follow."""
from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PLANES = ("common", "env_servers", "actors", "learner", "deploy")
# what each plane (common: each of its parts) may import besides itself
ALLOWED = {
    "env_servers": {"common"},
    "actors": {"common", "env_servers"},
    "learner": {"common"},
    "deploy": {"common", "env_servers", "actors", "learner"},
    "common.stream": {"common.config", "common.processes", "common.redaction"},
    "common.weights": {"common.config", "common.processes", "common.atomic_write"},
    "common.processes": set(),
}


def plane_of(module: str) -> str:
    parts = module.split(".")
    return ".".join(parts[:2]) if parts[0] == "common" else parts[0]


def imports() -> dict[str, set[str]]:
    """Each module of the project's packages -> the project modules it imports (at any depth)."""
    found: dict[str, set[str]] = defaultdict(set)
    for plane in PLANES:
        for path in (ROOT / plane).rglob("*.py"):
            module = ".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if isinstance(node, ast.Import):
                    names = [alias.name for alias in node.names]
                elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                    names = [node.module] + [f"{node.module}.{alias.name}" for alias in node.names]
                else:
                    continue
                found[module].update(n for n in names if n.split(".")[0] in PLANES)
    return found


def test_no_plane_imports_one_downstream_of_it():
    wrong = []
    for module, targets in imports().items():
        source = plane_of(module)
        allowed = ALLOWED.get(source)
        if allowed is None:          # common's single modules (config, run_dir, ...): common only
            allowed = {p for p in map(plane_of, targets) if p.startswith("common")} - {"common.stream",
                                                                                      "common.weights"}
        for target in targets:
            plane = plane_of(target)
            if plane != source and plane not in allowed and plane.split(".")[0] not in allowed:
                wrong.append(f"{module} imports {target}")
    assert not wrong, "imports against the planes' direction:\n" + "\n".join(sorted(set(wrong)))


def test_planes_form_no_cycle():
    graph: dict[str, set[str]] = defaultdict(set)
    for module, targets in imports().items():
        graph[plane_of(module)].update(plane_of(t) for t in targets if plane_of(t) != plane_of(module))
    done: set[str] = set()

    def visit(node: str, path: tuple[str, ...]) -> None:
        assert node not in path, "planes import each other in a cycle: " + " -> ".join((*path, node))
        if node in done:
            return
        for nxt in graph.get(node, ()):
            visit(nxt, (*path, node))
        done.add(node)

    for node in list(graph):
        visit(node, ())
