"""What the benchmarks share, written once: the checkout's root, their arguments, a seeded model
for a run, the servers they start and stop, what ``/proc`` says of a process, the machine,
percentiles, rounds that alternate the systems compared (the 2-core machines are shared and
noisy: a slow minute must fall on every system, not on one), timings and rich tables.

Every benchmark runs as a module from the checkout's root (``python -m benchmarks.cluster.soak``),
so it imports this as ``benchmarks.common`` with no path set-up. Only the standard library is
imported at the top: a benchmark's timed child process pays for what it measures, not for this
(numpy, torch, rich and the project's packages are imported where they are used).
"""

from __future__ import annotations

import argparse
import os
import platform
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar

if TYPE_CHECKING:
    import numpy as np
    import torch
    from rich.table import Table

    from orthrus_real.engine.sampling import SamplingParams

ROOT = Path(__file__).resolve().parents[1]
T = TypeVar("T")


# ----- arguments ----------------------------------------------------------------------------
def parser(doc: str | None) -> argparse.ArgumentParser:
    """A benchmark's argument parser: its ``--help`` is the module's docstring as written (what
    it measures, against what, and how to run it)."""
    return argparse.ArgumentParser(description=doc,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)


def add_model_argument(ap: argparse.ArgumentParser, size: str, note: str = "") -> None:
    """``--model DIR``: the model to run, by default one ``model_dir`` makes (``size``)."""
    ap.add_argument("--model", type=Path, default=None,
                    help=f"model directory (default: a seeded {size} llama made for the run){note}")


# ----- a model for the run ------------------------------------------------------------------
@contextmanager
def model_dir(given: str | Path | None, size: str = "small", name: str | None = None,
              seed: int = 0, **options) -> Iterator[Path]:
    """``given``, or a seeded llama of ``size`` (``init-model``'s sizes, its ``options``) made
    in a temporary directory for the run and removed after it: no model hub is reachable here,
    and random weights cost what trained ones do. ``name``: the model's directory name (what a
    server calls the model; default ``size``)."""
    if given is not None:
        yield Path(given)
        return
    from orthrus_real.engine.init_model import init_model

    with tempfile.TemporaryDirectory(prefix="orthrus-bench-") as tmp:
        yield init_model(Path(tmp) / (name or size), "llama", size, seed=seed, **options)


def random_tokens(rng: np.random.Generator, length: int, vocab_size: int) -> list[int]:
    """``length`` token ids from ``rng``, below any model's vocabulary (8,000 at most; the tiny
    one has 512) and above the special tokens 0-3."""
    return [int(t) for t in rng.integers(4, min(8000, vocab_size), length)]


def greedy(max_tokens: int) -> SamplingParams:
    """Greedy decoding of exactly ``max_tokens`` tokens (no early stop): every run does the same
    work."""
    from orthrus_real.engine.sampling import SamplingParams

    return SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)


# ----- processes ----------------------------------------------------------------------------
def python_module(module: str, *args: str) -> list[str]:
    """The command that runs ``module`` (``python -m``) with this interpreter; start it in
    ``ROOT`` (``serving`` does), where ``benchmarks`` is importable."""
    return [sys.executable, "-m", module, *args]


def stop(proc: subprocess.Popen, timeout: float = 60.0) -> int:
    """SIGTERM (a server drains what it has in flight), then SIGKILL if it has not exited within
    ``timeout`` seconds; its exit code."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
    try:
        return proc.wait(timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        return proc.wait()


@contextmanager
def serving(cmd: Sequence[str], url: str, start_timeout: float = 120.0,
            stop_timeout: float = 60.0, **popen) -> Iterator[subprocess.Popen]:
    """A server (``orthrus-real serve``, a stub replica, a gateway) started from ``cmd`` in
    ``ROOT``, yielded once ``url``/health answers; stopped (``stop``) however the block ends."""
    from orthrus_real.server.serving import wait_healthy

    popen.setdefault("cwd", ROOT)
    proc = subprocess.Popen(list(cmd), **popen)
    try:
        wait_healthy(url, start_timeout, proc)
        yield proc
    finally:
        stop(proc, stop_timeout)


def rss_mb(pid: int) -> float | None:
    """A process's resident memory in MiB (``VmRSS``); None once it is gone."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


