"""The house's floors: the core and the experiment layer import neither SimPy nor torch, the
real executors import neither the simulator nor matplotlib when they load, no modules import
each other in a circle, and orthrus_real's rooms import only from the rooms below them."""

from __future__ import annotations

import ast
import pkgutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def loaded_after(imports: list[str]) -> set[str]:
    code = ("import sys\n" + "".join(f"import {m}\n" for m in imports)
            + "print('\\n'.join(sorted(sys.modules)))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT,
                         check=True).stdout
    return set(out.split())


def modules(package: str, recursive: bool = False) -> list[str]:
    path = ROOT / package.replace(".", "/")
    found = []
    for m in pkgutil.iter_modules([str(path)]):
        found.append(f"{package}.{m.name}")
        if recursive and m.ispkg:
            found += modules(f"{package}.{m.name}", recursive)
    return found


def test_core_and_experiment_layer_need_no_simpy_or_torch():
    loaded = loaded_after(["orthrus_sim.engine", *modules("orthrus_sim.engine"),
                           *modules("orthrus_sim.experiment"), "orthrus_sim.costmodel"])
    assert not {"simpy", "torch", "matplotlib"} & loaded
    assert not any(m.startswith("orthrus_sim.sim") for m in loaded)


def test_real_executors_load_without_the_simulator_or_matplotlib():
    pytest.importorskip("torch")
    mods = [m for m in modules("orthrus_real", recursive=True) if "vllm_backend" not in m]
    loaded = loaded_after(mods)
    assert "matplotlib" not in loaded
    assert not any(m.startswith("orthrus_sim.sim") for m in loaded), sorted(
        m for m in loaded if m.startswith("orthrus_sim.sim"))


# ----- the import graph, read from the source (function-level and TYPE_CHECKING imports too) -----
# orthrus_real's rooms, bottom floor first: a room imports only from rooms below it.
REAL_FLOORS = ["engine", "vllm_backend", "server", "cluster", "measure", "cli"]


def import_graph() -> dict[str, set[str]]:
    """Every project module -> the project modules it imports anywhere in its source."""
    files = {}
    for path in [*ROOT.glob("orthrus_sim/**/*.py"), *ROOT.glob("orthrus_real/**/*.py")]:
        name = ".".join(path.relative_to(ROOT).with_suffix("").parts)
        files[name.removesuffix(".__init__")] = path
    graph = {}
    for name, path in files.items():
        targets = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                assert node.level == 0, f"{name}: a relative import (the house uses absolute ones)"
                for alias in node.names:  # ``from pkg import module`` names the module
                    sub = f"{node.module}.{alias.name}"
                    targets.add(sub if sub in files else node.module)
            elif isinstance(node, ast.Import):
                targets.update(alias.name for alias in node.names)
        # importing a.b.c runs a/__init__ and a/b/__init__ too, unless the importer is inside them
        own = {name.rsplit(".", i)[0] for i in range(1, name.count(".") + 1)}
        parents = {t.rsplit(".", i)[0] for t in targets for i in range(1, t.count(".") + 1)}
        graph[name] = {t for t in targets | (parents - own) if t in files and t != name}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected groups of more than one module (Tarjan)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while not group or group[-1] != v:
                group.append(stack.pop())
                on_stack.discard(group[-1])
            if len(group) > 1:
                found.append(sorted(group))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


COMMAND_LINE = ("cli", "serve_options")  # orthrus_real's top-level modules: the top floor


def real_room(module: str) -> str:
    """``orthrus_real.server.api.errors`` -> ``server``; the command line's modules -> ``cli``."""
    if module == "orthrus_real":
        return "engine"  # the package's __init__, empty: below everything
    room = module.split(".")[1]
    if room in COMMAND_LINE:
        return "cli"
    assert room in REAL_FLOORS, f"{module}: room {room!r} is on no floor of REAL_FLOORS"
    return room


def test_no_two_modules_import_each_other_in_any_circle():
    assert cycles(import_graph()) == []


def test_every_orthrus_real_module_is_in_a_known_room():
    for module in import_graph():
        if module.startswith("orthrus_real"):
            real_room(module)


def test_cycle_finder_finds_a_pair_and_a_ring():
    graph = {"a": {"b"}, "b": {"a"}, "c": {"d"}, "d": {"e"}, "e": {"c"}, "f": {"a"}}
    assert sorted(cycles(graph)) == [["a", "b"], ["c", "d", "e"]]


def test_orthrus_real_rooms_import_only_downward():
    graph = import_graph()
    upward = sorted(
        f"{a} -> {b}" for a, targets in graph.items() if a.startswith("orthrus_real.")
        for b in targets if b.startswith("orthrus_real.")
        and REAL_FLOORS.index(real_room(b)) > REAL_FLOORS.index(real_room(a)))
    assert upward == []


def test_the_core_imports_nothing_of_the_project_above_it():
    graph = import_graph()
    outside = sorted(f"{a} -> {b}" for a, targets in graph.items()
                     if a.startswith("orthrus_sim.engine")
                     for b in targets if not b.startswith("orthrus_sim.engine"))
    assert outside == []
    assert not any(b.startswith("orthrus_real") for a, targets in graph.items()
                   if a.startswith("orthrus_sim") for b in targets)
