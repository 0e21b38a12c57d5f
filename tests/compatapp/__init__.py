"""Fenced models living beside django-pghistory and django-pgtrigger (tests/test_compat.py)."""
