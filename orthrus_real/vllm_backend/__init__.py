"""The vLLM-backed executor: a plug-in on released vLLM, not a fork.

* ``scheduler.OrthrusScheduler`` (vLLM's ``scheduler_cls``): every batch comes from the shared
  core's policy (IBS by default), then vLLM's KV-cache manager and request bookkeeping carry it.
* ``runner.PoolingRowsMixin`` (mixed into vLLM's model runner by ``worker``): after the one
  forward pass of a mixed batch it pools the embedding rows with the core's incremental pooler
  and leaves the generation rows to vLLM's sampler, so vLLM finishes both kinds of request.
* ``engine.VllmEngine``: the PyTorch engine's interface (``add_embedding``, ``add_generation``,
  ``step``, ...) over an in-process vLLM ``EngineCore``, so the HTTP server, bench, calibrate and
  validate run on it unchanged.

Supported releases are pinned in ``support.SUPPORTED``; others fail with a message that says so.
"""
