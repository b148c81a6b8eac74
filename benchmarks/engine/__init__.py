"""Benchmarks of the PyTorch engine and the vLLM plug-in."""
