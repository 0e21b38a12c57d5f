"""Stress, fault and property runs on the test database: many processes killed, frozen or campaigning."""
