"""``orthrus-real serve``'s options, one typed alias each (typer's ``Annotated`` form), so that
the command's signature is a list of names and defaults and its help text lives here, grouped
as ``serve --help`` prints it: the model, the scheduler, the server, the engine, the cluster."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

KNOB_HELP = "(default: SchedulerConfig's; any field: --set scheduler.FIELD=VALUE)"
BACKEND_HELP = ("torch (the PyTorch reference engine) | vllm (the vLLM plug-in; needs "
                "pip install -e '.[vllm]')")


# the model
Model = Annotated[Path, typer.Option("--model", help="model directory (config.json, weights, tokenizer)")]
EmbeddingAdapter = Annotated[Path | None, typer.Option("--embedding-adapter",
                                               help="PEFT LoRA adapter directory")]
ServedModelName = Annotated[str | None, typer.Option(help="model name clients use (default: dir name)")]
Pooling = Annotated[str, typer.Option(help="default pooling head for /v1/embeddings")]
MaxModelLen = Annotated[int | None, typer.Option(
    help="longest prompt + output accepted (default: the model's)")]

# the scheduler
PolicyName = Annotated[str, typer.Option(help="policy name (ibs: Orthrus's IBS) or module:Class")]
TokenBudget = Annotated[int | None, typer.Option(help=f"tokens per iteration {KNOB_HELP}")]
ChunkSize = Annotated[str | None, typer.Option(help="tokens per embedding chunk, or none (atomic)")]
MaxNumSeqs = Annotated[int | None, typer.Option(help="most generation requests running at once")]
ScenarioFile = Annotated[str | None, typer.Option(
    "--scenario", help="take the policy and scheduler knobs from this scenario's plan (replaces "
    "--policy and the knobs above)")]
Configuration = Annotated[str | None, typer.Option(
    "--configuration", help="with --scenario: the unified configuration to serve (default: its "
    "first); with --replicas also dedicated-E:G")]
SetField = Annotated[list[str], typer.Option(
    "--set", help="override a field: with --scenario any scenario field, else "
    "scheduler.FIELD=VALUE")]
KvCacheTokens = Annotated[int, typer.Option(help="KV-cache capacity in tokens")]
TpotTarget = Annotated[float | None, typer.Option(
    "--tpot-target", help="TPOT target in seconds: chunks beside decodes are cut so that each "
    "decode's mean time per token holds it (predicted, with the steps' measured slack; needs "
    "--calibration; --set scheduler.tpot_slack_iterations=0 caps every step instead)")]
Calibration = Annotated[str | None, typer.Option(
    "--calibration", help="cost model fitted to this engine (`orthrus-real calibrate`): predicts "
    "iteration times")]

# the server
Host = Annotated[str, typer.Option(help="bind address (loopback unless told otherwise)")]
Port = Annotated[int, typer.Option(help="TCP port, 1-65535")]
MaxQueued = Annotated[int, typer.Option(help="requests in flight before 429")]
MaxBodyBytes = Annotated[int, typer.Option(help="larger request bodies get 413")]
ApiKey = Annotated[str | None, typer.Option(
    "--api-key", envvar="ORTHRUS_API_KEY", help="require 'Authorization: Bearer KEY' (401 "
    "without it); an empty key is refused")]
MaxInputsPerRequest = Annotated[int, typer.Option(
    help="prompts or embedding inputs one request may hold (400 above it)")]
LogLevel = Annotated[str, typer.Option(help="critical | error | warning | info | debug")]

# the engine
Device = Annotated[str | None, typer.Option(help="cpu or cuda (default: cuda when present)")]
Dtype = Annotated[str | None, typer.Option(help="float32 or bfloat16 (default: by device)")]
Threads = Annotated[int, typer.Option(help="torch CPU threads (0: torch's default, or one per --cpus)")]
Cpus = Annotated[str | None, typer.Option(
    "--cpus", help="run the server on these CPUs only (0,1 or 0-3), e.g. apart from a bench "
    "client on the same machine")]
Backend = Annotated[str, typer.Option(help=BACKEND_HELP)]
Attention = Annotated[str | None, typer.Option(
    "--attention", help="gather (contexts copied out of the KV cache; default) | paged (the cache "
    "read in place)")]
CudaGraphs = Annotated[bool | None, typer.Option(
    "--cuda-graphs/--no-cuda-graphs", help="capture decode steps as CUDA graphs (default: on CUDA "
    "with --attention paged)")]
StaticStep = Annotated[bool | None, typer.Option(
    "--static-step/--no-static-step", help="run decode steps padded to fixed shapes (on with "
    "--cuda-graphs; on a CPU: the same path without capture)")]
CpuGemm = Annotated[str | None, typer.Option(
    "--cpu-gemm", help="the library of fp32 projections on a CPU: auto (measure MKL and oneDNN "
    "once, take the faster; default, or ORTHRUS_CPU_GEMM) | mkl | onednn")]

# the cluster
Replicas = Annotated[int | None, typer.Option(
    "--replicas", help="run this many engine replicas behind one endpoint, placed as the "
    "simulator's plan places --configuration (docs/cluster.md)")]
Devices = Annotated[str | None, typer.Option(
    "--devices", help="with --replicas: each replica's device, cuda:0,cuda:1 or cpu:0,cpu:1 (CPU "
    "core sets: cpu:0-1,cpu:2-3)")]
Router = Annotated[str | None, typer.Option(
    "--router", help="with --replicas: the routing rule (orthrus_sim.routing.rules.ROUTERS; "
    "default the scenario's cluster.router, round-robin)")]
AutoRestart = Annotated[bool, typer.Option(
    "--auto-restart", help="with --replicas: start a replica that died again by itself")]
Retries = Annotated[int, typer.Option(
    "--retries", help="with --replicas: how many times one request whose replica went down is "
    "sent to another (embeddings, generations that sent nothing, streams continued from their "
    "tokens; docs/cluster.md); 0: only requests that never reached an engine")]
RetryBudget = Annotated[float, typer.Option(
    "--retry-budget", help="with --replicas: the share of requests in flight that may be "
    "retrying at once (at least 16)")]
Ray = Annotated[str | None, typer.Option(
    "--ray", help="serve the replicas as a Ray Serve application: local (a Ray instance of this "
    "process) or auto / ray://HOST:PORT (a running Ray cluster)")]
