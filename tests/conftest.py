import os

import pytest

try:
    from hypothesis import settings
except ImportError:  # hypothesis comes with the dev extra; a bare install still runs the rest
    settings = None

if settings is not None:
    # Repeatable by default: the same examples on every machine, so a red CI names a change, not
    # a lucky draw. ORTHRUS_HYPOTHESIS=explore searches afresh (and remembers what fails).
    settings.register_profile("repeatable", derandomize=True, database=None)
    settings.register_profile("explore", derandomize=False)
    settings.load_profile(os.environ.get("ORTHRUS_HYPOTHESIS", "repeatable"))


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory):
    """Seeded tiny models of each family (fp32), each with a LoRA adapter in ``adapter/``."""
    torch = pytest.importorskip("torch")  # noqa: F841
    from orthrus_real.engine.init_model import init_model

    root = tmp_path_factory.mktemp("models")
    return {fam: init_model(root / fam, fam, "tiny", seed=i, adapter_rank=4)
            for i, fam in enumerate(("llama", "mistral", "qwen2"))}
