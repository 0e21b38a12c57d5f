"""A newcomer's path: a generated project, every docs page's samples."""
