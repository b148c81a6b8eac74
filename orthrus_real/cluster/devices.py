"""``--devices``: which device each replica runs on."""

from __future__ import annotations

from dataclasses import dataclass

from orthrus_real.engine.device import parse_cpus

KINDS = ("cpu", "cuda")


@dataclass(frozen=True)
class Device:
    """A replica's device: ``cuda:N``, or ``cpu`` on a set of cores (None: any)."""

    kind: str  # cpu | cuda
    index: int | None = None  # cuda:N
    cpus: frozenset[int] | None = None  # cpu:SET

    def __str__(self) -> str:
        if self.kind == "cuda":
            return "cuda" if self.index is None else f"cuda:{self.index}"
        return "cpu" if not self.cpus else f"cpu:{cpus_text(self.cpus)}"

    @property
    def torch_device(self) -> str:
        """What the engine's ``--device`` takes."""
        return "cpu" if self.kind == "cpu" else str(self)


def cpus_text(cpus) -> str:
    """``{0, 1, 2, 5}`` -> ``0-2,5`` (the ``--cpus`` syntax)."""
    out, run = [], []
    for c in sorted(cpus):
        if run and c == run[-1] + 1:
            run.append(c)
            continue
        if run:
            out.append(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]))
        run = [c]
    if run:
        out.append(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]))
    return ",".join(out)


def parse_devices(text: str | None, replicas: int, cuda_count: int) -> list[Device]:
    """One device per replica from ``cuda:0,cuda:1``, ``cpu:0,cpu:1`` or ``cpu:0-1,cpu:2-3``
    (a bare number continues the CPU set before it: ``cpu:0,1,cpu:2,3`` is two replicas on two
    cores each); ``;`` separates replicas too. One entry serves every replica. Default: one
    GPU each where there are enough, else the CPU (no pinning)."""
    if replicas < 1:
        raise ValueError(f"--replicas must be >= 1, got {replicas}")
    if not text:
        if cuda_count >= replicas:
            return [Device("cuda", i) for i in range(replicas)]
        if cuda_count:
            raise ValueError(f"--replicas {replicas} but {cuda_count} CUDA device(s) are visible; "
                             "give --devices (replicas may share a device: cuda:0,cuda:0)")
        return [Device("cpu")] * replicas
    entries: list[list[str]] = []
    for part in text.replace(";", ",").split(","):
        part = part.strip()
        if not part:
            raise ValueError(f"--devices {text!r}: an empty entry")
        if part.split(":", 1)[0] in KINDS:
            entries.append([part])
        elif entries and entries[-1][0].startswith("cpu:"):
            entries[-1].append(part)  # more cores of the CPU set before it
        else:
            raise ValueError(f"--devices {text!r}: {part!r} is not a device (cuda, cuda:N, cpu or "
                             "cpu:CORES such as cpu:0-1)")
    devices = [_device(",".join(e), text, cuda_count) for e in entries]
    if len(devices) == 1:
        devices = devices * replicas
    if len(devices) != replicas:
        raise ValueError(f"--devices {text!r} names {len(devices)} devices for --replicas {replicas}; "
                         "give one per replica (or one for all)")
    return devices


def _device(entry: str, text: str, cuda_count: int) -> Device:
    kind, _, rest = entry.partition(":")
    if kind == "cuda":
        if not rest:
            return Device("cuda")
        if not rest.isdigit():
            raise ValueError(f"--devices {text!r}: {entry!r} must be cuda:N")
        index = int(rest)
        if index >= cuda_count:
            raise ValueError(f"--devices {text!r}: {entry} but {cuda_count} CUDA device(s) are visible")
        return Device("cuda", index)
    cpus = parse_cpus(rest, f"--devices ({entry})") if rest else None
    return Device("cpu", cpus=frozenset(cpus) if cpus else None)


def split_cpus(text: str, replicas: int) -> str:
    """``--devices`` for ``replicas`` replicas from one CPU set (``0-3`` -> ``cpu:0-1,cpu:2-3``),
    or ``text`` as it is when it already names devices."""
    if text.split(":", 1)[0] in KINDS:
        return text
    cpus = sorted(parse_cpus(text, "--engine-cpus") or ())
    if len(cpus) < replicas:
        raise ValueError(f"--engine-cpus {text!r}: {len(cpus)} CPU(s) for {replicas} replicas; give "
                         "at least one each, or devices (cpu:0,cpu:0 to share one)")
    each = len(cpus) // replicas
    return ",".join(f"cpu:{cpus_text(cpus[i * each:(i + 1) * each])}" for i in range(replicas))
