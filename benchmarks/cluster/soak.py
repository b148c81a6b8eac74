"""A soak with faults: mixed load on ``orthrus-real serve --replicas R --auto-restart`` while
replicas are SIGKILLed, stalled (SIGSTOP, then SIGCONT) and sent bursts of bad requests.

What a cluster must survive in production, with real parts: a real gateway and real engine
processes, real HTTP from ``--clients`` closed-loop clients (embeddings, completions and chat,
streamed and not), and real signals on the replicas' pids (``GET /admin/replicas``). Before any
fault each greedy prompt of a fixed set is answered once; during the soak every greedy answer
to one of them must be that text exactly (a migrated stream too: concatenated deltas). Every
request must end ok, or with a clear 4xx for bad input (each body of the fuzz corpus) or a 422
``request_quarantined`` for poison; a connection error or a timeout is a request lost.

Hard checks (exit code 1 when one fails): no request lost, no unexpected failure (a 5xx such as
``replica_failed``, an error event mid-stream, a stream without ``[DONE]``, a corpus body not
answered by an OpenAI-shaped 4xx), no greedy answer different from its reference, and at the
end KV blocks used and requests in flight 0 on every replica. Figures (reported, flagged): p99
latency while a fault is active against the fault-free p99 (target: within 3x) and the
gateway's RSS growth after warm-up (target: under 5 %).

The fault schedule is fixed by ``--seed``, ``--minutes`` and ``--kill-every``: a SIGKILL every
``--kill-every`` seconds (round-robin over the replicas), a stall of another replica half-way
between two kills and a burst of bad requests a quarter of the way; each one logged with its
time since the start (stdout and ``--json``).

Run: python -m benchmarks.cluster.soak [--minutes 30] [--replicas 3] [--clients 12]
     [--kill-every 120] [--stall-s 5] [--model DIR] [--json soak.json]
CI:  python -m benchmarks.cluster.soak --minutes 2 --kill-every 30 --replicas 2 --clients 4
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx
import numpy as np
from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

from benchmarks.common import ROOT, model_dir, parser, percentile, python_module, rss_mb, stop, table

console = Console() if sys.stdout.isatty() else Console(width=130)  # a log: wide, not wrapped
PATHS = {"embedding": "/v1/embeddings", "completion": "/v1/completions",
         "completion_stream": "/v1/completions", "chat": "/v1/chat/completions",
         "chat_stream": "/v1/chat/completions"}
MIX = {"embedding": 0.3, "completion": 0.2, "completion_stream": 0.25, "chat": 0.1,
       "chat_stream": 0.15}
# --mix: the soak's own, or the chaos run of docs/cluster.md (half embeddings, half completions)
MIXES = {"soak": MIX, "chaos": {"embedding": 0.5, "completion": 0.25, "completion_stream": 0.25}}
GREEDY_PROMPTS = ("The soak test's first prompt: a replica", "Second prompt, about the gateway",
                  "third: what a stream must carry", "4th prompt with digits 0 1 2 3")
GREEDY_SIZES = (8, 32, 96)
SAMPLED_SIZES = (4, 16, 64, 128)
WORDS = ("alpha", "beta", "gamma", "delta", "replica", "gateway", "stream", "token", "embed",
         "kill", "stall", "burst", "lorem", "ipsum", "cache", "block")
ERROR_KEYS = {"message", "type", "param", "code"}
HARD_FAILURES = ("4xx", "5xx", "stream_error", "bad_answer", "corpus_wrong")
LOST = ("lost_connection", "lost_timeout")


# ----- records ----------------------------------------------------------------------------------
@dataclass
class Record:
    """One request's fate; times in seconds since the soak's start."""

    kind: str
    start: float
    end: float = 0.0
    outcome: str = "ok"  # ok | bad_input | quarantined | 4xx | 5xx | stream_error | bad_answer |
    #                      corpus_wrong | lost_connection | lost_timeout
    status: int | None = None
    code: str | None = None
    detail: str = ""
    replica: str | None = None
    retries: int | None = None  # the gateway's x-orthrus-retries, when it sends one
    reference: str | None = None  # the greedy reference this answer must equal
    mismatch: bool = False
    faults: list[int] = field(default_factory=list)  # kill/stall windows it overlapped
    text: str | None = field(default=None, repr=False)  # a generation's text (references)

    @property
    def latency(self) -> float:
        return self.end - self.start


@dataclass
class Fault:
    """One injected fault; ``until``: the end of its window (replica back up, stall over)."""

    id: int
    kind: str  # kill | stall | burst
    at: float
    replica: int | None = None
    pid: int | None = None
    until: float | None = None
    note: str = ""
    events: list[tuple[float, str]] = field(default_factory=list)


@dataclass
class Soak:
    """Everything the run accumulates (one instance, shared by the tasks)."""

    url: str
    t0: float
    records: list[Record] = field(default_factory=list)
    faults: list[Fault] = field(default_factory=list)
    rss: list[tuple[float, float]] = field(default_factory=list)
    log: list[tuple[float, str]] = field(default_factory=list)  # the cluster's own output
    pending: dict[int, tuple[str, float]] = field(default_factory=dict)  # client -> (kind, start)
    stop: bool = False

    def now(self) -> float:
        return time.monotonic() - self.t0

    def note(self, fault: Fault, text: str) -> None:
        """A fault's event, logged with its time (stdout and the JSON)."""
        t = self.now()
        fault.events.append((round(t, 2), text))
        console.print(f"[bold yellow]t={t:7.1f}s[/] fault {fault.id} {fault.kind}: {text}")


# ----- the cluster ------------------------------------------------------------------------------
def default_devices(replicas: int) -> str:
    """One core per replica in turn (cpu:0,cpu:1,cpu:0 on 2 cores): as tests/test_cluster.py."""
    cores = os.cpu_count() or 1
    return ",".join(f"cpu:{i % cores}" for i in range(replicas))


