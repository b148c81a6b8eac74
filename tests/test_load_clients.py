"""Real load clients against ``orthrus-real serve``, one engine and a 2-replica cluster behind
its gateway (the slow stage): guidellm, the vLLM project's load tester, runs its three
benchmarks (streamed chat, streamed completions, embeddings) at a constant rate, and every
request must succeed. Its throughput and TTFT are printed in the run's "figures" section.

guidellm (``pip install -e ".[loadtest]"``) is found as ``$ORTHRUS_GUIDELLM`` (an executable,
e.g. in a virtual environment of its own), else beside this Python, else on ``PATH``; without it
these tests are skipped.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")
pytest.importorskip("httpx")
pytestmark = pytest.mark.slow

from tests.test_cluster import Cluster  # noqa: E402
from tests.test_server import start_server  # noqa: E402

GUIDELLM_ENV = "ORTHRUS_GUIDELLM"
RATE, REQUESTS = 4.0, 24  # a constant 4 requests/s for 6 s
FORMATS = ["/v1/chat/completions", "/v1/completions", "/v1/embeddings"]


def guidellm_executable() -> str | None:
    given = os.environ.get(GUIDELLM_ENV)
    if given:
        return given
    beside = Path(sys.executable).parent / "guidellm"
    return str(beside) if beside.exists() else shutil.which("guidellm")


@pytest.fixture(scope="module")
def guidellm() -> str:
    exe = guidellm_executable()
    if exe is None:
        pytest.skip(f"guidellm is not installed (pip install -e '.[loadtest]', or set {GUIDELLM_ENV} "
                    "to its executable)")
    return exe


@pytest.fixture(scope="module")
def targets(tiny_models):
    """One engine in this process, and a 2-replica cluster (round-robin) in a child."""
    model = tiny_models["llama"]
    url, runner = start_server(model)
    cluster = Cluster(model, "--configuration", "orthrus")
    yield {"server": url, "cluster": cluster.url}, model
    cluster.close()
    runner.stop()


def run_guidellm(exe: str, url: str, request_format: str, model_dir: Path, out: Path) -> dict:
    """guidellm's benchmark of ``request_format`` against ``url``: its metrics (JSON output)."""
    cmd = [exe, "run", "--backend", f"kind=openai_http,target={url},request_format={request_format}",
           "--profile", f"kind=constant,rate={RATE:g}",
           "--constraint", f"kind=max_requests,count={REQUESTS}",
           "--constraint", "kind=max_duration,seconds=120",
           "--data", "kind=synthetic_text,prompt_tokens=64,output_tokens=32",
           "--tokenizer", f"kind=hf_auto,model={model_dir}",
           "--disable-console", "--output", f"kind=json,path={out}"]
    # one worker process starts in seconds (ten, its default, take ~15 s on two cores); no hub
    env = {**os.environ, "GUIDELLM__MAX_WORKER_PROCESSES": "1", "HF_HUB_OFFLINE": "1",
           "TRANSFORMERS_OFFLINE": "1"}
    run = subprocess.run(cmd, cwd=out.parent, capture_output=True, text=True, timeout=400, env=env)
    assert run.returncode == 0 and out.exists(), (run.stdout[-3000:], run.stderr[-3000:])
    return json.loads(out.read_text())["benchmarks"][0]


@pytest.mark.parametrize("request_format", FORMATS)
@pytest.mark.parametrize("target", ["server", "cluster"])
def test_guidellm_every_request_succeeds(guidellm, targets, target, request_format, tmp_path,
                                         request):
    urls, model = targets
    bench = run_guidellm(guidellm, urls[target], request_format, model, tmp_path / "guidellm.json")
    metrics = bench["metrics"]
    totals = metrics["request_totals"]
    errors = [r.get("error") for r in bench["requests"]["errored"][:3]]
    assert totals["errored"] == 0 and totals["incomplete"] == 0, (totals, errors)
    assert totals["successful"] == REQUESTS, totals

    def ok(name: str) -> dict:
        return metrics[name]["successful"]

    line = (f"guidellm {target} {request_format}: {totals['successful']}/{REQUESTS} successful, "
            f"{ok('requests_per_second')['mean']:.2f} requests/s")
    if request_format == "/v1/embeddings":
        latency = ok("request_latency")
        line += f", latency p50 {latency['median'] * 1e3:.0f} ms, p95 " \
                f"{latency['percentiles']['p95'] * 1e3:.0f} ms"
    else:
        ttft = ok("time_to_first_token_ms")
        assert ok("output_token_count")["total_sum"] == 32 * REQUESTS  # ignore_eos: all 32 each
        line += (f", {ok('output_tokens_per_second')['mean']:.1f} output tokens/s, TTFT p50 "
                 f"{ttft['median']:.0f} ms, p95 {ttft['percentiles']['p95']:.0f} ms")
    print(line)
    request.node.user_properties.append(("figures", line))
