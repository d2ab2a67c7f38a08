"""The fleet: what GTM knows about its regions and how it learns it.

``probing``       each region's readiness/capacity endpoint probed on an interval, with jitter
``health``        probe outcomes to a region's health: rise/fall hysteresis (pure)
``capacity``      intake of the capacity reports balancers push: signature, order, freshness
``region_state``  one state per region, fleet-wide: node quorum, operator overrides,
                  gradual re-admission (pure)
``shared_state``  the shared database's side of it: observations, overrides, region events,
                  published documents
``state_sync``    one node kept in step with the fleet through that database
``operator``      operator controls over regions (drain, weight, force), each with who and why,
                  as signed control-log entries (gtm.control)
``observation_seal``  health observations signed by their node; the fleet's membership
``roster``        every configured member with its last report (live, silent, fenced, never
                  reported), and how far an activation has reached (pure)
``signed_documents``  what a node verifies before a published version comes into force
``local_documents``   the version a node accepted, kept on its own disk and verified again

It feeds the decision core new snapshot inputs and never answers a query: it may import
``gtm.decision``, ``gtm.control`` (the signed control log), ``gtm.audit`` (tables and the event
chain) and the regional tier's report format, never ``gtm.geodns``, ``gtm.front``, ``gtm.cli``
or the process wiring above it. A new probe type goes in ``probing``; a new operator control in
``operator`` and ``region_state``.
"""