def start_cluster(model: Path, port: int, args, soak_log: list[tuple[float, str]]) -> subprocess.Popen:
    """The ``serve`` child (the gateway process itself; the replicas are its children), its
    output kept with its (monotonic) times so the gateway's own down/back lines land beside
    the faults."""
    cmd = python_module("orthrus_real.cli", "serve", "--model", str(model), "--port", str(port),
                        "--replicas", str(args.replicas), "--auto-restart", "--devices",
                        args.devices or default_devices(args.replicas), "--threads", "1",
                        "--kv-cache-tokens", str(args.kv_cache_tokens))
    if args.router:
        cmd += ["--router", args.router]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, cwd=ROOT)

    def read() -> None:
        for raw in proc.stdout:
            soak_log.append((time.monotonic(), raw.decode(errors="replace").rstrip()))

    threading.Thread(target=read, daemon=True).start()
    return proc


async def replicas(control: httpx.AsyncClient) -> list[dict]:
    try:
        return (await control.get("/admin/replicas")).json()["replicas"]
    except (httpx.HTTPError, ValueError, KeyError):
        return []


async def metrics(control: httpx.AsyncClient) -> dict[str, float]:
    """The cluster's /metrics, the ``replica`` label summed out."""
    from orthrus_real.cluster.metrics_text import sum_replicas
    from orthrus_real.measure.bench import parse_prometheus

    text = (await control.get("/metrics")).text
    return sum_replicas(parse_prometheus(text))[0]


def family(samples: dict[str, float], name: str) -> float | None:
    """The sum of every sample of ``name`` (any labels; ``_total`` counted once), None if absent."""
    hits = [v for k, v in samples.items()
            if k.partition("{")[0] in (name, name + "_total")]
    return sum(hits) if hits else None


# ----- the load ---------------------------------------------------------------------------------
def words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


def greedy_body(kind: str, prompt: str, size: int) -> dict:
    body = {"max_tokens": size, "temperature": 0, "ignore_eos": True}
    if kind.startswith("chat"):
        body["messages"] = [{"role": "user", "content": prompt}]
    else:
        body["prompt"] = prompt
    if kind.endswith("_stream"):
        body["stream"] = True
    return body


def ref_key(kind: str, prompt: int, size: int) -> str:
    """One reference per endpoint and mode: a streamed answer is judged against the streamed
    fault-free text (how the server's streamed and whole texts compare is reported apart)."""
    return f"{kind}/{prompt}/{size}"


def next_request(rng: random.Random, kinds: dict[str, float]) -> tuple[str, dict, str | None]:
    """The next request of a client: ``(kind, body, reference key or None)``."""
    kind = rng.choices(list(kinds), weights=list(kinds.values()))[0]
    if kind == "embedding":
        n = rng.choice((1, 1, 2, 4))
        texts = [words(rng, rng.randint(3, 40)) for _ in range(n)]
        return kind, {"input": texts[0] if n == 1 else texts}, None
    if rng.random() < 0.6:
        p, size = rng.randrange(len(GREEDY_PROMPTS)), rng.choice(GREEDY_SIZES)
        return kind, greedy_body(kind, GREEDY_PROMPTS[p], size), ref_key(kind, p, size)
    body = greedy_body(kind, words(rng, rng.randint(2, 30)), rng.choice(SAMPLED_SIZES))
    body.update(temperature=0.9, seed=rng.randrange(1 << 31))
    return kind, body, None


def error_of(resp_text: str) -> tuple[str | None, bool]:
    """``(error code, whether the body is OpenAI's error shape)``."""
    try:
        err = json.loads(resp_text)["error"]
        return err.get("code"), isinstance(err, dict) and set(err) == ERROR_KEYS
    except (ValueError, KeyError, TypeError, AttributeError):
        return None, False


def classify_status(rec: Record, status: int, text: str) -> None:
    rec.status = status
    code, shaped = error_of(text)
    rec.code = code
    rec.detail = text[:300]
    if status == 422 and code == "request_quarantined":
        rec.outcome = "quarantined"
    elif 400 <= status < 500:
        rec.outcome = "4xx"
    else:
        rec.outcome = "5xx"


async def send(soak: Soak, client: httpx.AsyncClient, kind: str, body: dict,
               ref: str | None, refs: dict[str, str], total_timeout: float = 600.0) -> Record:
    """One request of the load, timed and judged (status, stream end, reference text); one
    not over within ``total_timeout`` (a stream that trickles on) is lost."""
    rec = Record(kind, soak.now(), reference=ref)
    try:
        async with asyncio.timeout(total_timeout):
            await exchange(rec, client, kind, body, refs)
    except (httpx.TimeoutException, TimeoutError) as exc:
        rec.outcome, rec.detail = "lost_timeout", f"{type(exc).__name__}: {exc}"[:300]
    except httpx.HTTPError as exc:
        rec.outcome, rec.detail = "lost_connection", f"{type(exc).__name__}: {exc}"[:300]
    except (ValueError, KeyError, TypeError, AttributeError) as exc:  # an answer not as specified
        rec.outcome, rec.detail = "bad_answer", f"{type(exc).__name__}: {exc}"[:300]
    rec.end = soak.now()
    return rec


async def exchange(rec: Record, client: httpx.AsyncClient, kind: str, body: dict,
                   refs: dict[str, str]) -> None:
    """Send ``body`` and judge what comes back into ``rec`` (raises on a transport error)."""
    if body.get("stream"):
        text, done, error = [], False, None
        async with client.stream("POST", PATHS[kind], json=body) as r:
            rec.replica, rec.retries = r.headers.get("x-orthrus-replica"), retries_of(r)
            if r.status_code != 200:
                classify_status(rec, r.status_code, (await r.aread()).decode(errors="replace"))
            else:
                rec.status = 200
                async for line in r.aiter_lines():
                    if not line.startswith("data: "):
                        continue
                    if line == "data: [DONE]":
                        done = True
                        continue
                    doc = json.loads(line[6:])
                    if "error" in doc:
                        error = doc["error"]
                        continue
                    for choice in doc.get("choices", []):
                        text.append(choice.get("text") or (choice.get("delta") or {})
                                    .get("content") or "")
        if rec.status == 200:
            if error is not None:
                rec.outcome, rec.code = "stream_error", error.get("code")
                rec.detail = str(error.get("message"))[:300]
            elif not done:
                rec.outcome, rec.detail = "bad_answer", "the stream ended without [DONE]"
            else:
                judge_text(rec, "".join(text), refs)
    else:
        r = await client.post(PATHS[kind], json=body)
        rec.replica, rec.retries = r.headers.get("x-orthrus-replica"), retries_of(r)
        if r.status_code != 200:
            classify_status(rec, r.status_code, r.text)
        else:
            rec.status = 200
            judge_answer(rec, kind, body, r.json(), refs)


