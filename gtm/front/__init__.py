"""The HTTP front: the decision of :func:`gtm.decision.routing.decide` answered over HTTP.

For a request to a configured service host the front decides with the real client address
(the peer, or what trusted proxies forward), the service's residency class, an
``X-Data-Residency`` header and the tenant (API-key prefix, or ``X-GTM-Tenant``), and answers:

- redirect mode: ``307`` (or ``308``, per service) to the chosen region's base URL with the
  original path and query, ``Cache-Control: no-store``, ``X-GTM-Region`` and
  ``X-GTM-Decision-Id``;
- proxy mode: the request forwarded to the chosen region and its answer streamed back, with one
  retry inside the allowed set before the first byte (:mod:`gtm.front.proxy`); a client's
  session stays in the region that served it while that region is allowed, healthy and has
  headroom (:mod:`gtm.front.affinity`);
- ``451`` when the request's classes are allowed in no region, ``503`` with ``Retry-After``
  when every allowed region is unavailable: never an answer from outside the allowed set;
- ``404`` for an unknown host and a clear ``4xx`` for bad input (``400`` malformed headers,
  ``405`` methods outside the served set, ``413`` bodies over the proxy limit, ``414``/``431``
  heads over the limits, ``408`` a head not whole by its deadline).

Every one of those responses is counted in the audit store, and the decision id it names leads
back to its row (``gtm audit show ID``; :mod:`gtm.audit.decision_id`). ``gtm serve --http``
runs the front, alone or beside the DNS responder.

``server``          uvicorn in the caller's loop, and the TLS gate in front of the protocol
``protocol``        the HTTP protocol: bounded heads, deadlines, cached redirects answered in it
``connections``     the connection caps (total, per client) and the request-head deadline
``tls``             TLS from certificate and key files (the key 0600), reloaded on change
``app``             ``FrontApp``: the units put together, and the general path (decide, redirect,
                    refuse, reject, proxy)
``answers``         the answer cache: redirects answered from memory (the hot path)
``ledger``          every response counted towards the audit store, and its decision id
``headers``         a request's decision inputs: headers, Host and service, tenant index
``client_address``  the client behind trusted proxies
``signals``         residency classes and tenant of a request
``proxy``           proxy mode: forwarding with one retry inside the allowed set
``affinity``        proxy mode: a session kept in the region that served it (signed cookie)
``intake``          ``POST /v1/capacity``: signed capacity reports from regional balancers
``ops``             ``/livez``, ``/readyz``, ``/metrics``
``respond``, ``metrics``: JSON responses and the front's Prometheus counters

It may import ``gtm.decision``, ``gtm.fleet`` (report intake), ``gtm.audit`` and ``gtm.runtime``;
never ``gtm.geodns`` or ``gtm.cli``. A new operational endpoint goes in ``ops``; an endpoint
for people (policies, audit search) belongs to the admin API, not to the answering listener.
"""
