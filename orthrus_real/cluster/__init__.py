"""Several engine replicas behind one OpenAI endpoint (``orthrus-real serve --replicas N``).

``replicas``: which replica runs where (the simulator's plan for the configuration) and the
engine process of each; ``gateway``: the front endpoint that routes every request with the
project's one router (``orthrus_sim.routing.rules``); ``metrics_text``: the replicas'
Prometheus texts merged under a ``replica`` label; ``ray_app``: the same replicas as a Ray Serve
application. docs/cluster.md says how to run them.
"""