def retries_of(r: httpx.Response) -> int | None:
    value = r.headers.get("x-orthrus-retries")
    return int(value) if value and value.isdigit() else None


def judge_text(rec: Record, text: str, refs: dict[str, str]) -> None:
    """A greedy answer must be its reference exactly; the first difference is kept."""
    rec.text = text
    ref = refs.get(rec.reference) if rec.reference is not None else None
    if ref is None or text == ref:
        return
    rec.mismatch = True
    i = next((i for i, (a, b) in enumerate(zip(text, ref)) if a != b), min(len(text), len(ref)))
    rec.detail = (f"differs at character {i} of {len(text)} (reference {len(ref)}): got "
                  f"{text[max(i - 10, 0):i + 30]!r}, reference {ref[max(i - 10, 0):i + 30]!r}")


def judge_answer(rec: Record, kind: str, body: dict, doc: dict, refs: dict[str, str]) -> None:
    """A 200 must hold what was asked: a vector per input, the tokens asked, the greedy text."""
    if kind == "embedding":
        n = len(body["input"]) if isinstance(body["input"], list) else 1
        data = doc.get("data") or []
        if len(data) != n or not all(d.get("embedding") for d in data):
            rec.outcome, rec.detail = "bad_answer", f"{len(data)} embeddings for {n} inputs"
        return
    choice = (doc.get("choices") or [{}])[0]
    text = choice.get("text") if kind == "completion" else (choice.get("message") or {}).get("content")
    if text is None or doc.get("usage", {}).get("completion_tokens") != body["max_tokens"]:
        rec.outcome, rec.detail = "bad_answer", f"usage {doc.get('usage')}, text {text!r:.80}"
        return
    judge_text(rec, text, refs)


async def client_loop(soak: Soak, index: int, seed: int, kinds: dict[str, float],
                      refs: dict[str, str], timeout: float) -> None:
    """One closed-loop client: the next request as soon as the last one ended."""
    rng = random.Random(f"soak-{seed}-client-{index}")
    async with httpx.AsyncClient(base_url=soak.url, timeout=httpx.Timeout(timeout, connect=10)) as c:
        while not soak.stop:
            kind, body, ref = next_request(rng, kinds)
            soak.pending[index] = (kind, soak.now())
            rec = await send(soak, c, kind, body, ref, refs, 2 * timeout)
            del soak.pending[index]
            if not rec.mismatch:
                rec.text = None  # kept only where it tells something
            soak.records.append(rec)


async def references(url: str, kinds: dict[str, float]) -> dict[str, str]:
    """Each greedy prompt's text in each generation kind, asked once before any fault."""
    refs = {}
    async with httpx.AsyncClient(base_url=url, timeout=120) as c:
        soak = Soak(url, time.monotonic())
        for kind in kinds:
            if kind == "embedding":
                continue
            for p, prompt in enumerate(GREEDY_PROMPTS):
                for size in GREEDY_SIZES:
                    key = ref_key(kind, p, size)
                    rec = await send(soak, c, kind, greedy_body(kind, prompt, size), key, {})
                    if rec.outcome != "ok":
                        raise RuntimeError(f"reference {key}: {rec.outcome} {rec.status} {rec.detail}")
                    refs[key] = rec.text
    return refs


def stream_differences(refs: dict[str, str]) -> list[str]:
    """The greedy prompts whose streamed text (deltas joined) is not the whole answer's: the
    server's own streaming, fault-free (a figure: the soak judges each mode by its own)."""
    return sorted(k for k, v in refs.items() if "_stream/" in k
                  and refs.get(k.replace("_stream/", "/")) not in (None, v))


# ----- the fuzz corpus --------------------------------------------------------------------------
def corpus(max_model_len: int, max_body_bytes: int, max_inputs: int) -> list[tuple[str, str, bytes, str]]:
    """Bad requests, each ``(name, path, body, content type)``: every one must get a 4xx in
    OpenAI's error shape (never a 5xx, never a 200)."""
    E, C, H = "/v1/embeddings", "/v1/completions", "/v1/chat/completions"
    J = "application/json"

    def j(doc) -> bytes:
        return json.dumps(doc).encode()

    return [
        ("malformed_json_embedding", E, b'{"input": "abc"', J),
        ("malformed_json_completion", C, b'{"prompt": [1, 2,', J),
        ("not_json", C, b"hello there", J),
        ("empty_body", E, b"", J),
        ("json_array_body", E, b"[1, 2, 3]", J),
        ("json_null_body", C, b"null", J),
        ("input_wrong_type", E, j({"input": 5}), J),
        ("input_object", E, j({"input": {"a": 1}}), J),
        ("prompt_wrong_type", C, j({"prompt": True}), J),
        ("max_tokens_string", C, j({"prompt": "hi", "max_tokens": "ten"}), J),
        ("unknown_field_embedding", E, j({"input": "hi", "frobnicate": 1}), J),
        ("unknown_field_chat", H, j({"messages": [{"role": "user", "content": "hi"}], "foo": 1}), J),
        ("empty_prompt", C, j({"prompt": ""}), J),
        ("empty_input", E, j({"input": ""}), J),
        ("empty_input_list", E, j({"input": []}), J),
        ("empty_messages", H, j({"messages": []}), J),
        ("bad_role", H, j({"messages": [{"role": "wizard", "content": "hi"}]}), J),
        ("max_tokens_over_model_length", C, j({"prompt": "hi", "max_tokens": max_model_len + 1}), J),
        ("negative_max_tokens", C, j({"prompt": "hi", "max_tokens": -1}), J),
        ("huge_temperature", C, j({"prompt": "hi", "temperature": 1e308}), J),
        ("negative_temperature", H, j({"messages": [{"role": "user", "content": "hi"}],
                                       "temperature": -1}), J),
        ("zero_top_p", C, j({"prompt": "hi", "top_p": 0}), J),
        ("huge_seed", C, j({"prompt": "hi", "seed": 1 << 70}), J),
        ("token_id_out_of_vocab", C, j({"prompt": [10 ** 9]}), J),
        ("negative_token_id", E, j({"input": [[-1, 2]]}), J),
        ("lone_surrogate_input", E, b'{"input": "\\udfff"}', J),
        ("lone_surrogate_prompt", C, b'{"prompt": "a\\ud800b", "max_tokens": 2}', J),
        ("lone_surrogate_chat", H, b'{"messages": [{"role": "user", "content": "\\udfff"}]}', J),
        ("wrong_model", E, j({"model": "no-such-model", "input": "hi"}), J),
        ("too_many_inputs", E, j({"input": ["x"] * (max_inputs + 1)}), J),
        ("body_over_size_limit", E, j({"input": "x" * (max_body_bytes + 1024)}), J),
        ("wrong_content_type", E, j({"input": "hi"}), "text/plain"),
        ("n_unsupported", C, j({"prompt": "hi", "n": 2}), J),
        ("stream_options_without_stream", C, j({"prompt": "hi", "stream_options":
                                                {"include_usage": True}}), J),
    ]


