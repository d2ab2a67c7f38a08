"""The audit store: every decision, counted, hash-chained, in SQLite or PostgreSQL.

``record``  what one audit row holds, and the hash chain over rows (pure)
``schema``  the SQLAlchemy tables (alembic migrations create them)
``database`` URLs and engines for SQLite (WAL) and PostgreSQL (psycopg 3)
``spool``   the local write-ahead file rows pass through, so a database outage loses nothing
``writer``  the batched writer beside the answering path
``query``   reading rows back: tail, export, chain verification
"""
