"""Data parallelism (``--data-parallel-size N``): N whole engines behind one server.

``router.py``'s ``ReplicaRouter`` is an ``EngineClient`` like ``AsyncLLM``: the server serves from
it without knowing it fans out. It starts the replicas (``replica.py``: each an AsyncLLM in a local
process or a Ray actor), routes each request, relays outputs and aborts, and merges the replicas'
``/metrics`` (``metrics.py``). Both ends of the router-replica connection live here, so its
messages are read in one place.
"""