async def burst(soak: Soak, fault: Fault, bad: list[tuple[str, str, bytes, str]]) -> None:
    """Every corpus body at once; each must get an OpenAI-shaped 4xx."""
    async def one(c: httpx.AsyncClient, name: str, path: str, content: bytes, ctype: str) -> Record:
        rec = Record(f"bad:{name}", soak.now())
        try:
            r = await c.post(path, content=content, headers={"content-type": ctype})
            rec.status, rec.replica = r.status_code, r.headers.get("x-orthrus-replica")
            rec.code, shaped = error_of(r.text)
            rec.detail = r.text[:300]
            if 400 <= r.status_code < 500 and shaped:
                rec.outcome = ("quarantined" if r.status_code == 422 and rec.code ==
                               "request_quarantined" else "bad_input")
            else:
                rec.outcome = "corpus_wrong"
        except httpx.TimeoutException as exc:
            rec.outcome, rec.detail = "lost_timeout", f"{type(exc).__name__}: {exc}"[:300]
        except httpx.HTTPError as exc:
            rec.outcome, rec.detail = "lost_connection", f"{type(exc).__name__}: {exc}"[:300]
        rec.end = soak.now()
        return rec

    async with httpx.AsyncClient(base_url=soak.url, timeout=60) as c:
        recs = await asyncio.gather(*(one(c, *item) for item in bad))
    soak.records.extend(recs)
    wrong = [r for r in recs if r.outcome != "bad_input"]
    fault.until = soak.now()
    soak.note(fault, f"{len(recs)} bad requests: {len(recs) - len(wrong)} got a clear 4xx"
              + (f"; NOT: {', '.join(f'{r.kind[4:]}={r.status}' for r in wrong)}" if wrong else ""))


# ----- faults -----------------------------------------------------------------------------------
def schedule(duration: float, kill_every: float, seed: int, n_replicas: int,
             faults: tuple[str, ...] = ("burst", "kill", "stall"),
             max_kills: int | None = None) -> list[tuple[float, str, int]]:
    """``(at, kind, intended replica)``, fixed by the arguments: a kill every ``kill_every``
    (round-robin from ``seed``, at most ``max_kills``), a stall of the next replica half-way
    between kills, a burst a quarter of the way, of the ``faults`` kinds only; none in the last
    10 s (the cluster settles before the end checks)."""
    out = []
    k = 0
    while True:
        base = k * kill_every
        if base + kill_every * 0.25 >= duration - 10:
            break
        victim = (seed + k) % n_replicas
        for offset, kind, replica in ((0.25, "burst", -1), (1.0, "kill", victim),
                                      (1.5, "stall", (victim + 1) % n_replicas)):
            at = base + kill_every * offset
            if at < duration - 10 and kind in faults:
                out.append((round(at, 3), kind, replica))
        k += 1
    if max_kills is not None:  # the first ones only
        kills = [f for f in sorted(out) if f[1] == "kill"][max_kills:]
        out = [f for f in out if f not in kills]
    return sorted(out)


async def wait_all_up(control: httpx.AsyncClient, timeout: float) -> list[dict]:
    """``/admin/replicas`` once every replica is up, or as it is when ``timeout`` runs out."""
    deadline = time.monotonic() + timeout
    while True:
        reps = await replicas(control)
        if (reps and all(r["up"] for r in reps)) or time.monotonic() > deadline:
            return reps
        await asyncio.sleep(0.2)


def pick(reps: list[dict], intended: int) -> dict | None:
    """The intended replica if up, else the next one up in round-robin order; never leave no
    replica up."""
    up = [r for r in reps if r["up"] and r["pid"]]
    if len(up) < 2:
        return None
    n = len(reps)
    for i in range(n):
        cand = reps[(intended + i) % n]
        if cand["up"] and cand["pid"]:
            return cand
    return None


