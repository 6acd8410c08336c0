"""The package's imports run downhill (STYLE.md rule 16) and form no loop.

Every module under `dapo_mega/` is parsed with `ast` (nothing is imported); every import of
a `dapo_mega` module, at the top of a file or inside a function, is an edge. Each module
sits on a floor, found by the longest prefix of its dotted name in FLOORS, so a file added
under a known package falls into its package's floor without touching this test. A module
may import from its own floor or below, never from above; and no set of modules may import
each other in a loop (lazy imports inside functions included: a loop that only closes at
run time is still one concept split in two). A failure names each offending edge as
`file:line  importer -> imported`.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Dict, List, Optional, Set, Tuple

import pytest

PACKAGE = "dapo_mega"
ROOT = Path(__file__).resolve().parents[1] / PACKAGE

FLOORS: Dict[str, int] = {
    # 0: pure pieces: tensor math, data, rewards, config, model shapes, run-directory files,
    #    distributed helpers. They know nothing of Megatron, SGLang or engines.
    "dapo_mega": 0,  # the package __init__ only; a new top-level module gets NEW_TOP_LEVEL_FLOOR
    "dapo_mega.algo": 0,
    "dapo_mega.data": 0,
    "dapo_mega.reward": 0,
    "dapo_mega.config": 0,
    "dapo_mega.models": 0,
    "dapo_mega.distributed": 0,
    "dapo_mega.run_files": 0,  # the run directory's files: checkpoint directories, run id, config history
    "dapo_mega.heap": 0,
    "dapo_mega.tether": 0,
    "dapo_mega.log": 0,
    "dapo_mega.aio": 0,
    "dapo_mega.node": 0,  # what a process reads of its machine (cores), settable by a twin
    "dapo_mega.plugins": 0,  # the one loader of the user's code the config names (rewards, environments)
    "dapo_mega.environments": 0,  # what multi-turn samples talk to: the environment interface, the sandbox
    # 1: backends: Megatron (model, layout, train step, sharded state), the placement, and
    #    SGLang's wire (API tables, endpoint, HTTP client, command lines; nothing imports sglang).
    "dapo_mega.backends": 1,
    "dapo_mega.wire": 1,  # what travels between learners and engines: weight transport formats, checksums
    "dapo_mega.engines.sglang": 1,
    # 2: weights: the HF <-> Megatron mapping, conversion and live sync, built on the backends.
    "dapo_mega.weights": 2,
    # 3: engines: the fleet that starts, attaches to and watches them, the embedded engine.
    "dapo_mega.engines": 3,
    # 4: rollout: the rollout manager, dispatch and its watchdog, dynamic sampling, samples.
    "dapo_mega.rollout": 4,
    # 5: components of a run and the commands' bodies.
    "dapo_mega.driver": 5,
    "dapo_mega.session": 5,
    "dapo_mega.evaluate": 5,
    "dapo_mega.records": 5,  # what a run writes: metrics, console line, curves, ledger, ledger report
    "dapo_mega.plan": 5,  # the planner, its Plan record, the run's clock, the preflight checks
    "dapo_mega.launch": 5,
    # 6: the driver loop and the command line.
    "dapo_mega.trainer": 6,
    "dapo_mega.cli": 6,
}
NEW_TOP_LEVEL_FLOOR = 5
"""Floor of a new top-level module `dapo_mega.<name>` not in FLOORS: a component."""


@dataclass(frozen=True)
class Edge:
    """One import of a dapo_mega module by another."""

    importer: str
    imported: str
    path: str
    line: int

    def __str__(self) -> str:
        return f"{self.path}:{self.line}  {self.importer} -> {self.imported}"


def module_name(path: Path) -> str:
    """`dapo_mega/backends/megatron/model.py` -> `dapo_mega.backends.megatron.model`."""
    parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def all_modules() -> Dict[str, Path]:
    return {module_name(p): p for p in sorted(ROOT.rglob("*.py")) if "__pycache__" not in p.parts}


def _resolve_relative(module: str, is_package: bool, level: int, target: Optional[str]) -> str:
    base = module.split(".") if is_package else module.split(".")[:-1]
    base = base[: len(base) - (level - 1)] if level > 1 else base
    return ".".join(base + ([target] if target else []))


def _known(name: str, modules: Set[str]) -> Optional[str]:
    """The longest prefix of `name` that is a dapo_mega module (`a.b.func` -> `a.b`)."""
    parts = name.split(".")
    for end in range(len(parts), 0, -1):
        candidate = ".".join(parts[:end])
        if candidate in modules:
            return candidate
    return None


def imports_of(module: str, rel: str, source: str, modules: Set[str]) -> List[Edge]:
    """Every dapo_mega-internal import in one file (`rel`, its path), top-level and inside functions."""
    tree = ast.parse(source, filename=rel)
    is_package = rel.endswith("__init__.py")
    edges: List[Edge] = []
    for node in ast.walk(tree):
        targets: List[str] = []
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = _resolve_relative(module, is_package, node.level, node.module) if node.level else node.module or ""
            # `from pkg import sub` imports the submodule when `pkg.sub` is a module.
            targets = [f"{base}.{alias.name}" for alias in node.names]
        for target in targets:
            if not (target == PACKAGE or target.startswith(PACKAGE + ".")):
                continue
            known = _known(target, modules)
            if known is not None and known != module:
                edges.append(Edge(module, known, rel, node.lineno))
    return edges


def floor_of(module: str) -> int:
    parts = module.split(".")
    for end in range(len(parts), 0, -1):
        prefix = ".".join(parts[:end])
        if prefix in FLOORS and (prefix != PACKAGE or module == PACKAGE):
            return FLOORS[prefix]
    return NEW_TOP_LEVEL_FLOOR


def build_graph() -> List[Edge]:
    modules = all_modules()
    names = set(modules)
    return [e for m, p in modules.items()
            for e in imports_of(m, str(p.relative_to(ROOT.parent)), p.read_text(), names)]


def upward_edges(edges: List[Edge]) -> List[Edge]:
    """Edges from a lower floor to a higher one. The package `__init__`s re-export their own
    package's modules, so `a.b` -> `a.b.c` is a parent importing its child, not an ascent."""
    return [e for e in edges if floor_of(e.imported) > floor_of(e.importer)]


