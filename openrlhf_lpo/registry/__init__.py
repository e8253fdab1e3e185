"""Named registries: one rule for every table of the product that maps a name to an entry.

A name is registered once (a second registration is refused, naming the kind and the name), and an
unknown name's error lists the valid ones. The tables stay plain dicts owned by their rooms; this leaf
only adds and reads entries. It imports the standard library alone, so every room may import it
(``tests/core/test_product_rules.py`` allows exactly this leaf from every room).
"""

from __future__ import annotations

from typing import Callable, Mapping, MutableMapping, TypeVar

__all__ = ["register_unique", "registrar", "lookup"]

T = TypeVar("T")


def register_unique(table: MutableMapping[str, T], kind: str, name: str, value: T) -> T:
    """Add ``value`` to ``table`` under ``name`` and return it; ``ValueError`` if the name is taken:
    ``"<kind> '<name>' is already registered"``."""
    if name in table:
        raise ValueError(f"{kind} {name!r} is already registered")
    table[name] = value
    return value


def registrar(table: MutableMapping[str, T], kind: str, name: str) -> Callable[[T], T]:
    """The decorator form of :func:`register_unique`: ``@registrar(TABLE, kind, name)`` registers the
    decorated object under ``name`` and returns it unchanged."""

    def deco(value: T) -> T:
        return register_unique(table, kind, name, value)

    return deco


def lookup(table: Mapping[str, T], kind: str, name: str) -> T:
    """``table[name]``; ``ValueError`` if unknown: ``"unknown <kind> '<name>'; valid: a, b, c"``."""
    try:
        return table[name]
    except (KeyError, TypeError):  # TypeError: an unhashable name
        raise ValueError(f"unknown {kind} {name!r}; valid: {', '.join(sorted(table))}") from None
