"""The command: ``python -m devkit.sqlchange NAME`` (``make sql-change NAME=...``).

Exit status 0 when it wrote the migration or found nothing to do, 1 when it refused (nothing
written), 2 for a bad command line.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TextIO

from devkit.sqlchange.objects import SchemaError
from devkit.sqlchange.plan import plan
from devkit.sqlchange.repository import NAME, Package, RepositoryError
from devkit.sqlchange.text import SqlSyntaxError

REPO = Path(__file__).resolve().parent.parent.parent


def main(argv: Sequence[str] | None = None, stdout: TextIO = sys.stdout) -> int:
    """Run the command; its exit status."""
    parser = argparse.ArgumentParser(
        prog="python -m devkit.sqlchange",
        description="Write the next migration (delta, reverse, Django migration) from an edit of sql/schema.sql.",
    )
    parser.add_argument("name", help="the migration's name: lower case, digits, underscores (heartbeat_ttl_limit)")
    parser.add_argument(
        "--package", type=Path, default=REPO / "pg_lease_django", help="the app's directory (default: the checkout's)"
    )
    parser.add_argument("--dry-run", action="store_true", help="print the delta and the reverse; write nothing")
    arguments = parser.parse_args(argv)
    if not NAME.fullmatch(arguments.name):
        parser.error(f"name {arguments.name!r}: lower case letters, digits and underscores, at most 60, a letter first")
    package = Package(arguments.package)
    try:
        chain = package.chain()
        result = plan(package.built_by(chain), package.stated())
    except (RepositoryError, SchemaError, SqlSyntaxError) as error:
        print(f"devkit.sqlchange: {error}", file=stdout)
        return 1
    span = f"migrations {chain[0].name[:4]}-{chain[-1].name[:4]}"
    if not result.changes and not result.refusals:
        print(f"Nothing to do: sql/schema.sql states what {span} build.", file=stdout)
        return 0
    print(f"sql/schema.sql against what {span} build:", file=stdout)
    for change in result.changes:
        print(f"  {change}", file=stdout)
    if result.refusals:
        print("\nNothing written. A tool must not write these; write the migration by hand", file=stdout)
        print('(docs/architecture.md, "Changing the SQL"):', file=stdout)
        for refusal in result.refusals:
            print(f"  * {refusal}", file=stdout)
        return 1
    if arguments.dry_run:
        print("\n-- the delta\n" + "\n\n".join(result.forward), file=stdout)
        print("\n-- the reverse\n" + "\n\n".join(result.reverse), file=stdout)
        return 0
    command = f"python -m devkit.sqlchange {arguments.name}"
    try:
        written = package.write(arguments.name, chain, result, command)
    except RepositoryError as error:
        print(f"devkit.sqlchange: {error}", file=stdout)
        return 1
    print("Wrote:", file=stdout)
    for path in written:
        print(f"  {_shown(path)}", file=stdout)
    for note in result.notes:
        print(f"Note: {note}", file=stdout)
    print(
        "Next: say why in the migration's docstring (the .sql files are pinned: to redo them, delete the three "
        "files and run this again), then `make test` (tests/db/test_sql_source.py compares the catalogs).",
        file=stdout,
    )
    return 0


def _shown(path: Path) -> str:
    try:
        return str(path.resolve().relative_to(Path.cwd()))
    except ValueError:
        return str(path)


if __name__ == "__main__":
    sys.exit(main())
