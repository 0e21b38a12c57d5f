"""``python -m devkit.sqlchange NAME``: the next migration, written from an edit of ``schema.sql``.

``pg_lease_django/sql/schema.sql`` is the current schema; a change ships as a migration that
restates each object it changes whole (docs/architecture.md, "Changing the SQL"). This command
compares ``schema.sql`` with what the migrations build, object by object, and writes the next
migration: ``sql/migrations/NNNN_NAME.sql`` (the delta), ``NNNN_NAME_reverse.sql`` and
``migrations/NNNN_NAME.py`` (a ``RunSQLFile`` pinning the delta's SHA-256, after the last migration).

What the migrations build is read from the migrations themselves, not from git: their forward files
replayed in order (``repository``, ``objects``). That is what a database migrated to the last
migration holds, whatever is committed, and it works on a copy of the package (the tests') or with
a migration not yet committed (a second run finds nothing to do).

The modules, each importing only those before it: ``text`` (a file split into statements by
PostgreSQL's own parser, each with its parse tree and its text as written), ``grammar`` (keys and
signatures read from the tree, names and types as written), ``objects`` (the objects a sequence of
statements leaves), ``plan`` (the delta and reverse between two of them, and what a tool must not
write), ``repository`` (the package's files), ``__main__`` (the command).

The parser is pglast (libpg_query: PostgreSQL's own lexer and grammar, built into the wheel), a
development dependency only, in the ``test`` extra. What the model does not know it refuses by name.
"""
