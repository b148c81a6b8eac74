"""What the cluster's gateway itself costs: the same load straight to one replica and through
the gateway, alternated in rounds, in one run on one machine. The replica is a stub that answers
at once (``benchmarks/cluster/stub_replica.py``), so what the gateway adds is all that differs.

* A, latency: a closed loop at low concurrency (1 and 8) of non-streamed completions and
  embeddings; per-request latency direct and through the gateway, p50/p99, and what the gateway
  adds (target: <= 2 ms at p50).
* B, relayed rate: completions through the gateway at rising concurrency until the rate stops
  growing, beside the direct rate at each step (the load generator's own limit), with the
  gateway process's CPU per relayed request and the rate that implies on one full core
  (target: >= 500 requests/s).
* C, streaming: a stream of K events a fixed gap apart; each event's delay from the stub's send
  to the client, direct and through the gateway, and the gaps seen at the client (a relay that
  buffered would close them up).

The gateway is the project's own: the scenario, replicas and gateway ``orthrus-real serve
--replicas N`` builds (``cluster_scenario``, ``make_replicas``, ``make_gateway``), served by
``serve_cluster`` (its uvicorn settings), in a child process; its replicas are stubs (no
engine process). With 2+ cores the gateway is pinned to one core and the stub and the load
generator to another. The client is a raw asyncio HTTP/1.1 client over keep-alive connections
(uvloop when installed), so that its own cost stays small beside the gateway's.

Run: python -m benchmarks.cluster.gateway_overhead [--quick] [--rounds 3] [--json out.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import TypeVar

from rich.console import Console
from rich.progress import Progress

from benchmarks.common import (
    add_model_argument,
    alternate,
    core_times,
    cpu_seconds,
    machine,
    model_dir,
    parser,
    percentile,
    python_module,
    serving,
    table,
)
from orthrus_real.cluster.replicas import free_port
from orthrus_sim.experiment.results import write_json

HOST = "127.0.0.1"
T = TypeVar("T")
PROMPT = ("The quick brown fox jumps over the lazy dog while the gateway counts every token "
          "of this prompt before it routes the request to a replica. ") * 2
BODIES = {
    "completion": ("/v1/completions", {"model": "stub", "prompt": PROMPT, "max_tokens": 16,
                                       "temperature": 0}),
    "embedding": ("/v1/embeddings", {"model": "stub", "input": PROMPT}),
}
console = Console(width=None if sys.stdout.isatty() else 150)


def run(coro):
    """``coro`` to completion on a fresh loop (uvloop's when installed: a cheaper client)."""
    try:
        import uvloop

        factory = uvloop.new_event_loop
    except ImportError:
        factory = None
    with asyncio.Runner(loop_factory=factory) as runner:
        return runner.run(coro)


# ----- processes ----------------------------------------------------------------------------
def cores() -> tuple[set[int] | None, set[int] | None, str]:
    """(the gateway's cores, the stub's and client's cores, what the output says)."""
    allowed = sorted(os.sched_getaffinity(0))
    if len(allowed) < 2:
        return None, None, f"not pinned: only core(s) {allowed} available (all share them)"
    gw, rest = {allowed[0]}, {allowed[1]}
    return gw, rest, (f"gateway pinned to core {allowed[0]}; stub replica and load generator "
                      f"to core {allowed[1]}")


def gateway_child(cfg: dict) -> None:
    """In the child: the gateway ``serve --replicas N`` builds, over the stubs at ``ports``."""
    if cfg["cpus"]:
        os.sched_setaffinity(0, set(cfg["cpus"]))
    from orthrus_real.cluster.machine_plan import ClusterArgs, make_replicas
    from orthrus_real.cluster.replicas import ServeOptions
    from orthrus_real.cluster.serve import cluster_scenario, make_gateway, serve_cluster
    from orthrus_real.server.serving import bind_socket, setup_logging

    setup_logging(cfg["log_level"])
    n = len(cfg["ports"])
    opts = ServeOptions(cfg["model"], log_level=cfg["log_level"])
    args = ClusterArgs(n, "orthrus", "cpu", cfg["router"], 1, None)
    scenario, configuration = cluster_scenario(None, [], [], "ibs", args, opts)
    replicas = make_replicas(scenario, configuration, args)
    for r, port in zip(replicas, cfg["ports"]):
        r.port = port  # a stub: no process; the gateway's attach waits on its /engine
    gateway = make_gateway(scenario, replicas, opts, False, 30.0)
    profile = None
    if cfg.get("profile"):
        import cProfile

        # uvicorn re-raises the SIGTERM it drained on: exit through Python so the dump runs
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
        profile = cProfile.Profile()
        profile.enable()
    try:
        serve_cluster(gateway, HOST, cfg["port"], bind_socket(HOST, cfg["port"]),
                      cfg["log_level"], opts.max_body_bytes, None)
    finally:
        if profile is not None:
            profile.disable()
            profile.dump_stats(cfg["profile"])


@contextmanager
def processes(a: argparse.Namespace, model: str):
    """The stub replica(s) and the gateway over them, pinned; yields (direct url, gateway url,
    gateway pid, stub pids)."""
    gw_cpus, rest_cpus, _ = cores()
    if rest_cpus:
        os.sched_setaffinity(0, rest_cpus)  # this process: the load generator
    stub_ports = [free_port(HOST) for _ in range(a.stubs)]
    gw_port = free_port(HOST)
    cfg = {"model": model, "ports": stub_ports, "port": gw_port, "router": a.router,
           "log_level": a.gateway_log_level, "cpus": sorted(gw_cpus) if gw_cpus else None,
           "profile": str(a.profile_gateway.resolve()) if a.profile_gateway else None}
    pin = ["--cpus", ",".join(map(str, rest_cpus))] if rest_cpus else []
    with ExitStack() as running:
        stubs = [running.enter_context(serving(
            python_module("benchmarks.cluster.stub_replica", "--port", str(p), *pin),
            f"http://{HOST}:{p}", 120.0, 20.0, stdin=subprocess.DEVNULL)) for p in stub_ports]
        gw = running.enter_context(serving(
            python_module(__spec__.name, "--gateway-child", json.dumps(cfg)),
            f"http://{HOST}:{gw_port}", 120.0, 20.0, stdin=subprocess.DEVNULL))
        yield (f"http://{HOST}:{stub_ports[0]}", f"http://{HOST}:{gw_port}", gw.pid,
               [s.pid for s in stubs])


# ----- a raw HTTP/1.1 client ----------------------------------------------------------------
def request_bytes(url: str, path: str, body: dict) -> bytes:
    data = json.dumps(body).encode()
    host = url.split("//", 1)[1]
    return (f"POST {path} HTTP/1.1\r\nhost: {host}\r\ncontent-type: application/json\r\n"
            f"content-length: {len(data)}\r\n\r\n").encode() + data


LENGTH = re.compile(rb"\r\ncontent-length: *(\d+)", re.I)
CHUNKED = re.compile(rb"\r\ntransfer-encoding: *chunked", re.I)


class Connection:
    """One keep-alive connection: a request's bytes out, its status and body back."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer = reader, writer

    @classmethod
    async def open(cls, url: str) -> Connection:
        host, port = url.split("//", 1)[1].split(":")
        return cls(*await asyncio.open_connection(host, int(port)))

    async def head(self, raw: bytes) -> tuple[int, bytes]:
        self.writer.write(raw)
        head = await self.reader.readuntil(b"\r\n\r\n")
        return int(head[9:12]), head

    async def call(self, raw: bytes) -> int:
        status, head = await self.head(raw)
        m = LENGTH.search(head)
        if m:
            await self.reader.readexactly(int(m.group(1)))
        elif CHUNKED.search(head):
            async for _ in self.chunks():
                pass
        return status

    async def chunks(self):
        """A chunked body's chunks, each as it arrives."""
        while True:
            size = int((await self.reader.readuntil(b"\r\n")).split(b";")[0], 16)
            data = await self.reader.readexactly(size + 2)
            if size == 0:
                return
            yield data[:-2]

    def close(self) -> None:
        self.writer.close()


@dataclass
class Load:
    """A closed loop's outcome."""

    latencies: list[float] = field(default_factory=list)
    errors: int = 0
    elapsed: float = 0.0

    @property
    def rate(self) -> float:
        return len(self.latencies) / self.elapsed if self.elapsed else 0.0


async def closed_loop(url: str, raw: bytes, concurrency: int, requests: int | None = None,
                      duration: float | None = None) -> Load:
    """``concurrency`` connections, each sending the next request when its answer is in, until
    ``requests`` answers or ``duration`` seconds."""
    conns = [await Connection.open(url) for _ in range(concurrency)]
    for c in conns:  # warm each connection once
        await c.call(raw)
    out = Load()
    left = [requests] if requests is not None else None
    t0 = time.perf_counter()
    end = t0 + duration if duration is not None else None

    async def worker(c: Connection) -> None:
        while True:
            if left is not None:
                if left[0] <= 0:
                    return
                left[0] -= 1
            elif time.perf_counter() >= end:
                return
            start = time.perf_counter()
            status = await c.call(raw)
            out.latencies.append(time.perf_counter() - start)
            out.errors += status != 200

    try:
        await asyncio.gather(*(worker(c) for c in conns))
    finally:
        out.elapsed = time.perf_counter() - t0
        for c in conns:
            c.close()
    return out


async def one_stream(url: str, events: int, gap_ms: float) -> dict:
    """One streamed completion of ``events`` events ``gap_ms`` apart: each event's delay from
    the stub's send to its arrival here, and the gaps between arrivals."""
    body = {"model": "stub", "prompt": PROMPT, "max_tokens": events, "stream": True,
            "stub_gap_ms": gap_ms}
    c = await Connection.open(url)
    try:
        status, _ = await c.head(request_bytes(url, "/v1/completions", body))
        arrivals, delays, buf, done = [], [], b"", False
        async for chunk in c.chunks():
            now_wall, now = time.time(), time.perf_counter()
            buf += chunk
            while b"\n\n" in buf:
                event, buf = buf.split(b"\n\n", 1)
                if event == b"data: [DONE]":
                    done = True
                    continue
                doc = json.loads(event.removeprefix(b"data: "))
                arrivals.append(now)
                delays.append(now_wall - doc["stub_sent"])
    finally:
        c.close()
    gaps = [b - a for a, b in zip(arrivals, arrivals[1:])]
    return {"status": status, "events": len(arrivals), "done": done, "delays": delays,
            "gaps": gaps}


# ----- figures ------------------------------------------------------------------------------
# a percentile is the nearest rank at or above it: a latency some request had
pct = partial(percentile, method="higher")


def both_ways(fn: Callable[[str], T], direct: str, gateway: str, rounds: int,
              progress: Progress, task) -> dict[str, list[T]]:
    """``fn(url)`` straight to the stub and through the gateway, alternated in ``rounds`` (each
    round in turn first), the progress bar advanced after each."""
    def one(url: str) -> T:
        out = fn(url)
        progress.advance(task)
        return out

    return alternate({"direct": partial(one, direct), "gateway": partial(one, gateway)}, rounds)


def phase_latency(a, direct: str, gateway: str, progress: Progress) -> list[dict]:
    """A: per-request latency direct and through the gateway, alternated in rounds."""
    n_requests = {1: 150 if a.quick else 500, 8: 300 if a.quick else 1000}
    cells = [(kind, c) for kind in BODIES for c in a.latency_concurrency]
    task = progress.add_task("A latency", total=len(cells) * a.rounds * 2)
    rows = []
    for kind, conc in cells:
        path, body = BODIES[kind]

        def load(url: str, path: str = path, body: dict = body, conc: int = conc) -> Load:
            return run(closed_loop(url, request_bytes(url, path, body), conc,
                                   requests=n_requests.get(conc, 500)))

        loads = both_ways(load, direct, gateway, a.rounds, progress, task)
        per_round = [pct(gw.latencies, 50) - pct(dr.latencies, 50)
                     for dr, gw in zip(loads["direct"], loads["gateway"])]
        d, g = ([x for out in loads[name] for x in out.latencies] for name in ("direct", "gateway"))
        errors = sum(out.errors for outs in loads.values() for out in outs)
        rows.append({"kind": kind, "concurrency": conc, "requests_each": len(d),
                     "direct_p50_ms": pct(d, 50) * 1e3, "direct_p99_ms": pct(d, 99) * 1e3,
                     "gateway_p50_ms": pct(g, 50) * 1e3, "gateway_p99_ms": pct(g, 99) * 1e3,
                     "added_p50_ms": (pct(g, 50) - pct(d, 50)) * 1e3,
                     "added_p99_ms": (pct(g, 99) - pct(d, 99)) * 1e3,
                     "added_p50_ms_per_round": [x * 1e3 for x in per_round],
                     "p50_ratio": pct(g, 50) / pct(d, 50), "errors": errors})
    return rows


def phase_rate(a, direct: str, gateway: str, gw_pid: int, stub_pids: list[int],
               progress: Progress) -> dict:
    """B: the relayed rate at rising concurrency until it stops growing, beside the direct."""
    gw_core = next(iter(os.sched_getaffinity(gw_pid))) if len(os.sched_getaffinity(
        gw_pid)) == 1 else None
    path, body = BODIES["completion"]
    ladder = [c for c in (1, 2, 4, 8, 16, 32, 64, 128, 256) if c <= a.max_concurrency]
    task = progress.add_task("B relayed rate", total=len(ladder) * a.rounds * 2)

    def load(url: str, conc: int) -> dict:
        """One closed loop at ``conc``, with the CPU it took: the gateway's, its core's (busy
        and all), and the load generator's and stubs' together."""
        cpu0, (busy0, total0) = cpu_seconds(gw_pid), core_times(gw_core)
        side0 = time.process_time() + sum(cpu_seconds(p) for p in stub_pids)
        out = run(closed_loop(url, request_bytes(url, path, body), conc, duration=a.step_s))
        side = time.process_time() + sum(cpu_seconds(p) for p in stub_pids) - side0
        gw_cpu = cpu_seconds(gw_pid) - cpu0
        busy1, total1 = core_times(gw_core)
        return {"load": out, "gw_cpu": gw_cpu, "busy": busy1 - busy0, "total": total1 - total0,
                "side": side}

    steps, best, flat = [], 0.0, 0
    for conc in ladder:
        got = both_ways(partial(load, conc=conc), direct, gateway, a.rounds, progress, task)
        rates = {name: [r["load"].rate for r in runs] for name, runs in got.items()}
        gw = got["gateway"]
        gw_cpu = sum(r["gw_cpu"] for r in gw)
        gw_n = sum(len(r["load"].latencies) for r in gw)
        gw_t = sum(r["load"].elapsed for r in gw)
        core_busy, core_total = sum(r["busy"] for r in gw), sum(r["total"] for r in gw)
        side_cpu = sum(r["side"] for r in gw)
        d, g = statistics.median(rates["direct"]), statistics.median(rates["gateway"])
        steps.append({"concurrency": conc, "direct_rps": d, "gateway_rps": g, "ratio": g / d,
                      "gateway_rps_rounds": rates["gateway"], "direct_rps_rounds": rates["direct"],
                      "gateway_cpu_core_fraction": gw_cpu / gw_t,
                      "gateway_core_busy_fraction": core_busy / core_total if core_total else None,
                      "gateway_cpu_us_per_request": gw_cpu / gw_n * 1e6 if gw_n else None,
                      "client_and_stub_cpu_core_fraction": side_cpu / gw_t})
        if g > best * 1.05:
            best, flat = g, 0
        else:
            flat += 1
            if flat >= 2:  # two steps without growth: the peak is behind
                progress.update(task, completed=len(ladder) * a.rounds * 2)
                break
    peak = max(steps, key=lambda s: s["gateway_rps"])
    cpu_per = peak["gateway_cpu_us_per_request"]
    # the gateway's core busy (with the gateway, or with whatever else runs there)
    busy = peak["gateway_core_busy_fraction"] or peak["gateway_cpu_core_fraction"]
    limit = ("the gateway's core" if busy >= 0.9 or peak["gateway_cpu_core_fraction"] >= 0.9 else
             "the load generator and stub's core" if peak["client_and_stub_cpu_core_fraction"]
             >= 0.9 else "neither core is saturated (latency-bound)")
    return {"steps": steps, "peak": peak, "limited_by": limit,
            "one_core_rps_from_cpu": 1e6 / cpu_per if cpu_per else None}


def phase_stream(a, direct: str, gateway: str, progress: Progress) -> dict:
    """C: each event's delay and the gaps at the client, direct and through the gateway."""
    events, gap = a.stream_events, a.stream_gap_ms
    task = progress.add_task("C streaming", total=a.rounds * 2)
    got = both_ways(lambda url: run(one_stream(url, events, gap)), direct, gateway, a.rounds,
                    progress, task)
    out = {"events": events, "gap_ms": gap}
    for name, runs in got.items():
        delays = [d for r in runs for d in r["delays"]]
        gaps = [x for r in runs for x in r["gaps"]]
        out[name] = {"complete": all(r["events"] == events and r["done"] and r["status"] == 200
                                     for r in runs),
                     "delay_p50_ms": pct(delays, 50) * 1e3, "delay_max_ms": max(delays) * 1e3,
                     "gap_p50_ms": pct(gaps, 50) * 1e3, "gap_min_ms": min(gaps) * 1e3}
    # what the relay adds to each event: its delay through the gateway less the direct one
    out["added_delay_p50_ms"] = out["gateway"]["delay_p50_ms"] - out["direct"]["delay_p50_ms"]
    out["added_delay_max_ms"] = out["gateway"]["delay_max_ms"] - out["direct"]["delay_p50_ms"]
    # buffering shows as gaps that close up and delays that grow to whole gaps; a late event
    # now and then on a shared core is jitter (the worst event is reported beside it)
    g = out["gateway"]
    out["unbuffered"] = (g["complete"] and g["delay_p50_ms"] < gap / 2
                         and 0.75 * gap <= g["gap_p50_ms"] <= 1.25 * gap)
    return out


# ----- the run ------------------------------------------------------------------------------
def report(doc: dict) -> None:
    t = table("A. latency per request (ms): straight to the stub vs through the gateway",
              ["kind", "conc", "direct p50", "direct p99", "gateway p50", "gateway p99",
               "added p50", "added p99", "added p50 by round", "p50 ratio"])
    for r in doc["latency"]:
        t.add_row(r["kind"], str(r["concurrency"]), f"{r['direct_p50_ms']:.3f}",
                  f"{r['direct_p99_ms']:.3f}", f"{r['gateway_p50_ms']:.3f}",
                  f"{r['gateway_p99_ms']:.3f}", f"{r['added_p50_ms']:.3f}",
                  f"{r['added_p99_ms']:.3f}",
                  " ".join(f"{x:.2f}" for x in r["added_p50_ms_per_round"]), f"{r['p50_ratio']:.2f}x")
    console.print(t)
    b = doc["rate"]
    t = table("B. completions per second at rising concurrency (closed loop)",
              ["conc", "direct req/s", "gateway req/s", "gateway/direct", "gateway CPU (core)",
               "its core busy (all)", "gateway CPU us/req", "client+stub CPU (core)"])
    for s in b["steps"]:
        t.add_row(str(s["concurrency"]), f"{s['direct_rps']:.0f}", f"{s['gateway_rps']:.0f}",
                  f"{s['ratio']:.2f}", f"{s['gateway_cpu_core_fraction']:.0%}",
                  f"{s['gateway_core_busy_fraction'] or 0:.0%}",
                  f"{s['gateway_cpu_us_per_request']:.0f}",
                  f"{s['client_and_stub_cpu_core_fraction']:.0%}")
    console.print(t)
    c = doc["stream"]
    t = table(f"C. a stream of {c['events']} events {c['gap_ms']:g} ms apart "
              "(delay: the stub's send to the client's read)",
              ["", "complete", "delay p50 ms", "delay max ms", "gap p50 ms", "gap min ms"])
    for name in ("direct", "gateway"):
        x = c[name]
        t.add_row(name, str(x["complete"]), f"{x['delay_p50_ms']:.3f}", f"{x['delay_max_ms']:.3f}",
                  f"{x['gap_p50_ms']:.2f}", f"{x['gap_min_ms']:.2f}")
    console.print(t)
    at = {c: [r for r in doc["latency"] if r["concurrency"] == c]
          for c in sorted({r["concurrency"] for r in doc["latency"]})}
    low = min(at)
    worst = max(r["added_p50_ms"] for r in at[low])
    peak = b["peak"]
    console.print(f"[bold]machine[/]: {doc['machine']['cpu']}, {doc['machine']['cores']} cores, "
                  f"avx512: {', '.join(doc['machine']['avx512']) or 'none'}; {doc['pinning']}")
    console.print(f"added latency p50 at concurrency {low}: " + ", ".join(
        f"{r['kind']} {r['added_p50_ms']:.3f} ms" for r in at[low]) + f" (target <= 2 ms: "
        f"{'met' if worst <= 2 else 'NOT met'})")
    for conc in [k for k in at if k != low]:
        console.print(f"  at concurrency {conc}: " + ", ".join(
            f"{r['kind']} {r['added_p50_ms']:.3f} ms" for r in at[conc])
            + f" (requests queue at the gateway once {conc} in flight reach its rate: ~{conc} / "
              f"{peak['gateway_rps']:.0f} req/s = {conc / peak['gateway_rps'] * 1e3:.1f} ms)")
    one_core = b["one_core_rps_from_cpu"]
    figure = peak["gateway_rps"] if b["limited_by"] == "the gateway's core" else one_core
    console.print(f"highest relayed rate: {peak['gateway_rps']:.0f} req/s at concurrency "
                  f"{peak['concurrency']} ({peak['ratio']:.2f}x the direct "
                  f"{peak['direct_rps']:.0f} req/s), gateway at "
                  f"{peak['gateway_cpu_core_fraction']:.0%} of its core, limited by "
                  f"{b['limited_by']}; its CPU per request implies {one_core:.0f} req/s on one "
                  f"full core (target >= 500: {'met' if figure >= 500 else 'NOT met'})")
    console.print(f"streaming: each event {c['added_delay_p50_ms']:.3f} ms later through the "
                  f"gateway at p50 (worst event {c['added_delay_max_ms']:.3f} ms), gaps kept "
                  f"(p50 {c['gateway']['gap_p50_ms']:.2f} ms of {c['gap_ms']:g}); "
                  f"{'relayed as it comes (no buffering)' if c['unbuffered'] else 'BUFFERED'}")
    console.print("[dim]figures from one run on a shared machine: preliminary[/]")


def main() -> None:
    p = parser(__doc__)
    p.add_argument("--gateway-child", help=argparse.SUPPRESS)
    p.add_argument("--quick", action="store_true", help="a short run (fewer requests, steps)")
    p.add_argument("--rounds", type=int, default=3, help="alternated rounds per measurement")
    add_model_argument(p, "tiny", "; its tokenizer is what the gateway counts tokens with")
    p.add_argument("--stubs", type=int, default=1, help="stub replicas behind the gateway")
    p.add_argument("--router", default=None, help="the gateway's routing rule")
    p.add_argument("--latency-concurrency", type=int, nargs="+", default=[1, 8])
    p.add_argument("--max-concurrency", type=int, default=128)
    p.add_argument("--step-s", type=float, default=None, help="seconds per rate measurement")
    p.add_argument("--stream-events", type=int, default=None)
    p.add_argument("--stream-gap-ms", type=float, default=20.0)
    p.add_argument("--gateway-log-level", default="warning",
                   help="the gateway's --log-level (info logs a line per request)")
    p.add_argument("--json", type=Path, help="write the figures here")
    p.add_argument("--profile-gateway", type=Path, help="cProfile the gateway's main thread "
                   "into this file (read: python -m pstats FILE); its figures are then slower")
    a = p.parse_args()
    if a.gateway_child:
        gateway_child(json.loads(a.gateway_child))
        return
    a.step_s = a.step_s or (0.5 if a.quick else 1.0)
    a.stream_events = a.stream_events or (10 if a.quick else 25)
    if a.quick:
        a.rounds = min(a.rounds, 2)
    _, _, pinning = cores()
    with model_dir(a.model, "tiny", "tiny-llama") as model:
        console.print(f"{pinning}; model {model if a.model else '(tiny llama)'}; "
                      f"{a.stubs} stub replica(s); {a.rounds} alternated rounds")
        with processes(a, str(model)) as (direct, gateway, gw_pid, stub_pids):
            with Progress(console=console, transient=True) as progress:
                latency = phase_latency(a, direct, gateway, progress)
                rate = phase_rate(a, direct, gateway, gw_pid, stub_pids, progress)
                stream = phase_stream(a, direct, gateway, progress)
    doc = {"machine": machine(), "pinning": pinning, "rounds": a.rounds, "quick": a.quick,
           "stubs": a.stubs, "latency": latency, "rate": rate, "stream": stream,
           "note": "one run on a shared machine: preliminary figures"}
    report(doc)
    if a.json:
        write_json(doc, a.json)
        console.print(f"wrote {a.json}")


if __name__ == "__main__":
    main()
