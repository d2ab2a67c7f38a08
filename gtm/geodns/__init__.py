"""The authoritative GeoDNS responder.

``wire``       parsing queries (the one parse function listeners and the fuzzer share)
``render``     writing responses: the record types an authority for GTM serves, OPT, truncation
``zone``       the authoritative answer for a query, from the snapshot (pure)
``ratelimit``  response rate limiting per client network, with slip
``budget``     the memory budget: entry limits for the tables above, kept in two generations
``stats``      counters, exported to Prometheus at scrape time
``responder``  the answering path: wire bytes in, wire bytes out, from the answer caches
``server``     the UDP and TCP listeners around one responder

It may import ``gtm.decision``, ``gtm.audit`` (counting answers) and ``gtm.runtime`` (the
snapshot store and the audit writer it answers from); never ``gtm.front`` or ``gtm.cli``. A new
record type is parsed in ``wire``, answered in ``zone`` and written in ``render``.
"""
