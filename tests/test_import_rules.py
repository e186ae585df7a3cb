"""The dependency rules of the layout, checked on the source: one direction between roles, no cycles.

``sidecar`` knows nothing of ``replicator``; ``replicator`` knows nothing of ``controller_client``; generated
stubs depend on nothing of ours. Inside ``replicator/`` the floors (:data:`REPLICATOR_FLOORS`) are climbed one
way: at most one import runs from a lower floor up to a higher one (STYLE.md 22). Function-level (lazy) imports
count too: they are edges all the same.
"""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("sidecar", "replicator", "controller_client", "mtc_rpc")
FORBIDDEN = {
    "sidecar": ("replicator", "controller_client"),
    "replicator": ("controller_client",),
    "mtc_rpc": ("sidecar", "replicator", "controller_client"),
}
# replicator/'s floors, bottom up. A module stands on the floor of its longest listed prefix; an unlisted one
# on the top floor (the daemon: heartbeat, fetch, backup, options, Orbax mode, main).
REPLICATOR_FLOORS: tuple[tuple[str, ...], ...] = (
    # the ground floor: the vocabulary every role speaks, and the transport
    ("replicator.tiers", "replicator.net"),
    # a host's tiers and their plumbing: RAM disk, peers, erasure coding, the Orbax store and handshake clock,
    # metrics, tasks; and the host's rules with its coordinator (pure: the heartbeat and the simulation's hosts both call them)
    ("replicator.tier_wire", "replicator.local", "replicator.peer", "replicator.erasure", "replicator.orbax.store",
     "replicator.orbax.contract", "replicator.restore_phases", "replicator.orbax.handshake_clock",
     "replicator.metrics", "replicator.tasks", "replicator.host_protocol"),
    # the global view
    ("replicator.coordinator",),
)
# The imports allowed up a floor, each with its reason (at most one).
UPWARD_ALLOWED = {
    # a parity holding carries its code group: the erasure tier's value type, pure, but in erasure/
    ("replicator.tiers", "replicator.erasure.wire"),
}


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(REPO).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _graph() -> dict[str, set[str]]:
    modules = {_module_name(p): p for pkg in PACKAGES for p in (REPO / pkg).rglob("*.py")}
    graph: dict[str, set[str]] = {m: set() for m in modules}
    for mod, path in modules.items():
        is_pkg = path.name == "__init__.py"
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names: list[str] = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = mod.split(".") if is_pkg else mod.split(".")[:-1]
                    base = base[: len(base) - node.level + 1]
                    prefix = ".".join(base + ([node.module] if node.module else []))
                else:
                    prefix = node.module or ""
                names = [prefix] + [f"{prefix}.{a.name}" for a in node.names]
            for name in names:
                # the longest known module the name refers to
                while name and name not in modules:
                    name = name.rpartition(".")[0]
                if name and name != mod:
                    graph[mod].add(name)
    return graph


def test_roles_depend_one_way() -> None:
    bad = [
        f"{m} imports {d}"
        for m, deps in _graph().items()
        for d in deps
        if d.split(".")[0] in FORBIDDEN.get(m.split(".")[0], ())
    ]
    assert not bad, "\n".join(sorted(bad))


def _floor(module: str) -> int:
    best, floor = "", len(REPLICATOR_FLOORS)
    for i, prefixes in enumerate(REPLICATOR_FLOORS):
        for p in prefixes:
            if (module == p or module.startswith(p + ".")) and len(p) > len(best):
                best, floor = p, i
    return floor


def _upward_imports(graph: dict[str, set[str]]) -> set[tuple[str, str]]:
    """Imports inside replicator/ from a lower floor up to a higher one. A package a module sits in is not an
    edge of its own (``from replicator.orbax import contract`` imports ``replicator.orbax.contract``)."""
    return {(m, d) for m, deps in graph.items() if m.startswith("replicator.")
            for d in deps if d.startswith("replicator.") and not m.startswith(d + ".") and _floor(d) > _floor(m)}


def test_replicator_floors_are_climbed_one_way() -> None:
    assert len(UPWARD_ALLOWED) <= 1
    up = _upward_imports(_graph())
    extra = sorted(up - UPWARD_ALLOWED)
    assert not extra, "imports up a floor of replicator/ (a word in the wrong room?):\n" + "\n".join(
        f"{m} (floor {_floor(m)}) imports {d} (floor {_floor(d)})" for m, d in extra)


def test_the_floors_name_modules_that_exist() -> None:
    modules = _graph()
    missing = [p for floor in REPLICATOR_FLOORS for p in floor
               if not any(m == p or m.startswith(p + ".") for m in modules)]
    assert not missing, missing


def test_the_hosts_rules_are_pure() -> None:
    """``replicator.host_protocol`` imports no I/O, threads or clocks (STYLE.md 16, 20): only the vocabulary,
    the wire and the standard library's types."""
    allowed = {"replicator.tiers", "replicator.tier_wire", "mtc_rpc.coordinator_pb2", "mtc_rpc.tier_pb2", "mtc_rpc"}
    deps = _graph()["replicator.host_protocol"]
    assert deps <= allowed, sorted(deps - allowed)
    tree = ast.parse((REPO / "replicator" / "host_protocol.py").read_text())
    stdlib = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names} | {
        n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module and not n.level}
    impure = {"os", "time", "threading", "socket", "grpc", "random", "pathlib", "subprocess", "logging"}
    assert not stdlib & impure, sorted(stdlib & impure)


def test_no_import_cycles() -> None:
    graph = _graph()
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []

    def strongconnect(v: str) -> None:  # Tarjan's strongly connected components
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                strongconnect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                cycles.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            strongconnect(v)
    # A package's __init__ re-exporting its own modules is not a cycle between modules.
    real = [c for c in cycles if not all(m.startswith(min(c, key=len) + ".") or m == min(c, key=len) for m in c)]
    assert not real, real
