import pytest


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory):
    """Seeded tiny models of each family (fp32), each with a LoRA adapter in ``adapter/``."""
    torch = pytest.importorskip("torch")  # noqa: F841
    from orthrus_real.init_model import init_model

    root = tmp_path_factory.mktemp("models")
    return {fam: init_model(root / fam, fam, "tiny", seed=i, adapter_rank=4)
            for i, fam in enumerate(("llama", "mistral", "qwen2"))}
