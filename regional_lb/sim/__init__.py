"""The simulated inference server, for the demo, the tests and the benchmarks.

``engine``  a continuous-batching engine (slots, KV-cache memory, model load time, tokens)
``server``  ``regional-lb sim-backend``: the engine behind OpenAI-compatible endpoints, with
            vLLM's metric names and fault injection

May import ``balancing`` (GPU profiles) and ``protocol``; never the balancer's ``upstream`` or
``proxy``, so it stays a stand-in for a real server rather than a part of the balancer.
"""
