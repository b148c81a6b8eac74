"""Benchmarks of the fit: what it costs, and how far its prediction ranges hold."""
