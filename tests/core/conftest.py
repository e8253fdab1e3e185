"""Puts tests/core on sys.path so the core tests share ``simplex_reference`` (--import-mode=importlib
adds nothing)."""

import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
if HERE not in sys.path:
    sys.path.insert(0, HERE)
