"""The house's floors: the core, the experiment layer and routing import neither SimPy nor
torch, the real executors import neither the simulator nor matplotlib when they load, no modules
import each other in a circle, and each package's rooms import only from the rooms below them."""

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


def test_core_experiment_and_routing_need_no_simpy_or_torch():
    loaded = loaded_after(["orthrus_sim.engine", *modules("orthrus_sim.engine"),
                           *modules("orthrus_sim.experiment"), *modules("orthrus_sim.routing"),
                           "orthrus_sim.costmodel", *modules("orthrus_sim.costmodel")])
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


# orthrus_sim's rooms, bottom floor first: the core, the cost model, what describes an
# experiment, routing and placement across replicas (the simulator's and the real gateway's),
# the simulator, the questions a user asks (run, sweep, capacity, headroom, fit, predict), and
# the command line on top
SIM_FLOORS = ["engine", "costmodel", "experiment", "routing", "sim", "questions", "cli"]
FLOORS = {"orthrus_real": REAL_FLOORS, "orthrus_sim": SIM_FLOORS}
# each package's top-level modules: the command line and its helpers, the top floor
COMMAND_LINE = {"orthrus_real": ("cli", "serve_options"), "orthrus_sim": ("cli", "console")}


def room(module: str) -> str:
    """``orthrus_real.server.api.errors`` -> ``server``; the command line's modules -> ``cli``."""
    package, *rest = module.split(".")
    if not rest:
        return FLOORS[package][0]  # the package's __init__ (version, data folders): below everything
    if rest[0] in COMMAND_LINE[package]:
        return "cli"
    assert len(rest) > 1 or (ROOT / package / rest[0]).is_dir(), \
        f"{module}: a module at the top of {package}, where only the command line lives"
    assert rest[0] in FLOORS[package], f"{module}: room {rest[0]!r} is on no floor of {package}"
    return rest[0]


def test_no_two_modules_import_each_other_in_any_circle():
    assert cycles(import_graph()) == []


def test_every_module_is_in_a_known_room():
    for module in import_graph():
        room(module)


def test_a_module_at_the_top_or_in_no_known_room_is_named():
    with pytest.raises(AssertionError, match="at the top of orthrus_sim"):
        room("orthrus_sim.fit")
    with pytest.raises(AssertionError, match="on no floor"):
        room("orthrus_sim.tools.fit")
    assert room("orthrus_sim.questions.fit") == "questions" and room("orthrus_sim.console") == "cli"


def test_cycle_finder_finds_a_pair_and_a_ring():
    graph = {"a": {"b"}, "b": {"a"}, "c": {"d"}, "d": {"e"}, "e": {"c"}, "f": {"a"}}
    assert sorted(cycles(graph)) == [["a", "b"], ["c", "d", "e"]]


@pytest.mark.parametrize("package", sorted(FLOORS))
def test_rooms_import_only_downward(package):
    graph = import_graph()
    floors = FLOORS[package]
    upward = sorted(
        f"{a} -> {b}" for a, targets in graph.items() if a.split(".")[0] == package
        for b in targets if b.split(".")[0] == package
        and floors.index(room(b)) > floors.index(room(a)))
    assert upward == []


def test_the_core_imports_nothing_of_the_project_above_it():
    graph = import_graph()
    outside = sorted(f"{a} -> {b}" for a, targets in graph.items()
                     if a.startswith("orthrus_sim.engine")
                     for b in targets if not b.startswith("orthrus_sim.engine"))
    assert outside == []
    assert not any(b.startswith("orthrus_real") for a, targets in graph.items()
                   if a.startswith("orthrus_sim") for b in targets)
