"""The control plane: the admin API for compliance teams and operators.

``app``          the FastAPI app and its error shape
``routes/``      one router per resource: ``identity`` (principals, tokens, events),
                 ``documents`` (versions, proposals, approvals, activation, diff, impact),
                 ``regions`` (state and operator controls under the safety rules),
                 ``audit`` (decision search, export, lookup by id, replay)
``auth``         a bearer token to a principal, a principal to an allowed operation
``permissions``  the roles and the one role x operation table routes and tests read
``principals``   principals and API tokens in the shared database
``tokens``       what a token looks like and what is kept of it (a hash)
``principals`` and the control log (gtm.control) replace the per-row seals of earlier versions
``lifecycle``    proposals: draft, propose, four-eyes approval, signed activation
``versions``     document versions, content-addressed, checked on every read
``errors``       the control plane's errors, each with its HTTP status and code
``signer``       the Ed25519 key that signs activated versions (a 0600 file, not the database)
``diff``         a YAML-aware diff between versions
``impact``       recorded traffic replayed under a draft
``replay``       one recorded decision decided again under the versions it names
``events``       admin actions in the hash-chained event log
``scheduler``    scheduled activations, done once across admin nodes
``server``       the admin listener inside a node's event loop

It serves people, not traffic: it may import ``gtm.decision``, ``gtm.fleet``, ``gtm.audit`` and
``gtm.runtime`` (to validate documents as nodes will), never the answering listeners
(``gtm.geodns``, ``gtm.front``). A new admin endpoint is a route in ``routes/`` with an entry in
``permissions.OPERATIONS``.
"""
