"""The table of named checks: ``@check("name")`` registers a function that takes no argument and
returns the numbers it measured, ``{record key: value}``, for the rank's record (``checks``)."""

from typing import Callable, Dict

CHECKS: Dict[str, Callable[[], dict]] = {}


def check(name: str):
    """Register the decorated function as the check ``name`` (a name is registered once)."""

    def deco(fn):
        if name in CHECKS:
            raise ValueError(f"check {name!r} is already registered")
        CHECKS[name] = fn
        fn.check_name = name
        return fn

    return deco
