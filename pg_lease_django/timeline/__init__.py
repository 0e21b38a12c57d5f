"""A lease's history for people: its tenures read as rows (`reading`), and drawn as a chart (`chart`).

The admin and ``manage.py leases history`` tell the same story from `read_history`'s rows.
"""

from .chart import draw_timeline
from .reading import FORCED, HELD, UNKNOWN, History, TenureRow, read_history

__all__ = ["FORCED", "HELD", "UNKNOWN", "History", "TenureRow", "draw_timeline", "read_history"]
