"""The authoritative GeoDNS responder.

``wire``    parsing queries (the one parse function listeners and the fuzzer share)
``render``  writing responses
``zone``    the authoritative answer for a query, from the snapshot (pure)
``cache``   rendered answers reused per name, type, client bucket and snapshot
``ratelimit`` response rate limiting per client network, with slip
``stats``   counters, exported to Prometheus at scrape time
``server``  the UDP and TCP listeners
"""
