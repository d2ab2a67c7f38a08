"""The decision core: ``routing.decide(request, snapshot, now) -> Decision`` and all it reads.

``model``          what is asked (``DecisionRequest``) and what is decided (``Decision``, a
                   ``Candidate`` with a reason code for every region)
``routing``        ``decide()``: residency, health, ranking, spillover, outcome (DESIGN.md steps)
``plan``           steps 1-4 worked out once per snapshot and memoised on it
``snapshot``       the immutable snapshot one decision reads (topology, policy, GeoIP, region
                   health and capacity, versions) and the store whose one reference is swapped
``answer_window``  how long answers cached from a snapshot hold (both answering paths use it)
``topology``       the topology document: zone, regions, services
``policy``         residency policy documents, the merged set and its pure evaluation
``documents``      reading YAML documents with every problem located
``geoip``          the client's location from a MaxMind City database (memory-mapped)
``geometry``       great-circle distances

Pure: it may import ``gtm.errors`` and nothing else of GTM, and no socket, database, HTTP client
or event loop (``make check`` enforces it with import-linter). Its only file reads are the
loaders of documents and the GeoIP database, called by the runtime, never by ``decide()``.
A new routing step, rule field or snapshot input goes here; whatever gathers that input
(probes, reports, databases) goes in ``gtm.fleet``.
"""