def find_cycles(edges: List[Edge]) -> List[List[Edge]]:
    """One cycle per strongly connected component with a loop (Tarjan), as a list of edges."""
    graph: Dict[str, List[Edge]] = {}
    for e in edges:
        graph.setdefault(e.importer, []).append(e)
    index: Dict[str, int] = {}
    low: Dict[str, int] = {}
    stack: List[str] = []
    on_stack: Set[str] = set()
    components: List[Set[str]] = []
    counter = [0]

    def visit(v: str) -> None:  # recursion depth is bounded by the number of modules (~100)
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for e in graph.get(v, []):
            w = e.imported
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = set()
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.add(w)
                if w == v:
                    break
            if len(comp) > 1:
                components.append(comp)

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return [_cycle_in(comp, graph) for comp in components]


def _cycle_in(comp: Set[str], graph: Dict[str, List[Edge]]) -> List[Edge]:
    """A concrete loop through a strongly connected component (breadth-first back to the start)."""
    start = min(comp)
    previous: Dict[str, Edge] = {}
    frontier = [start]
    while frontier:
        nxt = []
        for v in frontier:
            for e in graph.get(v, []):
                if e.imported not in comp:
                    continue
                if e.imported == start:
                    path = [e]
                    while path[0].importer != start:
                        path.insert(0, previous[path[0].importer])
                    return path
                if e.imported not in previous:
                    previous[e.imported] = e
                    nxt.append(e.imported)
        frontier = nxt
    raise AssertionError(f"no loop found in component {sorted(comp)}")


