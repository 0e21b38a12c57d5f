"""What the tests run in child processes (``python -m tests.children.NAME``), never collected as tests."""
