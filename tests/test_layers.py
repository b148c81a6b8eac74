"""The house's floors: the core and the experiment layer import neither SimPy nor torch, and the
real executors import neither the simulator nor matplotlib when they load."""

from __future__ import annotations

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


def modules(package: str) -> list[str]:
    path = ROOT / package.replace(".", "/")
    return [f"{package}.{m.name}" for m in pkgutil.iter_modules([str(path)])]


def test_core_and_experiment_layer_need_no_simpy_or_torch():
    loaded = loaded_after(["orthrus_sim.engine", *modules("orthrus_sim.engine"),
                           *modules("orthrus_sim.experiment"), "orthrus_sim.costmodel"])
    assert not {"simpy", "torch", "matplotlib"} & loaded
    assert not any(m.startswith("orthrus_sim.sim") for m in loaded)


def test_real_executors_load_without_the_simulator_or_matplotlib():
    pytest.importorskip("torch")
    mods = [m for m in modules("orthrus_real") if not m.endswith("vllm_backend")]
    loaded = loaded_after(mods)
    assert "matplotlib" not in loaded
    assert not any(m.startswith("orthrus_sim.sim") for m in loaded), sorted(
        m for m in loaded if m.startswith("orthrus_sim.sim"))
