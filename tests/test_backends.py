"""Backend selection and the vLLM version pin: clear errors, no tracebacks (runs without vLLM)."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

pytest.importorskip("torch")

from orthrus_real.cli import app  # noqa: E402
from orthrus_real.server import backends  # noqa: E402
from orthrus_real.vllm_backend import support  # noqa: E402


def test_unknown_backend_is_named(tiny_models):
    with pytest.raises(ValueError, match="--backend must be one of torch, vllm, got 'tpu'"):
        backends.make_engine("tpu", str(tiny_models["llama"]))
    res = CliRunner().invoke(app, ["serve", "--model", str(tiny_models["llama"]), "--backend", "tpu"])
    assert res.exit_code == 2 and "--backend must be one of" in res.output


def test_vllm_version_pin(monkeypatch):
    monkeypatch.setattr(support, "installed_version", lambda: None)
    with pytest.raises(support.VllmUnavailable, match=r"pip install -e '\.\[vllm\]'"):
        support.check_vllm()
    monkeypatch.setattr(support, "installed_version", lambda: "0.31.2")
    with pytest.raises(support.VllmUnavailable, match="vLLM 0.31.2 is not supported.*0.32.x, 0.33.x"):
        support.check_vllm()
    monkeypatch.setattr(support, "installed_version", lambda: "0.32.0")
    assert support.check_vllm() == "0.32.0"


def test_calibrate_backend_vllm_without_vllm_says_so(tiny_models, tmp_path, monkeypatch):
    monkeypatch.setattr(support, "installed_version", lambda: "0.20.0")
    res = CliRunner().invoke(app, ["calibrate", "--backend", "vllm", "--model",
                                   str(tiny_models["llama"]), "--out", str(tmp_path / "c.json")])
    assert res.exit_code == 2 and "vLLM 0.20.0 is not supported" in res.output


@pytest.mark.parametrize("policy", ["prefill-only", "decode-only"])
def test_vllm_backend_refuses_disaggregation_roles_before_starting(tiny_models, policy):
    with pytest.raises(ValueError, match="disaggregated-serving role"):
        backends.make_engine("vllm", str(tiny_models["llama"]), policy=policy)
    with pytest.raises(ValueError, match="unknown policy|no policy"):
        support.check_policy("nonesuch")
