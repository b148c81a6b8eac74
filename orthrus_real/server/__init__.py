"""One replica's HTTP server: the OpenAI-compatible API (``api/``), the engine thread that runs
an engine's iterations, the backends it can serve, and the Prometheus metrics. Built on
``engine`` and ``vllm_backend``; knows nothing of the cluster or the measuring commands."""
