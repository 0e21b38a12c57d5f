"""What ``migrate`` copies from the settings into the database: the roles' privileges, the key
scopes and role limits (`privileges`), and the history scope (`history`). Nothing here is imported
eagerly."""
