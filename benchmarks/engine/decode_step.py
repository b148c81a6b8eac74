"""Time one decode step of the PyTorch engine under each attention path and step mode, and
count what it launches (torch.profiler): on CUDA the kernel launches and GPU kernel time per
step, on a CPU the operators per step.

    python -m benchmarks.engine.decode_step --model DIR [--streams 64] [--context 128]
        [--steps 10] [--device cuda] [--variants gather,gather+kept,paged,paged+static,paged+graphs]

Each variant is its own engine with ``streams`` generation requests prefilled to ``context``
tokens; the figures are medians over ``steps`` decode-only steps after 3 warm-up steps (which
capture the graphs). ``benchmarks/engine/peers.py`` calls ``measure`` for the CPU comparison of
the two attention paths.
"""

from __future__ import annotations

import statistics
from pathlib import Path

import numpy as np
import torch

from benchmarks.common import add_model_argument, greedy, model_dir, parser, random_tokens, sync, timed
from orthrus_real.engine.torch_engine import Engine
from orthrus_sim.engine import SchedulerConfig

VARIANTS = {  # name -> engine options
    "gather": {"attention": "gather", "static_step": False, "keep_decode_contexts": False},
    "gather+kept": {"attention": "gather", "static_step": False, "keep_decode_contexts": True},
    "paged": {"attention": "paged", "static_step": False},
    "paged+static": {"attention": "paged", "static_step": True, "cuda_graphs": False},
    "paged+graphs": {"attention": "paged", "static_step": True, "cuda_graphs": True},
}


def measure(model: Path, variant: str, streams: int = 64, context: int = 128, steps: int = 10,
            device: str | None = None, dtype: str | None = None, profile: bool = True) -> dict:
    """Median decode-step seconds of ``variant`` and (with ``profile``) launches per step."""
    steps_needed = 3 + steps * (2 if profile else 1) + 2
    engine = Engine(model, device=device, dtype=dtype, kv_cache_tokens=streams * (
        context + steps_needed + 16) + 1024, scheduler=SchedulerConfig(token_budget=8192),
        **VARIANTS[variant])
    rng = np.random.default_rng(0)
    for i in range(streams):
        engine.add_generation(f"g{i}", token_ids=random_tokens(rng, context, engine.cfg.vocab_size),
                              params=greedy(steps_needed))
    while not engine.stats or engine.stats[-1].decodes < streams:  # prefill
        engine.step()
    for _ in range(3):  # warm-up: compiles and captures
        engine.step()
    times = [timed(engine.step, engine.device) for _ in range(steps)]
    out = {"variant": variant, "step_ms": statistics.median(times) * 1e3,
           "decodes": engine.stats[-1].decodes}
    if engine.static is not None:
        out["replays"] = engine.static.replays
        out["eager_buckets"] = dict(engine.static.failed)
    if profile:
        out.update(count_launches(engine, steps))
    return out


def count_launches(engine: Engine, steps: int) -> dict:
    """Kernel launches (CUDA) or operators (CPU) and device time per step, from torch.profiler."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as prof

    cuda = engine.device.type == "cuda"
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with prof(activities=acts) as p:
        for _ in range(steps):
            engine.step()
        sync(engine.device)
    events = p.events()
    if cuda:
        launches = sum(1 for e in events if e.name in ("cudaLaunchKernel", "cuLaunchKernel",
                                                       "cudaLaunchKernelExC", "cudaGraphLaunch",
                                                       "cudaMemcpyAsync"))
        kernel_us = sum(e.device_time for e in events if e.device_type.name == "CUDA")
        copies_us = sum(e.device_time for e in events
                        if e.device_type.name == "CUDA" and "copy" in e.name.lower())
        return {"launches_per_step": launches / steps, "kernel_ms": kernel_us / steps / 1e3,
                "copy_share": copies_us / kernel_us if kernel_us else 0.0}
    ops = sum(1 for e in events if e.name.startswith("aten::"))
    return {"ops_per_step": ops / steps}


def main() -> None:
    ap = parser(__doc__)
    add_model_argument(ap, "small")
    ap.add_argument("--streams", type=int, default=64)
    ap.add_argument("--context", type=int, default=128)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--device", default=None)
    ap.add_argument("--dtype", default=None)
    ap.add_argument("--variants", default=None, help="comma-separated (default: all that "
                    "apply to the device)")
    args = ap.parse_args()
    cuda = (args.device or ("cuda" if torch.cuda.is_available() else "cpu")).startswith("cuda")
    names = args.variants.split(",") if args.variants else [
        v for v in VARIANTS if cuda or v != "paged+graphs"]
    with model_dir(args.model, "small") as model:
        for name in names:
            if name not in VARIANTS:
                raise SystemExit(f"--variants: unknown {name!r} (one of {', '.join(VARIANTS)})")
            r = measure(model, name, args.streams, args.context, args.steps, args.device,
                        args.dtype)
            print("DECODE", " ".join(f"{k}={v:.3f}" if isinstance(v, float) else f"{k}={v}"
                                     for k, v in r.items()), flush=True)


if __name__ == "__main__":
    main()
