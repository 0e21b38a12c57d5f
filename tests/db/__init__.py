"""Tests that talk to the suite's test database on the one test server."""
