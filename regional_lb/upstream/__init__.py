"""The balancer's side towards its inference instances: all of its outgoing I/O.

``h1client``      a lean HTTP/1.1 client for the proxy's hot path
``forward``       forwarding one leased request, its lease ended on every path
``pool``          the region's instances, estimator, admission and request leases
``probes``        active health probes, model discovery, metrics scraping, the report push
``load_signals``  real load from model servers' Prometheus metrics (vLLM, TGI, Triton)

May import ``balancing`` and ``protocol``, never ``proxy`` or ``sim``. A new probe of an
instance, a new model server's metrics or a credential sent to instances goes here.
"""
