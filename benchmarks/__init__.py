"""Benchmarks by role, each run as a module from the checkout's root
(``python -m benchmarks.simulator.speed``): ``simulator/`` (the simulator, the scheduling core,
sweeps and the cost model), ``engine/`` (the PyTorch engine and the vLLM plug-in), ``cluster/``
(a server, the gateway, a cluster under faults), ``fit/`` (what a fit costs and how far its
ranges hold); ``common.py``: the set-up they share. Each prints its figures beside a baseline
measured in the same run."""
