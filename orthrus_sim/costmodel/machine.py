"""Which machine this is, and whether a calibration was made on one like it.

A calibration is measured on one machine in one dtype; on a CPU without the same vector
instructions (bf16 above all) or in another dtype, its figures are off by integer factors
(fidelity.md: 0.71 requests/s measured against 5.87/s predicted). ``orthrus-sim run``,
``orthrus-real validate`` and ``bench`` say so in one line (``environment_warning``).
"""

from __future__ import annotations

import platform
from pathlib import Path

# the CPU flags that decide how fast a model's kernels run
KEY_FLAGS = ("avx2", "fma", "avx512f", "avx512_vnni", "avx512_bf16", "amx_tile", "amx_bf16")


def _cpuinfo() -> str:
    try:
        return Path("/proc/cpuinfo").read_text()
    except OSError:
        return ""


def cpu_flags() -> set[str]:
    """Every flag the CPU reports (empty where /proc/cpuinfo is not readable)."""
    for line in _cpuinfo().splitlines():
        if line.startswith("flags"):
            return set(line.split(":", 1)[1].split())
    return set()


def cpu_model() -> str:
    for line in _cpuinfo().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine() or "unknown CPU"


def this_machine(gpu: str | None = None) -> dict:
    """``{machine, cpu_flags, gpu}`` of this machine (``gpu``: the GPU's name, when one runs
    the engine; the caller knows, this module imports no torch)."""
    flags = cpu_flags()
    return {"machine": gpu or cpu_model(), "cpu_flags": [f for f in KEY_FLAGS if f in flags],
            "gpu": gpu}


def environment_warning(recorded, current: dict, dtype: str | None, name: str,
                        threads: int | None = None, colocated: int | None = None) -> str | None:
    """One line when ``current`` (``this_machine``), ``dtype`` or the engine's ``threads``
    differ from a calibration's recorded environment (``EnvironmentModel`` or a dict; None:
    nothing recorded, no warning). The threads matter as much as the machine: a profile on two
    cores prices a one-core engine's batches by another shape, not just a scale. ``colocated``:
    the engines that will share this machine (a cluster of CPU replicas); a profile of one
    engine alone prices away what its neighbours cost it."""
    if recorded is None:
        return None
    rec = recorded if isinstance(recorded, dict) else recorded.model_dump()
    diffs = []
    if rec.get("gpu") or current.get("gpu"):
        if rec.get("gpu") != current.get("gpu"):
            diffs.append(f"device {rec.get('gpu') or 'CPU'} there, {current.get('gpu') or 'CPU'} here")
    else:
        if rec.get("machine") and rec.get("machine") != current.get("machine"):
            diffs.append(f"CPU {rec.get('machine')!r} there, {current.get('machine')!r} here")
        missing = sorted(set(rec.get("cpu_flags") or []) - set(current.get("cpu_flags") or []))
        extra = sorted(set(current.get("cpu_flags") or []) - set(rec.get("cpu_flags") or []))
        if missing or extra:
            diffs.append("CPU flags " + ", ".join([f"-{f}" for f in missing] + [f"+{f}" for f in extra]))
    if dtype and rec.get("dtype") and dtype != rec["dtype"]:
        diffs.append(f"dtype {rec['dtype']} there, {dtype} here")
    if threads and rec.get("threads") and threads != rec["threads"]:
        diffs.append(f"{rec['threads']} engine thread(s) there, {threads} here")
    there = rec.get("colocated") or 1
    crowd = None
    if colocated and colocated != there:
        crowd = (f"calibration {name} was measured with {there} engine(s) on its machine and "
                 f"{colocated} will share this one: each engine's iterations run at another "
                 f"speed beside neighbours (calibrate --colocated {colocated})")
    if not diffs:
        return crowd
    line = (f"calibration {name} was measured on another machine ({'; '.join(diffs)}): its "
            "figures may not hold here; calibrate on this machine (orthrus-real calibrate) or "
            "fit (orthrus-sim fit)")
    return line if crowd is None else f"{line}; and {crowd}"


def hardware_warning(calibration, hardware: str, dtype_bytes: int, name: str) -> str | None:
    """``orthrus-sim run``'s check: one line when the scenario simulates other hardware, or a
    model in another dtype, than the calibration was made for."""
    diffs = []
    if calibration.hardware != hardware:
        diffs.append(f"made for {calibration.hardware}, the scenario simulates {hardware}")
    env = calibration.environment
    recorded = DTYPE_BYTES.get(env.dtype) if env is not None and env.dtype else None
    if recorded is not None and recorded != dtype_bytes:
        diffs.append(f"measured in {env.dtype}, the scenario's model is {dtype_bytes}-byte")
    if not diffs:
        return None
    return f"calibration {name}: {'; '.join(diffs)}: its figures may not hold"


DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}


def scenario_warning(scenario) -> str | None:
    """``hardware_warning`` for a scenario's calibration (None without one)."""
    if not scenario.calibration_file:
        return None
    from orthrus_sim.costmodel import get_model, load_calibration

    cal = load_calibration(scenario.calibration_file)
    return hardware_warning(cal, scenario.hardware, get_model(scenario.model).dtype_bytes,
                            Path(scenario.calibration_file).name)


def calibration_note(scenario) -> str | None:
    """One line where a scenario's figures do not stand on a calibration fitted for its
    hardware: one derived from another card's fit, or the roofline with assumed efficiencies."""
    path = scenario.calibration_file
    if not path:
        return (f"{scenario.hardware}: no calibration, its numbers are a roofline with assumed "
                "efficiencies (orthrus_sim/costmodel/coefficients.py)")
    from orthrus_sim.costmodel import load_calibration

    cal = load_calibration(path)
    if cal.source.derived_from:
        return (f"calibration {Path(path).stem}: derived, not fitted (the "
                f"{cal.source.derived_from} fit's efficiencies with {cal.hardware}'s own specs)")
    return None
