"""Reports for people outside the system: the compliance report of a time window.

``compliance`` gathers what a regulator asks for from the audit store and recomputes, from each
row's recorded inputs and the policy version it names, whether its answer was allowed (it does
not trust the row's own outcome); ``html`` renders it for a person to read. It may import
``gtm.audit``, ``gtm.fleet`` and ``gtm.decision``; the admin API and the CLI serve it.
"""
