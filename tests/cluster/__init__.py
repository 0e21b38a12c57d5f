"""Tests that start servers, clusters or browsers of their own (failover, Patroni, crashes, Chromium)."""
