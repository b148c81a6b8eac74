"""Orthrus: co-serving embedding and generation requests. This package holds the shared
scheduling core (``engine``), the cost model (``costmodel``), what describes an experiment
(``experiment``) and the SimPy simulator (``sim``)."""

from __future__ import annotations

from pathlib import Path

__version__ = "0.2.0"

_PACKAGE = Path(__file__).resolve().parent


def data_dir(name: str) -> Path:
    """A folder the project ships (``scenarios``, ``calibration``): inside the installed
    package (a wheel), or at the top of a source checkout (an editable install)."""
    installed = _PACKAGE / "_data" / name
    return installed if installed.is_dir() else _PACKAGE.parent / name
