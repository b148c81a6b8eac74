"""The soak with faults (``benchmarks/cluster/soak.py``), its CI version: two minutes of mixed load on
two replicas with ``--auto-restart``, a replica SIGKILLed every 30 s, a SIGSTOP/SIGCONT stall of
the other between kills and a burst of the bad-request corpus. No request may be lost or fail
(bad input gets its OpenAI-shaped 4xx, poison its 422), every greedy answer equals its
fault-free text, and KV blocks and in-flight requests are back to 0 at the end. The latency
ratio and the gateway's RSS growth are figures of the run, printed, not asserted."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SOAK = ROOT / "benchmarks" / "cluster" / "soak.py"


def soak_module():
    spec = importlib.util.spec_from_file_location("soak", SOAK)
    module = importlib.util.module_from_spec(spec)
    sys.modules["soak"] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


# ----- no processes ---------------------------------------------------------------------------
def test_the_fault_schedule_is_fixed_by_its_arguments():
    soak = soak_module()
    plan = soak.schedule(120, 30, 0, 2)
    assert plan == soak.schedule(120, 30, 0, 2)
    assert [(at, kind) for at, kind, _ in plan] == [
        (7.5, "burst"), (30.0, "kill"), (37.5, "burst"), (45.0, "stall"), (60.0, "kill"),
        (67.5, "burst"), (75.0, "stall"), (90.0, "kill"), (97.5, "burst"), (105.0, "stall")]
    kills = [r for _, kind, r in plan if kind == "kill"]
    assert kills == [0, 1, 0] and [r for _, k, r in soak.schedule(120, 30, 1, 2) if k == "kill"] == [1, 0, 1]
    # a stall is of another replica than the kill before it
    assert all(stall != kill for kill, stall in zip(kills, [r for _, k, r in plan if k == "stall"]))
    chaos = soak.schedule(40, 12, 0, 2, faults=("kill",), max_kills=1)  # the chaos run
    assert chaos == [(12.0, "kill", 0)]
    long = soak.schedule(30 * 60, 120, 0, 3)
    assert sum(k == "kill" for _, k, _ in long) == 14 and all(at < 30 * 60 - 10 for at, _, _ in long)


def test_the_corpus_is_bad_input_only_and_the_load_is_repeatable():
    soak = soak_module()
    bad = soak.corpus(4096, 1 << 20, 256)
    assert len(bad) >= 30 and len({name for name, *_ in bad}) == len(bad)
    assert any(len(body) > 1 << 20 for _, _, body, _ in bad)  # one over the body limit
    assert any(b"\\udfff" in body for _, _, body, _ in bad)  # a lone surrogate, escaped
    import random

    def draws(seed):
        rng = random.Random(f"soak-{seed}-client-0")
        return [soak.next_request(rng, soak.MIX) for _ in range(50)]

    assert draws(0) == draws(0) and draws(0) != draws(1)
    assert {kind for kind, _, _ in draws(0)} == set(soak.MIX)


# slow stage: two minutes of faults; the fast stage kills a replica once (tests/test_cluster.py)
@pytest.mark.slow
# ----- the soak -------------------------------------------------------------------------------
def test_a_two_minute_soak_with_faults_loses_nothing(tiny_models, tmp_path):
    pytest.importorskip("torch")
    out = tmp_path / "soak.json"
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.cluster.soak", "--model", str(tiny_models["llama"]),
         "--minutes", "2", "--kill-every", "30", "--replicas", "2", "--clients", "4", "--seed", "0",
         "--json", str(out), "--log", str(tmp_path / "cluster.log")],
        cwd=ROOT, capture_output=True, text=True, timeout=900)
    print(proc.stdout, proc.stderr[-3000:])  # the fault log and the table (shown on failure)
    assert out.exists(), proc.stdout[-3000:] + proc.stderr[-3000:]
    doc = json.loads(out.read_text())

    def brief(r: dict) -> str:
        return (f"{r['kind']} at {r['start']:.1f} s: {r['outcome']} {r['status']} {r['code']} "
                f"{r['detail']:.160}")

    why = "\n".join([f"outcomes {doc['outcomes']}, end {doc['end_metrics']}",
                      *map(brief, doc["failures"][:12]), *map(brief, doc["mismatches"][:5])])
    # the faults happened, each logged with its time
    done = [f for f in doc["faults"] if not any("skipped" in e for _, e in f["events"])]
    kinds = [f["kind"] for f in done]
    assert kinds.count("kill") >= 2 and kinds.count("stall") >= 1 and kinds.count("burst") >= 3
    assert all(f["events"] and f["until"] is not None for f in done)
    assert doc["requests"] > 100 and doc["corpus"]["sent"] >= 90
    # the hard checks
    checks = doc["checks"]
    assert checks["lost"]["value"] == 0, why
    assert checks["unexpected_failures"]["value"] == 0, why
    assert checks["reference_mismatches"]["value"] == 0, why
    assert checks["corpus_clear_4xx"]["ok"], why
    assert checks["kv_blocks_used_at_end"]["value"] == 0, why
    assert checks["in_flight_at_end"]["value"] == 0, why
    assert doc["passed"] and proc.returncode == 0, why
