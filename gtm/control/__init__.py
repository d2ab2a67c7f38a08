"""The control log: one append-only, signed, hash-chained log of every fact that moves traffic,
grants power or counts as evidence.

Threat model (DESIGN.md rule 6): **the database is untrusted storage.** An attacker may read and
write every table, switch triggers off and put back old rows, but holds no key file and cannot
rewrite the write-once checkpoint store. So nothing a service acts on is a bare row: principals,
role grants, tokens, proposals, approvals, activations, schedules and operator overrides are
entries of this log, each signed over all its fields by the admin service's key and chained to
its predecessor by hash; current state is *folded* from verified entries, and the tables that
hold it are caches nobody trusts. Readers keep the highest entry they accepted on their own disk
(:mod:`gtm.control.watermark`), so a log cut back, forked or missing entries is refused, loudly,
and the reader keeps its last good state.

``entry``      one entry: its canonical bytes, hash, signature and their check (pure)
``state``      the fold: entries in, principals/tokens/proposals/grants/overrides out (pure)
``log``        the log in the database: append under the head's lock, refresh, verify
``watermark``  the highest (sequence, hash) a reader accepted, kept on its own disk

What the log cannot prevent is said plainly: two admins who collude can grant each other any
role and then approve each other's changes; an attacker holding the admin service's key file can
write anything. Both are outside the threat model above, and both leave signed entries naming
who did it.
"""
