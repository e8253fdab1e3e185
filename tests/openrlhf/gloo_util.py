"""Helpers of the gloo multi-process tests (imported by name: ``conftest`` is not unique across test dirs)."""

import os
import socket

HERE = os.path.dirname(os.path.abspath(__file__))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
