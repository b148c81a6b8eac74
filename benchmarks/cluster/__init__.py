"""Benchmarks of one server, the cluster's gateway and a cluster under faults."""
