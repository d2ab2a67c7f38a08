"""Pure balancing: how the balancer chooses, with no I/O.

``cost``         a request's cost in reference-GPU seconds, corrected online
``pick``         the routing decision: least outstanding work over learned speed
``admission``    priority tiers with reserved capacity, bounded queues, tenant rate limits
``affinity``     session and prompt-prefix affinity under a load bound
``utilisation``  how busy the region is (the capacity report's utilisation)
``instance``     per-instance state: exact accounting of work in flight, learned speed
``health``       an instance's health transitions: probes, outlier ejection, slow start, drain
``gpus``         GPU profiles: relative speed, memory, batching (priors and the simulator)

Imports nothing of the balancer but ``regional_lb.errors``, and no socket or HTTP library
(import-linter checks both): the proxy, the tests and the discrete-event simulator in
``bench/regional`` drive the same code. A new pick rule or admission policy goes here.
"""
