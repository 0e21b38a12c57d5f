"""The blocking acquire and the settling of interrupted calls: ``plan`` (what to do, no I/O), ``settling``
(calls interrupted in flight), ``sync_driver`` and ``async_driver`` (the plan's two drivers). Kept empty: importing a
submodule runs this file."""
