"""Utilisation and scheduling figures of simulated replicas over the measurement window."""

from __future__ import annotations

from orthrus_sim.costmodel import Hardware
from orthrus_sim.sim.replica import Replica, ReplicaStats


def replica_metrics(replicas: list[Replica], window: list[ReplicaStats], seconds: float,
                    hardware: Hardware) -> dict:
    """``window[i]``: replica i's counters over the window, ``seconds`` long.

    busy: fraction of the window the GPU ran iterations (idle when it had nothing to run);
    mfu / mbu: model FLOPs and memory bytes per second over the hardware's peaks.
    """
    span = max(seconds, 1e-12)
    per_gpu = []
    for rep, st in zip(replicas, window):
        per_gpu.append({
            "replica": rep.index, "role": rep.role, "policy": rep.policy.name,
            "busy": st.busy_s / span,
            "mfu": st.flops / (hardware.peak_flops * span),
            "mbu": st.bytes / (hardware.mem_bw * span),
            "iterations": st.iterations,
            "budget_fill": st.budget_fill_sum / max(st.iterations, 1),
            "preemptions": dict(rep.policy.preemptions),
            "decode_runs": st.decode_runs,
        })
    n = max(len(per_gpu), 1)
    iterations = sum(st.iterations for st in window)
    return {
        "utilization": {
            "busy": sum(g["busy"] for g in per_gpu) / n,
            "idle_gpu_s": sum(span - st.busy_s for st in window),
            "mfu": sum(g["mfu"] for g in per_gpu) / n,
            "mbu": sum(g["mbu"] for g in per_gpu) / n,
            "per_gpu": per_gpu,
        },
        "budget_fill": sum(st.budget_fill_sum for st in window) / max(iterations, 1),
        "iterations": iterations,
        "preemptions": {kind: sum(rep.policy.preemptions[kind] for rep in replicas)
                        for kind in ("embedding", "generation")},
    }
