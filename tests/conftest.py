import os

import pytest

if os.environ.get("PYTEST_XDIST_WORKER"):
    # pytest-xdist runs one worker per core: each worker's BLAS and OpenMP pools (and the servers
    # its tests start, which inherit this) take one thread, or the workers' pools oversubscribe
    # the cores and spin against each other
    for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        os.environ.setdefault(var, "1")

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


# The files that take longest go first: pytest-xdist (one worker per core, whole files to a
# worker: see pytest_xdist_make_scheduler) hands out files in collection order, so the other
# worker fills in around these instead of one of them starting last and running alone. With two
# workers the two that start many processes (Ray, the cluster) do not start together (they starve
# each other); with more workers they may.
LONGEST_FIRST = ("test_cluster_ray.py", "test_fit.py", "test_soak.py", "test_core_properties.py",
                 "test_real_engine.py", "test_server.py", "test_server_limits.py",
                 "test_cluster.py", "test_server_isolation.py", "test_calibrate.py")


def pytest_collection_modifyitems(items):
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: in-file order kept


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """``-n N`` (xdist's default ``--dist load``): whole files to a worker, so that a module's
    servers and clusters start once, in collection order (xdist's own puts the files with the
    most tests first). An explicit other ``--dist`` is left alone."""
    if config.getoption("dist") != "load":
        return None
    from xdist.scheduler import LoadFileScheduling

    config.option.loadscopereorder = False
    return LoadFileScheduling(config, log)


def pytest_terminal_summary(terminalreporter):
    """Figures the tests measured (their ``user_properties`` named "figures": a real load
    client's throughput and TTFT, say), shown after the run; pytest-xdist carries them back
    from its workers, which print nothing themselves."""
    lines = [value for reports in terminalreporter.stats.values() for report in reports
             for name, value in getattr(report, "user_properties", ()) if name == "figures"]
    if lines:
        terminalreporter.section("figures")
        for line in dict.fromkeys(lines):
            terminalreporter.write_line(line)
