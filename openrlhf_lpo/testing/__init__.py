"""Tiny offline models and log readers for the tests and the demo (no hub, no network)."""
