"""Benchmarks of the simulator, the scheduling core, sweeps and the cost model."""
