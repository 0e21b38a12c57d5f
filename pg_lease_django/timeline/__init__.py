"""A lease's history for people: `reading` reads its tenures as rows, and `chart` draws them.

The admin and ``manage.py leases history`` tell the same story from `read_history`'s rows.
"""

from .chart import draw_timeline
from .reading import FORCED, HELD, UNKNOWN, History, TenureRow, read_history

__all__ = ["FORCED", "HELD", "UNKNOWN", "History", "TenureRow", "draw_timeline", "read_history"]
