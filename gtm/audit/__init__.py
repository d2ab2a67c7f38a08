"""The audit store: every decision, counted, hash-chained, in SQLite or PostgreSQL.

``record``       what one audit row holds, and the hash chain over rows (pure)
``decision_id``  the id a response names its decision by, and how it leads to its row
``event_chain``  the region events' hash chain (operator actions and state changes)
``schema``       the SQLAlchemy tables of the shared store (alembic migrations create them)
``database``     URLs and engines for SQLite (WAL) and PostgreSQL (psycopg 3)
``deadline``     a deadline on one database connection: no progress, its socket shut, discarded
``migrate``      running the alembic migrations from code
``spool``        the local write-ahead file rows pass through, so a database outage loses nothing
``writer``       the batched writer beside the answering path
``query``        reading rows back: tail, export, chain verification, a decision id's row
``partitions``   PostgreSQL's day partitions of the decisions table: made ahead, dropped whole
``status``       every chain's evidence at a glance: checkpoints in and outside the database

It may import ``gtm.decision`` (a row is a decision's record) and nothing of the fleet, the
listeners or the CLI. Evidence kept outside the database (checkpoints, keys) belongs here too.
"""
