"""The demo: ``make demo`` (``python -m gtm.demo``) on the embedded defaults.

``tour``         the walk through the decision core, then a live node asked as resolvers and
                 clients would ask it
``local_fleet``  one simulated inference server and one regional balancer per loopback region,
                 as separate processes (the demo and the failover benchmark use it)

May import anything in ``gtm`` and ``regional_lb``: it is a user of both tiers, and nothing
imports it.
"""