def cpu_seconds(pid: int) -> float:
    """User + system CPU of a process (all its threads) so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def core_times(core: int | None) -> tuple[float, float]:
    """(busy, total) jiffies of one core so far (``/proc/stat``; the whole machine for None):
    how busy a core is with anything, the process pinned there or others."""
    name = "cpu" if core is None else f"cpu{core}"
    for line in Path("/proc/stat").read_text().splitlines():
        parts = line.split()
        if parts[0] == name:
            values = [int(v) for v in parts[1:]]
            return sum(values) - values[3] - values[4], sum(values)
    return 0.0, 0.0


def machine() -> dict:
    """The machine a figure was measured on: CPU model, cores, AVX-512 flags, Python."""
    from orthrus_sim.costmodel.machine import cpu_flags, cpu_model

    return {"cpu": cpu_model(), "cores": os.cpu_count(),
            "avx512": sorted(f for f in cpu_flags() if f.startswith("avx512")),
            "python": platform.python_version()}


# ----- figures ------------------------------------------------------------------------------
def percentile(values: Sequence[float], q: float, method: str = "linear",
               digits: int | None = None) -> float | None:
    """The ``q``-th percentile (0-100) of ``values``, None for none; ``method``: numpy's
    (``higher``: the nearest rank at or above, a value that was measured), ``digits``: rounded."""
    if not len(values):
        return None
    import numpy as np

    p = float(np.percentile(values, q, method=method))
    return p if digits is None else round(p, digits)


def in_turn(names: Sequence[T], round_: int) -> list[T]:
    """The order of round ``round_``: ``names``, reversed every other round, so that no system
    always runs first (or always after the same neighbour)."""
    return list(names) if round_ % 2 == 0 else list(names)[::-1]


def alternate(runs: Mapping[str, Callable[[], T]], rounds: int, reverse: bool = True,
              announce: Callable[[int], None] | None = None) -> dict[str, list[T]]:
    """Every run once a round, one after the other (``in_turn`` when ``reverse``), ``rounds``
    times: each run's results in round order. A shared machine's slow minute then falls on all
    the systems compared, and a ratio between them taken in the same run holds."""
    out: dict[str, list[T]] = {name: [] for name in runs}
    for r in range(rounds):
        if announce is not None:
            announce(r)
        for name in in_turn(list(runs), r) if reverse else runs:
            out[name].append(runs[name]())
    return out


def medians(results: Mapping[str, Sequence[float]]) -> dict[str, float]:
    """The median of each system's rounds."""
    import statistics

    return {name: statistics.median(values) for name, values in results.items()}


def sync(device: torch.device | None = None) -> None:
    """Wait for the GPU's queued work (``device``, or any GPU present; nothing on a CPU), so
    that a clock read after it reads the work's end."""
    import torch

    if device is None:
        if torch.cuda.is_available():
            torch.cuda.synchronize()
    elif device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn: Callable[[], object], device: torch.device | None = None) -> float:
    """Seconds ``fn`` takes, its GPU work included (``sync`` before and after)."""
    sync(device)
    start = time.perf_counter()
    fn()
    sync(device)
    return time.perf_counter() - start


def table(title: str, columns: Sequence[str], justify: str = "right", label: str | None = None,
          **options) -> Table:
    """A rich table with these columns (each ``justify``-ed, with the column ``options``), after
    a left-justified ``label`` column (what each row is) if one is named; the caller adds the
    rows."""
    from rich.table import Table

    out = Table(title=title)
    if label is not None:
        out.add_column(label)
    for col in columns:
        out.add_column(col, justify=justify, **options)
    return out
