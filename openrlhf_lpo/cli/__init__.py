"""Command-line entry points of openrlhf-lpo (``lpo-train``)."""
