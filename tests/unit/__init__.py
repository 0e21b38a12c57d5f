"""Tests of pure logic (plans, bounds) with fake clocks: no server, no database."""