async def watch_back(soak: Soak, control: httpx.AsyncClient, fault: Fault, old_pid: int,
                     seen_down: bool = False, timeout: float = 300.0) -> None:
    """Until the replica is up again on a new pid: its window's end."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        rep = next((r for r in await replicas(control) if r["replica"] == fault.replica), None)
        if rep is not None:
            if not rep["up"] and not seen_down:
                seen_down = True
                soak.note(fault, f"the gateway took replica {fault.replica} down "
                                 f"({rep.get('last_exit')})")
            if rep["up"] and rep["pid"] != old_pid:
                fault.until = soak.now()
                soak.note(fault, f"replica {fault.replica} back up (pid {rep['pid']}, "
                                 f"restarts {rep['restarts']}) after {fault.until - fault.at:.1f} s")
                return
        await asyncio.sleep(0.2)
    fault.until = soak.now()
    soak.note(fault, f"replica {fault.replica} NOT back within {timeout:.0f} s")


async def take_victim(soak: Soak, control: httpx.AsyncClient, fault: Fault, intended: int,
                      wait_up: float) -> dict | None:
    """The replica a kill or stall hits (after waiting, at most ``wait_up``, for every one to be
    up, so faults do not pile up), noted in ``fault``; None (the fault skipped) when fewer than
    two are up."""
    victim = pick(await wait_all_up(control, wait_up), intended)
    if victim is None:
        fault.until = fault.at
        soak.note(fault, "skipped: fewer than 2 replicas up")
        return None
    fault.replica, fault.pid = victim["replica"], victim["pid"]
    fault.at = soak.now()
    return victim


async def kill(soak: Soak, control: httpx.AsyncClient, fault: Fault, intended: int,
               wait_up: float) -> None:
    """SIGKILL a replica up (after waiting, at most ``wait_up``, for every one to be up, so
    faults do not pile up); its window lasts until ``--auto-restart`` has it back."""
    victim = await take_victim(soak, control, fault, intended, wait_up)
    if victim is None:
        return
    try:
        os.kill(victim["pid"], signal.SIGKILL)
        soak.note(fault, f"SIGKILL replica {fault.replica} (pid {fault.pid}, {victim['in_flight']} "
                         f"in flight)")
    except ProcessLookupError:
        soak.note(fault, f"replica {fault.replica} (pid {fault.pid}) was already gone")
    await watch_back(soak, control, fault, victim["pid"])


async def stall(soak: Soak, control: httpx.AsyncClient, fault: Fault, intended: int,
                wait_up: float, stall_s: float, grace_s: float) -> None:
    """SIGSTOP for ``stall_s``, then SIGCONT. The gateway's health probe may take the stalled
    replica down and kill it first (expected): then the window lasts until it is back."""
    victim = await take_victim(soak, control, fault, intended, wait_up)
    if victim is None:
        return
    try:
        os.kill(fault.pid, signal.SIGSTOP)
    except ProcessLookupError:
        fault.until = fault.at
        soak.note(fault, f"replica {fault.replica} (pid {fault.pid}) was already gone")
        return
    soak.note(fault, f"SIGSTOP replica {fault.replica} (pid {fault.pid}, {victim['in_flight']} "
                     f"in flight) for {stall_s:g} s")
    taken_down = None
    deadline = time.monotonic() + stall_s
    try:
        while time.monotonic() < deadline:
            rep = next((r for r in await replicas(control) if r["replica"] == fault.replica), None)
            if rep is not None and (not rep["up"] or rep["pid"] != fault.pid) and taken_down is None:
                taken_down = soak.now() - fault.at
                soak.note(fault, f"the gateway took the stalled replica down after "
                                 f"{taken_down:.1f} s ({rep.get('last_exit')})")
            await asyncio.sleep(0.2)
    finally:  # however the soak ends, no replica is left stopped
        try:
            os.kill(fault.pid, signal.SIGCONT)
            soak.note(fault, f"SIGCONT replica {fault.replica}")
        except ProcessLookupError:
            soak.note(fault, f"SIGCONT: replica {fault.replica} (pid {fault.pid}) is gone (killed "
                             f"by the gateway)")
    if taken_down is None:  # it may still be taken down now that probes fail late
        await asyncio.sleep(grace_s)
        rep = next((r for r in await replicas(control) if r["replica"] == fault.replica), None)
        if rep is not None and (not rep["up"] or rep["pid"] != fault.pid):
            taken_down = soak.now() - fault.at
            soak.note(fault, f"the gateway took the replica down after the stall "
                             f"({rep.get('last_exit')})")
        else:
            fault.until = soak.now()
            soak.note(fault, f"replica {fault.replica} served on after the stall")
            return
    await watch_back(soak, control, fault, fault.pid, seen_down=True)
    fault.note = f"taken down {taken_down:.1f} s after SIGSTOP"


async def fault_loop(soak: Soak, plan: list[tuple[float, str, int]], args,
                     bad: list[tuple[str, str, bytes, str]]) -> None:
    """Each planned fault at its time, in its own task (a kill's recovery overlaps the next)."""
    tasks = []
    async with httpx.AsyncClient(base_url=soak.url, timeout=10) as control:
        wait_up = min(args.kill_every / 2, 60)
        for at, kind, replica in plan:
            await asyncio.sleep(max(at - soak.now(), 0))
            if soak.stop:
                break
            fault = Fault(len(soak.faults), kind, soak.now())
            soak.faults.append(fault)
            if kind == "burst":
                tasks.append(asyncio.create_task(burst(soak, fault, bad)))
            elif kind == "kill":
                tasks.append(asyncio.create_task(kill(soak, control, fault, replica, wait_up)))
            else:
                tasks.append(asyncio.create_task(stall(soak, control, fault, replica, wait_up,
                                                       args.stall_s, args.stall_grace_s)))
        await asyncio.gather(*tasks)


async def rss_loop(soak: Soak, pid: int, every: float) -> None:
    while not soak.stop:
        mb = rss_mb(pid)
        if mb is not None:
            soak.rss.append((round(soak.now(), 2), round(mb, 2)))
        await asyncio.sleep(every)


async def progress_loop(soak: Soak, progress: Progress, task, duration: float) -> None:
    while not soak.stop:
        counts = outcome_counts(soak.records)
        lost = sum(counts.get(k, 0) for k in LOST)
        failed = sum(counts.get(k, 0) for k in HARD_FAILURES)
        mism = sum(r.mismatch for r in soak.records)
        progress.update(task, completed=min(soak.now(), duration),
                        description=f"{len(soak.records)} req, ok {counts.get('ok', 0)}, "
                                    f"failed {failed}, lost {lost}, mismatch {mism}, "
                                    f"faults {len(soak.faults)}")
        await asyncio.sleep(1.0)


# ----- the report -------------------------------------------------------------------------------
def outcome_counts(records: list[Record]) -> dict[str, int]:
    out: dict[str, int] = {}
    for r in records:
        out[r.outcome] = out.get(r.outcome, 0) + 1
    return out


def latency_figures(records: list[Record], fault_kinds: dict[int, str]) -> dict:
    """p50/p99 of ok load requests (the corpus left out), fault-free against during a kill or
    stall window (both, and each kind of fault apart), overall and by kind."""
    def part(values: list[float]) -> dict:
        return {"n": len(values), "p50": percentile(values, 50, digits=4),
                "p99": percentile(values, 99, digits=4)}

    def split(recs):
        free = [r.latency for r in recs if not r.faults]
        during = [r.latency for r in recs if r.faults]
        p99f, p99d = percentile(free, 99, digits=4), percentile(during, 99, digits=4)
        return {"fault_free": part(free), "during_faults": part(during),
                "p99_ratio": round(p99d / p99f, 3) if p99f and p99d is not None else None}

    ok = [r for r in records if r.outcome == "ok" and not r.kind.startswith("bad:")]
    doc = split(ok)
    for kind in ("kill", "stall"):
        during = part([r.latency for r in ok if any(fault_kinds[f] == kind for f in r.faults)])
        free = doc["fault_free"]["p99"]
        during["p99_ratio"] = round(during["p99"] / free, 3) if free and during["p99"] else None
        doc[f"during_{kind}"] = during
    doc["by_kind"] = {k: split([r for r in ok if r.kind == k]) for k in MIX
                      if any(r.kind == k for r in ok)}
    return doc


def rss_figures(samples: list[tuple[float, float]], duration: float, warmup: float) -> dict:
    """The gateway's RSS: the mean over the first 10 % of the run after a warm-up of
    ``warmup`` of it, against the mean of the last 10 % of samples."""
    if not samples:
        return {"samples": 0}
    base = [mb for t, mb in samples if warmup * duration <= t < (warmup + 0.1) * duration]
    tail = [mb for _, mb in samples[-max(len(samples) // 10, 1):]]
    base = base or [samples[0][1]]
    growth = (np.mean(tail) / np.mean(base) - 1) * 100
    return {"samples": len(samples), "start_mb": samples[0][1],
            "after_warmup_mb": round(float(np.mean(base)), 2),
            "end_mb": round(float(np.mean(tail)), 2), "max_mb": max(mb for _, mb in samples),
            "growth_pct": round(float(growth), 2)}


def gateway_events(log: list[tuple[float, str]], t0: float) -> list[tuple[float, str]]:
    """The gateway's own lines about replicas going down and coming back, and its errors
    (times since the soak's start)."""
    keys = ("is down:", "is back:", "did not restart", "Traceback", "ERROR", "Error:")
    return [(round(t - t0, 2), line) for t, line in list(log) if any(k in line for k in keys)
            and not line.startswith("[replica")]


def report(doc: dict) -> None:
    """The rich table at the end."""
    t = table(f"soak: {doc['config']['minutes']} min, {doc['config']['replicas']} replicas, "
              f"{doc['config']['clients']} clients", ["value"], label="figure")
    t.add_column("check")
    for kind, outcomes in sorted(doc["by_kind"].items()):
        t.add_row(f"requests {kind}", ", ".join(f"{k} {v}" for k, v in sorted(outcomes.items())), "")
    bad = doc["corpus"]
    t.add_row("bad requests (corpus)", f"{bad['sent']} sent, {bad['clear_4xx']} clear 4xx", "")
    for name, check in doc["checks"].items():
        mark = "[green]ok[/]" if check["ok"] else ("[red]FAIL[/]" if check["hard"] else "[yellow]flag[/]")
        t.add_row(name, str(check["value"]), mark + ("" if check["hard"] else " (figure)"))
    lat = doc["latency"]
    for part in ("fault_free", "during_faults", "during_kill", "during_stall"):
        p = lat[part]
        t.add_row(f"latency {part.replace('_', ' ')}", f"n {p['n']}, p50 {p['p50']} s, p99 {p['p99']} s",
                  f"p99 x{p['p99_ratio']}" if p.get("p99_ratio") else "")
    rss = doc["rss"]
    if rss.get("samples"):
        t.add_row("gateway RSS", f"start {rss['start_mb']:.0f} MB, after warm-up "
                                 f"{rss['after_warmup_mb']:.0f} MB, end {rss['end_mb']:.0f} MB", "")
    for name, value in doc["gateway_counters"].items():
        t.add_row(name, "absent" if value is None else f"{value:g}", "")
    codes = doc["failure_codes"]
    if codes:
        t.add_row("failure codes", ", ".join(f"{k} {v}" for k, v in sorted(codes.items())), "")
    for f in sorted(doc["faults"], key=lambda f: f["at"]):
        t.add_row(f"fault {f['id']} {f['kind']} @ {f['at']:.1f} s",
                  f"replica {f['replica']}" if f["replica"] is not None else "",
                  (f"window {f['until'] - f['at']:.1f} s" if f["until"] is not None else "")
                  + (f"; {f['note']}" if f["note"] else ""))
    console.print(t)


def summarize(soak: Soak, args, duration: float, refs: dict[str, str], end: dict) -> dict:
    """Every figure, and the checks: hard ones fail the run, the others are flagged."""
    windows = [f for f in soak.faults if f.kind in ("kill", "stall") and f.until is not None
               and f.until > f.at]
    for r in soak.records:
        r.faults = [f.id for f in windows if r.start <= f.until and f.at <= r.end]
    load = [r for r in soak.records if not r.kind.startswith("bad:")]
    bad = [r for r in soak.records if r.kind.startswith("bad:")]
    counts = outcome_counts(soak.records)
    lost = sum(counts.get(k, 0) for k in LOST)
    failed = sum(counts.get(k, 0) for k in HARD_FAILURES)
    mismatches = [r for r in soak.records if r.mismatch]
    by_kind: dict[str, dict[str, int]] = {}
    for r in load:
        by_kind.setdefault(r.kind, {})
        by_kind[r.kind][r.outcome] = by_kind[r.kind].get(r.outcome, 0) + 1
    failure_codes: dict[str, int] = {}
    for r in soak.records:
        if r.outcome in HARD_FAILURES or r.outcome in LOST:
            key = f"{r.outcome}:{r.status or '-'}:{r.code or '-'}"
            failure_codes[key] = failure_codes.get(key, 0) + 1
    lat = latency_figures(soak.records, {f.id: f.kind for f in soak.faults})
    rss = rss_figures(soak.rss, duration, args.warmup)
    kv, in_flight = end.get("kv_blocks_used"), end.get("requests_in_flight")
    ratio = lat["p99_ratio"]
    streams = stream_differences(refs)
    checks = {
        "lost": {"value": lost, "ok": lost == 0, "hard": True},
        "unexpected_failures": {"value": failed, "ok": failed == 0, "hard": True},
        "reference_mismatches": {"value": len(mismatches), "ok": not mismatches, "hard": True},
        "kv_blocks_used_at_end": {"value": kv, "ok": kv == 0, "hard": True},
        "in_flight_at_end": {"value": in_flight, "ok": in_flight == 0, "hard": True},
        "corpus_clear_4xx": {"value": f"{counts.get('bad_input', 0)}/{len(bad)}",
                             "ok": all(r.outcome in ("bad_input", "quarantined") for r in bad),
                             "hard": True},
        # the soak sends no poison: a request quarantined here is one the gateway mistook for it
        "quarantined_without_poison": {"value": counts.get("quarantined", 0),
                                       "ok": not counts.get("quarantined"), "hard": False},
        "streamed_text_equals_whole": {"value": f"{len(streams)} prompt(s) differ",
                                       "ok": not streams, "hard": False},
        "p99_during_faults_over_fault_free": {"value": ratio, "ok": ratio is None or ratio <= 3.0,
                                              "hard": False},
        "gateway_rss_growth_pct": {"value": rss.get("growth_pct"),
                                   "ok": rss.get("growth_pct") is None or rss["growth_pct"] < 5.0,
                                   "hard": False},
    }
    return {
        "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "duration_s": round(duration, 2),
        "passed": all(c["ok"] for c in checks.values() if c["hard"]),
        "checks": checks,
        "requests": len(load), "by_kind": by_kind, "outcomes": counts,
        "failure_codes": failure_codes,
        "corpus": {"sent": len(bad), "clear_4xx": counts.get("bad_input", 0),
                   "wrong": [asdict(r) for r in bad if r.outcome != "bad_input"]},
        "lost": lost, "failed": failed,
        "quarantined": counts.get("quarantined", 0),
        "mismatches": [asdict(r) for r in mismatches],
        "retried_requests": sum(1 for r in soak.records if r.retries),
        "latency": lat, "rss": rss, "rss_samples": soak.rss,
        "faults": [asdict(f) for f in soak.faults],
        "gateway_events": gateway_events(soak.log, soak.t0),
        "gateway_counters": end.get("counters", {}),
        "end_metrics": end,
        "references": refs,
        "stream_differences": {k: {"streamed": refs[k], "whole": refs[k.replace("_stream/", "/")]}
                               for k in streams},
        "failures": [asdict(r) for r in soak.records
                     if r.outcome in HARD_FAILURES or r.outcome in LOST][:200],
        "records": [[r.kind, round(r.start, 3), round(r.end, 3), round(r.latency, 4), r.outcome,
                     r.status, r.code, r.replica, r.retries, r.mismatch, r.faults]
                    for r in soak.records],
        "records_columns": ["kind", "start", "end", "latency", "outcome", "status", "code",
                            "replica", "retries", "mismatch", "faults"],
    }


async def settle(url: str, timeout: float) -> dict:
    """After the load: every replica up again, then KV blocks used and in-flight 0 (aborted
    requests free theirs a moment later); the last values read, and the gateway's counters."""
    async with httpx.AsyncClient(base_url=url, timeout=10) as control:
        reps = await wait_all_up(control, timeout)
        deadline = time.monotonic() + 30
        while True:
            m = await metrics(control)
            kv, flying = family(m, "orthrus_kv_blocks_used"), family(m, "orthrus_requests_in_flight")
            if (kv == 0 and flying == 0) or time.monotonic() > deadline:
                break
            await asyncio.sleep(0.5)
        health = (await control.get("/health")).json()
    counters = {name: family(m, name) for name in (
        "orthrus_cluster_retries", "orthrus_cluster_migrations", "orthrus_cluster_quarantined",
        "orthrus_cluster_restarts")}
    return {"replicas_up": [r["up"] for r in reps], "kv_blocks_used": kv,
            "requests_in_flight": flying, "gateway_in_flight": sum(r["in_flight"] for r in
                                                                   health["replicas"]),
            "counters": counters, "health": health["status"]}


# ----- main -------------------------------------------------------------------------------------
async def soak_run(url: str, pid: int, args, soak_log: list) -> tuple[dict, float]:
    """References, then the load, the faults and the samplers for ``--minutes``; then the end
    checks. Returns every figure and the soak's time zero (monotonic)."""
    async with httpx.AsyncClient(base_url=url, timeout=30) as c:
        card = (await c.get("/v1/models")).json()["data"][0]
        chat = await c.post("/v1/chat/completions", json=greedy_body(
            "chat", "hello", 2))
    kinds = dict(MIXES[args.mix])
    if chat.status_code != 200 and "chat" in kinds:  # no chat template: its share goes to completions
        console.print(f"[yellow]no chat ({chat.status_code} {chat.text[:120]}): completions only")
        kinds["completion"] += kinds.pop("chat")
        kinds["completion_stream"] += kinds.pop("chat_stream")
    max_len = card.get("max_model_len") or 4096
    if max(GREEDY_SIZES + SAMPLED_SIZES) + 64 > max_len:
        raise SystemExit(f"the model's length {max_len} is too short for the soak's sizes")
    refs = await references(url, kinds)
    console.print(f"{len(refs)} greedy references taken before any fault; max_model_len {max_len}")
    bad = corpus(max_len, args.max_body_bytes, args.max_inputs)
    duration = args.minutes * 60
    plan = schedule(duration, args.kill_every, args.seed, args.replicas,
                    tuple(args.faults.split(",")), args.max_kills)
    soak = Soak(url, time.monotonic(), log=soak_log)
    console.print(f"fault plan: {len(plan)} faults: " + ", ".join(
        f"{k}@{a:.0f}s" + (f"(r{r})" if r >= 0 else "") for a, k, r in plan))
    with Progress(TextColumn("{task.description}"), BarColumn(), TimeElapsedColumn(),
                  TimeRemainingColumn(), console=console, transient=False) as progress:
        task = progress.add_task("starting", total=duration)
        clients = [asyncio.create_task(client_loop(soak, i, args.seed, kinds, refs,
                                                   args.request_timeout))
                   for i in range(args.clients)]
        side = [asyncio.create_task(rss_loop(soak, pid, args.rss_every)),
                asyncio.create_task(progress_loop(soak, progress, task, duration))]
        faults = asyncio.create_task(fault_loop(soak, plan, args, bad))
        await asyncio.sleep(duration)
        soak.stop = True
        console.print(f"t={soak.now():.1f}s: load stops; waiting for requests in flight")
        await asyncio.wait(clients, timeout=args.request_timeout + 30)
        for kind, start in soak.pending.values():  # never answered: lost
            soak.records.append(Record(kind, start, soak.now(), "lost_timeout",
                                       detail="still unanswered when the soak ended"))
        await asyncio.wait([faults], timeout=300)
        for t in [*side, faults, *clients]:
            t.cancel()
    try:
        end = await settle(url, 300)
    except (httpx.HTTPError, ValueError, KeyError) as exc:  # the gateway itself is gone
        end = {"error": f"{type(exc).__name__}: {exc}", "counters": {}}
        console.print(f"[red]the end checks could not read the cluster: {end['error']}")
    rss_after = rss_mb(pid)
    if rss_after is not None:
        soak.rss.append((round(soak.now(), 2), round(rss_after, 2)))
    return summarize(soak, args, duration, refs, end), soak.t0


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = parser(__doc__)
    p.add_argument("--minutes", type=float, default=30.0, help="how long the load runs")
    p.add_argument("--replicas", type=int, default=3)
    p.add_argument("--clients", type=int, default=12, help="closed-loop clients")
    p.add_argument("--kill-every", type=float, default=120.0, help="seconds between SIGKILLs")
    p.add_argument("--max-kills", type=int, default=None, help="at most this many SIGKILLs")
    p.add_argument("--faults", default="burst,kill,stall",
                   help="the kinds of fault: any of burst, kill, stall (comma-separated)")
    p.add_argument("--mix", choices=sorted(MIXES), default="soak",
                   help="the requests' mix: soak (every kind, chat too) or chaos (half "
                        "embeddings, half completions, streamed and not)")
    p.add_argument("--stall-s", type=float, default=5.0, help="how long a SIGSTOP lasts")
    p.add_argument("--stall-grace-s", type=float, default=3.0,
                   help="a stall's window: its end plus this")
    p.add_argument("--seed", type=int, default=0, help="fixes the load and the fault schedule")
    p.add_argument("--model", type=Path, default=None,
                   help="a model directory (default: a tiny seeded llama made in a temp dir)")
    p.add_argument("--devices", default=None, help="serve --devices (default: cpu:0,cpu:1,cpu:0...)")
    p.add_argument("--router", default=None, help="serve --router (default: the scenario's)")
    p.add_argument("--kv-cache-tokens", type=int, default=8192)
    p.add_argument("--max-body-bytes", type=int, default=1 << 20, help="serve's (its default)")
    p.add_argument("--max-inputs", type=int, default=256, help="serve's --max-inputs-per-request")
    p.add_argument("--request-timeout", type=float, default=120.0,
                   help="a request not answered within this is lost")
    p.add_argument("--rss-every", type=float, default=None,
                   help="seconds between RSS samples (default: the run / 200, 1-5 s)")
    p.add_argument("--warmup", type=float, default=0.1, help="fraction of the run before the "
                   "RSS baseline")
    p.add_argument("--start-timeout", type=float, default=300.0)
    p.add_argument("--json", type=Path, default=None, help="write every figure here")
    p.add_argument("--log", type=Path, default=None, help="write the cluster's output here")
    args = p.parse_args(argv)
    if args.rss_every is None:
        args.rss_every = min(max(args.minutes * 60 / 200, 1.0), 5.0)
    if args.replicas < 2:
        p.error("--replicas must be >= 2 (a fault must leave a replica serving)")
    unknown = set(args.faults.split(",")) - {"burst", "kill", "stall"}
    if unknown:
        p.error(f"--faults: {', '.join(sorted(unknown))} not a fault (burst, kill, stall)")
    return args


def main(argv: list[str] | None = None) -> int:
    """Run the soak; 0 when every hard check held, 1 otherwise."""
    args = parse_args(argv)
    with model_dir(args.model, "tiny", "llama", adapter_rank=4) as model:
        from orthrus_real.cluster.replicas import free_port
        from orthrus_real.server.serving import wait_healthy

        port = free_port()
        url = f"http://127.0.0.1:{port}"
        cluster_log: list[tuple[float, str]] = []
        t_log = time.monotonic()
        proc = start_cluster(model, port, args, cluster_log)
        try:
            wait_healthy(url, args.start_timeout, proc)  # the server's own wait
            console.print(f"cluster healthy at {url} ({args.replicas} replicas, gateway pid {proc.pid}) "
                          f"after {time.monotonic() - t_log:.1f} s")
            doc, t0 = asyncio.run(soak_run(url, proc.pid, args, cluster_log))
        except BaseException:
            console.print("\n".join(line for _, line in cluster_log[-60:]))
            raise
        finally:
            code = stop(proc, 90)  # the gateway drains, then each replica drains and exits
    doc["cluster_exit_code"] = code
    if args.log:
        args.log.write_text("".join(f"{t - t0:9.2f} {line}\n" for t, line in cluster_log))
    doc["cluster_log_tail"] = [line for _, line in cluster_log[-80:]]
    report(doc)
    if doc["gateway_events"]:
        console.print("gateway's own lines about replicas:")
        for t, line in doc["gateway_events"][:40]:
            console.print(f"  t={t:7.1f}s {line}", markup=False, highlight=False)
    if args.json:
        args.json.write_text(json.dumps(doc, indent=1, default=str) + "\n")
        console.print(f"figures written to {args.json}")
    console.print("[green]PASSED[/]: every hard check held" if doc["passed"]
                  else "[red]FAILED[/]: " + ", ".join(k for k, c in doc["checks"].items()
                                                      if c["hard"] and not c["ok"]))
    return 0 if doc["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
