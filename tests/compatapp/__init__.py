"""Fenced models living beside django-pghistory and django-pgtrigger (tests/db/test_compat.py)."""