# --------------------------------------------------------------------------- the package


def test_package_imports_form_no_cycle():
    cycles = find_cycles(build_graph())
    assert not cycles, "import loops (break each one; a lazy import inside a function counts):\n" + "\n\n".join(
        "\n".join(f"  {e}" for e in cycle) for cycle in cycles)


def test_package_imports_run_downhill():
    bad = upward_edges(build_graph())
    assert not bad, ("imports from a lower floor up to a higher one (floors in tests/test_import_graph.py "
                     "FLOORS; move the code down or the import up):\n" + "\n".join(
                         f"  {e}  (floor {floor_of(e.importer)} -> {floor_of(e.imported)})" for e in bad))


def test_every_floor_prefix_names_real_modules():
    """A typo in FLOORS would silently put a package on the default floor."""
    names = set(all_modules())
    missing = [p for p in FLOORS if not any(n == p or n.startswith(p + ".") for n in names)]
    assert not missing, f"FLOORS names no module: {missing}"


def test_graph_sees_function_level_imports():
    """The walker finds lazy imports too (the plan imports the tiny model inside a function)."""
    plan = ROOT / "plan" / "memory.py"
    lazy = [e for e in build_graph() if e.importer == "dapo_mega.plan.memory" and e.imported == "dapo_mega.models.tiny"]
    assert lazy, "plan/memory.py imports the tiny model inside resolve_model_shape; the walker missed it"
    assert plan.read_text().splitlines()[lazy[0].line - 1].startswith("    "), "that import is indented"


SCRIPT_DIRS = ("bench", "tools", "launch")
"""The folders of scripts beside the package: each puts its own folder on sys.path and imports
its siblings by bare name (`from timing import spread`)."""


