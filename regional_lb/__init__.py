"""Regional tier of GTM: a cost-aware least-outstanding-work balancer for inference instances.

``balancing/``  pure balancing: request cost, pick, admission, affinity, utilisation, instance
                state and its health transitions, GPU profiles
``protocol/``   the OpenAI-compatible HTTP both the proxy and the simulator speak: request
                parsing and errors, raw ASGI helpers, disconnect detection, serving on a socket
``upstream/``   the balancer's I/O towards its instances: the HTTP/1.1 client, forwarding a
                leased request, probes, model servers' metrics, the pool of instances
``sim/``        the simulated inference server (engine and its HTTP server)
``proxy/``      the balancer's HTTP surface: the OpenAI endpoints and the admin endpoints
``capacity_report``, ``config``, ``metrics``, ``tracing``, ``errors``, ``logs``, ``cli``: shared
by all of them (the report is the interface the global tier reads).

Layers, checked by import-linter in ``make check``: ``proxy`` above ``upstream`` above
``protocol`` above ``balancing``; ``sim`` uses ``protocol`` and ``balancing`` only.
"""
