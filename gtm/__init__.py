"""GTM's global tier: which region serves each client, answered over DNS and HTTP.

The packages follow a query's path (DESIGN.md "One decision, end to end"):

``decision/``  the pure core: ``routing.decide(request, snapshot, now)`` and everything it reads
``fleet/``     what the node learns about regions: probes, capacity reports, quorum, operator
               controls, all shared through the database
``audit/``     every answer counted into the hash-chained audit store (SQLite or PostgreSQL)
``geodns/``    the authoritative DNS responder
``front/``     the HTTP redirect / proxy front, with the capacity-report intake
``cli/``       the ``gtm`` command
``demo/``      ``make demo``

and the composition root at the top: ``settings`` (one object built at start-up), ``runtime``
(one node's moving parts: snapshot store, GeoIP reloads, audit writer, probing, state sync),
``node`` (the runtime and its listeners, started and stopped together), with the process-wide
``errors``, ``logs``, ``metrics``, ``listen`` (listen addresses) and ``heap`` (GC pauses kept
off the answering paths). The layering is checked by import-linter in ``make check``.
"""