def script_graph(folder: Path) -> List[Edge]:
    """The imports between the scripts of one folder (bare names of its own .py files), top-level
    and inside functions."""
    files = {p.stem: p for p in sorted(folder.glob("*.py"))}
    edges: List[Edge] = []
    for name, path in files.items():
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.Import):
                targets = [alias.name.split(".")[0] for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
                targets = [node.module.split(".")[0]]
            else:
                continue
            edges += [Edge(f"{folder.name}/{name}", f"{folder.name}/{t}", f"{folder.name}/{path.name}",
                           node.lineno) for t in targets if t in files and t != name]
    return edges


@pytest.mark.parametrize("folder", SCRIPT_DIRS)
def test_scripts_beside_the_package_import_each_other_in_no_loop(folder):
    """bench/run.py imported timing.py, which imported run.py back (git_state, machine_info)."""
    edges = script_graph(ROOT.parent / folder)
    cycles = find_cycles(edges)
    assert not cycles, f"import loops in {folder}/:\n" + "\n\n".join(
        "\n".join(f"  {e}" for e in cycle) for cycle in cycles)


def test_the_script_walker_sees_sibling_imports():
    """The walker finds bench's sibling imports (run.py imports timing), so an empty graph is not a pass."""
    assert any(e.importer == "bench/run" and e.imported == "bench/timing" for e in script_graph(ROOT.parent / "bench"))


# --------------------------------------------------------------------------- the checker itself


def _edges(pairs: List[Tuple[str, str]]) -> List[Edge]:
    return [Edge(a, b, f"{a.replace('.', '/')}.py", i + 1) for i, (a, b) in enumerate(pairs)]


def package_edges(edges: List[Edge]) -> List[Edge]:
    """The edges between the package's rooms (`dapo_mega.<name>`): one room may not import
    another that imports it back, even through modules that form no loop."""
    def room(module: str) -> str:
        return ".".join(module.split(".")[:2])

    return [replace(e, importer=room(e.importer), imported=room(e.imported)) for e in edges
            if room(e.importer) != room(e.imported)]


def test_the_package_rooms_import_each_other_in_no_loop():
    """weights <-> engines (the embedded engine read the weights' transport formats while the
    syncer spoke to engines) and config <-> run_files were such loops: the formats and
    checksums on the wire are now their own room (`dapo_mega.wire`)."""
    cycles = find_cycles(package_edges(build_graph()))
    assert not cycles, "loops between rooms:\n" + "\n\n".join("\n".join(f"  {e}" for e in c) for c in cycles)


def test_checker_reports_a_loop_by_its_edges():
    edges = _edges([("dapo_mega.weights.convert", "dapo_mega.backends.megatron.checkpoint"),
                    ("dapo_mega.backends.megatron.checkpoint", "dapo_mega.weights.convert"),
                    ("dapo_mega.algo.loss", "dapo_mega.config")])
    cycles = find_cycles(edges)
    assert len(cycles) == 1
    text = "\n".join(str(e) for e in cycles[0])
    assert "dapo_mega/backends/megatron/checkpoint.py:2  dapo_mega.backends.megatron.checkpoint -> dapo_mega.weights.convert" in text
    assert "dapo_mega.weights.convert -> dapo_mega.backends.megatron.checkpoint" in text


def test_checker_reports_an_upward_edge():
    edges = _edges([("dapo_mega.weights.sync", "dapo_mega.rollout.client"),
                    ("dapo_mega.rollout.manager", "dapo_mega.engines.sglang.client"),
                    ("dapo_mega.algo.policy_loss", "dapo_mega.config")])
    assert [str(e) for e in upward_edges(edges)] == [
        "dapo_mega/weights/sync.py:1  dapo_mega.weights.sync -> dapo_mega.rollout.client"]


def test_floors_are_prefix_based():
    assert floor_of("dapo_mega.rollout.some_new_module") == FLOORS["dapo_mega.rollout"]
    assert floor_of("dapo_mega.data.new_reader") == 0
    assert floor_of("dapo_mega.backends.vllm.client") == FLOORS["dapo_mega.backends"]
    assert floor_of("dapo_mega.brand_new_component") == NEW_TOP_LEVEL_FLOOR
    assert floor_of("dapo_mega") == 0


@pytest.mark.parametrize("source, expected", [
    ("import dapo_mega.algo.advantages as A", ["dapo_mega.algo.advantages"]),
    ("from dapo_mega.weights import mapping as M", ["dapo_mega.weights.mapping"]),
    ("from dapo_mega.config import ConfigError", ["dapo_mega.config"]),
    ("def f():\n    from ..config import DapoConfig", ["dapo_mega.config"]),
    ("from . import advantages", ["dapo_mega.algo.advantages"]),
    ("import torch\nfrom typing import List", []),
])
def test_import_forms(source, expected):
    """Absolute, aliased, function-level and relative imports all resolve to the module."""
    modules = set(all_modules()) | {"dapo_mega.algo._probe"}
    edges = imports_of("dapo_mega.algo._probe", "dapo_mega/algo/_probe.py", source, modules)
    assert [e.imported for e in edges] == expected


def floors_line() -> str:
    """FLOORS as docs/architecture.md states them: each floor's packages, lowest floor first."""
    by_floor: Dict[int, List[str]] = {}
    for name, floor in FLOORS.items():
        if name != PACKAGE:
            by_floor.setdefault(floor, []).append(name[len(PACKAGE) + 1:])
    return " < ".join(", ".join(by_floor[f]) for f in sorted(by_floor))


def test_the_floors_the_docs_state_are_these():
    """docs/architecture.md's floors line is written from FLOORS (issue #49 item 7): a floor
    changed here and not there fails."""
    docs = " ".join((ROOT.parent / "docs" / "architecture.md").read_text().split())
    assert f"(floors: {floors_line()})" in docs, f"docs/architecture.md should say: (floors: {floors_line()})"
