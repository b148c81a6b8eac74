"""Turn a finished simulation into the ``orthrus.results/1`` metrics (see docs/results.md)."""

from __future__ import annotations

import numpy as np

from orthrus_sim.engine.request import Request, RequestKind, RequestState

PERCENTILES = {"p50": 50, "p95": 95, "p99": 99}


def summary(values: list[float]) -> dict[str, float | None]:
    if not values:
        return {"mean": None, "p50": None, "p95": None, "p99": None, "count": 0}
    arr = np.asarray(values, dtype=float)
    out = {"mean": float(arr.mean())}
    for name, q in PERCENTILES.items():
        out[name] = float(np.percentile(arr, q))
    out["count"] = int(arr.size)
    return out


def request_row(req: Request, replica_of: dict[str, int] | None = None) -> dict:
    return {
        "request_id": req.request_id, "kind": req.kind.value, "state": req.state.value,
        "arrival_s": req.arrival_time, "admitted_s": req.admitted_at,
        "first_chunk_s": req.first_chunk_at, "first_token_s": req.first_token_at,
        "finished_s": req.finished_at, "input_tokens": req.input_len,
        "output_tokens": req.num_generated, "preemptions": req.num_preemptions,
        "latency_s": (req.finished_at - req.arrival_time)
        if req.state is RequestState.FINISHED else None,
        "reject_reason": req.reject_reason,
    }


def request_metrics(issued: list[Request], workflows: list, start: float, end: float) -> dict:
    """Throughput, latency and request counts over the window [start, end]: a request counts
    when it finished inside it. Shared by the simulator and the live load generator."""
    window = max(end - start, 1e-12)
    lat = {"embedding": [], "generation": [], "ttft": [], "tpot": []}
    admission = {"embedding": [], "generation": []}
    completed = {"embedding": 0, "generation": 0}
    unfinished = {"embedding": 0, "generation": 0}
    rejected = {"embedding": 0, "generation": 0}
    for r in issued:
        kind = r.kind.value
        if r.state is RequestState.REJECTED:
            rejected[kind] += 1
        elif r.state is not RequestState.FINISHED or r.finished_at > end + 1e-9:
            unfinished[kind] += 1
        elif r.finished_at >= start:
            completed[kind] += 1
            lat[kind].append(r.finished_at - r.arrival_time)
            if r.admitted_at is not None:  # a live client does not see admission
                admission[kind].append(r.admitted_at - r.arrival_time)
            if r.kind is RequestKind.GENERATION:
                lat["ttft"].append(r.first_token_at - r.arrival_time)
                if r.num_generated > 1:
                    lat["tpot"].append((r.finished_at - r.first_token_at) / (r.num_generated - 1))
    flows_done = [w for w in workflows if w.end is not None and start <= w.end <= end + 1e-9]
    throughput = {
        "embedding": completed["embedding"] / window,
        "generation": completed["generation"] / window,
        "combined": (completed["embedding"] + completed["generation"]) / window,
    }
    latency = {k: summary(v) for k, v in lat.items()}
    if workflows:
        throughput["workflow"] = len(flows_done) / window
        latency["workflow"] = summary([w.end - w.start for w in flows_done])
        completed["workflow"] = len(flows_done)
        unfinished["workflow"] = sum(1 for w in workflows if w.end is None or w.end > end + 1e-9)
    return {
        "throughput_rps": throughput,
        "latency_s": latency,
        "admission_wait_s": {k: summary(v) for k, v in admission.items()},
        "completed": completed,
        "unfinished": unfinished,
        "rejected": rejected,
        "issued": {"embedding": sum(1 for r in issued if r.kind is RequestKind.EMBEDDING),
                   "generation": sum(1 for r in issued if r.kind is RequestKind.GENERATION)},
        "window_s": [start, end],
    }


def replica_metrics(replicas: list, end: float, peak_flops: float) -> dict:
    """Utilisation, budget fill, iterations and preemptions of simulated replicas."""
    elapsed = max(end, 1e-12)
    per_gpu = [{"replica": rep.index, "role": rep.role, "policy": rep.policy.name,
                "busy": rep.stats.busy_s / elapsed,
                "compute": rep.stats.flops / (peak_flops * elapsed),
                "iterations": rep.stats.iterations,
                "budget_fill": rep.stats.budget_fill_sum / max(rep.stats.iterations, 1),
                "preemptions": dict(rep.policy.preemptions),
                "decode_runs": rep.stats.decode_runs}
               for rep in replicas]
    iterations = sum(rep.stats.iterations for rep in replicas)
    return {
        "utilization": {
            "busy": float(np.mean([g["busy"] for g in per_gpu])),
            "compute": float(np.mean([g["compute"] for g in per_gpu])),
            "per_gpu": per_gpu,
        },
        "budget_fill": sum(rep.stats.budget_fill_sum for rep in replicas) / max(iterations, 1),
        "iterations": iterations,
        "preemptions": {kind: sum(rep.policy.preemptions[kind] for rep in replicas)
                        for kind in ("embedding", "generation")},
    }


def compute_metrics(issued: list[Request], workflows: list, replicas: list, start: float,
                    end: float, peak_flops: float, sim_wall_s: float, extra: dict) -> dict:
    """The full metrics of one simulated configuration (docs/results.md)."""
    return {**request_metrics(issued, workflows, start, end),
            **replica_metrics(replicas, end, peak_flops), "sim_wall_s": sim_wall_s, **extra}
