"""``manage.py leased_job KEY [--until-signalled]``: a cron-style command whose work runs under ``@leased``.

What a short-lived process started by cron looks like: it holds KEY while it works, releases it and
exits. With ``--until-signalled`` it says ``holding`` and works until a signal ends it (SIGTERM
unwinds the hold, releasing the lease, then ends the process by SIGTERM). tests/db/test_metrics.py runs
it to see its metrics leave with it (the Pushgateway, the multiprocess directory).
"""

from __future__ import annotations

import time
from typing import Any

from django.core.management.base import BaseCommand, CommandParser

from pg_lease_django import current_lease, leased


@leased(lambda key, until_signalled: key, ttl=10)
def work(key: str, until_signalled: bool) -> int:
    lease = current_lease(key)
    assert lease is not None
    lease.check()
    if until_signalled:
        print("holding", flush=True)
        while True:
            time.sleep(1)
    return lease.epoch


class Command(BaseCommand):
    help = "Hold KEY (@leased) for one short piece of work, then exit."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("key")
        parser.add_argument("--until-signalled", action="store_true")

    def handle(self, *args: Any, **options: Any) -> None:
        self.stdout.write(f"epoch {work(options['key'], options['until_signalled'])}")
