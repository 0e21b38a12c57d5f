"""Tests that read the code, the docs and the build files: no server, no database."""
