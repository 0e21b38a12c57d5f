"""The blocking acquire and the settling of interrupted calls.

``plan`` says what to do and does no I/O. ``settling`` settles calls interrupted in flight.
``sync_driver`` and ``async_driver`` are the plan's two drivers. This file is kept empty, because
importing a submodule runs it.
"""
