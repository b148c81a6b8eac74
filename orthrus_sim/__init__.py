"""Orthrus: co-serving embedding and generation requests. This package holds, floor above floor,
the shared scheduling core (``engine``), the cost model (``costmodel``), what describes an
experiment (``experiment``), routing and placement across replicas (``routing``), the SimPy
simulator (``sim``) and the questions a user asks (``questions``), with the command line on top
(``cli``). Here, below them all: the version and the project's files (where the shipped folders
are, reading a JSON or YAML file with errors that name it, a scenario's relative paths, results
file names)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

__version__ = "0.2.0"

_PACKAGE = Path(__file__).resolve().parent


def data_dir(name: str) -> Path:
    """A folder the project ships (``scenarios``, ``calibration``): inside the installed
    package (a wheel), or at the top of a source checkout (an editable install)."""
    installed = _PACKAGE / "_data" / name
    return installed if installed.is_dir() else _PACKAGE.parent / name


def read_structured(path: str | Path, what: str, yaml_format: bool | None = None) -> Any:
    """Parse ``path`` as YAML (``yaml_format``, or by default a .yaml/.yml name) or JSON;
    a ValueError names ``what`` and the file."""
    path = Path(path)
    if not path.exists():
        raise ValueError(f"{what} {path} does not exist")
    text = path.read_text()
    if yaml_format or (yaml_format is None and path.suffix in (".yaml", ".yml")):
        import yaml  # here, not at the top: a run from a JSON or in-memory scenario skips it

        try:
            return yaml.safe_load(text)
        except yaml.YAMLError as exc:
            raise ValueError(f"{what} {path} is not valid YAML ({exc})") from None
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{what} {path} is not valid JSON ({exc})") from None


def resolve_path(value: str | Path, info: Any = None, must_exist: bool = True) -> Path:
    """A path from a scenario field: relative paths resolve from the scenario file's folder
    (pydantic validation context ``base_dir``), else from the current directory."""
    path = Path(value).expanduser()
    if not path.is_absolute():
        context = getattr(info, "context", None) or {}
        path = Path(context.get("base_dir", Path.cwd())) / path
    if must_exist and not path.exists():
        raise ValueError(f"file {path} does not exist")
    return path


def safe_name(name: str) -> str:
    """A configuration name as part of a file name (``unified:pkg.mod:Cls`` has ':' and may
    have '/'): the one rule for every results file."""
    return name.replace(":", "_").replace("/", "_")
