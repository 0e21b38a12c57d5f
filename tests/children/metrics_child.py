"""A worker of tests/db/test_metrics.py's multiprocess test: holds KEY until its stdin closes.

    PROMETHEUS_MULTIPROC_DIR=... python -m tests.children.metrics_child KEY

Prints ``{"event": "holding"}`` once the hold is entered and ``{"event": "released"}`` after it is
left; its metrics go to the multiprocess directory (prometheus_client reads the variable at import).
"""

from __future__ import annotations

import json
import os
import sys


def main() -> None:
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "tests.settings")
    import django

    django.setup()
    from pg_lease_django import hold

    with hold(sys.argv[1], ttl=30):
        print(json.dumps({"event": "holding"}), flush=True)
        sys.stdin.read()  # until the parent closes it
    print(json.dumps({"event": "released"}), flush=True)


if __name__ == "__main__":
    main()
