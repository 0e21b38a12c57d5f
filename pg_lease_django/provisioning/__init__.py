"""What ``migrate`` copies from the settings into the database, where the lease functions read it.

`privileges` copies the roles' privileges, the key scopes and the role limits, and `history` copies
the history scope. Nothing here is imported eagerly.
"""
