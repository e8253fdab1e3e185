"""Verifiable rewards. Submodules are imported explicitly (no heavy imports here)."""
